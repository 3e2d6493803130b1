"""lorakit.patch against PEFT: every row of a mixed batch gets the logits PEFT gives with its adapter alone."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig

import lorakit
from helpers import LOGITS_TOLERANCE, reference_logits, rel_err
from _peft_models import ARCHS, TARGETS, VOCAB, save_adapter, tiny_model
from lorakit.peft import AdapterError

@st.composite
def lora_configs(draw, arch: str) -> LoraConfig:
    names = TARGETS[arch]
    targets = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    # Scalings alpha / r up to 4, as trained adapters have them: larger ones make a random tiny model so
    # ill-conditioned that float32 rounding alone moves its logits by more than the tolerance.
    r = draw(st.integers(1, 64))
    kwargs = dict(r=r, lora_alpha=draw(st.integers(1, 4 * r)), target_modules=targets,
                  use_rslora=draw(st.booleans()), init_lora_weights=False)
    if draw(st.booleans()):
        kwargs["rank_pattern"] = {targets[0]: draw(st.integers(r, 64))}
    if draw(st.booleans()):
        kwargs["alpha_pattern"] = {targets[-1]: draw(st.integers(1, 4 * r))}
    in_layers = [t for t in targets if t not in ("embed_tokens", "lm_head", "wte")]
    if in_layers and draw(st.booleans()):  # PEFT applies layers_to_transform to per-layer modules only
        kwargs["target_modules"] = in_layers
        kwargs["layers_to_transform"] = [draw(st.integers(0, 1))]  # tiny models have 2 layers
    elif draw(st.booleans()):  # a regex string instead of a list
        kwargs["target_modules"] = r"(.*\.)?(" + "|".join(targets) + ")"
    if arch == "gpt2":
        kwargs["fan_in_fan_out"] = True
    return LoraConfig(**kwargs)


def patched(base, adapters, max_loras=4):
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=max_loras)
    for a in adapters.values():
        handle.load_adapter(a.name, a.path)
    return model, handle


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_mixed_batch_matches_peft(arch, data, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp(arch)
    base = tiny_model(arch, seed=data.draw(st.integers(0, 100)))
    n_adapters = data.draw(st.integers(1, 3))
    adapters = {}
    for i in range(n_adapters):
        adapters[f"a{i}"] = save_adapter(base, f"a{i}", data.draw(lora_configs(arch)), tmp_path, seed=i, std=0.1)
    batch = data.draw(st.integers(1, 5))
    names = data.draw(st.lists(st.sampled_from([None, *adapters]), min_size=batch, max_size=batch))
    seq = data.draw(st.integers(1, 9))
    input_ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seq))

    model, handle = patched(base, adapters)
    with torch.no_grad():
        out = model(input_ids=input_ids, lora_ids=handle.ids(names), use_cache=False).logits
    ref = reference_logits(base, adapters, names, input_ids)
    for b, name in enumerate(names):
        err = rel_err(out[b], ref[b])
        assert err < LOGITS_TOLERANCE[torch.float32], f"row {b} ({name}): relative error {err:.2e}"
    with torch.no_grad():  # without lora_ids the patched model is the base model, bit for bit
        plain = model(input_ids=input_ids, use_cache=False).logits
        assert torch.equal(plain, base(input_ids=input_ids, use_cache=False).logits)


def two_adapters(tmp_path, arch="llama", ranks=(8, 64)):
    base = tiny_model(arch, seed=0)
    adapters = {}
    for i, r in enumerate(ranks):
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS[arch], init_lora_weights=False)
        adapters[f"r{r}"] = save_adapter(base, f"r{r}", cfg, tmp_path, seed=i)
    return base, adapters


def test_rank_growth_keeps_loaded_adapters_exact(tmp_path):
    base, adapters = two_adapters(tmp_path)
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=3)
    handle.load_adapter("r8", adapters["r8"].path)
    input_ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(0))
    ids = handle.ids(["r8", None, "r8"])
    with torch.no_grad():
        before = model(input_ids=input_ids, lora_ids=ids, use_cache=False).logits
        handle.load_adapter("r64", adapters["r64"].path)  # grows every layer's padding from 16 to 64
        after = model(input_ids=input_ids, lora_ids=ids, use_cache=False).logits
        mixed = model(input_ids=input_ids, lora_ids=handle.ids(["r64", "r8", None]), use_cache=False).logits
    assert all(layer.r_max in (0, 64) for layer in handle.layers.values())
    assert torch.equal(before, after)
    ref = reference_logits(base, adapters, ["r64", "r8", None], input_ids)
    assert rel_err(mixed, ref) < LOGITS_TOLERANCE[torch.float32]


def test_compiled_whole_model_matches_eager_and_never_recompiles_for_new_ids(tmp_path):
    torch._dynamo.reset()
    base, adapters = two_adapters(tmp_path)
    model, handle = patched(base, adapters)
    input_ids = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for names in (["r8", None, "r64", "r8"], [None, None, None, None], ["r64", "r64", "r8", None]):
            ids = handle.ids(names)
            eager = model(input_ids=input_ids, lora_ids=ids, use_cache=False).logits
            comp = compiled(input_ids=input_ids, lora_ids=ids, use_cache=False).logits
            assert rel_err(comp, eager) < LOGITS_TOLERANCE[torch.float32], names


def test_the_patch_kernel_options_reach_every_lora_op(tmp_path):
    """patch(kernels=...): every LoRA op of the model launches with its options (a compiled forward carries them as
    the ops' constants), and the logits do not depend on them."""
    base, adapters = two_adapters(tmp_path)
    input_ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    logits = []
    for pdl in (frozenset(), frozenset({"shrink", "expand"})):
        model = copy.deepcopy(base)
        handle = lorakit.patch(model, max_loras=4, kernels=lorakit.ops.KernelOptions(pdl=pdl))
        for a in adapters.values():
            handle.load_adapter(a.name, a.path)
        ids = handle.ids(["r8", "r64"])
        calls = []

        def backend(gm, example_inputs):
            calls.extend((str(n.target), n.args) for n in gm.graph.nodes if n.op == "call_function"
                         and str(n.target) in ("lorakit.shrink", "lorakit.expand"))
            return gm.forward

        torch._dynamo.reset()
        with torch.no_grad():
            logits.append(torch.compile(model, backend=backend, fullgraph=True)(input_ids=input_ids, lora_ids=ids,
                                                                                use_cache=False).logits)
            assert torch.equal(logits[-1], model(input_ids=input_ids, lora_ids=ids, use_cache=False).logits)
        shrinks = [args[8:] for target, args in calls if target == "lorakit.shrink"]
        expands = [args[9:10] for target, args in calls if target == "lorakit.expand"]  # pdl (then the DoRA rescale)
        assert shrinks and expands  # the embedding has an expand alone
        assert set(shrinks) == {(bool(pdl), bool(pdl))} and set(expands) == {(bool(pdl),)}
    assert torch.equal(*logits)


def test_per_token_ids_match_per_sequence_ids(tmp_path):
    base, adapters = two_adapters(tmp_path)
    model, handle = patched(base, adapters)
    input_ids = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(2))
    ids = handle.ids(["r8", "r64"])
    with torch.no_grad():
        per_seq = model(input_ids=input_ids, lora_ids=ids, use_cache=False).logits
        per_tok = model(input_ids=input_ids, lora_ids=ids[:, None].expand(2, 4), use_cache=False).logits
    assert torch.equal(per_seq, per_tok)


def test_unload_frees_the_slot_and_leaves_others(tmp_path):
    base, adapters = two_adapters(tmp_path)
    model, handle = patched(base, adapters, max_loras=2)
    input_ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(input_ids=input_ids, lora_ids=handle.ids(["r64"]), use_cache=False).logits
        handle.unload_adapter("r8")
        assert handle.adapters == {"r64": 1}
        after = model(input_ids=input_ids, lora_ids=handle.ids(["r64"]), use_cache=False).logits
        handle.load_adapter("r8-again", adapters["r8"].path)
        assert handle.adapters == {"r8-again": 0, "r64": 1}
    assert torch.equal(before, after)


def test_bad_requests_name_the_problem_and_change_nothing(tmp_path):
    base, adapters = two_adapters(tmp_path)
    model, handle = patched(base, {"r8": adapters["r8"]}, max_loras=2)
    input_ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))

    def logits():
        with torch.no_grad():
            return model(input_ids=input_ids, lora_ids=handle.ids(["r8", None]), use_cache=False).logits

    before = logits()
    with pytest.raises(AdapterError, match=r"'r8' is already loaded in slot 0"):
        handle.load_adapter("r8", adapters["r8"].path)
    with pytest.raises(ValueError, match=r"unknown adapter name\(s\) \['nope'\].*loaded: \['r8'\]"):
        handle.ids(["r8", "nope"])
    with pytest.raises(AdapterError, match=r"no adapter 'nope' is loaded"):
        handle.unload_adapter("nope")
    gpt2 = save_adapter(tiny_model("gpt2", 0), "gpt2", LoraConfig(r=4, target_modules=["c_attn"]), tmp_path, 0)
    with pytest.raises(AdapterError, match=r"'gpt2'.*c_attn"):
        handle.load_adapter("gpt2", gpt2.path)
    with pytest.raises(AdapterError, match=r"'missing'"):
        handle.load_adapter("missing", tmp_path / "does-not-exist")
    small = lorakit.patch(copy.deepcopy(base), max_loras=1, max_rank=32)
    with pytest.raises(AdapterError, match=r"rank 64 is above this model's max_rank=32"):
        small.load_adapter("r64", adapters["r64"].path)
    handle.load_adapter("r64", adapters["r64"].path)
    with pytest.raises(AdapterError, match=r"all 2 slots hold adapters \(r8, r64\)"):
        handle.load_adapter("third", adapters["r8"].path)
    handle.unload_adapter("r64")
    assert handle.adapters == {"r8": 0}
    assert torch.equal(logits(), before)
    with pytest.raises(ValueError, match="already patched"):
        lorakit.patch(model)


def test_generate_with_using_matches_peft_and_base(tmp_path):
    """transformers' generate (KV cache, prefill then one token a step) under handle.using."""
    base, adapters = two_adapters(tmp_path)
    model, handle = patched(base, adapters)
    input_ids = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(5))
    names = ["r64", None, "r8"]
    kwargs = dict(max_new_tokens=5, do_sample=False)
    with handle.using(names):
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    for b, name in enumerate(names):
        ref_model = base if name is None else adapters[name].peft_model
        ref = ref_model.generate(input_ids=input_ids[b: b + 1], attention_mask=torch.ones_like(input_ids[b: b + 1]),
                                 **kwargs)
        assert torch.equal(out[b], ref[0]), f"row {b} ({name})"
    with torch.no_grad():  # outside the block, no adapter is applied
        plain = model(input_ids=input_ids, use_cache=False).logits
        assert torch.equal(plain, base(input_ids=input_ids, use_cache=False).logits)


def test_rank_growth_recompiles_once(tmp_path):
    torch._dynamo.reset()
    base, adapters = two_adapters(tmp_path)
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=2)
    handle.load_adapter("r8", adapters["r8"].path)
    compiled = torch.compile(model, fullgraph=True)
    input_ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        compiled(input_ids=input_ids, lora_ids=handle.ids(["r8", None]), use_cache=False)
        handle.load_adapter("r64", adapters["r64"].path)  # padding 16 -> 64: one recompile
        for names in (["r64", "r8"], [None, "r64"]):
            comp = compiled(input_ids=input_ids, lora_ids=handle.ids(names), use_cache=False).logits
            ref = reference_logits(base, adapters, names, input_ids)
            assert rel_err(comp, ref) < LOGITS_TOLERANCE[torch.float32], names


def test_tied_head_stays_tied_and_bfloat16_matches_peft(tmp_path):
    base = tiny_model("gemma2", seed=1)  # ties lm_head to embed_tokens
    cfg = LoraConfig(r=16, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"], init_lora_weights=False)
    adapter = save_adapter(base, "tied", cfg, tmp_path, seed=0)
    model = copy.deepcopy(base).to(torch.bfloat16)
    handle = lorakit.patch(model, max_loras=2)
    handle.load_adapter("tied", adapter.path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    input_ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = model(input_ids=input_ids, lora_ids=handle.ids(["tied", None]), use_cache=False).logits.float()
        ref = reference_logits(base, {"tied": adapter}, ["tied", None], input_ids)
    for b in range(2):
        assert rel_err(out[b], ref[b]) < LOGITS_TOLERANCE[torch.bfloat16], b


def test_broken_adapter_files_change_nothing(tmp_path):
    base, adapters = two_adapters(tmp_path)
    model, handle = patched(base, {"r8": adapters["r8"]}, max_loras=3)
    input_ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(8))

    def logits():
        with torch.no_grad():
            return model(input_ids=input_ids, lora_ids=handle.ids(["r8", None]), use_cache=False).logits

    before = logits()
    import shutil

    from safetensors.torch import load_file, save_file

    nan = tmp_path / "nan"
    shutil.copytree(adapters["r64"].path, nan)
    weights = load_file(nan / "adapter_model.safetensors")
    key = next(k for k in weights if "lora_B" in k)
    weights[key][0, 0] = float("nan")
    save_file(weights, nan / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"'nan'.*(NaN|non-finite)"):
        handle.load_adapter("nan", nan)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapters["r64"].path, corrupt)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match=r"'corrupt'"):
        handle.load_adapter("corrupt", corrupt)

    wrong = tmp_path / "wrong"
    shutil.copytree(adapters["r64"].path, wrong)
    weights = load_file(wrong / "adapter_model.safetensors")
    key = next(k for k in weights if "q_proj.lora_B" in k)
    weights[key] = weights[key][:-1]  # one output row short of the base layer
    save_file(weights, wrong / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"'wrong'.*q_proj"):
        handle.load_adapter("wrong", wrong)

    assert handle.adapters == {"r8": 0}
    assert torch.equal(logits(), before)


def test_compiled_model_under_using_never_recompiles_for_new_ids(tmp_path):
    """Ids set by handle.using reach the compiled graph as inputs, like lora_ids (static-cache decoding)."""
    torch._dynamo.reset()
    base, adapters = two_adapters(tmp_path)
    model, handle = patched(base, adapters)
    compiled = torch.compile(model, fullgraph=True)
    input_ids = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for names in (["r8", None, "r64"], ["r64", "r64", None], [None, "r8", "r8"]):
            with handle.using(names):
                comp = compiled(input_ids=input_ids, use_cache=False).logits
            ref = reference_logits(base, adapters, names, input_ids)
            assert rel_err(comp, ref) < LOGITS_TOLERANCE[torch.float32], names


def test_forward_with_grad_enabled_warns_inference_only(tmp_path):
    base, adapters = two_adapters(tmp_path)
    model, handle = patched(base, adapters)
    input_ids = torch.randint(0, VOCAB, (1, 3), generator=torch.Generator().manual_seed(10))
    with pytest.warns(UserWarning, match="inference-only"):
        model(input_ids=input_ids, lora_ids=handle.ids(["r8"]), use_cache=False)


def test_flattened_tokens_map_to_their_rows_and_a_subset_is_refused(tmp_path):
    """A layer fed the batch's tokens flattened ([batch * seq], as an MoE block's experts are) gets each token's
    adapter; one fed a subset of them (the tokens routed to it) is refused with per-token ids, never misread."""
    base, adapters = two_adapters(tmp_path)
    model, handle = patched(base, adapters)
    o_proj = model.model.layers[0].self_attn.o_proj
    x = torch.randn(2, 3, 32)
    ctx = handle._ctx
    for ids in (handle.ids(["r8", "r64"]), handle.ids(["r8", "r64"])[:, None].expand(2, 3)):
        ctx.begin(ids, None)
        try:
            assert torch.equal(o_proj(x.reshape(6, 32)), o_proj(x).reshape(6, 32))
        finally:
            ctx.end()
    ctx.begin(handle.ids(["r8", "r64"])[:, None].expand(2, 3), None)
    try:
        with pytest.raises(ValueError, match="lora_ids has 2 rows"):
            o_proj(x.reshape(6, 32)[:4])
    finally:
        ctx.end()

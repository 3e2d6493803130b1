"""DoRA adapters against PEFT: the expand's rescale against the float64 reference (torch path and the Triton kernel
under the interpreter), then patched models whose DoRA rows, mixed with plain LoRA and base rows in one batch, get
the logits PEFT gives each adapter alone; rank growth, hot-swap, compile, the engine and the refusals."""

import copy
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file, save_file

import lorakit
from _lora_cases import TOLERANCE, cases, make_case
from _peft_models import TARGETS, VOCAB, save_adapter, tiny_model
from lorakit.peft import AdapterError
from lorakit.ops import add_lora, build_lora_meta
from lorakit.ops.expand import _launch_expand
from lorakit.ops.reference import lora_ref
from lorakit.ops.shrink import _launch_shrink
from helpers import dequantized, greedy, quant_model, reference_logits, rel_err

LOGITS_TOLERANCE = 1e-5  # float32, each row against PEFT's
DORA_ARCHS = ("llama", "qwen2", "gemma2", "gpt2")  # qwen2: biases on q/k/v; gemma2: a scaled embedding; gpt2: Conv1D


def random_dora(case, rows: int, seed: int) -> torch.Tensor:
    """A rescale for every slot: gains in [-0.5, 0.5), shifts of order one; slot 0 plain LoRA (zeros)."""
    gen = torch.Generator().manual_seed(seed)
    dora = torch.rand(case.A.shape[0], rows, sum(case.slice_sizes), generator=gen) - 0.5
    dora[0] = 0
    return dora


def check_dora_y(y, case, dora):
    ref = lora_ref(case.y, case.x, case.A, case.B, case.ranks, case.scales, case.slots, case.slice_sizes, dora)
    magnitude = lora_ref(case.y.abs(), case.x.abs(), case.A.abs(), case.B.abs(), case.ranks, case.scales,
                         case.slots, case.slice_sizes, dora.abs())
    err = rel_err(y, ref, magnitude)
    assert err <= 2 * TOLERANCE[case.y.dtype], f"relative error {err:.2e}"
    base = (case.slots < 0).cpu()
    assert torch.equal(y.cpu()[base], case.y.cpu()[base]), "base-model rows must be left untouched"


@given(case=cases((torch.float32, torch.float16, torch.bfloat16)), rows=st.sampled_from([1, 2]))
def test_expand_rescales_dora_slots_as_the_reference(case, rows):
    dora = random_dora(case, rows, seed=int(case.ranks.sum()))
    meta = build_lora_meta(case.slots, case.A.shape[0])
    y = case.y.clone()
    add_lora(y, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes, dora=dora)
    check_dora_y(y, case, dora)
    plain, zero = case.y.clone(), case.y.clone()  # a zero rescale is plain LoRA, bit for bit
    add_lora(plain, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes)
    add_lora(zero, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes, dora=torch.zeros_like(dora))
    assert torch.equal(plain, zero)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on the CPU needs TRITON_INTERPRET=1")
@given(case=cases((torch.float32, torch.float16), tokens=(1, 3, 33), out_sizes=(1, 24, 67, 300),
                  r_maxes=(1, 16, 40, 130)), rows=st.sampled_from([1, 2]))
def test_triton_expand_rescales_dora_slots_interpreted(case, rows):
    dora = random_dora(case, rows, seed=int(case.ranks.sum()))
    for block_m, sms in ((None, None), (64, 1)):
        meta = build_lora_meta(case.slots, case.A.shape[0], block_m)
        h = _launch_shrink(case.x, case.A, case.ranks, meta.token_order, meta.tiles, meta.block_m, 1)
        y = case.y.clone()
        _launch_expand(list(torch.split(y, case.slice_sizes, dim=1)), h, case.B, case.ranks, case.scales,
                       meta.token_order, meta.tiles, meta.block_m, sms=sms, dora=dora)
        check_dora_y(y, case, dora)


def test_expand_refuses_a_dora_buffer_of_the_wrong_shape():
    case = make_case(5, 16, [8, 4], 8, 3, "uniform", torch.float32, seed=0)
    meta = build_lora_meta(case.slots, case.A.shape[0])
    bad = torch.zeros(case.A.shape[0], 3, sum(case.slice_sizes))
    with pytest.raises(ValueError, match=r"dora must be float32 \[S="):
        torch.ops.lorakit.expand(list(torch.split(case.y.clone(), case.slice_sizes, dim=1)),
                                 torch.zeros(1, len(case.slice_sizes), case.x.shape[0], case.A.shape[2]), case.B,
                                 case.ranks, case.scales, meta.token_slot, meta.token_order, meta.tiles,
                                 meta.block_m, False, bad)


# Models against PEFT.

def dora_config(arch: str, targets, r: int, alpha: int, **kwargs) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_dora=True, init_lora_weights=False,
                      fan_in_fan_out=arch == "gpt2", **kwargs)


def assert_rows_match(model, handle, base, adapters, names, input_ids):
    with torch.no_grad():
        out = model(input_ids=input_ids, lora_ids=handle.ids(names), use_cache=False).logits
    ref = reference_logits(base, adapters, names, input_ids)
    for b, name in enumerate(names):
        err = rel_err(out[b], ref[b])
        assert err < LOGITS_TOLERANCE, f"row {b} ({name}): relative error {err:.2e}"


@pytest.mark.parametrize("arch", DORA_ARCHS)
@settings(max_examples=2, deadline=None)
@given(data=st.data())
def test_dora_rows_mixed_with_plain_lora_and_base_rows_match_peft(arch, data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"dora-{arch}")
    base = tiny_model(arch, seed=data.draw(st.integers(0, 100)))
    names = TARGETS[arch]
    adapters = {}
    for i in range(2):  # two DoRA adapters of drawn ranks and modules
        targets = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
        r = data.draw(st.integers(1, 40))
        adapters[f"d{i}"] = save_adapter(base, f"d{i}", dora_config(arch, targets, r, data.draw(st.integers(1, 2 * r))),
                                         tmp, seed=i, std=0.1)
    plain = LoraConfig(r=8, lora_alpha=16, target_modules=names[:4], init_lora_weights=False,
                       fan_in_fan_out=arch == "gpt2")
    adapters["plain"] = save_adapter(base, "plain", plain, tmp, seed=7, std=0.1)
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=4)
    for a in adapters.values():
        handle.load_adapter(a.name, a.path)
    input_ids = torch.randint(0, VOCAB, (5, 6), generator=torch.Generator().manual_seed(3))
    assert_rows_match(model, handle, base, adapters, ["d0", None, "plain", "d1", "d0"], input_ids)


@pytest.mark.parametrize("arch", ["gemma2", "gpt2"])
def test_dora_on_a_scaled_embedding_and_a_tied_head_matches_peft(arch, tmp_path):
    """Gemma 2's embedding scales its output (and so the delta) by sqrt(hidden); its head and GPT-2's are tied to
    the embedding, and PEFT gives each of the two its own DoRA layer."""
    base = tiny_model(arch, seed=5)
    embed, head = TARGETS[arch][-2:]
    adapters = {"d": save_adapter(base, "d", dora_config(arch, [embed, head, TARGETS[arch][0]], 8, 16), tmp_path,
                                  seed=0, std=0.1)}
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=2)
    handle.load_adapter("d", adapters["d"].path)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(2))
    assert_rows_match(model, handle, base, adapters, ["d", None, "d"], ids)


def test_dora_differs_from_its_plain_lora(tmp_path):
    """The rescale is there: the same A and B served without the magnitudes give other logits."""
    base = tiny_model("llama", seed=0)
    dora = save_adapter(base, "d", dora_config("llama", TARGETS["llama"][:7], 8, 16), tmp_path, seed=0, std=0.1)
    weights = load_file(f"{dora.path}/adapter_model.safetensors")
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    save_file({k: v for k, v in weights.items() if "magnitude" not in k}, plain_dir / "adapter_model.safetensors")
    cfg = json.load(open(f"{dora.path}/adapter_config.json"))
    json.dump({**cfg, "use_dora": False}, open(plain_dir / "adapter_config.json", "w"))
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=2)
    handle.load_adapter("d", dora.path)
    handle.load_adapter("p", plain_dir)
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, lora_ids=handle.ids(["d", "p"]), use_cache=False).logits
    assert rel_err(out[0], out[1]) > 1e-2


def test_rank_growth_and_hot_swap_keep_dora_exact(tmp_path):
    base = tiny_model("qwen2", seed=1)
    adapters = {
        "p4": save_adapter(base, "p4", LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS["qwen2"][:7],
                                                  init_lora_weights=False), tmp_path, seed=0, std=0.1),
        "d32": save_adapter(base, "d32", dora_config("qwen2", TARGETS["qwen2"][:7], 32, 32), tmp_path, seed=1,
                            std=0.1),
        "d8": save_adapter(base, "d8", dora_config("qwen2", ["q_proj", "v_proj", "down_proj"], 8, 16), tmp_path,
                           seed=2, std=0.1),
    }
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=2)
    ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    handle.load_adapter("p4", adapters["p4"].path)
    handle.load_adapter("d32", adapters["d32"].path)  # grows every store to rank 32 and allocates the rescale
    assert_rows_match(model, handle, base, adapters, ["p4", "d32", None], ids)
    handle.unload_adapter("d32")
    handle.unload_adapter("p4")
    handle.load_adapter("d8", adapters["d8"].path)  # into the slot the rank-4 plain adapter had
    handle.load_adapter("p4", adapters["p4"].path)  # into the DoRA adapter's slot: its rescale is cleared
    assert_rows_match(model, handle, base, adapters, ["p4", "d8", None], ids)


def test_compiled_dora_model_matches_eager_and_never_recompiles(tmp_path):
    base = tiny_model("qwen2", seed=2)
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=3)
    for i, targets in enumerate((TARGETS["qwen2"][:7], ["q_proj", "o_proj", "up_proj"])):
        a = save_adapter(base, f"d{i}", dora_config("qwen2", targets, 8, 16), tmp_path, seed=i, std=0.1)
        handle.load_adapter(a.name, a.path)
    ids = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()  # frames of this model class compiled by earlier tests would count against the limit
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for names in (["d0", None, "d1", "d0"], [None] * 4, ["d1", "d1", None, "d0"]):
            eager = model(input_ids=ids, lora_ids=handle.ids(names), use_cache=False).logits
            comp = compiled(input_ids=ids, lora_ids=handle.ids(names), use_cache=False).logits
            assert rel_err(comp, eager) < LOGITS_TOLERANCE, names


def test_the_engine_serves_dora_as_peft_generates(tmp_path):
    from lorakit.engine import Engine

    base = tiny_model("llama", seed=3)
    folders, peft = {}, {}
    for i, targets in enumerate((TARGETS["llama"][:7], ["q_proj", "v_proj", "gate_proj", "embed_tokens"])):
        a = save_adapter(base, f"d{i}", dora_config("llama", targets, 8, 16), tmp_path, seed=i, std=0.1)
        folders[a.name], peft[a.name] = a.path, a.peft_model
    engine = Engine(copy.deepcopy(base), max_loras=2, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                    num_blocks=64, max_seq_len=40, adapters=folders)
    gen = torch.Generator().manual_seed(2)
    requests = [(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), adapter)
                for n, adapter in ((5, None), (11, "d0"), (3, "d1"), (7, "d0"))]
    for tokens, (prompt, adapter) in zip(greedy(engine, requests), requests):
        model = base if adapter is None else peft[adapter]
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        assert tokens == want.tolist(), adapter


def test_dora_on_a_quantized_base_matches_peft_on_the_dequantized_one(tmp_path):
    base = quant_model("qwen2", seed=4)
    saved = save_adapter(base, "d", dora_config("qwen2", TARGETS["qwen2"][:7], 8, 16), tmp_path, seed=0, std=0.05)
    lorakit.quantize(base, "fp8")
    ref = PeftModel.from_pretrained(dequantized(base), saved.path).eval()
    handle = lorakit.patch(base, max_loras=1)
    handle.load_adapter("d", saved.path)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = base(input_ids=ids, lora_ids=handle.ids(["d", "d"]), use_cache=False).logits
        want = ref(input_ids=ids, use_cache=False).logits
    assert rel_err(out, want) < 1e-4


# Refusals: each names the problem and the fix, and changes nothing.

def edited(src, tmp_path, name, weights=None, config=None):
    path = tmp_path / name
    path.mkdir()
    w = load_file(f"{src}/adapter_model.safetensors")
    save_file(weights(w) if weights else w, path / "adapter_model.safetensors")
    cfg = json.load(open(f"{src}/adapter_config.json"))
    json.dump(config(cfg) if config else cfg, open(path / "adapter_config.json", "w"))
    return path


def test_bad_dora_adapters_are_refused_by_name(tmp_path):
    base = tiny_model("llama", seed=0)
    good = save_adapter(base, "good", dora_config("llama", ["q_proj", "down_proj"], 4, 8), tmp_path, seed=0).path
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=2)
    mag = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    cases = {
        "no_use_dora": (None, lambda c: {**c, "use_dora": False}, r"holds DoRA magnitudes.*does not set use_dora"),
        "missing": (lambda w: {k: v for k, v in w.items() if k != mag}, None,
                    r"use_dora is set but .*q_proj.* have no DoRA magnitude"),
        "shape": (lambda w: {**w, mag: w[mag][:-1]}, None, r"DoRA magnitude has shape \[31\].*needs \[32\]"),
        "nan": (lambda w: {**w, mag: w[mag] * float("nan")}, None, r"DoRA magnitude holds NaN"),
        "alora": (None, lambda c: {**c, "alora_invocation_tokens": [5, 6]},
                  r"use_dora and alora_invocation_tokens are both set"),
    }
    handle.load_adapter("good", good)
    for name, (weights, config, message) in cases.items():
        path = edited(good, tmp_path, name, weights, config)
        with pytest.raises(AdapterError, match=message):
            handle.load_adapter(name, path)
        if name != "nan":  # the value checks need the weights; the rest are refused from the header alone
            with pytest.raises(AdapterError, match=message):
                handle.inspect_adapter(name, path)
    assert handle.adapters == {"good": 0}


def test_lorakit_serve_loads_a_dora_adapter_at_runtime_and_serves_it_as_peft(tmp_path):
    import httpx

    from _serve_helpers import build_world, start

    world = build_world(tmp_path)
    base, tokenizer, root, _ = world
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"],
                     use_dora=True, init_lora_weights=False)
    dora = save_adapter(base, "dora", cfg, root, seed=9, std=0.3)
    server = start(world, allow_runtime_lora=True)
    try:
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "dora", "lora_path": dora.path})
        assert r.status_code == 200, r.text
        prompt = "What is the capital of France?"
        out = server.client().completions.create(model="dora", prompt=prompt, max_tokens=10, temperature=0,
                                                 extra_body={"ignore_eos": True})
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            want = dora.peft_model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                            attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
        assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    finally:
        server.close()

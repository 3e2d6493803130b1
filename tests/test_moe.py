"""MoE expert LoRA (PEFT's ``target_parameters`` on stacked experts) against PEFT and the float64 references.

Tiny random Mixtral, Qwen3-MoE, Qwen2-MoE (shared expert) and OLMoE models; adapters on the experts' gate_up /
down parameters and on attention with random nonzero A and B; each row of a mixed batch (base rows and three adapters)
against PEFT with that adapter alone (float32, relative error < 1e-5); compiled whole; rank growth; the engine's
greedy tokens against ``generate``; the op on its torch path and its Triton kernels (interpreted) against
``ops/reference.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig
from safetensors.torch import load_file, save_file

import lorakit
from _lora_cases import TOLERANCE, make_slots
from _peft_models import save_adapter
from helpers import (BOTH_EXPERTS as BOTH, MOE_VOCAB as VOCAB, moe_config, moe_model, reference_logits, rel_err,
                     three_adapters, triton_on_cpu)
from lorakit.engine import Engine, SamplingParams
from lorakit.peft import AdapterError
from lorakit.layers.moe import ExpertSlots, LoraExperts
from lorakit.layers.patch import slot_bytes
from lorakit.ops import KernelOptions, add_expert_lora, build_lora_meta, expert_keys
from lorakit.ops.experts import _launch, expert_split_k
from lorakit.ops.reference import expert_lora_ref, moe_experts_ref


def patched(base, adapters, **kw):
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=4, **kw)
    for a in adapters.values():
        handle.load_adapter(a.name, a.path)
    return model, handle


NAMES = [None, "both", "gate_up", "down", "both", None]


# ----------------------------------------------------------------------------------------------- models vs PEFT


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss"])
def test_mixed_batch_rows_equal_peft(family, tmp_path):
    base = moe_model(family)
    shared = ("shared_expert.down_proj", "shared_expert_gate") if family == "qwen2_moe" else ()
    adapters = three_adapters(base, tmp_path, attention=("q_proj", "v_proj", *shared))
    model, handle = patched(base, adapters)
    assert sum(isinstance(m, LoraExperts) for m in model.modules()) == 2
    input_ids = torch.randint(0, VOCAB, (len(NAMES), 7), generator=torch.Generator().manual_seed(1))
    want = reference_logits(base, adapters, NAMES, input_ids)
    with torch.no_grad():
        got = model(input_ids=input_ids, lora_ids=handle.ids(NAMES), use_cache=False).logits
    for i, name in enumerate(NAMES):
        assert rel_err(got[i], want[i]) < TOLERANCE[torch.float32], (family, name)
    # the delta matters: a row of another adapter is far from this one's
    assert rel_err(got[1], reference_logits(base, adapters, [None], input_ids[1:2])[0]) > 1e-2


def test_without_ids_the_model_is_unchanged_bit_for_bit(tmp_path):
    base = moe_model("mixtral", seed=3)
    adapters = three_adapters(base, tmp_path)
    model, _ = patched(base, adapters)
    input_ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(input_ids=input_ids).logits, base(input_ids=input_ids).logits)


def test_compiled_whole_model_matches_eager_and_never_recompiles_for_new_ids(tmp_path):
    base = moe_model("qwen3_moe", seed=1)
    adapters = three_adapters(base, tmp_path)
    model, handle = patched(base, adapters)
    input_ids = torch.randint(0, VOCAB, (len(NAMES), 6), generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(model, fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for names in (NAMES, list(reversed(NAMES)), [None] * len(NAMES)):
            ids = handle.ids(names)
            eager = model(input_ids=input_ids, lora_ids=ids, use_cache=False).logits
            comp = compiled(input_ids=input_ids, lora_ids=ids, use_cache=False).logits
            assert rel_err(comp, eager) < TOLERANCE[torch.float32], names
            assert rel_err(comp, reference_logits(base, adapters, names, input_ids)) < TOLERANCE[torch.float32], names


def test_rank_growth_keeps_loaded_adapters_and_hot_swaps_zero_the_slot(tmp_path):
    base = moe_model("olmoe", seed=2)
    small = save_adapter(base, "small", LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=BOTH),
                         tmp_path, seed=10)
    big = save_adapter(base, "big", LoraConfig(r=40, lora_alpha=8, target_modules=["k_proj"],
                                               target_parameters=["experts.down_proj"]), tmp_path, seed=11)
    other = save_adapter(base, "other", LoraConfig(r=2, lora_alpha=4, target_modules=[],
                                                   target_parameters=["experts.gate_up_proj"]), tmp_path, seed=12)
    adapters = {a.name: a for a in (small, big, other)}
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=2)
    handle.load_adapter("small", small.path)
    stores = [m for m in model.modules() if isinstance(m, ExpertSlots)]
    assert sorted(s.r_max for s in stores) == [16] * 4
    input_ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(input_ids=input_ids, lora_ids=handle.ids(["small", None])).logits
        handle.load_adapter("big", big.path)  # down_proj's stores grow 16 -> 48
        assert sorted(s.r_max for s in stores) == [16, 16, 48, 48]
        assert torch.equal(model(input_ids=input_ids, lora_ids=handle.ids(["small", None])).logits, before)
        after = model(input_ids=input_ids, lora_ids=handle.ids(["small", "big"])).logits
        assert rel_err(after, reference_logits(base, adapters, ["small", "big"], input_ids)) < TOLERANCE[torch.float32]
        handle.unload_adapter("big")  # its slot zeroed, then another adapter in it
        handle.load_adapter("other", other.path)
        got = model(input_ids=input_ids, lora_ids=handle.ids(["other", "small"])).logits
        assert rel_err(got, reference_logits(base, adapters, ["other", "small"], input_ids)) < TOLERANCE[torch.float32]
    slot = handle.adapters["other"]
    for s in stores:
        assert not s.lora_A[slot, :, 2:].any() and not s.lora_B[slot, 2:].any()


@settings(max_examples=8)
@given(top_k=st.integers(1, 4), ranks=st.lists(st.integers(1, 24), min_size=3, max_size=3),
       params=st.lists(st.sampled_from([["experts.gate_up_proj"], ["experts.down_proj"], BOTH]), min_size=3,
                       max_size=3),
       mapping=st.sampled_from(["distinct", "uniform", "identical", "some-base", "all-base"]), seed=st.integers(0, 99))
def test_property_rows_equal_peft(tmp_path_factory, top_k, ranks, params, mapping, seed):
    base = moe_model("qwen3_moe", seed=seed % 3, layers=1, top_k=top_k)
    tmp = tmp_path_factory.mktemp("moe")
    adapters = {f"a{i}": save_adapter(base, f"a{i}", LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj"],
                                                               target_parameters=p), tmp, seed=seed + i)
                for i, (r, p) in enumerate(zip(ranks, params))}
    model, handle = patched(base, adapters)
    gen = torch.Generator().manual_seed(seed)
    slots = make_slots(mapping, 5, 3, gen)
    names = [None if s < 0 else f"a{s}" for s in slots.tolist()]
    input_ids = torch.randint(0, VOCAB, (5, 4), generator=gen)
    with torch.no_grad():
        got = model(input_ids=input_ids, lora_ids=handle.ids(names), use_cache=False).logits
    assert rel_err(got, reference_logits(base, adapters, names, input_ids)) < TOLERANCE[torch.float32]


def test_engine_greedy_tokens_equal_generate(tmp_path):
    base = moe_model("qwen2_moe", seed=5)
    adapters = three_adapters(base, tmp_path, attention=("q_proj", "shared_expert.gate_proj"))
    engine = Engine(copy.deepcopy(base), max_loras=3, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                    num_blocks=64, max_seq_len=40, adapters={n: a.path for n, a in adapters.items()})
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(2)
    requests = [(torch.randint(3, VOCAB, (n,), generator=gen).tolist(), a)
                for n, a in ((5, None), (11, "both"), (3, "gate_up"), (9, "down"), (7, "both"))]
    ids = [engine.add_request(prompt, params, adapter) for prompt, adapter in requests]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    for i, (prompt, adapter) in zip(ids, requests):
        model = base if adapter is None else adapters[adapter].peft_model
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        # generate stops at the eos token (2), the engine (ignore_eos) goes on: the same tokens up to it
        assert got[i][: len(want)] == want.tolist() and (len(want) == 6 or want[-1] == 2), adapter


def test_handle_describes_the_expert_parameters_and_slot_bytes_counts_them():
    base = moe_model("mixtral", experts=3)
    estimate = slot_bytes(base, 16)
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=2)
    m = handle.base_modules["model.layers.0.mlp.experts.gate_up_proj"]
    assert (m.kind, m.num_experts, m.in_features, m.out_features) == ("experts", 3, 32, 96)
    m = handle.base_modules["model.layers.1.mlp.experts.down_proj"]
    assert (m.kind, m.num_experts, m.in_features, m.out_features) == ("experts", 3, 48, 32)
    assert estimate == handle.slot_bytes(16) // 2  # one slot of every store, at rank 16


# ---------------------------------------------------------------------------------------------- adapter refusals


def _rewrite(folder, config=None, weights=None):
    if config is not None:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        cfg.update(config)
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
    if weights is not None:
        tensors = load_file(folder / "adapter_model.safetensors")
        save_file(weights(tensors), folder / "adapter_model.safetensors")


def test_refusals_name_the_adapter_the_parameter_and_the_fix(tmp_path):
    base = moe_model("mixtral", experts=4)
    a = save_adapter(base, "a", LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=BOTH), tmp_path, 0)
    key = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"  # the outer wrapper: down_proj
    cases = [
        ({"target_parameters": ["experts.nope"]}, None, r"'experts.nope' names no stacked MoE expert parameter.*"
                                                        r"experts.down_proj"),
        ({"target_parameters": "experts.down_proj"}, None, "must be a list of parameter names"),
        ({"fan_in_fan_out": True}, None, "ParamWrapper does not work with fan_in_fan_out"),
        ({"r": 8}, None, r"rank 4 but adapter_config.json gives rank 8"),
        (None, lambda t: {**t, key: t[key][:10]}, r"experts.down_proj'.*need A \[r \* 4, 48\]"),
        (None, lambda t: {k: v for k, v in t.items() if "layers.1.mlp.experts.base_layer" not in k},
         r"layers.1.mlp.experts.gate_up_proj.*no LoRA weights"),
        (None, lambda t: {**t, key: t[key] * float("nan")}, "NaN"),
    ]
    for i, (config, weights, match) in enumerate(cases):
        folder = tmp_path / f"bad{i}"
        folder.mkdir()
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (folder / f).write_bytes((tmp_path / "a" / f).read_bytes())
        _rewrite(folder, config, weights)
        handle = lorakit.patch(copy.deepcopy(base), max_loras=1)
        with pytest.raises(AdapterError, match=match):
            handle.load_adapter("bad", folder)
        assert not handle.adapters
    # a model without experts names what it lacks
    dense = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    with pytest.raises(AdapterError, match="the model has none"):
        lorakit.patch(dense, max_loras=1).load_adapter("a", a.path)


# --------------------------------------------------------------------------------------------------- the op


def op_case(tokens, slots, experts, r_max, in_f, out_f, dtype, mapping, seed, pad_nan=False):
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, r_max + 1, (slots, experts), generator=gen, dtype=torch.int32)
    A = torch.randn(slots, experts, r_max, in_f, generator=gen) * 0.3
    Bs = torch.randn(slots, r_max, experts * out_f, generator=gen) * 0.3
    if pad_nan:  # rank padding never read: NaN there cannot reach y
        for s in range(slots):
            for e in range(experts):
                A[s, e, ranks[s, e]:] = float("nan")
                Bs[s, ranks[s, e]:, e * out_f:(e + 1) * out_f] = float("nan")
    A, Bs = A.to(dtype), Bs.to(dtype)
    B = Bs.view(slots, r_max, experts, out_f).permute(0, 2, 3, 1)
    x = torch.randn(tokens, in_f, generator=gen).to(dtype)
    y = torch.randn(tokens, out_f, generator=gen).to(dtype)
    scales = torch.rand(slots, experts, generator=gen) + 0.5
    slot = make_slots(mapping, tokens, slots, gen)
    expert = torch.randint(0, experts, (tokens,), generator=gen)
    return y, x, A, B, ranks, scales, slot, expert


def check_op(y_out, case):
    y, x, A, B, ranks, scales, slot, expert = case
    clean = lambda t: torch.nan_to_num(t, nan=0.0)  # noqa: E731  (the reference stops at the rank anyway)
    ref = expert_lora_ref(y, x, clean(A), clean(B), ranks, scales, slot, expert)
    mag = expert_lora_ref(y.abs(), x.abs(), clean(A).abs(), clean(B).abs(), ranks, scales, slot, expert)
    assert rel_err(y_out, ref, mag) <= TOLERANCE[y.dtype]
    base = slot < 0
    assert torch.equal(y_out[base], y[base])


@given(tokens=st.sampled_from([1, 3, 7, 33, 133]), slots=st.integers(1, 4), experts=st.integers(1, 5),
       r_max=st.sampled_from([1, 5, 16, 40]), dims=st.sampled_from([(8, 24), (40, 3), (67, 130)]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       mapping=st.sampled_from(["distinct", "uniform", "zipf", "identical", "all-base", "some-base"]),
       seed=st.integers(0, 999))
def test_op_torch_path_matches_reference(tokens, slots, experts, r_max, dims, dtype, mapping, seed):
    case = op_case(tokens, slots, experts, r_max, *dims, dtype, mapping, seed, pad_nan=True)
    y, x, A, B, ranks, scales, slot, expert = case
    out = y.clone()
    add_expert_lora(out, x, A, B, ranks, scales, expert_keys(slot, expert, slots, experts))
    check_op(out, case)


@triton_on_cpu
@settings(max_examples=12)
@given(tokens=st.sampled_from([1, 3, 7, 33]), slots=st.integers(1, 3), experts=st.integers(1, 4),
       r_max=st.sampled_from([1, 5, 16, 40, 130]), dims=st.sampled_from([(8, 24), (40, 3), (67, 300)]),
       dtype=st.sampled_from([torch.float32, torch.float16]),
       mapping=st.sampled_from(["distinct", "uniform", "identical", "some-base"]), seed=st.integers(0, 999))
def test_triton_kernels_match_reference_interpreted(tokens, slots, experts, r_max, dims, dtype, mapping, seed):
    case = op_case(tokens, slots, experts, r_max, *dims, dtype, mapping, seed, pad_nan=True)
    y, x, A, B, ranks, scales, slot, expert = case
    key = torch.where(slot >= 0, slot * experts + expert, -1)
    for block_m, split_k, sms in ((None, 1, None), (64, 3, 1)):  # decode and prefill tiles; K split; one SM
        meta = build_lora_meta(key, slots * experts, block_m)
        out = y.clone()
        _launch(out, x, A, B, ranks, scales, meta.token_order, meta.tiles, meta.block_m, split_k, sms=sms)
        check_op(out, case)
    out = y.clone()  # and through the public call, launching directly
    add_expert_lora(out, x, A, B, ranks, scales, expert_keys(slot, expert, slots, experts),
                    options=KernelOptions(direct_devices={"cuda", "cpu"}))
    check_op(out, case)


def test_opcheck_and_compiled_op_match_eager():
    case = op_case(9, 2, 3, 8, 16, 24, torch.float32, "some-base", seed=1)
    y, x, A, B, ranks, scales, slot, expert = case
    meta = expert_keys(slot, expert, 2, 3)
    args = (y.clone(), x, A, B, ranks, scales, meta.token_slot, meta.token_order, meta.tiles, meta.block_m, 1)
    torch.library.opcheck(torch.ops.lorakit.expert_lora.default, args)

    def f(y, x):
        y = y.clone()
        add_expert_lora(y, x, A, B, ranks, scales, expert_keys(slot, expert, 2, 3))
        return y

    assert torch.equal(torch.compile(f, fullgraph=True)(y, x), f(y, x))


def test_op_refuses_bad_arguments_before_touching_y():
    y, x, A, B, ranks, scales, slot, expert = op_case(5, 2, 3, 8, 16, 24, torch.float32, "uniform", seed=2)
    meta = expert_keys(slot, expert, 2, 3)
    bad = [
        (dict(A=A[:, :, :, :8]), r"A must have shape \[S, E, R_max, in=16\]"),
        (dict(B=B[:, :2]), r"B must have shape \(2, 3, 24, 8\)"),
        (dict(ranks=ranks.long()), "ranks must have dtype"),
        (dict(scales=scales[:1]), r"scales must have shape \(2, 3\)"),
        (dict(x=x.half()), "y must have dtype"),
        (dict(x=x.half(), y=y.half()), "A must have dtype"),
        (dict(ranks=ranks + 9), r"ranks must lie in \[0, R_max=8\]"),
    ]
    for change, match in bad:
        args = dict(y=y.clone(), x=x, A=A, B=B, ranks=ranks, scales=scales) | change
        before = args["y"].clone()
        with pytest.raises((ValueError, TypeError), match=match):
            add_expert_lora(**args, meta=meta)
        assert torch.equal(args["y"], before)
    with pytest.raises(ValueError, match="built for 6 keys but A holds 1 slots x 3 experts"):
        add_expert_lora(y.clone(), x, A[:1], B[:1], ranks[:1], scales[:1], meta)
    assert expert_split_k(4096, 16, 9, 132) > 1 and expert_split_k(64, 16, 9, 132) == 1


def test_moe_reference_equals_the_base_experts_with_the_delta_merged():
    """moe_experts_ref (float64) against the model's own experts with W_e + scale * B_e @ A_e merged in."""
    base = moe_model("mixtral", layers=1)
    experts = base.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    T, E, R = 6, 4, 3
    A = torch.randn(1, E, R, 32, generator=gen) * 0.3
    B = torch.randn(1, E, 96, R, generator=gen) * 0.3
    ranks, scales = torch.full((1, E), R, dtype=torch.int32), torch.full((1, E), 0.7)
    x = torch.randn(T, 32, generator=gen)
    top = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=gen)
    weights = {"gate_up_proj": experts.gate_up_proj.detach(), "down_proj": experts.down_proj.detach()}
    ref = moe_experts_ref(x, top, w, torch.zeros(T, dtype=torch.long), weights,
                          {"gate_up_proj": (A, B, ranks, scales)}, torch.nn.functional.silu)
    merged = copy.deepcopy(experts)
    with torch.no_grad():
        merged.gate_up_proj += 0.7 * B[0] @ A[0]
        assert rel_err(merged(x, top, w), ref) < TOLERANCE[torch.float32]
        wrapper = LoraExperts(copy.deepcopy(experts), None, 1)
        assert wrapper.slots["gate_up_proj"].num_experts == E


# ------------------------------------------------------------------------ per-expert linear targets (older layout)


class ExpertMLP(torch.nn.Module):
    """One expert as transformers 4 kept it: three nn.Linear (gate, up, down under either naming)."""

    def __init__(self, hidden, inter, act, names):
        super().__init__()
        self.names = names
        for name, (n_in, n_out) in zip(names, ((hidden, inter), (hidden, inter), (inter, hidden))):
            self.add_module(name, torch.nn.Linear(n_in, n_out, bias=False))
        self.act = act

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act(gate(x)) * up(x))


class ExpertList(torch.nn.ModuleList):
    """transformers 4's experts layout: a ModuleList of MLPs, each called on the tokens routed to it."""

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self):
            token, k = torch.where(top_k_index == e)
            out.index_add_(0, token, expert(hidden[token]) * top_k_weights[token, k, None].to(hidden.dtype))
        return out


def older_layout(model, names):
    """A copy of ``model`` with its stacked experts split into per-expert nn.Linear modules of the same weights."""
    old = copy.deepcopy(model)
    for layer in old.model.layers:
        stacked = layer.mlp.experts
        e, i2, h = stacked.gate_up_proj.shape
        experts = ExpertList([ExpertMLP(h, i2 // 2, stacked.act_fn, names) for _ in range(e)])
        with torch.no_grad():
            for w_gu, w_d, expert in zip(stacked.gate_up_proj, stacked.down_proj, experts):
                gate, up, down = (getattr(expert, n) for n in names)
                gate.weight.copy_(w_gu[: i2 // 2])
                up.weight.copy_(w_gu[i2 // 2:])
                down.weight.copy_(w_d)
        layer.mlp.experts = experts
    return old


@pytest.mark.parametrize("names,mixtral_path", [(("gate_proj", "up_proj", "down_proj"), False),
                                                (("w1", "w3", "w2"), True)])
def test_per_expert_linear_adapters_of_the_older_layout_fold_into_the_stacked_experts(names, mixtral_path, tmp_path,
                                                                                      monkeypatch):
    """An adapter trained when the experts were per-expert nn.Linear modules (keys ``experts.<e>.gate_proj``, ...;
    transformers 4's Mixtral: ``block_sparse_moe.experts.<e>.w1``), with other ranks and alphas for up and down,
    served on the stacked experts: each row equals PEFT on the model of the older layout (the same weights)."""
    import peft.utils.transformers_weight_conversion as conversion

    # PEFT on transformers 5 rewrites such configs for a model of the new layout; the old-layout model keeps them
    monkeypatch.setattr(conversion, "convert_peft_config_for_transformers", lambda *args, **kwargs: None)
    base = moe_model("qwen3_moe", seed=6)
    old = older_layout(base, names)
    gate, up, down = names
    configs = {
        "all": LoraConfig(r=4, lora_alpha=8, target_modules=[gate, up, down, "q_proj"], rank_pattern={up: 6},
                          alpha_pattern={down: 3}),
        "gate_up": LoraConfig(r=8, lora_alpha=8, target_modules=[gate, up]),
        "down": LoraConfig(r=2, lora_alpha=4, target_modules=f".*\\.{down}"),  # a regex
    }
    adapters = {n: save_adapter(old, n, c, tmp_path, seed=i, std=0.2) for i, (n, c) in enumerate(configs.items())}
    assert any(f"experts.3.{up}.lora_A" in k for k in load_file(tmp_path / "all" / "adapter_model.safetensors"))
    if mixtral_path:  # the keys as transformers 4's Mixtral named the block
        for a in adapters.values():
            _rewrite(Path(a.path), weights=lambda t: {k.replace(".mlp.experts.", ".block_sparse_moe.experts."): v
                                                      for k, v in t.items()})
    model, handle = patched(base, adapters)
    info = handle.inspect_adapter("x", adapters["all"].path)
    assert info.modules["model.layers.0.mlp.experts.gate_up_proj"][0] == 10  # gate's 4 + up's 6
    assert info.modules["model.layers.1.mlp.experts.down_proj"] == (4, 3 / 4)
    names_ = [None, "all", "gate_up", "down", "all"]
    input_ids = torch.randint(0, VOCAB, (len(names_), 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = model(input_ids=input_ids, lora_ids=handle.ids(names_), use_cache=False).logits
    want = reference_logits(old, adapters, names_, input_ids)
    for i, name in enumerate(names_):
        assert rel_err(got[i], want[i]) < TOLERANCE[torch.float32], name


def test_peft_converted_per_expert_targets_are_served(tmp_path):
    """PEFT on transformers 5 turns target_modules naming the experts' projections into target_parameters (gate_up at
    twice the rank, by rank and alpha patterns): served as PEFT serves it."""
    base = moe_model("olmoe", seed=7)
    a = save_adapter(base, "conv", LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj",
                                                                                "k_proj"]), tmp_path, seed=3)
    config = json.loads((tmp_path / "conv" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["down_proj", "gate_up_proj"]
    model, handle = patched(base, {"conv": a})
    input_ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = model(input_ids=input_ids, lora_ids=handle.ids(["conv", None]), use_cache=False).logits
    assert rel_err(got, reference_logits(base, {"conv": a}, ["conv", None], input_ids)) < TOLERANCE[torch.float32]


def test_lorakit_serve_serves_an_moe_model_with_an_expert_adapter(tmp_path):
    """The OpenAI-compatible server over an engine of a MoE model: a completion on the expert adapter is PEFT's."""
    from _serve_helpers import LiveServer, make_tokenizer
    from lorakit.serve import ServeConfig, create_app

    tokenizer = make_tokenizer()
    config = moe_config("qwen3_moe")
    config.vocab_size, config.eos_token_id = len(tokenizer), tokenizer.eos_token_id
    torch.manual_seed(9)
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    a = save_adapter(base, "moe", LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], target_parameters=BOTH),
                     tmp_path, seed=1, std=0.2)
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=1, adapters={"moe": a.path}, block_size=4)
    server = LiveServer(create_app(engine, ServeConfig(model_name="tiny")))
    try:
        got = {name: server.client().completions.create(model=name, prompt="hello world, the", max_tokens=6,
                                                        temperature=0).choices[0].text for name in ("moe", "tiny")}
    finally:
        server.close()
    prompt = torch.tensor([tokenizer("hello world, the").input_ids])
    for name, model in (("moe", a.peft_model), ("tiny", base)):
        with torch.no_grad():
            want = model.generate(prompt, max_new_tokens=6, do_sample=False,
                                  attention_mask=torch.ones_like(prompt))[0, prompt.shape[1]:]
        assert got[name] == tokenizer.decode(want, skip_special_tokens=True), name
    assert got["moe"] != got["tiny"]

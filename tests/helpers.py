"""Helpers the test files share: plain functions, classes and constants, no fixtures (those are in conftest.py).

No test file imports another test file: what two of them need lives here, or in the topic modules beside it
(``_lora_cases``: random LoRA op problems; ``_peft_models``: tiny models and saved PEFT adapters; ``_serve_helpers``:
the served tiny world and live servers; ``_tokenizers``: a BPE tokenizer; ``_ranks``: CPU ranks; ``_gpu_plan``: the
GPU check's split). lorakit is imported inside the helpers that use it, so importing this module stays cheap.

Sections: waiting; numbers; GPU; adapter folders; tokenizers; LoRA op checks; attention cases; reference logits;
MoE models; quantized models; a 2048-wide Qwen2 for GPU tests; served-world attacks; penalties and grammars; a fake
Hugging Face hub.
"""

from __future__ import annotations

import copy
import hashlib
import http.server
import json
import math
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st

# ------------------------------------------------------------------------------------------------------ waiting


def wait_for(check, timeout: float = 60.0, poll: float = 0.01):
    """Poll ``check()`` every ``poll`` seconds until it is truthy, and return that value; fail after ``timeout``."""
    end = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < end, "timed out"
        time.sleep(poll)
    return got


def free_port() -> int:
    """A loopback TCP port nothing listens on right now (for a server started in another process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------------ numbers


def rel_err(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor | None = None) -> float:
    """||out - ref|| / ||ref||, or / ||magnitude|| where given: the same computation on absolute values,
    which bounds rounding error even where the sums cancel (a one-element delta of rank 4, say)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "output has NaN"
    denom = (ref if magnitude is None else magnitude.double().cpu()).norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN included."""
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.view(view), b.view(view))


# ---------------------------------------------------------------------------------------------------------- GPU

# Marks a test that runs Triton kernels on the CPU, which needs the interpreter (tests/conftest.py sets it there).
triton_on_cpu = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton kernels on the CPU need TRITON_INTERPRET=1"
)


def poison_cuda_cache(nbytes: int = 1 << 30) -> None:
    """Fill freed allocator blocks with NaN, so an output element a kernel forgets to write shows up."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


# -------------------------------------------------------------------------------------------- adapter folders


def edit_config(folder, **changes):
    """Rewrite an adapter folder's adapter_config.json with ``changes`` applied."""
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


# ------------------------------------------------------------------------------------------------- tokenizers

WORD_VOCAB = 64  # word_tokenizer's base vocabulary: w0 .. w63


def word_tokenizer(added=()):
    """A word-level tokenizer of the base vocabulary w0 .. w63, plus ``added`` special tokens (ids 64, ...)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(WORD_VOCAB)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core)
    tokenizer.add_tokens(list(added), special_tokens=True)
    return tokenizer


# ------------------------------------------------------------------------------------------- LoRA op checks


def check_h(h: torch.Tensor, case) -> None:
    """h (shrink's partials) sums to the reference; every partial is exactly zero on base rows and rank padding."""
    from _lora_cases import H_TOLERANCE
    from lorakit.ops.reference import shrink_ref

    ref = shrink_ref(case.x, case.A, case.ranks, case.slots)
    magnitude = shrink_ref(case.x.abs(), case.A.abs(), case.ranks, case.slots)  # bounds rounding where sums cancel
    assert rel_err(h.sum(0), ref, magnitude) <= H_TOLERANCE
    assert (h.cpu()[:, ref == 0] == 0).all(), "base rows and rank padding must be written as zeros"


def check_y(y: torch.Tensor, case) -> None:
    """y (after add_lora) matches the float64 reference within the dtype's tolerance; base rows are untouched."""
    from _lora_cases import TOLERANCE
    from lorakit.ops.reference import lora_ref

    ref = lora_ref(case.y, case.x, case.A, case.B, case.ranks, case.scales, case.slots, case.slice_sizes)
    magnitude = lora_ref(case.y.abs(), case.x.abs(), case.A.abs(), case.B.abs(), case.ranks, case.scales,
                         case.slots, case.slice_sizes)
    err = rel_err(y, ref, magnitude)
    assert err <= TOLERANCE[case.y.dtype], f"relative error {err:.2e} over {TOLERANCE[case.y.dtype]:.0e}"
    base = (case.slots < 0).cpu()
    assert torch.equal(y.cpu()[base], case.y.cpu()[base]), "base-model rows must be left untouched"


# ------------------------------------------------------------------------------------------- attention cases

# Relative error ||out - ref|| / ||ref|| allowed on attention, by dtype: the output is rounded once, and the kernel
# rounds the softmax weights to the dtype for the tensor-core dot with V.
ATTENTION_TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass
class AttnCase:
    """One step of a batch: the caches hold each sequence's context; key/value/kv_index its new tokens."""

    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D], the new tokens' keys (rows of padding and of seq_lens-0 sequences unused)
    value: torch.Tensor
    kv_index: torch.Tensor  # int64 [T], -1 where nothing is written
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]: context written, every other row NaN
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, max_blocks], garbage past each sequence's blocks
    seq_lens: torch.Tensor  # int32 [S]
    query_start: torch.Tensor  # int32 [S + 1]
    scale: float
    softcap: float = 0.0
    window: int = 0

    def written(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches after the step's write, by plain indexing (independent of write_kv)."""
        k, v = self.k_cache.clone(), self.v_cache.clone()
        rows = (self.kv_index >= 0).nonzero().squeeze(1)
        index = self.kv_index[rows]
        bs = k.shape[1]
        k[index // bs, index % bs] = self.key[rows]
        v[index // bs, index % bs] = self.value[rows]
        return k, v

    def attention_args(self, k_cache=None, v_cache=None) -> tuple:
        if k_cache is None:
            k_cache, v_cache = self.written()
        return (self.query, k_cache, v_cache, self.block_tables, self.seq_lens, self.query_start, self.scale,
                self.softcap, self.window)

    def to(self, device) -> AttnCase:
        return AttnCase(*(v.to(device) if isinstance(v, torch.Tensor) else v for v in vars(self).values()))


def make_attn_case(seqs: list[tuple[int, int]], *, block_size: int, num_kv_heads: int, group: int, head_dim: int,
                   dtype: torch.dtype, softcap: float = 0.0, window: int = 0, sharpness: float = 1.0,
                   pad_rows: int = 0, free_blocks: int = 2, extra_cols: int = 1, garbage: str = "free",
                   seed: int = 0, device: str = "cpu") -> AttnCase:
    """A random attention step over a paged cache. seqs: (new tokens n, seq_len L) per sequence, L >= n or L == 0.
    Blocks are shuffled over the cache."""
    from lorakit.ops import cdiv

    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seqs)
    need = [cdiv(L, block_size) for _, L in seqs]
    num_blocks = sum(need) + free_blocks
    order = torch.randperm(num_blocks, generator=cpu_gen).int()
    free = order[sum(need):]
    max_blocks = max(need, default=0) + extra_cols
    if garbage == "free" and len(free):  # blocks full of NaN
        tables = free[torch.randint(0, len(free), (num_seqs, max_blocks), generator=cpu_gen)]
    elif garbage == "huge":  # far outside the cache: reading one faults
        tables = torch.randint(1 << 28, 1 << 30, (num_seqs, max_blocks), generator=cpu_gen, dtype=torch.int32)
        tables[:, ::2] = -(1 << 20)
    else:
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    tables = tables.to(torch.int32)
    start = 0
    for s, nb in enumerate(need):
        tables[s, :nb] = order[start:start + nb]
        start += nb

    starts = [0]
    for n, _ in seqs:
        starts.append(starts[-1] + n)
    num_tokens = starts[-1] + pad_rows

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    kv_index = torch.full((num_tokens,), -1, dtype=torch.int64)
    for s, (n, L) in enumerate(seqs):
        pos = torch.arange(L)
        index = tables[s, pos // block_size].long() * block_size + pos % block_size
        ctx = max(L - n, 0)
        flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
        flat_k[index[:ctx].to(device)] = randn(ctx, num_kv_heads, head_dim)
        flat_v[index[:ctx].to(device)] = randn(ctx, num_kv_heads, head_dim)
        if L > 0:
            kv_index[starts[s]:starts[s + 1]] = index[ctx:]
    return AttnCase(
        query=randn(num_tokens, num_kv_heads * group, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        kv_index=kv_index.to(device),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables.to(device),
        seq_lens=torch.tensor([L for _, L in seqs], dtype=torch.int32, device=device),
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=sharpness / math.sqrt(head_dim),
        softcap=softcap,
        window=window,
    )


def zero_rows(case: AttnCase) -> torch.Tensor:
    """Rows that must come out exactly zero: padding past query_start[S] and rows of seq_lens-0 sequences."""
    zero = torch.ones(case.query.shape[0], dtype=torch.bool)
    starts, lens = case.query_start.tolist(), case.seq_lens.tolist()
    for s, L in enumerate(lens):
        if L > 0:
            zero[starts[s]:starts[s + 1]] = False
    return zero


def check_attention(out: torch.Tensor, case: AttnCase, what: str = "") -> None:
    """``out`` (paged attention over ``case``) against the float64 reference; padding rows exactly zero."""
    from lorakit.ops.reference import attention_ref

    k_cache, v_cache = case.written()
    ref = attention_ref(*case.attention_args(k_cache, v_cache))
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    err = rel_err(out, ref)
    tol = ATTENTION_TOLERANCE[case.query.dtype]
    assert err <= tol, f"{what}: relative error {err:.2e} over {tol:.0e}"
    zero = zero_rows(case).to(out.device)
    assert (out[zero] == 0).all(), f"{what}: padding rows and rows of seq_lens-0 sequences must be zero"


@st.composite
def attn_cases(draw, dtypes, max_new: int = 9, max_context: int = 40) -> AttnCase:
    """Hypothesis strategy: one batch step of decodes, prefills, padding entries and sequences with nothing to
    attend to, over random cache layouts and garbage block tables."""
    seqs = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(("decode", "decode", "prefill", "prefill", "empty", "no-keys")))
        ctx = draw(st.integers(0, max_context))
        if kind == "decode":
            seqs.append((1, ctx + 1))
        elif kind == "prefill":
            n = draw(st.integers(0, max_new))
            seqs.append((n, ctx + n))
        elif kind == "empty":  # a padding entry of a CUDA-graph bucket, with or without context
            seqs.append((0, draw(st.sampled_from((0, ctx)))))
        else:  # rows whose sequence has seq_lens 0: nothing to attend to
            seqs.append((draw(st.integers(1, 3)), 0))
    return make_attn_case(
        seqs,
        block_size=draw(st.sampled_from((4, 8, 16))),
        num_kv_heads=draw(st.sampled_from((1, 2))),
        group=draw(st.sampled_from((1, 2, 4))),
        head_dim=draw(st.sampled_from((16, 32, 64))),
        dtype=draw(st.sampled_from(dtypes)),
        softcap=draw(st.sampled_from((0.0, 0.0, 1.5))),
        window=draw(st.sampled_from((0, 0, 1, 3, 16))),
        sharpness=draw(st.sampled_from((1.0, 4.0))),
        pad_rows=draw(st.integers(0, 3)),
        free_blocks=draw(st.integers(0, 3)),
        extra_cols=draw(st.integers(0, 2)),
        garbage=draw(st.sampled_from(("free", "zero", "huge"))),
        seed=draw(st.integers(0, 1 << 16)),
    )


def run_triton(case: AttnCase, kind: str | None, num_segments: int | None) -> torch.Tensor:
    """The paged-attention kernel launched directly, with the launch configuration of ``kind`` (decode/prefill)."""
    from lorakit.ops.attention import ATTENTION_CONFIGS, _launch_paged_attention

    config = None if kind is None else ATTENTION_CONFIGS[kind, case.query.element_size()]
    return _launch_paged_attention(*case.attention_args(), config=config, num_segments=num_segments)


# ------------------------------------------------------------------------------------------- reference logits

# Relative error of each row's logits against PEFT's, by dtype.
LOGITS_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def reference_logits(base, adapters, names, input_ids):
    """Each row's logits from ``base`` (name None) or its adapter's PEFT model alone (``adapters``: SavedAdapters)."""
    rows = []
    for b, name in enumerate(names):
        model = base if name is None else adapters[name].peft_model
        with torch.no_grad():
            rows.append(model(input_ids=input_ids[b: b + 1], use_cache=False).logits[0])
    return torch.stack(rows)


# ------------------------------------------------------------------------------------------------- MoE models

MOE_VOCAB = 96
BOTH_EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]  # the stacked experts' two parameters


def moe_config(family: str, experts: int = 4, top_k: int = 2, layers: int = 2):
    """A tiny config of an MoE family: mixtral, qwen3_moe, qwen2_moe (shared expert), olmoe or gpt_oss."""
    import transformers

    common = dict(vocab_size=MOE_VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=experts,
                                          num_experts_per_tok=top_k)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24, head_dim=8,
                                           num_experts=experts, num_experts_per_tok=top_k)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                           shared_expert_intermediate_size=40, num_experts=experts,
                                           num_experts_per_tok=top_k)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=48, num_experts=experts, num_experts_per_tok=top_k)
    if family == "gpt_oss":  # experts stored transposed [E, in, out], with biases and a gate of their own
        return transformers.GptOssConfig(**common, intermediate_size=24, head_dim=8, num_local_experts=experts,
                                         num_experts_per_tok=top_k, rope_parameters=None)
    raise ValueError(family)


def moe_model(family: str, seed: int = 0, **kw):
    """A tiny random MoE model (eager attention) with random stacked experts; ``kw``: moe_config's."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(family, **kw), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:  # random stacked experts, gpt-oss's biases too (zero at init)
                p.normal_(0, 0.1)
    return model


def three_adapters(base, tmp_path, attention=("q_proj", "v_proj")):
    """Adapters on both expert parameters (+ attention), on gate_up alone (+ o_proj), on down alone (rsLoRA with an
    alpha pattern), of ranks 8, 4 and 20."""
    from peft import LoraConfig

    from _peft_models import save_adapter

    configs = {
        "both": LoraConfig(r=8, lora_alpha=16, target_modules=list(attention), target_parameters=BOTH_EXPERTS),
        "gate_up": LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"], target_parameters=["experts.gate_up_proj"]),
        "down": LoraConfig(r=20, lora_alpha=8, use_rslora=True, target_modules=[],
                           target_parameters=["experts.down_proj"], alpha_pattern={"layers.1.mlp.experts.down_proj": 3}),
    }
    return {n: save_adapter(base, n, c, tmp_path, seed=i, std=0.2) for i, (n, c) in enumerate(configs.items())}


# -------------------------------------------------------------------------------------------- quantized models

QUANT_VOCAB = 128


def quant_model(arch: str, seed: int = 0, dtype=torch.float32):
    """A tiny model wide enough for int4 (in_features a multiple of its group of 128)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=QUANT_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = transformers.Qwen2Config(**common) if arch == "qwen2" else transformers.LlamaConfig(**common)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype).eval()


def dequantized(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of a quantized model with each quantized layer an nn.Linear of the weight it multiplies by."""
    from lorakit.layers.quant import QuantizedLinear

    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if isinstance(module, QuantizedLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                     dtype=module.compute_dtype, device=module.device)
            with torch.no_grad():
                linear.weight.copy_(module.dequantized_weight(module.compute_dtype))
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, linear)
    return ref


def greedy(engine, requests, max_tokens=6, ignore_eos=True) -> list[list[int]]:
    """Each (prompt, adapter)'s greedy tokens from ``engine``, the requests run together."""
    from lorakit.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    ids = [engine.add_request(prompt, params, adapter) for prompt, adapter in requests]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    return [got[i] for i in ids]


# ------------------------------------------------------------------------- a 2048-wide Qwen2 for GPU tests

QWEN2_2048_VOCAB = 512
# Relative error of a bf16 model's logits against float32 PEFT on the dequantized base (as in test_patch_gpu).
BF16_PEFT_LOGITS_TOLERANCE = 3e-2
# The float32 engine tests' graphs: one decode bucket (smaller batches pad to it), no mixed-step graphs. Each graph
# shape compiles the float32 (IEEE-dot) LoRA kernels anew, and Triton takes ~10 s a variant there: with the default
# buckets a float32 engine test spent ~2 minutes compiling on the H200.
FLOAT32_GRAPHS = dict(graph_sizes=(8,), graph_token_sizes=())


def qwen2_2048(dtype):
    """A random two-layer Qwen2 of hidden size 2048 (biases on q/k/v), seed 0, in ``dtype``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=QWEN2_2048_VOCAB, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


def qwen2_2048_requests():
    """Six (prompt ids, adapter) requests for qwen2_2048 under adapters a0, a1, a2 and the base model."""
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, QWEN2_2048_VOCAB, (n,), generator=gen).tolist(), a)
            for n, a in ((5, None), (40, "a0"), (3, "a1"), (19, "a2"), (7, "a0"), (12, None))]


def assert_rows_match_peft(model, handle, ref_base, adapters, names, input_ids, label):
    """Each row of a bf16 patched model's mixed batch against float32 PEFT on ``ref_base`` with its adapter alone."""
    from peft import PeftModel

    with torch.no_grad():
        out = model(input_ids=input_ids, lora_ids=handle.ids(names), use_cache=False).logits.float()
        for b, name in enumerate(names):
            ref_model = ref_base if name is None else PeftModel.from_pretrained(copy.deepcopy(ref_base),
                                                                                adapters[name]).eval()
            ref = ref_model(input_ids=input_ids[b: b + 1], use_cache=False).logits[0]
            err = rel_err(out[b], ref)
            assert err < BF16_PEFT_LOGITS_TOLERANCE, f"{label} row {b} ({name}): {err:.2e}"


def greedy_with_top2(engine, requests, max_tokens):
    """Each request's greedy tokens and, per token, the two most likely tokens' log-probabilities."""
    from lorakit.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    ids = [engine.add_request(prompt, params, adapter) for prompt, adapter in requests]
    got = {i: ([], []) for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.token_ids)
            got[out.request_id][1].extend(sorted(t.top.values(), reverse=True)[:2] for t in out.logprobs)
    return [got[i] for i in ids]


def assert_same_tokens_but_at_near_ties(eager, graphs, gap=0.1):
    """Graph replays pad the batch to a captured size, and the GEMMs' tiles (so the bf16 rounding) follow the row
    count: greedy tokens may part only where the eager run's two best tokens were within ``gap`` of each other
    (a near tie: one bf16 step of these logits is about 0.016), and nothing after that is compared."""
    for (want, top), (tokens, _) in zip(eager, graphs):
        split = next((i for i, (a, b) in enumerate(zip(want, tokens)) if a != b), None)
        assert len(tokens) == len(want)
        if split is not None:
            best, second = top[split]
            assert best - second < gap, f"tokens parted at step {split} where eager's margin was {best - second:.3f}"


# ------------------------------------------------------------------------------------ served-world attacks

BYSTANDER_TOKENS = 100  # the Bystander's: long enough to overlap every attack (about 2 s at slow_steps' pace)


@contextmanager
def slow_steps(live, seconds: float = 0.02):
    """Every engine step of ``live`` (a LiveServer) takes ``seconds`` longer, so that a stream lasts long enough to
    see an attack happen."""
    engine = live.server.config.app.state.engine
    step = engine.step
    engine.step = lambda: (time.sleep(seconds), step())[1]
    try:
        yield engine
    finally:
        engine.step = step


@contextmanager
def bystander(live, world, **kw):
    """A Bystander that is streaming when the block starts, and is checked when the block ends."""
    from _serve_helpers import Bystander

    with slow_steps(live), Bystander(live, world, max_tokens=BYSTANDER_TOKENS, **kw) as b:
        wait_for(lambda: len(b.gaps) >= 2 or b.error is not None)
        yield b
    b.check()


def post(live, path: str, body, **kw):
    """POST ``body`` (JSON-encoded unless already str or bytes) to ``live``'s ``path``; the httpx response."""
    import httpx

    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(live.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=kw.pop("timeout", 60), **kw)


# ------------------------------------------------------------------------------------ penalties and grammars

# What logits_world's tokenizer is trained on: JSON, prose, digits.
LOGITS_CORPUS = ['{"name": "Paris", "ok": true, "n": 42}', "What is the capital of France? Paris is.",
                 "hello world, the quick brown fox 0123456789 yes no maybe"]
# A JSON schema that logits_world's tokenizer can write.
LOGITS_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                                                  "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["name", "ok", "n"], "additionalProperties": False}


def logits_world(tmp, chat_template: str | None = None, max_position_embeddings: int = 256):
    """(base model, tokenizer, one saved adapter "a") of a tiny Llama whose BPE tokenizer knows LOGITS_CORPUS."""
    import transformers
    from peft import LoraConfig

    from _peft_models import save_adapter
    from _tokenizers import bpe_tokenizer

    tokenizer = bpe_tokenizer(LOGITS_CORPUS, chat_template=chat_template)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_position_embeddings,
                                      eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    adapter = save_adapter(base, "a", cfg, tmp, seed=1, std=0.3)
    return base, tokenizer, adapter


def logits_reference(world, prompt: list[int], adapter: bool, params) -> list[int]:
    """Greedy tokens from full forward passes of a logits_world, with the penalties, bias and grammar of ``params``
    (SamplingParams) applied to the logits."""
    import llguidance
    import llguidance.hf
    import llguidance.torch

    base, tokenizer, saved = world
    model = saved.peft_model if adapter else base
    matcher = None
    if params.structured_output is not None:
        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=tokenizer.eos_token_id)
        matcher = llguidance.LLMatcher(lltok, params.structured_output.grammar())
    out: list[int] = []
    while len(out) < params.max_tokens:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        if matcher is not None:
            mask = llguidance.torch.allocate_token_bitmask(1, len(tokenizer))
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            allowed = torch.tensor([bool((int(mask[0, v // 32]) >> (v % 32)) & 1) for v in range(len(logits))])
            logits[~allowed] = float("-inf")
        for token, bias in params.logit_bias:
            logits[token] += bias
        for token in set(prompt + out) if params.repetition_penalty != 1 else ():
            r = params.repetition_penalty
            logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
        for token in set(out):
            logits[token] -= params.frequency_penalty * out.count(token) + params.presence_penalty
        token = int(logits.argmax())
        out.append(token)
        if matcher is not None:
            assert matcher.consume_token(token)
        if token == tokenizer.eos_token_id:
            break
    return out


# ----------------------------------------------------------------------------------- a fake Hugging Face hub

HUB_COMMITS = {"main": "a" * 40, "v1": "b" * 40}  # v1 holds an adapter's files too
HUB_FILES = {  # revision -> files of org/tiny-model
    "main": {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"weights", "tokenizer.json": b"{}",
             "pytorch_model.bin": b"a pickle", "modeling_evil.py": b"import os", "README.md": b"# tiny"},
    "v1": {"config.json": b'{"model_type": "llama", "v": 1}', "model.safetensors": b"old weights",
           "adapter_config.json": b"{}", "adapter_model.safetensors": b"adapter weights"},
}


class FakeHub(http.server.ThreadingHTTPServer):
    """``repos``: {repo id: {revision: {file: bytes}}} (default: org/tiny-model, HUB_FILES); revisions' commits are
    HUB_COMMITS'."""

    def __init__(self, repos: dict | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[str] = []
        self.repos = repos or {"org/tiny-model": HUB_FILES}

    def env(self, home) -> dict:
        """The environment that points huggingface_hub at this hub, with its cache under ``home``."""
        return {"HF_ENDPOINT": f"http://127.0.0.1:{self.server_address[1]}", "HF_HOME": str(home),
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}


class _Handler(http.server.BaseHTTPRequestHandler):
    """FakeHub's requests: a revision's file list (api/models/.../revision|tree), each file's HEAD and GET."""

    def log_message(self, *args):
        pass

    def _answer(self, body: bytes | None):
        self.server.requests.append(f"{self.command} {self.path}")
        parts = self.path.split("?")[0].strip("/").split("/")
        if body is None:
            if parts[:1] == ["api"] and len(parts) >= 6 and parts[1] == "models" and parts[4] in ("revision", "tree"):
                repo, revision = "/".join(parts[2:4]), parts[5]
                revision = next((r for r, c in HUB_COMMITS.items() if c == revision), revision)
                files = self.server.repos.get(repo)
                if files is None:
                    return self._status(404, "Repository not found", {"X-Error-Code": "RepoNotFound"})
                if revision not in files:
                    return self._status(404, "Revision not found", {"X-Error-Code": "RevisionNotFound"})
                if parts[4] == "tree":  # the revision's files, as snapshot_download lists them
                    body = json.dumps([{"type": "file", "path": f, "size": len(c), "oid": hashlib.sha1(c).hexdigest()}
                                       for f, c in files[revision].items()]).encode()
                else:
                    body = json.dumps({"id": repo, "sha": HUB_COMMITS[revision],
                                       "siblings": [{"rfilename": f} for f in files[revision]]}).encode()
                return self._send(body, {"Content-Type": "application/json"})
            if len(parts) >= 5 and parts[2] == "resolve":
                revision = next((r for r, c in HUB_COMMITS.items() if c == parts[3]), parts[3])
                content = self.server.repos.get("/".join(parts[:2]), {}).get(revision, {}).get("/".join(parts[4:]))
                if content is None:
                    return self._status(404, "Entry not found", {"X-Error-Code": "EntryNotFound"})
                etag = hashlib.sha256(content).hexdigest()
                return self._send(content, {"X-Repo-Commit": HUB_COMMITS[revision], "ETag": f'"{etag}"',
                                            "Content-Type": "application/octet-stream"})
            return self._status(404, "not found", {})

    def _status(self, code, message, headers):
        self._send(json.dumps({"error": message}).encode(), {"Content-Type": "application/json", **headers}, code)

    def _send(self, body: bytes, headers: dict, code: int = 200):
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self):
        self._answer(None)

    def do_HEAD(self):
        self._answer(None)

"""Tensor parallelism of the base model: logits at tp=2 (two gloo processes on the CPU) equal the unsharded model's.

Each rank builds the same full model (same seed), shards a deep copy, and compares its logits with the full
model's on the same ids: one forward, and greedy decoding with the KV cache. Ranks report through files; the
parent fails on a missing report, a child's traceback, or a child still running after the deadline (then killed).
"""

from __future__ import annotations

import copy
import json
import os
import traceback

import pytest
import torch
import transformers
from _peft_models import _cfg, tiny_model
from _ranks import join_gloo, run_ranks
from helpers import rel_err

from lorakit.parallel import ColumnParallelLinear, plan_model, shard_model

WORLD_SIZE = 2
DEADLINE_S = 90  # for both ranks together; a rank stuck in a collective times out after 60 s
TOL = {torch.float32: 1e-5}  # relative: ||out - ref|| / ||ref||

# case -> (arch, config overrides). tiny_model's shapes split by 2: 4 heads, 2 kv heads, intermediate 48, vocab 96.
CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),  # row-parallel bias added once
    "llama-sdpa": ("llama", {"attn_implementation": "sdpa"}),
    "qwen2": ("qwen2", {}),  # q/k/v biases: column-parallel bias slices
    "mistral": ("mistral", {}),
}


def _model(case: str, seed: int = 0):
    arch, overrides = CASES[case]
    overrides = dict(overrides)
    attn = overrides.pop("attn_implementation", "eager")
    cfg = _cfg(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # transformers initializes biases to zero, which would hide a bias added per rank
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


@torch.no_grad()
def _decode(model, ids: torch.Tensor, steps: int = 3) -> torch.Tensor:
    """Greedy decoding with the KV cache (which holds only this rank's KV heads): every step's logits."""
    out = model(ids, use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        out = model(logits[-1].argmax(-1, keepdim=True), past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    report: dict = {}
    try:
        join_gloo(rank, WORLD_SIZE, init_file)
        ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
        for case in CASES:
            full = _model(case)
            sharded = shard_model(copy.deepcopy(full), rank, WORLD_SIZE)
            with torch.no_grad():
                ref, out = full(ids).logits, sharded(ids).logits
            report[case] = {"rel_err": rel_err(out, ref), "shape_ok": out.shape == ref.shape,
                            "decode_rel_err": rel_err(_decode(sharded, ids), _decode(full, ids)),
                            "tied": sharded.lm_head.weight is sharded.model.embed_tokens.weight,
                            "full_tied": full.lm_head.weight is full.model.embed_tokens.weight}
        torch.distributed.destroy_process_group()
    except BaseException:  # noqa: BLE001 - anything a rank raises is reported to the parent as a failure
        report["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Run every case on two ranks once; one report per rank."""
    tmp = tmp_path_factory.mktemp("tp")
    return run_ranks(_worker, (str(tmp / "rendezvous"), str(tmp)), tmp, WORLD_SIZE, DEADLINE_S)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_logits_match_unsharded(reports, case):
    for rank, report in enumerate(reports):
        result = report[case]
        assert result["shape_ok"], f"rank {rank}: logits shape differs from the full model's"
        assert result["rel_err"] < TOL[torch.float32], f"rank {rank}: relative error {result['rel_err']:.2e}"
        assert result["decode_rel_err"] < TOL[torch.float32], f"rank {rank}: decoding with the KV cache: " \
                                                              f"relative error {result['decode_rel_err']:.2e}"
        assert result["tied"] == result["full_tied"], f"rank {rank}: tying changed by sharding"
    if case == "llama-tied":
        assert reports[0][case]["full_tied"], "the tied case's model is not tied: the test would prove nothing"


def test_tp1_is_identity_without_a_process_group():
    full = tiny_model("llama", 0)
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    sharded = shard_model(copy.deepcopy(full), rank=0, world_size=1)
    assert isinstance(sharded.model.layers[0].self_attn.q_proj, ColumnParallelLinear)
    with torch.no_grad():
        assert rel_err(sharded(ids).logits, full(ids).logits) == 0.0


def test_kv_heads_not_dividing_are_refused():
    model = tiny_model("llama", 0)  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match=r"k_proj: 2 heads \(num_key_value_heads\) do not split over tensor-parallel "
                                         r"size 4; use a tensor-parallel size that divides 2"):
        plan_model(model, 4)


def test_dimension_not_dividing_is_refused():
    model = tiny_model("llama", 0)  # intermediate 48, vocab 96, hidden 32: 5 divides none of them
    with pytest.raises(ValueError, match=r"model\.embed_tokens: vocabulary size 96 does not divide by the "
                                         r"tensor-parallel size 5"):
        plan_model(model, 5)


def test_model_matching_nothing_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="no attention or MLP projection of this model matches TP_PLAN"):
        plan_model(model, 2)


def test_fused_projection_is_refused():
    model = tiny_model("phi3", 0)  # qkv_proj, gate_up_proj
    with pytest.raises(ValueError, match=r"qkv_proj is a fused projection"):
        plan_model(model, 2)


def test_gpt2_conv1d_matches_nothing():
    model = tiny_model("gpt2", 0)  # Conv1D projections, not nn.Linear: only the head would match
    with pytest.raises(ValueError, match="no attention or MLP projection"):
        plan_model(model, 2)


def test_row_layer_without_column_sibling_is_refused():
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.down_proj = torch.nn.Linear(8, 8)

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.o_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    model = torch.nn.ModuleDict({"attn": Attn(), "mlp": Mlp()})
    with pytest.raises(ValueError, match="mlp has a row-parallel layer but no column-parallel sibling"):
        plan_model(model, 2)


def test_subclass_whose_forward_would_be_dropped_is_refused():
    model = tiny_model("gemma2", 0)  # its embed_tokens scales by sqrt(hidden) in its own forward
    with pytest.raises(ValueError, match=r"model\.embed_tokens is a \w+ScaledWordEmbedding, whose own forward"):
        plan_model(model, 2)


def test_world_size_without_a_matching_process_group_is_refused():
    model = tiny_model("llama", 0)
    with pytest.raises(ValueError, match="world_size=2 but the process group has 1 ranks"):
        shard_model(model, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        shard_model(model, rank=2, world_size=2)

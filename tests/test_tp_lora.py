"""LoRA on a tensor-parallel model: at tp=2 (two gloo processes on the CPU) a mixed batch's logits equal the
unsharded lorakit-patched model's and PEFT's, for adapters on the sharded projections and on the vocab-parallel
embedding and head (LoRA split with the vocabulary; trainable token rows whole on every rank).

The parent builds a tiny Llama (biases on, random, so a bias added per rank would show) and saves PEFT adapters
of different ranks and targets; each rank loads the base weights, shards a copy, patches it, loads the adapters
and writes its logits to a file; the parent compares them. Ranks report through files, as in test_tp.py.
"""

from __future__ import annotations

import copy
import json
import os
import traceback

import pytest
import torch
import transformers
from _peft_models import VOCAB, SavedAdapter, _cfg, save_adapter
from _ranks import join_gloo, run_ranks
from helpers import rel_err
from peft import LoraConfig

import lorakit
from lorakit.peft import AdapterError

WORLD_SIZE = 2
DEADLINE_S = 120
TOL = 1e-5  # float32, relative: ||out - ref|| / ||ref||
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> LoraConfig arguments: ranks, targets and scalings differ
    "all7": dict(r=8, lora_alpha=16, target_modules=ALL7),
    "qvdown": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                   rank_pattern={"down_proj": 12}, use_rslora=True),
    "mlp1": dict(r=16, lora_alpha=8, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
                 layers_to_transform=[1]),
}
ADAPTERS |= {  # on the vocab-parallel head and embedding
    "head": dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]),
    "embed": dict(r=4, lora_alpha=8, target_modules=["v_proj", "embed_tokens"]),
    "tokens": dict(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [3, 50, 70]}),
}
REFUSED = {  # name -> LoraConfig arguments of adapters a tensor-parallel model must refuse
    "saved_head": dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "dora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_dora=True),
}
NAMES = [None, "all7", "qvdown", "mlp1", "all7", "head", "embed", "tokens"]


def _base_model(state: dict | None = None):
    cfg = _cfg("llama")
    cfg.attention_bias = cfg.mlp_bias = True
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        if state is None:  # transformers initializes biases to zero, which would hide a bias added per rank
            gen = torch.Generator().manual_seed(0)
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        else:
            model.load_state_dict(state)
    return model


def _input_ids() -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (len(NAMES), 7), generator=torch.Generator().manual_seed(3))
    ids[NAMES.index("tokens"), 1:4] = torch.tensor([3, 50, 70])  # its trainable rows, in both ranks' halves
    return ids


def _worker(rank: int, tmp: str) -> None:
    report: dict = {}
    try:
        join_gloo(rank, WORLD_SIZE, f"{tmp}/rendezvous")
        from lorakit.parallel.lora import LoraRowParallelLinear
        from lorakit.parallel import shard_model

        full = _base_model(torch.load(f"{tmp}/base.pt"))
        model = shard_model(copy.deepcopy(full), rank, WORLD_SIZE)
        handle = lorakit.patch(model, max_loras=len(ADAPTERS) + 1)  # a free slot: refusals come from the checks
        for name in ADAPTERS:
            handle.load_adapter(name, f"{tmp}/{name}")
        layer = model.model.layers[0]
        report["row_wrapped"] = all(isinstance(m, LoraRowParallelLinear) for m in (layer.self_attn.o_proj,
                                                                                   layer.mlp.down_proj))
        report["q_grouped"] = type(layer.self_attn.q_proj).__name__ == "LoraLinearMember"
        head, embed = model.lm_head, model.model.embed_tokens  # their slots hold this rank's vocabulary rows
        report["vocab_sharded"] = (type(head).__name__ == "LoraVocabParallelHead" and head.out_sizes == [VOCAB // 2]
                                   and embed.in_features == VOCAB // 2 and embed.tokens.vocab == VOCAB)
        report["refusals"] = {}
        for name in REFUSED:
            try:
                handle.load_adapter(name, f"{tmp}/{name}")
                report["refusals"][name] = None
            except AdapterError as e:
                report["refusals"][name] = str(e)
        ids = _input_ids()
        with torch.no_grad():
            logits = model(ids, lora_ids=handle.ids(NAMES), use_cache=False).logits
            plain = model(ids, use_cache=False).logits  # no lora_ids: the sharded base model
        torch.save({"logits": logits, "plain": plain}, f"{tmp}/rank{rank}.pt")
        torch.distributed.destroy_process_group()
    except BaseException:  # noqa: BLE001 - anything a rank raises is reported to the parent as a failure
        report["traceback"] = traceback.format_exc()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def _save(base, name: str, lora_config: LoraConfig, tmp, seed: int) -> SavedAdapter:
    """save_adapter, with the trainable token rows random too (PEFT starts them as copies of the model's)."""
    saved = save_adapter(base, name, lora_config, tmp, seed=seed, std=0.1)
    model = saved.peft_model
    gen = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        touched = [p.copy_(torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()
                   if "trainable_tokens_delta" in n]
    if touched:
        model.save_pretrained(saved.path)
    return saved


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Save the base weights and adapters, run both ranks once; returns (reports, rank logits, saved adapters)."""
    tmp = tmp_path_factory.mktemp("tp_lora")
    base = _base_model()
    torch.save(base.state_dict(), tmp / "base.pt")
    saved = {name: _save(base, name, LoraConfig(init_lora_weights=False, **kw), tmp, seed=i)
             for i, (name, kw) in enumerate({**ADAPTERS, **REFUSED}.items())}
    reports = run_ranks(_worker, (str(tmp),), tmp, WORLD_SIZE, DEADLINE_S)
    outs = [torch.load(tmp / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    return base, reports, outs, saved


def test_tp2_lora_matches_unsharded_lorakit_and_peft(run):
    base, reports, outs, saved = run
    ids = _input_ids()
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=len(ADAPTERS))
    for name in ADAPTERS:
        handle.load_adapter(name, saved[name].path)
    with torch.no_grad():
        unsharded = model(ids, lora_ids=handle.ids(NAMES), use_cache=False).logits
        peft = torch.stack([(base if n is None else saved[n].peft_model)(input_ids=ids[b: b + 1],
                                                                         use_cache=False).logits[0]
                            for b, n in enumerate(NAMES)])
        plain = base(ids, use_cache=False).logits
    for rank, out in enumerate(outs):
        for b, name in enumerate(NAMES):
            for ref, what in ((unsharded, "unsharded lorakit"), (peft, "PEFT")):
                err = rel_err(out["logits"][b], ref[b])
                assert err < TOL, f"rank {rank}, row {b} ({name}): relative error {err:.2e} against {what}"
        assert rel_err(out["plain"], plain) < TOL, f"rank {rank}: the sharded base model without lora_ids"
    for b, name in enumerate(NAMES):
        if name is not None:
            assert not torch.allclose(peft[b], plain[b], rtol=1e-3), f"adapter {name!r} changes nothing: untested"


def test_tp2_row_layers_are_wrapped_and_column_layers_grouped(run):
    _, reports, _, _ = run
    for rank, report in enumerate(reports):
        assert report["row_wrapped"], f"rank {rank}: o_proj / down_proj are not LoraRowParallelLinear"
        assert report["q_grouped"], f"rank {rank}: q/k/v (column-parallel) were not grouped"
        assert report["vocab_sharded"], f"rank {rank}: the embedding's / head's slots are not split by vocabulary"


def test_tp2_whole_matrices_of_vocab_parallel_modules_are_refused(run):
    _, reports, _, _ = run
    for rank, report in enumerate(reports):
        message = report["refusals"]["saved_head"]
        assert message is not None, f"rank {rank}: an adapter saving the whole lm_head was loaded"
        assert "saves whole matrices of ['lm_head']" in message and "trainable_token_indices" in message, message
        message = report["refusals"]["dora"]
        assert message is not None and "DoRA adapter (use_dora)" in message and "tensor-parallel-size 1" in message

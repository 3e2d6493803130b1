"""``load_sharded`` reads only a rank's slices of a safetensors checkpoint, and gives the same shard as
``shard_model(from_pretrained(folder))``, parameter for parameter and buffer for buffer, at tp=2 (two gloo processes
on the CPU): a tiny Llama with random biases, with an untied head in one file and a tied head over an indexed
checkpoint of several files."""

from __future__ import annotations

import json
import os
import traceback

import pytest
import torch
import transformers
from _peft_models import _cfg
from _ranks import join_gloo, run_ranks

WORLD_SIZE = 2


def _save(folder, tied: bool) -> None:
    cfg = _cfg("llama")
    cfg.attention_bias = cfg.mlp_bias = True
    cfg.tie_word_embeddings = tied
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    model.save_pretrained(folder, max_shard_size="20KB" if tied else "1GB")


def _worker(rank: int, tmp: str) -> None:
    report: dict = {}
    try:
        join_gloo(rank, WORLD_SIZE, f"{tmp}/rendezvous")
        from lorakit.parallel import load_sharded, shard_model

        for kind in ("untied", "tied"):
            folder = f"{tmp}/{kind}"
            got = load_sharded(folder, dtype=torch.float32)
            want = shard_model(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
                               rank, WORLD_SIZE)
            g, w = dict(got.named_parameters()), dict(want.named_parameters())
            gb, wb = dict(got.named_buffers()), dict(want.named_buffers())
            report[kind] = dict(
                names=sorted(g) == sorted(w) and sorted(gb) == sorted(wb),
                differ=[n for n in w if g[n].shape != w[n].shape or not torch.equal(g[n], w[n])]
                + [n for n in wb if not torch.equal(gb[n], wb[n])],
                meta=[n for n, t in [*g.items(), *gb.items()] if t.is_meta],
                tied=got.lm_head.weight is got.model.embed_tokens.weight,
                ids=got(torch.tensor([[1, 5, 70, 3]])).logits.tolist() == want(torch.tensor([[1, 5, 70, 3]])).logits.tolist())
        torch.distributed.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        report["traceback"] = traceback.format_exc()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def test_load_sharded_equals_shard_model_of_the_full_model(tmp_path):
    _save(tmp_path / "untied", tied=False)
    _save(tmp_path / "tied", tied=True)
    assert (tmp_path / "tied" / "model.safetensors.index.json").is_file(), "the tied checkpoint should be indexed"
    for rank, report in enumerate(run_ranks(_worker, (str(tmp_path),), tmp_path, WORLD_SIZE, 120)):
        for kind in ("untied", "tied"):
            r = report[kind]
            assert r["names"] and not r["differ"] and not r["meta"], (rank, kind, r)
            assert r["tied"] == (kind == "tied"), (rank, kind)
            assert r["ids"], (rank, kind, "logits differ")


def test_load_sharded_refuses_a_folder_without_safetensors(tmp_path):
    from lorakit.parallel import load_sharded

    transformers.LlamaConfig(**_cfg("llama").to_dict()).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors checkpoints only"):
        load_sharded(tmp_path)

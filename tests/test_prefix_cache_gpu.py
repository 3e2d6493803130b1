"""The prefix cache on a GPU: Triton kernels, CUDA graphs (decode and mixed steps), float32, the cache on vs off.

A tiny Llama in float32 keeps greedy decoding free of near ties, so the cache must not change a single token: the
requests share a system prompt over the base model, two LoRA adapters and an aLoRA adapter (with and without its
invocation), and every prompt is sent twice (the second round hits the first round's blocks)."""

import copy

import pytest
import torch
from peft import LoraConfig

from _peft_models import TARGETS, VOCAB, save_adapter, tiny_model
from lorakit.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu


def test_prefix_cache_keeps_greedy_tokens_with_graphs(tmp_path):
    base = tiny_model("llama", seed=3)
    adapters = {n: save_adapter(base, n, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS["llama"][:7],
                                                     init_lora_weights=False), tmp_path, seed=i, std=0.2).path
                for i, n in enumerate("ab")}
    invocation = [7, 8, 9]
    adapters["x"] = save_adapter(base, "x", LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                                       init_lora_weights=False, task_type="CAUSAL_LM",
                                                       alora_invocation_tokens=invocation), tmp_path, seed=7, std=0.2).path
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(20, VOCAB, (37,), generator=gen).tolist()
    work = [(system + torch.randint(20, VOCAB, (k % 5 + 1,), generator=gen).tolist(), [None, "a", "b"][k % 3])
            for k in range(12)]
    work += [(system + invocation, "x"), (system, "x")]
    runs = {}
    for cache in (True, False):
        engine = Engine(copy.deepcopy(base).cuda(), max_loras=3, max_num_seqs=8, block_size=4, num_blocks=200,
                        max_seq_len=64, max_num_batched_tokens=128, prefix_cache=cache, adapters=adapters)
        tokens = {}
        for _ in range(2):
            for prompt, name in work:
                rid = engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), name)
                tokens[rid] = []
            while engine.has_unfinished():
                for out in engine.step():
                    tokens[out.request_id] += out.token_ids
        assert engine.runner.mixed_replays > 0 and engine.runner.decode_replays > 0
        engine.blocks.check()
        assert engine.blocks.num_free == engine.blocks.num_blocks, "a block leaked"
        runs[cache] = list(tokens.values()), engine.scheduler.computed_prompt_tokens
    (on, computed_on), (off, computed_off) = runs[True], runs[False]
    assert on == off
    assert computed_off == 2 * sum(len(p) for p, _ in work)
    assert computed_on < computed_off / 4, (computed_on, computed_off)

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


@pytest.mark.quick  # the aLoRA model test of gpu-check --quick
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


def test_prompt_logprobs_with_graphs_and_a_cached_prefix_equal_peft(tmp_path):
    """On the GPU, CUDA graphs on: prompts that ask for their logprobs (their steps run eagerly) beside greedy
    requests that replay graphs, one of them after its prefix was cached; each position equals HF + PEFT's
    log-softmax (float32)."""
    from peft import PeftModel

    base = tiny_model("llama", seed=3)
    path = save_adapter(base, "a", LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS["llama"][:7],
                                              init_lora_weights=False), tmp_path, seed=1, std=0.2).path
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(20, VOCAB, (n,), generator=gen).tolist() for n in (9, 23, 40)]
    engine = Engine(copy.deepcopy(base).cuda(), max_loras=2, max_num_seqs=8, block_size=4, num_blocks=200,
                    max_seq_len=64, max_num_batched_tokens=16, adapters={"a": path})
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(prompts[2], greedy, "a")  # its blocks cached before the scored requests come
    while engine.has_unfinished():
        engine.step()
    jobs = [(p, name) for p in prompts for name in (None, "a")]
    rids = {engine.add_request(p, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1), name): (p, name)
            for p, name in jobs}
    engine.add_request(prompts[0], greedy, None)
    first = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in rids and out.prompt_logprobs is not None:
                first[out.request_id] = out.prompt_logprobs
    assert engine.runner.decode_replays > 0 and set(first) == set(rids)
    for rid, (prompt, name) in rids.items():
        model = copy.deepcopy(base) if name is None else PeftModel.from_pretrained(copy.deepcopy(base), path)
        with torch.no_grad():
            ref = model.eval()(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
        for p in range(1, len(prompt)):
            want = ref[p - 1, prompt[p]].item()
            assert abs(first[rid][p].logprob - want) <= 1e-4 * abs(want), (name, p, first[rid][p], want)

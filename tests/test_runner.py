"""The model runner on the CPU: per-step data reaches the layers through the model call only (two engines in
one process never see each other's step), the decode forward traces as one graph, and the graph buckets."""

import copy

import torch
from peft import LoraConfig

from _peft_models import TARGETS, VOCAB, save_adapter, tiny_model
from lorakit import patch
from lorakit.engine import Engine, SamplingParams
from lorakit.engine.runner import ModelRunner, graph_buckets
from lorakit.engine.scheduler import StepPlan


def test_graph_buckets_are_captured_largest_first():
    assert graph_buckets(None, 64) == [64, 48, 32, 16, 8, 4, 2, 1]
    assert graph_buckets(None, 20) == [20, 16, 8, 4, 2, 1]
    assert graph_buckets([1, 3, 100], 8) == [8, 3, 1]
    assert graph_buckets([5], 5) == [5]


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_two_engines_in_one_process_do_not_collide(tmp_path):
    """Engine B steps in the middle of each of engine A's forward passes (from a hook between A's decoder layers),
    over another model and its own adapter: each gets the tokens it gets alone."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 3, 5)]
    bases = {"llama": tiny_model("llama", seed=3), "gpt2": tiny_model("gpt2", seed=4)}
    adapters = {arch: save_adapter(base, arch, LoraConfig(r=4, target_modules=TARGETS[arch][:3],
                                                           init_lora_weights=False), tmp_path, seed=1, std=0.2).path
                for arch, base in bases.items()}

    def start(arch):
        engine = Engine(copy.deepcopy(bases[arch]), max_loras=1, adapters={"a": adapters[arch]}, block_size=4,
                        max_num_batched_tokens=8)
        return engine, {engine.add_request(p, GREEDY, name): [] for p, name in zip(prompts, ["a", None, "a"])}

    def step(engine, got):
        for out in engine.step():
            got[out.request_id] += out.token_ids

    alone = {}
    for arch in bases:
        engine, alone[arch] = start(arch)
        while engine.has_unfinished():
            step(engine, alone[arch])
    (a, got_a), (b, got_b) = start("llama"), start("gpt2")

    def step_b(module, args):
        if b.has_unfinished():
            step(b, got_b)

    a.model.model.layers[1].register_forward_pre_hook(step_b)
    while a.has_unfinished():
        step(a, got_a)
    assert not b.has_unfinished(), "B must have finished inside A's forward passes"
    assert list(got_a.values()) == list(alone["llama"].values())
    assert list(got_b.values()) == list(alone["gpt2"].values())


def test_decode_forward_traces_as_one_graph(tmp_path):
    """The compile=True decode path: the model with its step context compiles with fullgraph=True, dynamic=False
    (here with dynamo's eager backend: the CPU cannot capture) and gives the eager logits and KV cache."""
    base = tiny_model("llama", seed=1)
    adapter = save_adapter(base, "a", LoraConfig(r=4, target_modules=TARGETS["llama"]), tmp_path, seed=0)
    model = copy.deepcopy(base)
    handle = patch(model, 2)
    handle.load_adapter("a", adapter.path)
    runner = ModelRunner(model, handle, num_blocks=16, block_size=4, max_num_seqs=4, max_seq_len=32)
    step = runner._metadata(StepPlan([], []), 4, 4)  # four sequences decoding their first token, each in a block
    for name, values in dict(input_ids=[5, 6, 7, 8], lora_ids=[0, -1, 0, 1], kv_index=[0, 4, 8, 12],
                             seq_lens=[1] * 4, query_start=range(5)).items():
        step[name].copy_(torch.tensor(values))
    step["block_tables"][:, 0] = torch.arange(4)
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="eager")
    with torch.inference_mode():
        logits = runner._forward(step, None, compiled)
        caches = [c.clone() for c in runner.k_caches + runner.v_caches]
        for c in runner.k_caches + runner.v_caches:
            c.zero_()
        assert torch.equal(runner._forward(step, None), logits)
    assert all(torch.equal(c, w) and w.any() for c, w in zip(runner.k_caches + runner.v_caches, caches))

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


def run(engine: Engine, prompts, adapters, during_forward=None) -> dict[str, list[int]]:
    """Every request's tokens; ``during_forward`` is called in the middle of each of the engine's forward passes."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, greedy, a) for p, a in zip(prompts, adapters)]
    got = {i: [] for i in ids}
    hook = None
    if during_forward is not None:
        hook = engine.model.model.layers[1].register_forward_pre_hook(lambda module, args: during_forward())
    try:
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.token_ids
    finally:
        if hook is not None:
            hook.remove()
    return list(got.values())


def test_two_engines_in_one_process_do_not_collide(tmp_path):
    """Engine B steps in the middle of each of engine A's forward passes (between its decoder layers), over
    another model and other adapters: each gets the tokens it gets alone."""
    gen = torch.Generator().manual_seed(0)
    setups = []
    for arch, seed in (("llama", 3), ("gpt2", 4)):
        base = tiny_model(arch, seed=seed)
        adapter = save_adapter(base, arch, LoraConfig(r=4, target_modules=TARGETS[arch][:3], init_lora_weights=False),
                               tmp_path, seed=seed, std=0.2)
        prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 3, 5)]
        setups.append((base, {arch: adapter.path}, prompts, [arch, None, arch]))

    def engine(i):
        base, adapters, _, _ = setups[i]
        return Engine(copy.deepcopy(base), max_loras=1, adapters=adapters, block_size=4, max_num_batched_tokens=8)

    alone = [run(engine(i), *setups[i][2:]) for i in range(2)]
    a, b = engine(0), engine(1)
    b_ids = [b.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), n)
             for p, n in zip(*setups[1][2:])]
    b_got = {i: [] for i in b_ids}

    def step_b():
        for out in b.step() if b.has_unfinished() else []:
            b_got[out.request_id] += out.token_ids

    assert run(a, *setups[0][2:], during_forward=step_b) == alone[0]
    while b.has_unfinished():
        step_b()
    assert list(b_got.values()) == alone[1]


def test_decode_forward_traces_as_one_graph(tmp_path):
    """The compile=True decode path: the model with its step context compiles with fullgraph=True, dynamic=False
    (here with dynamo's eager backend: the CPU cannot capture) and gives the eager logits."""
    base = tiny_model("llama", seed=1)
    adapter = save_adapter(base, "a", LoraConfig(r=4, target_modules=TARGETS["llama"]), tmp_path, seed=0)
    model = copy.deepcopy(base)
    handle = patch(model, 2)
    handle.load_adapter("a", adapter.path)
    runner = ModelRunner(model, handle, num_blocks=16, block_size=4, max_num_seqs=4, max_seq_len=32)
    step = runner._metadata(StepPlan([], []), 4, 4)  # an empty bucket of 4, as captured
    step["lora_ids"].copy_(torch.tensor([0, -1, 0, 1]))
    step["input_ids"].copy_(torch.tensor([5, 6, 7, 8]))
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="eager")
    with torch.inference_mode():
        assert torch.equal(runner._forward(step, None, compiled), runner._forward(step, None))

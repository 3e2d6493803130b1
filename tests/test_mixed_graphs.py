"""Every step a CUDA graph: the padded buckets and the packed metadata they replay from.

On the CPU: the numpy metadata equals the per-token reference it replaced (kept here, with the block-table rows
a request keeps across growth and preemption), and a step padded to its bucket (decode or mixed: padded tokens
and sequences, each sequence's last-token logits gathered by the forward a graph captures) gives the unpadded
eager logits, float32, for random plans over a tiny Llama with adapters on every projection and the head.
On a GPU (``-m gpu``): mixed steps replay their graphs and match eager within the bf16 logits tolerance, also
after a rank growth recaptures them, and the engine's greedy tokens with graphs equal those without."""

import copy
import gc
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from peft import LoraConfig

from _peft_models import TARGETS, VOCAB, save_adapter, tiny_model
from lorakit import patch
from lorakit.engine import Engine, SamplingParams
from lorakit.engine.runner import STEP_TENSORS, ModelRunner, token_buckets
from lorakit.engine.scheduler import BlockManager, Request, Scheduled, StepPlan
from helpers import LOGITS_TOLERANCE, rel_err

BLOCK = 4
MAX_SEQ_LEN = 64


def test_token_buckets_are_captured_largest_first():
    assert token_buckets(None, 2048) == [2048, 1536, 1024, 768, 512, 448, 384, 320, 256, 192, 128, 64]
    assert token_buckets(None, 300) == [300, 256, 192, 128, 64]
    assert token_buckets(None, 48) == [48]
    assert token_buckets([8, 100, 5000], 512) == [512, 100, 8]
    assert token_buckets([1, 2], 16) == [16, 2]  # a mixed step has 2 tokens at least
    assert token_buckets((), 512) == token_buckets(None, None) == token_buckets(None, 1) == []


def reference_metadata(plan, rows, tokens, block_size, max_blocks):
    """The runner's metadata as it was built before numpy: per-token Python lists, one int64 tensor."""
    ids, pos, lora, kv_index, seq_lens, starts, keep = [], [], [], [], [], [0], []
    tables = []
    for item in plan.items:
        r = item.request
        n = len(item.tokens)
        ids += item.tokens
        pos += range(item.start, item.start + n)
        lora += [r.slot] * n
        kv_index += [r.blocks[p // block_size] * block_size + p % block_size for p in range(item.start, item.start + n)]
        seq_lens.append(item.start + n)
        starts.append(starts[-1] + n)
        if item.sample:
            keep.append(starts[-1] - 1)
        tables += r.blocks + [0] * (max_blocks - len(r.blocks))
    pad_t, pad_s = tokens - len(ids), rows - len(plan.items)
    flat = (ids + [0] * pad_t, pos + [0] * pad_t, lora + [-1] * pad_t, kv_index + [-1] * pad_t,
            seq_lens + [0] * pad_s, starts + [starts[-1]] * pad_s, tables + [0] * (pad_s * max_blocks),
            keep or [max(len(ids) - 1, 0)])
    parts = dict(zip(STEP_TENSORS + ("keep",), torch.split(torch.tensor([x for f in flat for x in f]),
                                                            [len(f) for f in flat])))
    for name in ("seq_lens", "query_start", "block_tables"):
        parts[name] = parts[name].to(torch.int32)
    parts["block_tables"] = parts["block_tables"].view(rows, max_blocks)
    return parts


@pytest.fixture(scope="module")
def cpu_runner(tmp_path_factory):
    """A tiny Llama with two adapters (every projection, embeddings and head) and a runner whose token buckets
    include one no larger than max_num_seqs (its mixed graph then takes T - 1 sequences)."""
    tmp = tmp_path_factory.mktemp("mixed_graphs")
    base = tiny_model("llama", seed=2)
    model = copy.deepcopy(base)
    handle = patch(model, 2)
    for seed, rank in enumerate((4, 8)):
        cfg = LoraConfig(r=rank, target_modules=TARGETS["llama"], init_lora_weights=False)
        handle.load_adapter(f"a{seed}", save_adapter(base, f"a{seed}", cfg, tmp, seed=seed, std=0.1).path)
    return ModelRunner(model, handle, num_blocks=128, block_size=BLOCK, max_num_seqs=6, max_seq_len=MAX_SEQ_LEN,
                       max_num_batched_tokens=40, graph_token_sizes=[6, 12, 24])


def random_plan(rng: random.Random, manager: BlockManager, max_items: int, max_tokens: int, mixed: bool):
    """Requests at random offsets (decoding, or a prompt chunk when ``mixed``), each with its blocks and adapter."""
    items = []
    budget = max_tokens
    for k in range(rng.randint(1, max_items)):
        n = 1 if not mixed or rng.random() < 0.5 or budget < 2 else rng.randint(2, min(12, budget))
        if budget < n:
            break
        start = rng.randint(0 if n > 1 else 1, MAX_SEQ_LEN - n)
        request = Request(str(k), [], None, 1, k, slot=rng.choice([-1, 0, 1]))
        manager.grow(request.blocks, start + n)
        items.append(Scheduled(request, start, [rng.randrange(VOCAB) for _ in range(n)], n == 1 or rng.random() < 0.6))
        budget -= n
    return StepPlan(items, [])


def assert_same_metadata(runner, plan, rows, tokens):
    got = runner._metadata(plan, rows, tokens)
    want = reference_metadata(plan, rows, tokens, BLOCK, runner.max_blocks)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@given(seed=st.integers(0, 2**32 - 1), pad_rows=st.integers(0, 3), pad_tokens=st.integers(0, 9))
def test_metadata_equals_the_per_token_reference(cpu_runner, seed, pad_rows, pad_tokens):
    """Random plans, padded or not, then again after some requests grew and some were preempted (new blocks):
    the kept block-table rows follow."""
    rng = random.Random(seed)
    manager = BlockManager(4096, BLOCK)
    plan = random_plan(rng, manager, 8, 60, mixed=rng.random() < 0.7)
    for _ in range(3):
        rows, tokens = len(plan.items) + pad_rows, plan.num_tokens + pad_tokens
        assert_same_metadata(cpu_runner, plan, rows, tokens)
        items = []
        for item in plan.items:
            r, end = item.request, item.start + len(item.tokens)
            if rng.random() < 0.3:  # preempted, and back at its start with a block it never had
                fresh = []
                manager.grow(fresh, 1)
                manager.free(r.blocks)
                r.blocks += fresh
                r.preemptions += 1
                end = 0
            if end < MAX_SEQ_LEN:
                manager.grow(r.blocks, end + 1)
                items.append(Scheduled(r, end, [rng.randrange(VOCAB)], True))
        plan = StepPlan(items, [])


def test_block_table_rows_are_reused_once_a_request_is_gone(cpu_runner):
    manager = BlockManager(64, BLOCK)
    plan = random_plan(random.Random(0), manager, 3, 3, mixed=False)
    rows = cpu_runner._table_rows([i.request for i in plan.items])
    del plan
    gc.collect()
    assert set(rows) <= set(cpu_runner._free_rows)
    plan = random_plan(random.Random(1), manager, 3, 3, mixed=False)
    assert_same_metadata(cpu_runner, plan, len(plan.items), plan.num_tokens)  # a reused row is rewritten whole


def prefill(runner, plan):
    """Write each request's earlier positions into the KV cache, one eager step of their prompt chunks."""
    items = [Scheduled(i.request, 0, [(7 * p + 3) % VOCAB for p in range(i.start)], False)
             for i in plan.items if i.start > 0]
    if items:
        runner.execute(StepPlan(items, []))


@given(seed=st.integers(0, 2**32 - 1), mixed=st.booleans())
def test_padded_bucket_logits_equal_eager(cpu_runner, seed, mixed):
    """The step padded to its bucket, through the forward its graph captures (run eagerly here, as the capture's
    warm-up runs it), gives the logits of the unpadded eager step for the items that sample."""
    rng = random.Random(seed)
    plan = random_plan(rng, BlockManager(128, BLOCK), 6, 40, mixed)
    prefill(cpu_runner, plan)
    bucket = cpu_runner._bucket(len(plan.items), plan.num_tokens)
    assert bucket is not None and bucket.decode == (plan.num_tokens == len(plan.items))
    eager = cpu_runner.execute(plan)
    with torch.inference_mode():
        m = cpu_runner._metadata(plan, bucket.rows, bucket.tokens, per_sequence=True)
        padded = cpu_runner._bucket_forward(m, bucket)[m["keep"]]
    sampled = sum(i.sample for i in plan.items)
    if sampled:  # else both give one row nobody reads
        assert padded.shape == eager.shape == (sampled, VOCAB)
        assert rel_err(padded, eager) < LOGITS_TOLERANCE[torch.float32], (bucket, rel_err(padded, eager))


def test_the_cpu_runner_counts_eager_steps_and_no_device_time(cpu_runner):
    before = cpu_runner.eager_steps
    plan = random_plan(random.Random(3), BlockManager(64, BLOCK), 3, 10, mixed=True)
    cpu_runner.execute(plan)
    cpu_runner.poll()
    assert cpu_runner.eager_steps == before + 1
    assert (cpu_runner.gpu_seconds, cpu_runner.timed_steps, cpu_runner.graph_replays) == (0.0, 0, 0)


# On a GPU.


def cuda_runner(tmp_path, **options):
    base = tiny_model("llama", seed=5)
    model = copy.deepcopy(base).to("cuda", torch.bfloat16)
    handle = patch(model, 3)
    cfg = LoraConfig(r=8, target_modules=TARGETS["llama"], init_lora_weights=False)
    handle.load_adapter("a", save_adapter(base, "a", cfg, tmp_path, seed=0, std=0.1).path)
    handle.load_adapter("b", save_adapter(base, "b", cfg, tmp_path, seed=1, std=0.1).path)
    runner = ModelRunner(model, handle, num_blocks=128, block_size=BLOCK, max_num_seqs=6, max_seq_len=MAX_SEQ_LEN,
                         max_num_batched_tokens=40, graph_token_sizes=[6, 12, 24], **options)
    return base, handle, runner


def check_graphs_against_eager(runner, rng, steps):
    for _ in range(steps):
        mixed = rng.random() < 0.7
        plan = random_plan(rng, BlockManager(128, BLOCK), 6, 40, mixed)
        prefill(runner, plan)
        replays = (runner.decode_replays, runner.mixed_replays)
        graph = runner.execute(plan)
        decode = plan.num_tokens == len(plan.items)
        assert (runner.decode_replays, runner.mixed_replays) == (replays[0] + decode, replays[1] + (not decode))
        runner.cuda_graphs = False
        eager = runner.execute(plan)
        runner.cuda_graphs = True
        if any(i.sample for i in plan.items):
            assert rel_err(graph.float(), eager.float()) < LOGITS_TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_mixed_steps_replay_graphs_that_match_eager(tmp_path):
    """Random decode and mixed plans: each replays its bucket's graph (counters) and gives the eager logits within
    the bf16 tolerance; an adapter of a higher rank grows the slots, the graphs are recaptured and still do."""
    base, handle, runner = cuda_runner(tmp_path)
    # every bucket, and a base twin of each of the 4 decode buckets
    assert runner.graph_captures == 1 and len(runner.buckets) == 4 + 4 and len(runner._graphs) == 8 + 4
    assert (6, 5, False) in runner.buckets  # T = max_num_seqs: T - 1 sequences
    rng = random.Random(0)
    check_graphs_against_eager(runner, rng, 40)
    handle.unload_adapter("b")
    cfg = LoraConfig(r=48, target_modules=["q_proj", "o_proj", "up_proj", "lm_head"], init_lora_weights=False)
    handle.load_adapter("c", save_adapter(base, "c", cfg, tmp_path, seed=2, std=0.1).path)  # rank growth
    check_graphs_against_eager(runner, rng, 40)
    assert runner.graph_captures == 2
    torch.cuda.synchronize()
    runner.poll()
    assert runner.timed_steps == runner.graph_replays + runner.eager_steps and runner.gpu_seconds > 0


@pytest.mark.gpu
def test_engine_greedy_tokens_with_mixed_graphs_equal_eager(tmp_path):
    """Prompts arrive while others decode: the engine's greedy tokens with every step a graph equal those of the
    engine without graphs."""
    base = tiny_model("llama", seed=3)
    adapters = {name: save_adapter(base, name, LoraConfig(r=8, target_modules=TARGETS["llama"][:7],
                                                           init_lora_weights=False), tmp_path, seed=s, std=0.2).path
                for s, name in enumerate(("a", "b"))}
    outs = {}
    for graphs in (True, False):
        engine = Engine(copy.deepcopy(base).to("cuda", torch.bfloat16), max_loras=2, max_num_seqs=8,
                        max_num_batched_tokens=32, graph_token_sizes=(8, 16), block_size=BLOCK, cuda_graphs=graphs,
                        adapters=adapters)
        gen = torch.Generator().manual_seed(0)
        got = {}
        for i, name in enumerate([None, "a", "b"] * 4):
            prompt = torch.randint(0, VOCAB, (3 + 4 * i,), generator=gen).tolist()
            got[engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), name)] = []
            for out in engine.step():  # one step per arrival: later prompts join running decodes
                got[out.request_id] += out.token_ids
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.token_ids
        runner = engine.runner
        if graphs:
            assert runner.mixed_replays > 0 and runner.decode_replays > 0, (runner.mixed_replays, runner.eager_steps)
        else:
            assert runner.graph_replays == 0 and runner.eager_steps > 0
        outs[graphs] = list(got.values())
    assert outs[True] == outs[False]


"""Sampling parameters, the batched sampler (support, distribution, reproducibility whatever the batch) and
incremental detokenization with stop conditions on a tiny byte-level BPE tokenizer trained here."""

import asyncio
import math
import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from _tokenizers import bpe_tokenizer
from lorakit.engine.detokenize import IncrementalDetokenizer
from lorakit.engine.outputs import stop_token_ids, token_finish
from lorakit.engine.sampling import (SamplingBatch, SamplingParams, _mask_top_k_top_p, _random_u32, gumbel_noise,
                                     process_logits, sample)

M32 = 0xFFFFFFFF


def build(params, seeds, steps=None):
    return SamplingBatch.build(params, list(seeds), list(steps) if steps is not None else [0] * len(params), "cpu")


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the tokens' counts against probabilities ``probs`` (all cells expect >= 5)."""
    expected = probs.double() * tokens.numel()
    assert expected.min() >= 5, "too few draws for a chi-square test"
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    return float(((counts - expected) ** 2 / expected).sum())


def chi2_bound(dof: int) -> float:
    """About 6 standard deviations above the mean: fails for a wrong distribution, not by bad luck."""
    return dof + 6 * math.sqrt(2 * dof)


# ---------------------------------------------------------------- SamplingParams


def test_params_normalise():
    p = SamplingParams(stop="###", stop_token_ids=[3, 7], top_k=-1)
    assert p.stop == ("###",) and p.stop_token_ids == (3, 7) and p.top_k == 0
    p = SamplingParams(stop=["a", "bc"], max_tokens=4, min_tokens=4, seed=2**63 - 1, logprobs=20, temperature=0)
    assert p.stop == ("a", "bc") and isinstance(p.stop, tuple)
    with pytest.raises(AttributeError):
        p.top_p = 0.5  # frozen


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 2.0),
        ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", True),
        ("temperature", "1"),
        ("top_k", -2), ("top_k", True), ("top_k", 1.5),
        ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_p", -0.5),
        ("seed", -1), ("seed", 2**63), ("seed", True), ("seed", 1.0),
        ("stop", ""), ("stop", [""]), ("stop", ["a", 3]), ("stop", 5),
        ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", [1.5]), ("stop_token_ids", 3),
        ("ignore_eos", 1),
        ("logprobs", -1), ("logprobs", 21), ("logprobs", True),
        ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", True),
        # Past what the sampler's tensors hold, or what stays finite in float32 (a request once killed its step so).
        ("max_tokens", 2**31), ("top_k", 2**31), ("top_k", 2**63), ("stop_token_ids", [2**31]),
        ("stop_token_ids", [2**64]), ("temperature", 100.5), ("temperature", 1e300),
        ("repetition_penalty", 1e-300), ("repetition_penalty", 0.0), ("repetition_penalty", 1e300),
        ("repetition_penalty", math.nan), ("presence_penalty", math.inf), ("frequency_penalty", -2.5),
        ("logit_bias", {2**31: 1.0}), ("logit_bias", {2**63: 1.0}), ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: math.nan}), ("logit_bias", {1: math.inf}), ("logit_bias", {1: 100.5}),
        ("logit_bias", {1: True}), ("logit_bias", {True: 1.0}),
    ],
)
def test_params_reject(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be .*, got {re.escape(repr(value))}$"):
        SamplingParams(**{field: value})


def test_a_huge_value_is_quoted_short():
    with pytest.raises(ValueError) as e:
        SamplingParams(stop=["ok"] * 10**6 + [3])
    assert len(str(e.value)) < 300


# Rows of ordinary values with one or two fields set to what a request's JSON can also carry: ints at and past the
# int32 / int64 edges, floats that float32 rounds to 0 or to infinity, NaN, bools.
_ORDINARY = dict(
    max_tokens=st.integers(1, 40), temperature=st.floats(0, 3), top_k=st.integers(-1, 50), top_p=st.floats(0.01, 1),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    stop=st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    stop_token_ids=st.lists(st.integers(0, 40), max_size=3), ignore_eos=st.booleans(),
    logprobs=st.one_of(st.none(), st.integers(0, 20)), min_tokens=st.integers(0, 1),
    presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2), repetition_penalty=st.floats(0.5, 2),
    logit_bias=st.dictionaries(st.integers(0, 40), st.floats(-100, 100), max_size=3),
)
_EDGE_INTS = st.one_of(st.sampled_from([-2, -1, 0, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1, True]),
                       st.integers(-2**70, 2**70))
_EDGE_FLOATS = st.one_of(st.sampled_from([0.0, 5e-324, 1e-300, 1e-45, 1e-6, 1e-5, 0.01, 100.0, 100.0001, 3.5e38,
                                          1e300, -1e300, True]), st.floats(allow_nan=True, allow_infinity=True))
_EDGES = {name: _EDGE_INTS for name in ("max_tokens", "top_k", "seed", "logprobs", "min_tokens")}
_EDGES |= {name: _EDGE_FLOATS for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                                           "repetition_penalty")}
_EDGES |= dict(stop_token_ids=st.lists(_EDGE_INTS, min_size=1, max_size=2),
               logit_bias=st.dictionaries(st.one_of(st.integers(0, 40), _EDGE_INTS),
                                          st.one_of(st.floats(-100, 100), _EDGE_FLOATS), min_size=1, max_size=2))


@st.composite
def _row(draw) -> dict:
    kwargs = draw(st.fixed_dictionaries({}, optional=_ORDINARY))
    for name in draw(st.lists(st.sampled_from(sorted(_EDGES)), max_size=2, unique=True)):
        kwargs[name] = draw(_EDGES[name])
    return kwargs


@settings(max_examples=300)  # about 2 ms each
@example(rows=[{"top_k": 2**63}, {}], vocab=7, data_seed=0)  # once overflowed the step's int64 tensor: every row failed
@example(rows=[{"repetition_penalty": 1e-300}], vocab=7, data_seed=0)  # 0 in float32: logits / 0
@example(rows=[{"top_p": 1e-300, "temperature": 1.0}], vocab=7, data_seed=0)  # 0 in float32: an empty support
@given(rows=st.lists(_row(), min_size=1, max_size=4), vocab=st.sampled_from([1, 7, 40]),
       data_seed=st.integers(0, 2**32 - 1))
def test_any_params_that_construct_build_a_batch_and_sample(rows, vocab, data_seed):
    """Whatever a request carries is refused by SamplingParams (ValueError) or samples: no tensor overflows, and each
    row's token is in the vocabulary with a finite processed logit (no NaN or infinity reached the sampler)."""
    params = []
    for kwargs in rows:
        try:
            params.append(SamplingParams(**kwargs))
        except ValueError as e:
            assert str(e).startswith("SamplingParams.") and len(str(e)) < 400
    if not params:
        return
    gen = torch.Generator().manual_seed(data_seed)
    histories = [(torch.randint(vocab, (3,), generator=gen).tolist(),
                  torch.randint(vocab, (2,), generator=gen).tolist()) for _ in params]
    seeds = [p.seed if p.seed is not None else int(torch.randint(2**62, (), generator=gen)) for p in params]
    steps = [len(out) for _, out in histories]
    outside = [t for p in params for t, _ in p.logit_bias if t >= vocab]
    if outside:  # the engine's check against its vocabulary (Engine.add_request refuses these first)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            SamplingBatch.build(params, seeds, steps, "cpu", histories=histories, vocab_size=vocab)
        return
    batch = SamplingBatch.build(params, seeds, steps, "cpu", histories=histories, vocab_size=vocab)
    logits = torch.randn(len(params), vocab, generator=gen) * 5
    out = sample(logits, batch)
    tokens = out.token_ids
    assert ((tokens >= 0) & (tokens < vocab)).all()
    z = process_logits(logits, batch)
    assert torch.isfinite(z.gather(1, tokens[:, None])).all()
    sampled = batch.temperature > 0  # and their tokens lie in the top-k / top-p support the sampler computes
    support = _mask_top_k_top_p(z / batch.temperature.clamp(min=1e-5)[:, None], batch.top_k, batch.top_p)
    assert torch.isfinite(support.gather(1, tokens[:, None]))[sampled].all()
    if out.logprobs is not None:
        assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.top_logprobs).all()


def test_batch_build():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1e-6, top_k=3), SamplingParams(top_p=0.9)]
    b = build(params, [1, 2, 2**63 - 1], [0, 5, 9])
    assert b.temperature.tolist() == [0.0, 0.0, 1.0] and b.top_k.tolist() == [0, 3, 0]
    assert b.seeds.tolist() == [1, 2, 2**63 - 1] and b.steps.tolist() == [0, 5, 9]
    assert (b.all_greedy, b.any_top_k_or_p, b.max_logprobs) == (False, True, None)
    # top-k of a greedy row needs no sort; the largest logprobs asked for wins
    b = build([SamplingParams(temperature=0, top_k=3, logprobs=2), SamplingParams(logprobs=5)], [0, 0])
    assert (b.all_greedy, b.any_top_k_or_p, b.max_logprobs) == (False, False, 5)
    with pytest.raises(ValueError, match="one seed and one step per request, got 2 params, 1 seeds, 2 steps"):
        SamplingBatch.build(params[:2], [0], [0, 0], "cpu")
    with pytest.raises(ValueError, match=r"seeds must be ints in \[0, 2\*\*63\), got -1"):
        build(params[:1], [-1])
    with pytest.raises(ValueError, match=r"sample expects logits of shape \[B, V\] with B = 3 rows .* got \(2, 5\)"):
        sample(torch.zeros(2, 5), build(params, [0, 0, 0]))


# ---------------------------------------------------------------- randomness


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _reference_u32(seed: int, step: int, v: int) -> int:
    key = 0x9E3779B9
    for word in (seed & M32, seed >> 32, step & M32, step >> 32):
        key = _lowbias32(key ^ word)
    return _lowbias32(key ^ _lowbias32(v ^ 0x5BD1E995))


def test_hash_is_exact():
    """The torch integer hash equals the same hash on Python ints, also for seeds and steps near 2**63."""
    seeds = [0, 1, 12345, 2**32 - 1, 2**32, 2**63 - 1]
    steps = [0, 7, 2**31, 2**40 + 3, 1, 2**63 - 1]
    got = _random_u32(torch.tensor(seeds), torch.tensor(steps), 300)
    for b, (seed, step) in enumerate(zip(seeds, steps)):
        for v in (0, 1, 2, 150, 299):
            assert got[b, v].item() == _reference_u32(seed, step, v), (seed, step, v)
    assert got.min() >= 0 and got.max() < 2**32


def test_noise_is_uniform_and_gumbel():
    seeds, steps = torch.arange(64), torch.arange(64) % 3
    top_byte = (_random_u32(seeds, steps, 4096) >> 24).flatten()
    assert chi2(top_byte, torch.full((256,), 1 / 256)) < chi2_bound(255)
    low_byte = (_random_u32(seeds, steps, 4096) & 255).flatten()
    assert chi2(low_byte, torch.full((256,), 1 / 256)) < chi2_bound(255)
    g = gumbel_noise(seeds, steps, 4096).double()
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772157) < 0.01  # Euler-Mascheroni
    assert abs(g.var().item() - math.pi**2 / 6) < 0.03


@pytest.mark.parametrize("neighbour", ["step", "seed"])
def test_neighbouring_draws_are_independent(neighbour):
    """The pair (token at (s, t), token at the next step or the next seed) is uniform on 8 x 8 cells."""
    n = 16000
    seeds = torch.arange(n) * 2
    first = sample(torch.zeros(n, 8), build([SamplingParams()] * n, seeds.tolist())).token_ids
    nxt = build([SamplingParams()] * n, (seeds + (neighbour == "seed")).tolist(), [int(neighbour == "step")] * n)
    second = sample(torch.zeros(n, 8), nxt).token_ids
    assert chi2(first * 8 + second, torch.full((64,), 1 / 64)) < chi2_bound(63)


def test_reproducible_and_seed_dependent():
    logits = torch.zeros(200, 1000)
    batch = build([SamplingParams()] * 200, range(200))
    a, b = sample(logits, batch).token_ids, sample(logits.clone(), batch).token_ids
    assert torch.equal(a, b)
    assert a.unique().numel() > 150  # 200 draws from 1000 equally likely tokens: ~181 distinct
    later = sample(logits, build([SamplingParams()] * 200, range(200), [1] * 200)).token_ids
    assert (later != a).sum() > 150


PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1.0]) | st.floats(0.05, 3.0),
    top_k=st.sampled_from([0, 1, 2, 5, 50]),
    top_p=st.just(1.0) | st.floats(0.05, 1.0),
    logprobs=st.none() | st.integers(0, 6),
)


@given(
    params=PARAMS, seed=st.integers(0, 2**63 - 1), step=st.integers(0, 2**40), vocab=st.sampled_from([1, 3, 7, 133]),
    others=st.lists(st.tuples(PARAMS, st.integers(0, 2**63 - 1), st.integers(0, 1000)), max_size=6),
    pos=st.integers(0, 6), data_seed=st.integers(0, 2**32 - 1),
)
def test_token_independent_of_batch(params, seed, step, vocab, others, pos, data_seed):
    """A row's token (and logprobs) depend on its logits, params, seed and step, not on the batch around it."""
    gen = torch.Generator().manual_seed(data_seed)
    row = torch.randn(vocab, generator=gen) * 3
    alone = sample(row[None], build([params], [seed], [step]))
    pos = min(pos, len(others))
    rows = others[:pos] + [(params, seed, step)] + others[pos:]
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    logits[pos] = row
    out = sample(logits, build(*zip(*rows)))
    assert out.token_ids[pos] == alone.token_ids[0]
    if params.logprobs is not None:
        k = min(params.logprobs, vocab)
        assert out.logprobs[pos] == alone.logprobs[0]
        assert torch.equal(out.top_ids[pos, :k], alone.top_ids[0])
        assert torch.equal(out.top_logprobs[pos, :k], alone.top_logprobs[0])


# ---------------------------------------------------------------- what gets sampled


@given(batch=st.integers(1, 9), vocab=st.sampled_from([1, 2, 7, 133]), data_seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_greedy_is_argmax(batch, vocab, data_seed, dtype):
    gen = torch.Generator().manual_seed(data_seed)
    logits = torch.randint(-3, 3, (batch, vocab), generator=gen).to(dtype)  # many ties: lowest index wins
    greedy = torch.rand(batch, generator=gen) < 0.7
    params = [SamplingParams(temperature=0.0 if g else 1.0, top_k=2) for g in greedy.tolist()]
    out = sample(logits, build(params, torch.randint(0, 2**62, (batch,), generator=gen).tolist()))
    assert torch.equal(out.token_ids[greedy], logits.float().argmax(-1)[greedy])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6),
    SamplingParams(temperature=1.0, top_p=0.3), SamplingParams(temperature=1e-6),
])
def test_degenerate_sampling_is_argmax(params):
    """top_k=1, a top_p below the top token's probability and a tiny temperature all give the argmax."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 50, generator=gen)
    logits[torch.arange(256), torch.randint(0, 50, (256,), generator=gen)] += 6  # top probability > 0.3
    out = sample(logits, build([params] * 256, range(256)))
    assert torch.equal(out.token_ids, logits.argmax(-1))


@given(vocab=st.integers(2, 300), k_frac=st.floats(0, 1), temperature=st.floats(0.1, 10.0),
       data_seed=st.integers(0, 2**32 - 1))
def test_top_k_support(vocab, k_frac, temperature, data_seed):
    gen = torch.Generator().manual_seed(data_seed)
    k = 1 + int(k_frac * (vocab - 1))
    logits = torch.randn(vocab, generator=gen).expand(128, vocab)
    params = SamplingParams(temperature=temperature, top_k=k)
    out = sample(logits, build([params] * 128, range(data_seed, data_seed + 128)))
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[logits[0].topk(k).indices] = True
    assert allowed[out.token_ids].all()


def nucleus(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, slack: float = 0.0) -> torch.Tensor:
    """Reference in float64: the [V] mask of tokens top-k then top-p keep (``slack`` widens the nucleus)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True)
    kept = torch.zeros_like(probs, dtype=torch.bool)
    kept[order[: top_k or None]] = True
    probs = torch.where(kept, probs, 0) / probs[kept].sum()
    sorted_probs = probs[order]
    before = sorted_probs.cumsum(0) - sorted_probs
    kept[order[before >= top_p + slack]] = False
    kept[order[0]] = True
    return kept


@given(vocab=st.integers(2, 300), scale=st.floats(0.1, 6.0), top_p=st.floats(0.01, 0.99),
       top_k=st.sampled_from([0, 3, 20]), temperature=st.floats(0.2, 4.0), data_seed=st.integers(0, 2**32 - 1))
def test_top_p_support(vocab, scale, top_p, top_k, temperature, data_seed):
    gen = torch.Generator().manual_seed(data_seed)
    logits = (torch.randn(vocab, generator=gen) * scale).expand(128, vocab)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    out = sample(logits, build([params] * 128, range(data_seed, data_seed + 128)))
    assert nucleus(logits[0], temperature, top_k, top_p, slack=1e-4)[out.token_ids].all()


LOGITS8 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])


@pytest.mark.parametrize("params", [
    SamplingParams(), SamplingParams(temperature=0.5), SamplingParams(temperature=2.0),
    SamplingParams(top_k=3), SamplingParams(top_p=0.8), SamplingParams(temperature=1.5, top_k=5, top_p=0.9),
])
@pytest.mark.parametrize("vary", ["seed", "step"])
def test_distribution(params, vary):
    """Tokens drawn over many seeds (or many steps of one seed) follow softmax(top-k/top-p(logits / T))."""
    n = 20000
    seeds, steps = (range(n), [0] * n) if vary == "seed" else ([2024] * n, range(n))
    tokens = sample(LOGITS8.expand(n, 8), build([params] * n, seeds, steps)).token_ids
    kept = nucleus(LOGITS8, params.temperature, params.top_k, params.top_p)
    assert kept[tokens].all()
    probs = torch.softmax(LOGITS8.double() / params.temperature, -1)[kept]
    remap = torch.cumsum(kept.long(), 0) - 1  # token -> index among the kept
    assert chi2(remap[tokens], probs / probs.sum()) < chi2_bound(int(kept.sum()) - 1)


def test_logprobs_are_raw():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=gen) * 2
    params = [SamplingParams(temperature=t, top_k=k, logprobs=lp)
              for t, k, lp in [(0, 0, 3), (0.7, 5, 0), (1.3, 0, 7), (2.0, 2, None), (1.0, 0, 1), (0.5, 0, 0)]]
    out = sample(logits, build(params, range(6)))
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(-1, out.token_ids[:, None]).squeeze(-1), rtol=0, atol=1e-6)
    top = ref.topk(7, dim=-1)
    assert out.top_ids.shape == (6, 7) and torch.equal(out.top_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values, rtol=0, atol=1e-6)
    assert (out.top_logprobs.diff(dim=-1) <= 0).all()
    assert sample(logits, build([SamplingParams()] * 6, range(6))).logprobs is None


@pytest.mark.gpu
def test_cuda_matches_cpu_and_replays_in_a_graph():
    seeds, steps = [0, 1, 2**63 - 1, 12345], [0, 7, 2**40, 3]
    cpu_u = _random_u32(torch.tensor(seeds), torch.tensor(steps), 5000)
    assert torch.equal(_random_u32(torch.tensor(seeds).cuda(), torch.tensor(steps).cuda(), 5000).cpu(), cpu_u)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=50, logprobs=3),
              SamplingParams(top_p=0.9, temperature=0.8), SamplingParams(logprobs=1)]
    batch = SamplingBatch.build(params, seeds, steps, "cuda")
    gen = torch.Generator().manual_seed(0)
    first, second = (torch.randn(4, 5000, generator=gen) * 3 for _ in range(2))
    on_cpu = sample(first, SamplingBatch.build(params, seeds, steps, "cpu"))
    static = first.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = sample(static, batch)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(eager.token_ids.cpu(), on_cpu.token_ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample(static, batch)
    static.copy_(second)
    graph.replay()
    expected = sample(second.cuda(), batch)
    assert torch.equal(captured.token_ids, expected.token_ids)
    assert torch.equal(captured.top_ids, expected.top_ids)


# ---------------------------------------------------------------- detokenization


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE with 300 tokens, so that "é", "日本" and emoji are split across several tokens."""
    return bpe_tokenizer(["Hello world, café au lait à la crème!", "日本語のテキスト 日本 東京",
                          "emoji 😀🎉 party 👍🏽", "the quick brown fox jumps over the lazy dog."])


PIECES = ["a", "b", "ab", " ", "c", "é", "日", "本", "😀", "👍", "🏽", ".", "the ", "lo"]
TEXTS = st.lists(st.sampled_from(PIECES), max_size=14).map("".join)


def encode(tokenizer, text: str, cuts: list[int] = ()) -> list[int]:
    """Token ids of ``text``, encoded in pieces cut at ``cuts`` (another of its tokenizations)."""
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [i for a, b in zip(bounds, bounds[1:]) for i in tokenizer.encode(text[a:b], add_special_tokens=False)]


def run(tokenizer, ids, prompt=(), eos=None, **params):
    """Feed ``ids`` until the request finishes, each with the engine's finish for it (``token_finish``), as the
    output processor does: (deltas, reason, detokenizer)."""
    params = SamplingParams(**params)
    stop_ids = stop_token_ids(params, eos)
    det = IncrementalDetokenizer(tokenizer, list(prompt), params)
    deltas, reason = [], None
    for n, i in enumerate(ids, 1):
        delta, reason = det.append(i, token_finish(params, stop_ids, n, i))
        deltas.append(delta)
        if reason:
            break
    return deltas, reason, det


@given(text=TEXTS, prompt=TEXTS, cuts=st.lists(st.integers(0, 100), max_size=4))
def test_stream_concatenates_to_decode(tokenizer, text, prompt, cuts):
    ids = encode(tokenizer, text, cuts)
    if not ids:
        return
    assert tokenizer.decode(ids) == text
    deltas, reason, det = run(tokenizer, ids, prompt=tokenizer.encode(prompt), max_tokens=len(ids))
    assert reason == "length" and len(deltas) == len(ids) and det.token_ids == ids
    assert "".join(deltas) == det.text == text
    assert not any("\ufffd" in d for d in deltas)  # a split character is held until complete
    for t, _ in enumerate(ids):  # nothing held back longer than its character is incomplete
        assert "".join(deltas[: t + 1]) == tokenizer.decode(ids[: t + 1]).rstrip("\ufffd")


@given(text=TEXTS, cuts=st.lists(st.integers(0, 100), max_size=4), data=st.data())
def test_stop_strings(tokenizer, text, cuts, data):
    """The text ends right before the first stop string to appear, no part of which is ever emitted, and
    only what could still become a stop string (or an incomplete character) is held back."""
    ids = encode(tokenizer, text, cuts)
    if not ids:
        return
    spans = st.tuples(st.integers(0, len(text)), st.integers(1, 4)).map(lambda s: text[s[0]: s[0] + s[1]])
    stop = data.draw(st.lists(spans.filter(bool) | TEXTS.filter(bool), min_size=1, max_size=3))
    deltas, reason, det = run(tokenizer, ids, stop=stop, max_tokens=len(ids))
    assert "".join(deltas) == det.text
    stable = [tokenizer.decode(ids[: t + 1]).rstrip("\ufffd") for t in range(len(ids))]
    hits = [t for t, s in enumerate(stable) if any(x in s for x in stop)]
    if not hits:
        assert reason == "length" and det.text == text
        return
    t_stop = hits[0]
    assert reason == "stop" and len(deltas) == t_stop + 1
    assert det.text == stable[t_stop][: min(i for x in stop if (i := stable[t_stop].find(x)) >= 0)]
    for t in range(t_stop):
        held = max((j for s in stop for j in range(1, len(s)) if stable[t].endswith(s[:j])), default=0)
        assert "".join(deltas[: t + 1]) == stable[t][: len(stable[t]) - held]


def test_eos_and_stop_token_ids(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("hello 日本") + [eos] + tokenizer.encode("more")
    deltas, reason, det = run(tokenizer, ids, eos=eos, max_tokens=50)
    assert (reason, det.text, det.token_ids) == ("stop", "hello 日本", ids[: ids.index(eos) + 1])
    assert deltas[-1] == ""
    _, reason, det = run(tokenizer, ids, eos=[7, eos], ignore_eos=True, max_tokens=len(ids))
    assert (reason, det.text) == ("length", "hello 日本more")  # eos is special: skipped, not stopping
    _, reason, det = run(tokenizer, ids, eos=None, max_tokens=len(ids))
    assert (reason, det.text) == ("length", "hello 日本more")
    dot = tokenizer.encode(".")[0]
    ids = tokenizer.encode("ab") + [dot] + tokenizer.encode("cd")
    deltas, reason, det = run(tokenizer, ids, stop_token_ids=[dot], max_tokens=50)
    assert (reason, det.text, det.token_ids[-1]) == ("stop", "ab", dot)
    with pytest.raises(RuntimeError, match=r"append\(5\) after the request finished \('stop'\)"):
        det.append(5)


def test_min_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    a, b = tokenizer.encode("a")[0], tokenizer.encode("b")[0]
    ids = [a, eos, b, eos, a]
    _, reason, det = run(tokenizer, ids, eos=eos, min_tokens=2, max_tokens=10)
    assert (reason, det.token_ids, det.text) == ("stop", [a, eos, b, eos], "ab")  # eos counts from token 3
    _, reason, det = run(tokenizer, ids, eos=eos, min_tokens=1, max_tokens=10)
    assert (reason, det.token_ids, det.text) == ("stop", [a, eos], "a")
    # "ab" completes at token 2 < min_tokens: emitted; the next "ab" stops, its first "a" held back till then
    deltas, reason, det = run(tokenizer, [a, b, a, a, b, a], stop="ab", min_tokens=3, max_tokens=10)
    assert (reason, deltas, det.text, len(det.token_ids)) == ("stop", ["", "ab", "", "a", ""], "aba", 5)


def test_length_flushes_held_text(tokenizer):
    ids = tokenizer.encode("ok xy")
    deltas, reason, det = run(tokenizer, ids, stop="xyz", max_tokens=len(ids))
    assert (reason, det.text) == ("length", "ok xy")
    assert not "".join(deltas[:-1]).endswith("x")  # "x" and "xy" were held back until the end
    ids = tokenizer.encode("a日")
    split = next(t for t in range(1, len(ids)) if tokenizer.decode(ids[:t]).endswith("\ufffd"))
    deltas, reason, det = run(tokenizer, ids, max_tokens=split)
    assert reason == "length" and det.text == tokenizer.decode(ids[:split]) and det.text.endswith("\ufffd")


def _byte_tokens(tokenizer) -> list[int]:
    """The byte-level tokenizer's token of each byte 0..255 (GPT-2's printable stand-ins for bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return [tokenizer.convert_tokens_to_ids(chars[b]) for b in range(256)]


class _CountingTokenizer:
    """``tokenizer`` whose decode counts the ids it is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


BYTES = st.lists(st.one_of(st.integers(0, 255), st.sampled_from([0x80, 0xBF, 0xC3, 0xE4, 0xF0, 0xF4])), max_size=60)


@given(data=BYTES, text=TEXTS)
def test_any_bytes_stream_to_what_decode_gives(tokenizer, data, text):
    """Whatever the bytes (lone continuation bytes, lead bytes never completed, valid characters between), the
    stream's text is the decode of all tokens, and at each token a prefix of the decode so far."""
    byte = _byte_tokens(tokenizer)
    ids = [byte[b] for b in data] + tokenizer.encode(text)
    if not ids:
        return
    deltas, reason, det = run(tokenizer, ids, max_tokens=len(ids))
    assert reason == "length" and "".join(deltas) == det.text == tokenizer.decode(ids)
    for t in range(len(ids)):
        assert tokenizer.decode(ids[: t + 1]).startswith("".join(deltas[: t + 1]))


@pytest.mark.parametrize("bytes_", [[0xE4], [0xF0, 0x9F], [0x80], [0xE4, 0x61]], ids=["lead", "lead+cont", "cont", "lead+a"])
def test_the_cost_of_a_token_does_not_grow_with_the_output(tokenizer, bytes_):
    """Issue 29: tokens that each end in an incomplete UTF-8 sequence kept the decode window from moving, so every
    token decoded the whole output again (4,000 tokens: 1.07 s against 0.02 s for plain text). The ids decoded per
    token stay bounded, and the text is still the decode of the whole output."""
    byte = _byte_tokens(tokenizer)
    ids = [byte[b] for b in bytes_] * (2000 // len(bytes_))
    counting = _CountingTokenizer(tokenizer)
    deltas, reason, det = run(counting, ids, max_tokens=len(ids))
    assert reason == "length" and det.text == tokenizer.decode(ids)
    assert counting.decoded <= 64 * len(ids), counting.decoded / len(ids)
    assert sum(map(len, deltas[:-1])) >= len(det.text) - 16  # emitted as it goes, not all held to the end


@given(data=BYTES, text=TEXTS, prompt=TEXTS, specials=st.lists(st.integers(0, 80), max_size=3),
       stop=st.lists(TEXTS.filter(bool), max_size=2))
def test_the_streaming_decoder_gives_what_the_decodes_give(tokenizer, data, text, prompt, specials, stop):
    """Issue 32: a fast tokenizer decodes with the tokenizers library's DecodeStream, one call a token. Token for
    token, its deltas are those of the two decodes (a tokenizer that is not a transformers one has only those),
    whatever the bytes, special tokens among them (skipped), the prompt and the stop strings."""
    byte = _byte_tokens(tokenizer)
    ids = [byte[b] for b in data] + tokenizer.encode(text)
    for at in specials:
        ids.insert(at % (len(ids) + 1), tokenizer.eos_token_id)  # a special token, skipped in the text
    if not ids:
        return
    primed = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert primed._stream is not None  # the fast path is the one under test
    fast = run(tokenizer, ids, prompt=tokenizer.encode(prompt), stop=stop, max_tokens=len(ids))
    slow = run(_CountingTokenizer(tokenizer), ids, prompt=tokenizer.encode(prompt), stop=stop, max_tokens=len(ids))
    assert fast[:2] == slow[:2] and fast[2].text == slow[2].text
    if fast[1] == "length" and not stop:
        assert fast[2].text == tokenizer.decode(ids, skip_special_tokens=True)


@given(data=BYTES, text=TEXTS, stop=st.lists(TEXTS.filter(bool), max_size=2), cuts=st.lists(st.integers(0, 80),
       max_size=6), reads=st.lists(st.integers(0, 80), max_size=6))
def test_streamed_text_is_the_text_of_the_whole_request(tokenizer, data, text, stop, cuts, reads):
    """Issue 32: however a request's tokens come in outputs (one step, several, a catch-up) and however often its
    reader wakes (outputs merged while it was busy), the streamed text adds up to the text of the request's tokens
    decoded in one output, its finish too, for any bytes and stop strings."""
    from lorakit.engine.outputs import OutputProcessor, RequestOutput
    from lorakit.frontend.streams import RequestStream

    byte = _byte_tokens(tokenizer)
    ids = [byte[b] for b in data] + tokenizer.encode(text)
    if not ids:
        return
    params = SamplingParams(stop=stop, max_tokens=len(ids))
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})

    def outputs(groups):
        return [RequestOutput("r", "", ids[a:b], b == len(ids), "length" if b == len(ids) else None, None, 1, b)
                for a, b in zip(groups, groups[1:])]

    def streamed(groups, wake_after):
        async def go():
            outs = RequestStream(OutputProcessor("r", [], params, tokenizer), lambda: None)
            got = []
            for n, out in enumerate(outputs(groups)):
                outs.put(out)
                if n in wake_after:  # the reader wakes here and takes what is pending (nothing once it ended)
                    try:
                        got.append(await outs.__anext__())
                    except StopAsyncIteration:
                        break
            got += [out async for out in outs]
            return "".join(o.text for o in got), got[-1].finish_reason, sum(len(o.token_ids) for o in got)
        return asyncio.run(go())

    whole = streamed([0, len(ids)], set())
    assert streamed(bounds, {r % len(bounds) for r in reads}) == whole
    if not stop:
        assert whole == (tokenizer.decode(ids), "length", len(ids))

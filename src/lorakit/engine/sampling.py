"""Per-request sampling parameters and a batched sampler: one token per row of a [B, V] logits tensor.

A row's token depends only on its logits, its parameters, its history, its seed and its step, never on the
rest of the batch. ``sample`` has no per-row Python loop, no host sync and no data-dependent shapes, so it
can be captured in a CUDA graph; it branches only on flags that ``SamplingBatch.build`` computed on the host.

Before sampling, a row's logits are processed in this order (as vLLM does): the structured-output mask
(disallowed tokens -inf), ``logit_bias`` added, ``repetition_penalty`` on every token of the prompt and the
output so far (positive logits divided by it, negative ones multiplied), then ``frequency_penalty`` times
each token's count in the output and ``presence_penalty`` once per token present in it, subtracted.
Log-probabilities are always of the raw logits.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass

import torch
from torch import Tensor

from lorakit.engine.structured import StructuredOutput, unpack_mask

__all__ = ["MAX_LOGPROBS", "Penalties", "SampleOutput", "SamplingBatch", "SamplingParams", "gumbel_noise",
           "process_logits", "sample"]

MAX_LOGPROBS = 20
# Temperatures below this sample greedily: logits / T would overflow float32 long before T reaches 0.
MIN_TEMPERATURE = 1e-5
# The largest temperature: far past where sampling is uniform, and logits / T stays finite in float32 (an infinite T
# would turn masked -inf logits into NaN).
MAX_TEMPERATURE = 100.0
# repetition_penalty's range: 1/100 to 100, so that logits divided or multiplied by it stay finite in float32.
REPETITION_RANGE = (0.01, 100.0)
# Counts and token ids (top_k, max_tokens, stop and logit_bias ids) within int32's range, as any vocabulary or context
# is, so that no tensor the sampler builds (int64) can overflow; seeds within int64's.
MAX_INT32 = 2**31 - 1
_M32 = 0xFFFFFFFF


def _show(value) -> str:
    """A value as an error message quotes it: its repr, shortened (a request may send a megabyte of anything)."""
    return _REPR.repr(value)


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 80, 80, 40, 8, 8, 8


def _check_int(name: str, value, lo: int, hi: int, allowed: str | None = None) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi):
        raise ValueError(f"SamplingParams.{name} must be {allowed or f'an int in [{lo}, {hi}]'}, got {_show(value)}")


def _check_float(name: str, value, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"SamplingParams.{name} must be {allowed}, got {_show(value)}")


def _token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT32


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    ``temperature`` 0 (or below 1e-5) is greedy. ``top_k`` 0 or -1 is off (-1 is stored as 0). ``top_p`` 1 is
    off. ``seed`` makes the request reproducible whatever else runs beside it. ``stop`` strings,
    ``stop_token_ids`` and eos (unless ``ignore_eos``) end the request, but only after ``min_tokens``
    tokens. ``logprobs`` k returns the chosen token's log-probability and the k most likely (k <= 20);
    ``prompt_logprobs`` k the same for every prompt token but the first (its whole prompt is computed then: no
    prefix-cache hit, and no CUDA graph for its prompt's steps).

    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], 0 off), ``repetition_penalty`` (in [0.01, 100], 1
    off) and ``logit_bias`` ({token id: bias in [-100, 100]}) change the logits as the module docstring says;
    ``structured_output`` constrains the output to a JSON schema, regex, choice or grammar.

    Every value is checked here, against the ranges the sampler's tensors hold (ValueError naming the field): counts
    and token ids are ints in [0, 2**31), ``seed`` in [0, 2**63), floats finite, ``temperature`` at most 100. So
    any SamplingParams that constructs builds a batch; the engine checks the rest against its vocabulary (logit_bias
    ids) and context (max_tokens is cut to what fits), and compiles structured_output's grammar, checked here for
    its shape only (constructing one, or decoding one from a message, never compiles anything).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        _check_int("max_tokens", self.max_tokens, 1, MAX_INT32, allowed="an int >= 1 (and < 2**31)")
        _check_float("temperature", self.temperature, f"a float in [0, {MAX_TEMPERATURE:g}]",
                     lambda t: 0 <= t <= MAX_TEMPERATURE)
        _check_int("top_k", self.top_k, -1, MAX_INT32, allowed=f"0 or -1 (off) or an int in [1, {MAX_INT32}]")
        _check_float("top_p", self.top_p, "in (0, 1]", lambda p: 0 < p <= 1)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1, allowed="None or an int in [0, 2**63)")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"SamplingParams.stop must be a non-empty str or a list of them, got {_show(self.stop)}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_token_id(i) for i in ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of ints in [0, 2**31), got {_show(ids)}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {_show(self.ignore_eos)}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS, allowed=f"None or an int in [0, {MAX_LOGPROBS}]")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens,
                   allowed=f"an int in [0, max_tokens={_show(self.max_tokens)}]")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), "a float in [-2, 2]", lambda v: -2 <= v <= 2)
        lo, hi = REPETITION_RANGE
        _check_float("repetition_penalty", self.repetition_penalty, f"a float in [{lo:g}, {hi:g}]",
                     lambda v: lo <= v <= hi)
        bias = self.logit_bias
        pairs = tuple(bias.items()) if isinstance(bias, dict) else bias
        if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and _token_id(p[0]) and not isinstance(p[1], bool)
            and isinstance(p[1], (int, float)) and math.isfinite(p[1]) and -100 <= p[1] <= 100 for p in pairs
        ):
            raise ValueError(f"SamplingParams.logit_bias must be a map of token ids in [0, 2**31) to biases in "
                             f"[-100, 100], got {_show(bias)}")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise ValueError(f"SamplingParams.structured_output must be a StructuredOutput, got "
                                 f"{type(self.structured_output).__name__}")
            if self.ignore_eos:
                raise ValueError("SamplingParams.ignore_eos cannot be combined with structured_output: the grammar "
                                 "ends the output with eos")
        object.__setattr__(self, "logit_bias", tuple((int(i), float(b)) for i, b in pairs))
        object.__setattr__(self, "top_k", max(self.top_k, 0))
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass
class Penalties:
    """Per-row penalty factors and the token statistics they act on (rows without penalties: 0, 0, 1)."""

    presence: Tensor  # [B] float32
    frequency: Tensor  # [B] float32
    repetition: Tensor  # [B] float32
    output_counts: Tensor  # [B, V] float32: times each token occurs in the row's output so far
    seen: Tensor  # [B, V] bool: the token occurs in the row's prompt or output


@dataclass
class SamplingBatch:
    """The per-row tensors ``sample`` reads, and the host-side flags that pick its code path.

    ``temperature`` is 0 for greedy rows; ``top_k`` 0 is off; ``steps[b]`` counts the tokens row b's request
    generated before this one. ``max_logprobs`` is the largest ``logprobs`` asked for, None if no row asked.
    ``token_mask``, ``logit_bias`` and ``penalties`` are None when no row uses them.
    """

    temperature: Tensor  # [B] float32
    top_k: Tensor  # [B] int64
    top_p: Tensor  # [B] float32
    seeds: Tensor  # [B] int64
    steps: Tensor  # [B] int64
    all_greedy: bool
    any_top_k_or_p: bool
    max_logprobs: int | None
    token_mask: Tensor | None = None  # [B, ceil(V / 32)] int32, packed bits: 1 = allowed
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None  # rows [N], token ids [N], biases [N]
    penalties: Penalties | None = None

    @staticmethod
    def build(
        params: list[SamplingParams], seeds: list[int], steps: list[int], device: torch.device | str, *,
        histories: list[tuple[list[int], list[int]]] | None = None, vocab_size: int | None = None,
        token_mask: Tensor | None = None,
    ) -> SamplingBatch:
        """Rows in ``params`` order; ``seeds`` in [0, 2**63) (the engine draws one for unseeded requests).

        ``histories[b]`` is row b's (prompt ids, output ids so far), and ``vocab_size`` the logits' width: both
        needed only where a row has penalties or a logit bias. ``token_mask``: the packed structured-output mask
        on the host (see ``lorakit.engine.structured``), or None.
        """
        if not len(params) == len(seeds) == len(steps):
            raise ValueError(
                f"SamplingBatch.build needs one seed and one step per request, got {len(params)} params, "
                f"{len(seeds)} seeds, {len(steps)} steps"
            )
        for name, values in (("seeds", seeds), ("steps", steps)):
            bad = [v for v in values if isinstance(v, bool) or not (isinstance(v, int) and 0 <= v < 2**63)]
            if bad:
                raise ValueError(f"SamplingBatch.build: {name} must be ints in [0, 2**63), got {bad[0]!r}")
        temps = [0.0 if p.temperature < MIN_TEMPERATURE else float(p.temperature) for p in params]
        sampled = [p for p, t in zip(params, temps) if t > 0]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        pin = torch.device(device).type == "cuda"
        floats = torch.tensor([temps, [float(p.top_p) for p in params]], dtype=torch.float32, pin_memory=pin)
        ints = torch.tensor([[p.top_k for p in params], seeds, steps], dtype=torch.int64, pin_memory=pin)
        floats = floats.to(device, non_blocking=True)
        ints = ints.to(device, non_blocking=True)
        needs_vocab = any(p.penalized or p.logit_bias for p in params)
        if needs_vocab and (histories is None or len(histories) != len(params) or vocab_size is None):
            raise ValueError("SamplingBatch.build needs histories (one per row) and vocab_size for penalties and "
                             "logit_bias")
        return SamplingBatch(
            temperature=floats[0], top_p=floats[1], top_k=ints[0], seeds=ints[1], steps=ints[2],
            all_greedy=not sampled,
            any_top_k_or_p=any(p.top_k > 0 or p.top_p < 1 for p in sampled),
            max_logprobs=max(asked) if asked else None,
            token_mask=None if token_mask is None else token_mask.to(device, non_blocking=True),
            logit_bias=_logit_bias(params, vocab_size, device, pin) if needs_vocab else None,
            penalties=_penalties(params, histories, vocab_size, device, pin) if needs_vocab else None,
        )


def _logit_bias(params: list[SamplingParams], vocab_size: int, device, pin: bool):
    entries = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
    if not entries:
        return None
    bad = [t for _, t, _ in entries if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    rows, ids, biases = zip(*entries)
    index = torch.tensor([rows, ids], dtype=torch.int64, pin_memory=pin).to(device, non_blocking=True)
    values = torch.tensor(biases, dtype=torch.float32, pin_memory=pin).to(device, non_blocking=True)
    return index[0], index[1], values


def _penalties(params: list[SamplingParams], histories, vocab_size: int, device, pin: bool) -> Penalties | None:
    """Token statistics of the penalized rows, scattered on the device from one padded id matrix each."""
    if not any(p.penalized for p in params):
        return None
    batch = len(params)
    outputs = [out if p.penalized else [] for p, (_, out) in zip(params, histories)]
    seen = [prompt + out if p.repetition_penalty != 1 else [] for p, (prompt, out) in zip(params, histories)]

    def padded(lists: list[list[int]]) -> Tensor:  # vocab_size is a spare column that takes the padding
        width = max(1, max(map(len, lists)))
        host = torch.tensor([x + [vocab_size] * (width - len(x)) for x in lists], dtype=torch.int64, pin_memory=pin)
        return host.to(device, non_blocking=True)

    out_ids = padded(outputs)
    counts = torch.zeros(batch, vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    present = torch.zeros(batch, vocab_size + 1, dtype=torch.bool, device=device)
    present.scatter_(1, padded(seen), True)
    factors = torch.tensor([[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                            [p.repetition_penalty for p in params]], dtype=torch.float32, pin_memory=pin)
    factors = factors.to(device, non_blocking=True)
    return Penalties(factors[0], factors[1], factors[2], counts[:, :vocab_size], present[:, :vocab_size])


def process_logits(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """float32 logits [B, V] after the structured-output mask, logit bias and penalties (a new tensor)."""
    logits = logits.float().clone()
    if batch.token_mask is not None:
        logits.masked_fill_(~unpack_mask(batch.token_mask, logits.shape[-1]), float("-inf"))
    if batch.logit_bias is not None:
        rows, ids, values = batch.logit_bias
        logits.index_put_((rows, ids), values, accumulate=True)
    pen = batch.penalties
    if pen is not None:
        rep = pen.repetition[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(pen.seen, penalized, logits)
        logits = logits - pen.frequency[:, None] * pen.output_counts
        logits = logits - pen.presence[:, None] * (pen.output_counts > 0).float()
    return logits


@dataclass
class SampleOutput:
    """One token per row; log-probabilities are of the raw logits (before temperature, top-k and top-p)."""

    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None  # [B] float32, at the chosen token
    top_ids: Tensor | None  # [B, k] int64, k = min(max_logprobs, V)
    top_logprobs: Tensor | None  # [B, k] float32, descending


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, exact: no product reaches 2**63."""
    if c < 2**31:
        return (x * c) & _M32
    return (x * (c - 2**31) + ((x & 1) << 31)) & _M32  # x * 2**31 mod 2**32 == (x & 1) << 31


def _hash32(x: Tensor) -> Tensor:
    """Chris Wellons' lowbias32, a bijection of [0, 2**32) with good avalanche, on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _random_u32(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """[B, V] int64 in [0, 2**32): hash(seeds[b], steps[b], v), identical on every device and batch layout."""
    key = torch.full_like(seeds, 0x9E3779B9)
    for word in (seeds & _M32, (seeds >> 32) & _M32, steps & _M32, (steps >> 32) & _M32):
        key = _hash32(key ^ word)
    col = _hash32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) ^ 0x5BD1E995)
    return _hash32(key[:, None] ^ col)


def gumbel_noise(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """[B, V] float32 standard Gumbel noise, a pure function of (seeds[b], steps[b], v).

    Semantics: ``g[b, v] = -log(-log(1 - w))``, ``w = (hash(seeds[b], steps[b], v) + 0.5) / 2**32`` clamped
    below 1; ``-log1p(-w)`` keeps full relative precision for small w, where the winning tokens' noise is.
    """
    w = (_random_u32(seeds, steps, vocab_size).to(torch.float32) + 0.5) * 2.0**-32
    return -torch.log(-torch.log1p(-w.clamp_(max=1 - 2.0**-24)))


def _mask_top_k_top_p(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set to -inf all but each row's top_k largest, then all but the smallest top set with mass >= top_p.

    The top token always stays; top_k 0 and top_p 1 mask nothing. Ties are ordered by index (stable sort).
    """
    vocab = scaled.shape[-1]
    vals, idx = scaled.sort(dim=-1, descending=True, stable=True)
    pos = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, vocab)
    vals = vals.masked_fill(pos >= k[:, None], float("-inf"))
    probs = vals.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = top_p[:, None]  # a top_p that float32 rounds to 0 keeps the top token alone (pos 0), as a tiny one does
    vals = vals.masked_fill((mass_before >= p) & (p < 1) & (pos > 0), float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, idx, vals)


def sample(logits: Tensor, batch: SamplingBatch) -> SampleOutput:
    """One token per row of ``logits`` [B, V] (any float dtype; computed in float32).

    Semantics: with ``z = process_logits(logits, batch)`` (mask, bias, penalties: the module docstring), greedy
    rows (temperature 0) take ``argmax(z[b])`` (ties: lowest index). Other rows take
    ``argmax(mask(z[b] / T[b]) + gumbel_noise(seeds, steps, V)[b])`` where ``mask`` applies top-k then
    top-p (``-inf`` outside), i.e. a draw from softmax(mask(z / T)). Log-probabilities are of ``logits``.
    """
    if logits.dim() != 2 or logits.shape[0] != batch.temperature.shape[0]:
        raise ValueError(
            f"sample expects logits of shape [B, V] with B = {batch.temperature.shape[0]} rows in the batch, "
            f"got {tuple(logits.shape)}"
        )
    logits = logits.float()
    processed = batch.token_mask is not None or batch.logit_bias is not None or batch.penalties is not None
    z = process_logits(logits, batch) if processed else logits
    token_ids = z.argmax(dim=-1)
    if not batch.all_greedy:
        greedy = batch.temperature == 0
        scaled = z / torch.where(greedy, 1.0, batch.temperature)[:, None]
        if batch.any_top_k_or_p:
            scaled = _mask_top_k_top_p(scaled, batch.top_k, batch.top_p)
        sampled = (scaled + gumbel_noise(batch.seeds, batch.steps, logits.shape[-1])).argmax(dim=-1)
        token_ids = torch.where(greedy, token_ids, sampled)
    if batch.max_logprobs is None:
        return SampleOutput(token_ids, None, None, None)
    logprobs = logits.log_softmax(dim=-1)
    top_logprobs, top_ids = logprobs.topk(min(batch.max_logprobs, logits.shape[-1]), dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    return SampleOutput(token_ids, chosen, top_ids, top_logprobs)

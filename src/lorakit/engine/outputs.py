"""What a request gains, from the engine's step to the client's stream: one ``RequestOutput`` type, two floors.

The engine decides what a token decides (``token_finish``: STOP, LENGTH) and sends token ids, never text;
``OutputProcessor``, in the process that streams to the user, decides what text decides (detokenizing, stop
strings), once per token. Why it lives there, and what it costs: docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from lorakit.engine.detokenize import IncrementalDetokenizer
from lorakit.engine.finish import FinishReason
from lorakit.engine.sampling import SamplingParams

__all__ = ["CompletionOutput", "FinishReason", "OutputProcessor", "RequestOutput", "TokenLogprob", "Unread",
           "stop_token_ids", "token_finish"]


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: dict[int, float]  # the top tokens' logprobs (empty unless asked for)
    rank: int | None = None  # a prompt token's rank among the model's choices there (1: the most likely)


class RequestOutput(msgspec.Struct, array_like=True):
    """What one request gained in one step: new tokens (and, past an ``OutputProcessor``, their text), and whether
    it finished. A msgspec struct: the engine core process sends it as it is (``frontend.wire``)."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # why, when finish_reason is ERROR (or an ABORT the server caused)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with SamplingParams.prompt_logprobs, on the request's first output: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None
    adapter_gone: bool = False  # the error: the adapter (version) it names was gone when it came (a server's 404)

    @classmethod
    def ended(cls, request_id: str, reason: FinishReason, *, num_prompt_tokens: int = 0, num_output_tokens: int = 0,
              error: str | None = None, adapter_gone: bool = False) -> RequestOutput:
        """A request's last output that brings no token: it ended with ``reason`` (``error``: why)."""
        return cls(request_id, "", [], True, reason, num_prompt_tokens=num_prompt_tokens,
                   num_output_tokens=num_output_tokens, error=error, adapter_gone=adapter_gone)


class Unread:
    """Outputs not read yet, each key's (a request, a job) merged into one as they come: a reader that fell behind
    catches up with one output, not one per step. The one place a stream's outputs are merged, for every reader (the
    core client's, ``RequestStream``'s, the server's pushed and pulled streams)."""

    __slots__ = ("_outputs",)

    def __init__(self):
        self._outputs: dict = {}

    def add(self, key, out: RequestOutput) -> None:
        earlier = self._outputs.get(key)
        self._outputs[key] = out if earlier is None else _merged(earlier, out)

    def pop(self) -> tuple:
        """(key, output) of the key that came first."""
        key = next(iter(self._outputs))
        return key, self._outputs.pop(key)

    def take(self) -> list[tuple]:
        """Every (key, output), in the order the keys came; none left."""
        items, self._outputs = list(self._outputs.items()), {}
        return items

    def __bool__(self) -> bool:
        return bool(self._outputs)

    def __iter__(self):
        """The keys that have an output waiting."""
        return iter(self._outputs)


def _merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """A request's output and its next one, as one."""
    logprobs = None if earlier.logprobs is None and later.logprobs is None else \
        (earlier.logprobs or []) + (later.logprobs or [])
    return RequestOutput(earlier.request_id, earlier.text + later.text, earlier.token_ids + later.token_ids,
                         later.finished, later.finish_reason, logprobs, later.num_prompt_tokens,
                         later.num_output_tokens, later.error, later.num_cached_tokens,
                         earlier.prompt_logprobs if earlier.prompt_logprobs is not None else later.prompt_logprobs)


@dataclass
class CompletionOutput:
    """A finished request, as ``LLM.generate`` returns it."""

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs


def stop_token_ids(params: SamplingParams, eos_token_id: int | list[int] | None) -> frozenset[int]:
    """The tokens that end a request: its ``stop_token_ids`` and the model's eos (unless ``ignore_eos``)."""
    eos = [] if eos_token_id is None or params.ignore_eos else (
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    return frozenset(params.stop_token_ids) | frozenset(eos)


def token_finish(params: SamplingParams, stop_ids: frozenset[int], count: int, token: int) -> FinishReason | None:
    """Why a request ends at its ``count``-th output token ``token``: STOP for a stop token past ``min_tokens``
    (as in vLLM: it counts from token min_tokens + 1 on), LENGTH at ``max_tokens``; None while it runs."""
    if count > params.min_tokens and token in stop_ids:
        return FinishReason.STOP
    return FinishReason.LENGTH if count >= params.max_tokens else None


@dataclass
class Processed:
    """An engine output past the processor: ``output`` (None when its request is not followed here: aborted or ended
    already), and ``abort``: a stop string ended it here while it still runs in the engine, which must be told."""

    output: RequestOutput | None
    abort: bool = False


class OutputProcessor:
    """One request's outputs given their text (see the module docstring): made before its first output comes, fed
    each output in order. ``tokenizer`` None gives outputs without text (and no stop strings)."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer):
        self.request_id = request_id
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
        self.finished = False

    def process(self, out: RequestOutput) -> Processed:
        """``out`` with its text; a stop string found here cuts its tokens and finishes it. Outputs after the
        finished one (steps in flight when a stop string ended it) are dropped (``output`` None)."""
        if self.finished:
            return Processed(None)
        text, reason, taken = "", None, 0
        last = len(out.token_ids) - 1
        for i, token in enumerate(out.token_ids):
            delta, reason = self._detok.append(token, out.finish_reason if i == last else None)
            text, taken = text + delta, taken + 1
            if reason is not None:
                break
        abort = reason is not None and out.finish_reason is None  # a stop string: the engine does not know yet
        reason = reason or out.finish_reason
        self.finished = reason is not None
        if taken < len(out.token_ids):  # a stop string ended it before its last token: the rest is dropped
            out = msgspec.structs.replace(out, token_ids=out.token_ids[:taken],
                                          logprobs=out.logprobs[:taken] if out.logprobs is not None else None,
                                          num_output_tokens=out.num_output_tokens - len(out.token_ids) + taken)
        # a new output, never the engine's changed: that one stays what the engine said (no text, its own finish)
        return Processed(msgspec.structs.replace(out, text=text, finished=self.finished, finish_reason=reason), abort)

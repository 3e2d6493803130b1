"""SGLang's native ``POST /generate`` over lorakit's engine: the request mapped to jobs, the outputs to SGLang's shapes.

``jobs(body, ...)`` turns a request into one ``Job`` (prompt, SamplingParams, adapter) per output, in SGLang's
order (prompt by prompt, ``n`` samples each), and refuses with ``Refused`` (an ApiError: an HTTP status, a message
naming the key) whatever lorakit would not do as SGLang does. ``Output`` gathers one job's results as SGLang returns
them: cumulative ``text`` and ``output_ids``, and ``meta_info`` whose ``finish_reason`` is an object such as
``{"type": "length", "length": 16}`` or ``{"type": "stop", "matched": 2}``. ``generate(body, state)`` is the
handler, a plain function as openai.py's are.
"""

from __future__ import annotations

import functools
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag

from lorakit.engine import SamplingParams
from lorakit.engine.lengths import ContextOverflow, fit_max_tokens
from lorakit.engine.outputs import FinishReason, stop_token_ids
from lorakit.engine.structured import StructuredOutput
from lorakit.frontend.client import Adapter
from lorakit.serve.protocol import MAX_ITEMS, MAX_N, ApiError, _ids_kind, _list, nth_sample, shown, token_id
from lorakit.serve.state import Result, ServerState
from lorakit.serve.streaming import Reply

__all__ = ["GenerateBody", "Job", "Output", "Refused", "generate", "jobs"]

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _strings(v) -> bool:
    return isinstance(v, str) or isinstance(v, list) and len(v) <= MAX_ITEMS and all(isinstance(s, str) for s in v)


def _ints(v) -> bool:
    return isinstance(v, list) and len(v) <= MAX_ITEMS and all(_int(i) for i in v)


# sampling_params keys lorakit supports: key -> (SamplingParams field, what the value must be, its check). Adding a
# key SamplingParams has learned is one line here (and its line out of UNSUPPORTED).
SUPPORTED: dict[str, tuple[str, str, Callable[[Any], bool]]] = {
    "max_new_tokens": ("max_tokens", "an int", _int),
    "max_tokens": ("max_tokens", "an int", _int),  # OpenAI's name, for clients that send it
    "min_new_tokens": ("min_tokens", "an int", _int),
    "temperature": ("temperature", "a number", _number),
    "top_p": ("top_p", "a number", _number),
    "top_k": ("top_k", "an int", _int),
    "stop": ("stop", "a string or a list of strings", _strings),
    "stop_token_ids": ("stop_token_ids", "a list of ints", _ints),
    "ignore_eos": ("ignore_eos", "true or false", lambda v: isinstance(v, bool)),
    "sampling_seed": ("seed", "an int", _int),
    "n": ("n", "an int", _int),  # not a SamplingParams field: n jobs per prompt
    "presence_penalty": ("presence_penalty", "a number", _number),
    "frequency_penalty": ("frequency_penalty", "a number", _number),
    "repetition_penalty": ("repetition_penalty", "a number", _number),
    "logit_bias": ("logit_bias", "an object of token id -> bias", lambda v: isinstance(v, dict) and len(v) <= MAX_ITEMS
                   and all(not k.startswith("-") and token_id(k) is not None and _number(b) for k, b in v.items())),
    "json_schema": ("structured_output", "a JSON schema as a string", lambda v: isinstance(v, str)),
    "regex": ("structured_output", "a string", lambda v: isinstance(v, str)),
}

# SGLang's sampling_params keys lorakit does not support yet, accepted only at the value that changes nothing.
UNSUPPORTED: dict[str, Any] = {
    "min_p": 0, "ebnf": None, "structural_tag": None, "stop_regex": None,
    "custom_params": None, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "stream_interval": 1,
}

# Top-level keys of SGLang's request beyond the ones GenerateBody reads, accepted only at their defaults.
UNSUPPORTED_TOP: dict[str, Any] = {
    "return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0, "return_text_in_logprobs": False,
    "return_hidden_states": False, "log_metrics": True,
}


class GenerateBody(BaseModel):
    """The request; other keys land in ``model_extra`` and ``jobs`` refuses them by name (null ones are ignored)."""

    model_config = ConfigDict(extra="allow")
    text: str | _list(str) | None = None
    input_ids: Annotated[Union[Annotated[_list(int), Tag("ids")], Annotated[_list(_list(int)), Tag("batch")]],
                         Discriminator(_ids_kind)] | None = None
    lora_path: str | _list(str | None) | None = None
    sampling_params: dict[str, Any] | _list(dict[str, Any]) | None = None
    rid: str | _list(str) | None = None
    stream: bool = False


class Refused(ApiError):
    """A request /generate refuses: a message, the parameter at fault (OpenAI's ``param``), the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(status, message, param)


@dataclass
class Job:
    """One output to generate: the prompt (text or token ids), how to sample it, its adapter (None: the base)."""

    prompt: str | list[int]
    params: SamplingParams
    adapter: Adapter | None
    id: str
    asked: str | None = None  # the key that asked for its max_tokens (None: the default, cut to the context)


def jobs(body: GenerateBody, resolve: Callable[[str | None], Adapter | None], max_tokens_limit: int
         ) -> tuple[list[Job], bool]:
    """The request's jobs, prompt-major (prompt i's k-th sample is job ``i * n + k``), and whether SGLang answers
    with a list (a batch of prompts, or ``n`` > 1) rather than one object. ``resolve``: a ``lora_path`` name to its
    adapter (``ServerState.adapter_of``: None for null or the base model's name; a 404 for a name nobody serves).
    Raises ``Refused``."""
    for key, value in (body.model_extra or {}).items():
        if value is not None and not (key in UNSUPPORTED_TOP and value == UNSUPPORTED_TOP[key]):
            raise Refused(f"{shown(key)} is not supported by lorakit's /generate; it takes text or input_ids, "
                          f"lora_path, sampling_params, rid and stream", key[:100])
    if (body.text is None) == (body.input_ids is None):
        raise Refused("give exactly one of text and input_ids", "text")
    if body.text is not None:
        batched = isinstance(body.text, list)
        prompts: list = body.text if batched else [body.text]
        where = "text"
    else:
        if not body.input_ids:
            raise Refused("input_ids is empty", "input_ids")
        batched = isinstance(body.input_ids[0], list)
        prompts = body.input_ids if batched else [body.input_ids]
        where = "input_ids"
    if not prompts:
        raise Refused(f"{where} is an empty list", where)
    adapter_of = [resolve(name) for name in _per_prompt(body.lora_path, len(prompts), "lora_path")]
    sampling = [_sampling(sp, max_tokens_limit) for sp in _per_prompt(body.sampling_params, len(prompts),
                                                                          "sampling_params")]
    samples = {k for _, k, _ in sampling}
    if len(samples) > 1:
        raise Refused(f"every prompt's sampling_params must have the same n, got {sorted(samples)}", "n")
    n = samples.pop()
    batched = batched or n > 1
    if isinstance(body.rid, list) and len(body.rid) != len(prompts):
        raise Refused(f"{len(prompts)} prompts but {len(body.rid)} rid entries", "rid")
    out = []
    for i, (prompt, adapter, (params, _, asked)) in enumerate(zip(prompts, adapter_of, sampling)):
        for k in range(n):
            if n > 1 or body.rid is None:
                rid = uuid.uuid4().hex
            else:
                rid = body.rid[i] if isinstance(body.rid, list) else f"{body.rid}_{i}" if batched else body.rid
            out.append(Job(prompt, nth_sample(params, k), adapter, rid, asked))
    return out, batched


def _per_prompt(value, count: int, param: str) -> list:
    """A value for all prompts, or a list with one per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise Refused(f"{count} prompt(s) but {len(value)} {param} entries; give one per prompt, or one for all",
                      param)
    return value


def _sampling(sp: dict[str, Any] | None, max_tokens_limit: int) -> tuple[SamplingParams, int, str | None]:
    """SamplingParams, n, and the key that asked for max_tokens (None: the default) from one prompt's
    sampling_params."""
    kwargs, used = {}, {}  # used: SamplingParams field -> the key that set it
    for key, value in (sp or {}).items():
        if value is None:  # null: the default, as SGLang reads it
            continue
        if key in SUPPORTED:
            field, kind, ok = SUPPORTED[key]
            if not ok(value):
                raise Refused(f"sampling_params.{key} must be {kind}, got {shown(value)}", key)
            if field in used:
                raise Refused(f"sampling_params has both {used[field]} and {key}; give one", key)
            kwargs[field], used[field] = value, key
        elif key in UNSUPPORTED:
            if value != UNSUPPORTED[key] or isinstance(value, bool) != isinstance(UNSUPPORTED[key], bool):
                raise Refused(f"sampling_params.{key} is not supported by lorakit yet (only "
                              f"{UNSUPPORTED[key]!r}, which changes nothing)", key)
        else:
            raise Refused(f"sampling_params.{shown(key)} is not a sampling parameter lorakit knows; supported: "
                          f"{', '.join(SUPPORTED)}", key[:100])
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = {token_id(k): b for k, b in kwargs["logit_bias"].items()}
    if "structured_output" in kwargs:
        key, value = used["structured_output"], kwargs["structured_output"]
        try:
            kwargs["structured_output"] = StructuredOutput.json_schema(value) if key == "json_schema" else \
                StructuredOutput(regex=value)
        except ValueError as e:
            raise Refused(f"sampling_params.{key}: {e}", key) from None
    n = kwargs.pop("n", 1)
    if not 1 <= n <= MAX_N:
        raise Refused(f"sampling_params.n must be in [1, {MAX_N}], got {shown(n)}", "n")
    kwargs.setdefault("max_tokens", min(DEFAULT_MAX_NEW_TOKENS, max_tokens_limit))
    if kwargs["max_tokens"] > max_tokens_limit:
        key = used["max_tokens"]
        raise Refused(f"sampling_params.{key}={kwargs['max_tokens']} is above this server's limit of "
                      f"{max_tokens_limit}", key)
    try:
        return SamplingParams(**kwargs), n, used.get("max_tokens")
    except ValueError as e:
        message, param = str(e), None
        for field, key in used.items():
            if message.startswith(f"SamplingParams.{field} "):
                message, param = message.replace(f"SamplingParams.{field}", f"sampling_params.{key}", 1), key
        raise Refused(message.replace("SamplingParams.", "sampling_params."), param) from None


class Output(Result):
    """One job's results so far, in SGLang's shape. ``prompt_ids``: its prompt, tokenized and checked; the
    engine's ``eos_token_id`` and ``text`` (token ids to text) tell what a "stop" finish matched."""

    def __init__(self, job: Job, prompt_ids: list[int], eos_token_id: int | list[int] | None,
                 text: Callable[[list[int]], str]):
        super().__init__()
        self.job, self.prompt_ids, self._text = job, prompt_ids, text
        self._stop_ids = stop_token_ids(job.params, eos_token_id)
        self._start = time.monotonic()

    def as_dict(self, index: int | None = None) -> dict:
        """SGLang's response (``index``: the job's place in a streamed batch)."""
        meta = {"id": self.job.id, "finish_reason": self._finish(), "prompt_tokens": len(self.prompt_ids),
                "completion_tokens": len(self.token_ids), "cached_tokens": self.cached_tokens}
        if self.finish_reason is not None:
            meta["e2e_latency"] = time.monotonic() - self._start
        out = {"text": self.text, "output_ids": list(self.token_ids), "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out

    def _finish(self) -> dict | None:
        reason = self.finish_reason
        if reason == FinishReason.LENGTH:
            return {"type": "length", "length": len(self.token_ids)}
        if reason != FinishReason.STOP:
            return None if reason is None else {"type": "abort", "message": f"the request ended: {reason}"}
        if self.token_ids and self.token_ids[-1] in self._stop_ids:
            return {"type": "stop", "matched": self.token_ids[-1]}
        stops = self.job.params.stop
        if len(stops) > 1:  # the one that starts first in the output's text
            text = self._text(self.token_ids)
            stops = sorted((s for s in stops if s in text), key=text.find) or stops
        return {"type": "stop", "matched": stops[0] if stops else None}


async def generate(body: GenerateBody, state: ServerState) -> Reply:
    """POST /generate: the reply, a coroutine of SGLang's response, or with ``stream`` an iterator of cumulative
    chunks (with ``index`` when batched)."""
    jobs_, batched = jobs(body, lambda name: state.adapter_of(name, "lora_path"), state.config.max_tokens_limit)
    state.in_flight.precheck(len(jobs_))  # before the work of tokenizing
    for job in jobs_:
        state.check_stop(job.params.stop)
    compiled = set()  # a prompt's n jobs share their structured output: compiled once
    for job in jobs_:
        spec = job.params.structured_output
        if spec is not None and (id(spec), job.adapter) not in compiled:
            compiled.add((id(spec), job.adapter))
            await state.check_grammar(spec, job.adapter, "json_schema" if spec.json is not None else "regex")
    tokenized: dict[tuple[int, Adapter | None], list[int]] = {}  # a prompt's n jobs share it: tokenized once
    for job in jobs_:
        if (id(job.prompt), job.adapter) not in tokenized:
            tokenized[id(job.prompt), job.adapter] = await state.prompt_ids(job.prompt, job.adapter)
    for job in jobs_:  # an asked max_new_tokens that does not fit is refused, as on every route
        if job.asked is not None:
            prompt_len = len(tokenized[id(job.prompt), job.adapter])
            try:
                fit_max_tokens(prompt_len, state.engine.max_seq_len, asked=job.params.max_tokens, name=job.asked)
            except ContextOverflow as e:
                raise Refused(str(e), job.asked) from None
    outputs = [Output(job, tokenized[id(job.prompt), job.adapter], state.eos_token_id,
                      functools.partial(state.text, adapter=job.adapter, skip_special_tokens=True)) for job in jobs_]
    work = [(out.prompt_ids, out.job.params, out.job.adapter) for out in outputs]
    stream, tokens = state.stream(work), state.tokens(work)
    if body.stream:
        async def chunks():
            async for i, out in stream:
                outputs[i].add(out)
                yield outputs[i].as_dict(i if batched else None)
        return Reply(chunks(), sequences=len(jobs_), tokens=tokens)

    async def complete():
        async for i, out in stream:
            outputs[i].add(out)
        results = [out.as_dict() for out in outputs]
        return results if batched else results[0]
    return Reply(complete(), sequences=len(jobs_), tokens=tokens)

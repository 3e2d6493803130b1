"""OpenAI's ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``: plain functions of (request body,
ServerState) that a test can call without HTTP.

A handler checks the whole request before anything runs (ApiError), tokenizing off the event loop and having the
engine compile its grammar, if any, off every loop (once for all its prompts and samples), and returns its ``Reply``:
a coroutine that gives the response, or with ``stream`` an async iterator of chunks, the number of sequences it
runs and the tokens they can occupy in the KV cache (``streaming.respond`` sends either, within the limits on both).
A request's choices, ``n`` per prompt and prompt by prompt, run together. The usage and logprobs blocks are built
here, once; a large answer (thousands of logprob entries: a long prompt's prompt_logprobs) is built on the tokenizing
thread and encoded a slice at a time, so that the event loop is never held for more than a few milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Callable

import msgspec
from starlette.responses import Response

from lorakit import __version__
from lorakit.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from lorakit.frontend.client import Adapter
from lorakit.serve.protocol import (ApiError, ChatBody, CompletionBody, chat_messages, nth_sample, samples, shown,
                                   structured_param)
from lorakit.serve.state import INLINE_SIZE, Result, ServerState
from lorakit.serve.streaming import Push, Reply, pulled
from lorakit.serve.tools import ToolCalls, checked_tools, parser_for, stream_deltas, tool_grammar

__all__ = ["SYSTEM_FINGERPRINT", "chat", "completions", "model", "models"]

SYSTEM_FINGERPRINT = f"lorakit-{__version__}"  # what OpenAI's answers carry to name the backend's configuration
SLICE = 256  # tokens' logprobs encoded by one call (of a block built off the event loop): a millisecond or so
_encode = msgspec.json.Encoder().encode


def models(state: ServerState) -> dict:
    """GET /v1/models: the base model, then every adapter by name, with its version and sha256 under "lorakit"
    once registered (a fleet's replica lists the adapters it registers on request too)."""
    versions = state.adapter_versions
    return {"object": "list", "data": [_model(name, state, versions)
                                       for name in (state.config.model_name, *state.servable())]}


def model(model_id: str, state: ServerState) -> dict:
    """GET /v1/models/{model_id}."""
    if model_id not in state.servable():
        state.adapter_of(model_id)
    return _model(model_id, state, state.adapter_versions)


def _model(name: str, state: ServerState, versions: dict[str, tuple[int, str]]) -> dict:
    base = state.config.model_name
    entry = {"id": name, "object": "model", "created": state.created(name), "owned_by": "lorakit",
             "parent": None if name == base else base}
    if name != base and name in versions:
        number, sha256 = versions[name]
        entry["lorakit"] = {"version": number, "sha256": sha256}  # which files, as read when it was registered
    return entry


async def completions(body: CompletionBody, state: ServerState) -> Reply:
    """POST /v1/completions: choice ``i * n + k`` is prompt i's k-th sample."""
    adapter = state.adapter_of(body.model)
    prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
        body.prompt[0], int) else [body.prompt]
    n = samples(body)
    state.in_flight.precheck(len(prompts) * n)  # before the work of tokenizing
    prompts = [await state.prompt_ids(p, adapter) for p in prompts]
    params = state.sampling_params(body, prompts, default_max_tokens=16, adapter=adapter)
    await state.body_grammar(body, params, adapter)  # compiled once for every prompt and sample
    jobs = [(p, nth_sample(params, k), adapter) for p in prompts for k in range(n)]
    echoed = [state.text(p, adapter) if body.echo else "" for p in prompts]
    logprobs = _Logprobs(state, adapter, len(jobs))
    # max_tokens 0 with echo (lm-evaluation-harness scoring a prompt): one token runs, none is shown
    none = body.echo and 0 in (body.max_tokens, body.max_completion_tokens)
    scored = body.echo and body.logprobs is not None  # the echoed prompt's tokens lead the logprobs block

    def choice(i: int, text: str, out: RequestOutput | Result) -> dict:
        shown = [] if none else out.logprobs
        prompt = (prompts[i // n], out.prompt_logprobs) if scored and out.prompt_logprobs is not None else None
        entry = {"index": i, "text": text, "logprobs": logprobs.completion(i, shown, prompt),
                 "finish_reason": FinishReason.LENGTH if none and out.finish_reason else out.finish_reason}
        if body.prompt_logprobs is not None and out.prompt_logprobs is not None:  # vLLM's shape
            entry["prompt_logprobs"] = logprobs.vllm(out.prompt_logprobs, body.prompt_logprobs)
        return entry

    echo = [{"index": i, "text": echoed[i // n], "logprobs": None, "finish_reason": None}
            for i in range(len(jobs))] if body.echo else []
    width = 1 + max(body.logprobs or 0, body.prompt_logprobs or 0)
    return _reply(body, state, _head("cmpl", "text_completion", body, adapter), jobs, prompts, echo,
                  lambda i, out: choice(i, "" if none else out.text, out),
                  lambda i, r: choice(i, echoed[i // n] + ("" if none else r.text), r), logprobs, width,
                  hide_tokens=none)


async def chat(body: ChatBody, state: ServerState) -> Reply:
    """POST /v1/chat/completions: the messages through the chat template of the adapter's tokenizer."""
    adapter = state.adapter_of(body.model)
    messages = chat_messages(body)
    tools, choice, named = checked_tools(body.tools, body.tool_choice)
    calling = None if choice is None else ToolCalls(
        tools, choice, named, parser_for(state.chat_template(adapter), state.config.tool_call_parser))
    n = samples(body)
    state.in_flight.precheck(n)
    prompt = await state.chat_ids(messages, adapter, tools)
    params = state.sampling_params(body, [prompt], default_max_tokens=None, adapter=adapter)
    grammar = None if calling is None else tool_grammar(tools, choice, named, body.parallel_tool_calls is not False)
    if grammar is not None:
        if params.structured_output is not None:
            raise ApiError(400, f"tool_choice {shown(body.tool_choice if choice != 'named' else named)} constrains the "
                                f"output to tool calls, and {structured_param(body)} constrains it too; give one",
                           "tool_choice")
        params = dataclasses.replace(params, structured_output=grammar)
        await state.check_grammar(grammar, adapter, "tools")
    else:
        await state.body_grammar(body, params, adapter)  # compiled once for every sample
    logprobs = _Logprobs(state, adapter, n)
    held = [""] * n  # with tools, each choice's text until it ends (then parsed for calls)

    def block(out: RequestOutput | Result) -> dict | None:
        return logprobs.chat(out.logprobs or []) if body.logprobs else None

    def chunk(k: int, out: RequestOutput) -> dict | list[dict]:
        if calling is None or not calling.active:
            return {"index": k, "delta": {"content": out.text} if out.text else {}, "logprobs": block(out),
                    "finish_reason": out.finish_reason}
        held[k] += out.text
        if not out.finished:
            return []
        content, calls, finish = calling.answer(held[k], out.finish_reason)
        deltas = stream_deltas(content, calls) or [{}]
        return [{"index": k, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas[:-1]] + [
            {"index": k, "delta": deltas[-1], "logprobs": None, "finish_reason": finish}]

    def whole(k: int, r: Result) -> dict:
        message, finish = {"role": "assistant", "content": r.text}, r.finish_reason
        if calling is not None and calling.active:
            message["content"], calls, finish = calling.answer(r.text, r.finish_reason)
            if calls:
                message["tool_calls"] = calls
        entry = {"index": k, "message": message, "logprobs": block(r), "finish_reason": finish}
        if body.prompt_logprobs is not None and r.prompt_logprobs is not None:  # vLLM's shape, per choice
            entry["prompt_logprobs"] = logprobs.vllm(r.prompt_logprobs, body.prompt_logprobs)
        return entry

    jobs = [(prompt, nth_sample(params, k), adapter) for k in range(n)]
    roles = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for k in range(n)]
    head = _head("chatcmpl", "chat.completion.chunk" if body.stream else "chat.completion", body, adapter)
    return _reply(body, state, head, jobs, [prompt], roles, chunk, whole, logprobs,
                  1 + max(body.top_logprobs or 0, body.prompt_logprobs or 0))


def _head(prefix: str, object_: str, body: CompletionBody | ChatBody, adapter: Adapter | None) -> dict:
    """The fields every response and chunk of a request starts with; ``lorakit``: which adapter version answered
    (the request runs on it to its end), as /v1/models shows versions."""
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": object_, "created": int(time.time()), "model": body.model,
            "system_fingerprint": SYSTEM_FINGERPRINT}
    if adapter is not None:
        head["lorakit"] = {"adapter": adapter.name, "version": adapter.ref.version, "sha256": adapter.ref.sha256}
    return head


def _usage(prompts: list[list[int]], completion_tokens: int, cached: list[int]) -> dict:
    """The usage block: each prompt's tokens once (not once per choice), and every generated token; of the prompt
    tokens, those served from the prefix cache (``cached``: per job, the prompts' jobs in order, n per prompt;
    each prompt's first job counts)."""
    prompt_tokens = sum(map(len, prompts))
    n = max(len(cached) // max(len(prompts), 1), 1)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached[::n])}}


def _reply(body: CompletionBody | ChatBody, state: ServerState, head: dict, jobs: list, prompts: list[list[int]],
           first: list[dict], chunk: Callable[[int, RequestOutput], dict], whole: Callable[[int, Result], dict],
           logprobs: _Logprobs, width: int, hide_tokens: bool = False) -> Reply:
    """The reply, a choice per job (``whole``); or with ``stream`` its chunks: the ``first`` choices, a choice per
    output (``chunk``), and last the usage chunk when the client asked for it with stream_options.include_usage
    (every chunk then carries "usage": null). ``width``: the logprob entries each token's logprobs make (itself and
    its top alternatives): an answer (then a JSON Response) or a chunk of more than INLINE_SIZE entries is made on
    the tokenizing thread, its ``logprobs`` blocks encoded there (``_Logprobs.encoding``). ``hide_tokens``: the
    generated tokens are not shown, nor counted."""
    count = (lambda ids: 0) if hide_tokens else len

    def answer(results: list[Result]) -> dict:
        return {**head, "choices": [whole(i, r) for i, r in enumerate(results)],
                "usage": _usage(prompts, sum(count(r.token_ids) for r in results), [r.cached_tokens for r in results])}

    async def complete() -> dict | Response:
        results = await state.results(jobs)
        if sum(_entries(r, width) for r in results) <= INLINE_SIZE:
            return answer(results)
        return await state.off_loop(lambda: Response(_encode(logprobs.encoding(answer, results)),
                                                     media_type="application/json"))

    with_usage = body.stream_options is not None and body.stream_options.include_usage
    extra = {"usage": None} if with_usage else {}
    generated, cached = 0, [0] * len(jobs)

    def output(i: int, out: RequestOutput) -> list[dict]:
        nonlocal generated
        generated += count(out.token_ids)
        cached[i] = out.num_cached_tokens
        made = chunk(i, out)
        return [{**head, "choices": [c], **extra} for c in (made if isinstance(made, list) else [made])]

    def last() -> list[dict]:
        return [{**head, "choices": [], "usage": _usage(prompts, generated, cached)}] if with_usage else []

    if not body.stream:
        return Reply(complete(), sequences=len(jobs), tokens=state.tokens(jobs))
    if any(params.prompt_logprobs is not None for _, params, _ in jobs):  # a first output of thousands of entries
        return Reply(_pulled_off_loop(state, [{**head, "choices": [c], **extra} for c in first], jobs, width, output,
                                      last, logprobs), sequences=len(jobs), tokens=state.tokens(jobs))
    push = Push([{**head, "choices": [c], **extra} for c in first], lambda listener: state.submit(jobs, listener),
                len(jobs), output, last)
    return Reply(pulled(push), sequences=len(jobs), tokens=state.tokens(jobs), push=push)


async def _pulled_off_loop(state: ServerState, first: list[dict], jobs: list, width: int,
                           output: Callable[[int, RequestOutput], list[dict]], last: Callable[[], list[dict]],
                           logprobs: _Logprobs):
    """A stream's chunks as ``streaming.pulled`` gives them; an output of more than INLINE_SIZE logprob entries has
    its chunks made on the tokenizing thread, their logprobs encoded there (``_Logprobs.encoding``)."""
    for c in first:
        yield c
    async for i, out in state.stream(jobs):
        if _entries(out, width) <= INLINE_SIZE:
            made = output(i, out)
        else:
            made = await state.off_loop(logprobs.encoding, output, i, out)
        for c in made:
            yield c
    for c in last():
        yield c


def _entries(out: RequestOutput | Result, width: int) -> int:
    """The logprob entries an output's choice can hold: ``width`` per token of its logprobs and prompt logprobs."""
    return width * (len(out.logprobs or ()) + len(out.prompt_logprobs or ()))


def _finite(logprob: float) -> float:
    """A log-probability JSON can carry: -inf (a token the model rules out) as -9999.0, as vLLM sends it."""
    return max(logprob, -9999.0) if not math.isnan(logprob) else -9999.0


class _Logprobs:
    """OpenAI's logprobs blocks for one request's choices, each token as text by the request's tokenizer (decoded
    once a request). Built within ``encoding``, a block's long lists come encoded (msgspec.Raw), a SLICE of tokens
    at a time: no more than a slice's objects live at once, and no call holds the GIL for more than about a
    millisecond."""

    def __init__(self, state: ServerState, adapter: Adapter | None, choices: int):
        self._decode = lambda token_id: state.text([token_id], adapter)
        self._texts: dict[int, str] = {}  # token id -> its text
        self._offsets = [0] * choices  # characters of each choice's text so far (completions' text_offset)
        self._encoded = False

    def encoding(self, make: Callable, *args):
        """make(*args), the blocks it builds encoded a slice at a time; for the tokenizing thread (see the class)."""
        self._encoded = True
        try:
            return make(*args)
        finally:
            self._encoded = False

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode(token_id)
        return text

    def _list(self, items: list, make: Callable) -> list | msgspec.Raw:
        """[make(x) for x in items], encoded a SLICE at a time within ``encoding``."""
        if not self._encoded or len(items) <= SLICE:
            return [make(x) for x in items]
        parts = (_encode([make(x) for x in items[i:i + SLICE]])[1:-1] for i in range(0, len(items), SLICE))
        return msgspec.Raw(b"[" + b",".join(parts) + b"]")

    def completion(self, index: int, lps: list[TokenLogprob] | None,
                   prompt: tuple[list[int], list[TokenLogprob | None]] | None = None) -> dict | None:
        """Completions' block for choice ``index``'s new tokens ``lps``, led by the echoed prompt's (``prompt``:
        its ids and their logprobs, the first None, as OpenAI gives it) when given."""
        pairs = list(zip(*prompt)) if prompt is not None else []
        pairs += [(t.token_id, t) for t in lps or []]
        if not pairs:
            return None
        tokens = [self._text(i) for i, _ in pairs]
        starts = []
        for token in tokens:
            starts.append(self._offsets[index])
            self._offsets[index] += len(token)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp.logprob) for _, lp in pairs],
                "text_offset": starts, "top_logprobs": self._list(pairs, lambda pair: None if pair[1] is None else
                                                                  {self._text(i): _finite(v)
                                                                   for i, v in pair[1].top.items()})}

    def vllm(self, lps: list[TokenLogprob | None], k: int) -> list[dict | None] | msgspec.Raw:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank,
        decoded_token}} for the prompt's token and the top ``k``."""
        def entry(lp: TokenLogprob | None) -> dict | None:
            if lp is None:
                return None
            shown = {lp.token_id: {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                   "decoded_token": self._text(lp.token_id)}}
            for rank, (i, v) in enumerate(list(lp.top.items())[:k], 1):
                shown.setdefault(i, {"logprob": _finite(v), "rank": rank, "decoded_token": self._text(i)})
            return shown
        return self._list(lps, entry)

    def chat(self, lps: list[TokenLogprob]) -> dict:
        return {"content": self._list(lps, lambda t: {**self._token(t.token_id, t.logprob),
                                                      "top_logprobs": [self._token(i, v) for i, v in t.top.items()]})}

    def _token(self, token_id: int, logprob: float) -> dict:
        """A chat logprobs entry: the token's text, its logprob and the UTF-8 bytes of that text (as vLLM gives
        them: a token that holds part of a character reads as U+FFFD)."""
        text = self._text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

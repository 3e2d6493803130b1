"""The request bodies lorakit accepts, the one mapping from an OpenAI body to ``SamplingParams``, and ``ApiError``.

Every parameter is either supported, accepted and ignored (``user``), or refused with a 400 that names it:
an unknown field with a value other than null is an error, never silently dropped. ``ApiError`` is the one
error type handlers raise, and ``ApiError.body()`` the one place an error takes OpenAI's shape.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator

from lorakit.engine import SamplingParams
from lorakit.engine.lengths import ContextOverflow, fit_max_tokens
from lorakit.engine.structured import StructuredOutput

__all__ = ["ERROR_CODES", "MAX_JSON_DEPTH", "ApiError", "ChatBody", "CompletionBody", "LoadBody", "UnloadBody",
           "check_extras", "chat_messages", "deeper_than", "error_status", "json_value", "nth_sample", "parse_body",
           "read_json", "samples", "sampling_params", "shown", "structured_param", "token_id"]

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               408: "invalid_request_error", 409: "invalid_request_error", 429: "rate_limit_error",
               431: "invalid_request_error"}


def shown(value: Any, limit: int = 100) -> str:
    """Something a client sent, as an error message quotes it: its repr, cut to ``limit`` characters."""
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit + 2 else f"{text[:limit]}..."


# OpenAI's error ``code``: a string or null. Its own where it has one (a wrong key, an unknown model, a rate limit),
# else one naming the status, so that a stream's error event (sent after a 200) still tells a 503 from a 500; a 400
# has none (its ``param`` names what is wrong).
ERROR_CODES = {401: "invalid_api_key", 403: "permission_denied", 404: "not_found", 405: "method_not_allowed",
               408: "request_timeout",
               413: "request_too_large", 429: "rate_limit_exceeded", 431: "request_header_fields_too_large",
               500: "internal_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error for the client: its HTTP status, message and the parameter at fault; OpenAI's error type and code
    follow from the status (a 404 for ``model`` is "model_not_found"). ``headers``: the response's own (a 429's
    Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.type = ERROR_TYPES.get(status, "internal_server_error" if status >= 500 else "invalid_request_error")
        self.code = "model_not_found" if status == 404 and param == "model" else ERROR_CODES.get(status)

    def body(self) -> dict:
        """OpenAI's error shape, as a response body and as a stream's error event."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_version(text: str | None) -> int | None:
    """A push's ``?version=N``: a positive whole number, or None when absent (ApiError 400 otherwise)."""
    if text is None:
        return None
    if not (text.isdigit() and 0 < len(text) <= 18 and int(text) > 0):
        raise ApiError(400, f"version must be a positive whole number, got {text[:40]!r}", "version")
    return int(text)


def error_status(code: str | None) -> int:
    """The HTTP status of an error ``code`` (an error event's, sent after a 200): None is a 400's; unknown, 500."""
    if code is None:
        return 400
    return 404 if code == "model_not_found" else _STATUSES.get(code, 500)


_STATUSES = {code: status for status, code in ERROR_CODES.items()}


# Text a tokenizer cannot take. JSON can spell a UTF-16 surrogate that is not half of a pair (\ud800), and Python's
# json reads one, and the UTF-8 bytes of one (ED A0 80), into a str that is no Unicode text: a tokenizer (Rust), the
# engine core's transport, a JSON response all refuse it. Found in the raw body at C speed, before parsing: a real
# escape follows an even run of backslashes; pairs are removed first (keeping that run), then any surrogate left is
# lone. Walking a parsed body of millions of items to look for one took seconds on the event loop.
_PAIR = re.compile(rb"(?<!\\)((?:\\\\)*)\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_LONE = re.compile(rb"\xed[\xa0-\xbf]|(?<!\\)(?:\\\\)*\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_WALK_ITEMS = 20_000  # the most values looked at to name the field that holds one (a bound on the event loop's time)


def _lone_surrogate(raw: bytes) -> bool:
    """Whether JSON text (its UTF-8 bytes) spells a lone surrogate, raw or escaped (at C speed)."""
    return (b"\\u" in raw or b"\xed" in raw) and _LONE.search(_PAIR.sub(rb"\1", raw)) is not None


def parse_body(body: bytes) -> Any:
    """A request body's JSON (json.JSONDecodeError as json.loads raises it), or an ApiError 400 for text no tokenizer
    takes: bytes that are not UTF-8, or a lone surrogate, naming the field that holds it (``messages[0].content``)."""
    lone = _lone_surrogate(body)
    try:
        value = json.loads(body)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 text ({e.reason} at byte {e.start}); send UTF-8 JSON"
                       ) from None
    if lone:
        where = _holding_surrogate(value)
        raise ApiError(400, f"{where or 'the request body'}: text with a lone UTF-16 surrogate (\\ud800-\\udfff, half "
                            f"of a pair, or the UTF-8 bytes of one) is not Unicode text; send the character, or both "
                            f"halves of its pair", where)
    return value


def _holding_surrogate(value: Any) -> str | None:
    """The path of the first string of a parsed body with a surrogate in it (or in its key), as JSON names it
    (``messages[0].content``, ``logit_bias.<key>``); None if not found within _WALK_ITEMS values."""
    stack = [(value, "", "")]  # a value, its container's path and its part of its own
    for _ in range(_WALK_ITEMS):
        if not stack:
            return None
        item, parent, part = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return f"{parent}{part}" or None
        elif isinstance(item, dict):
            path = f"{parent}{part}"
            for key, v in reversed(list(item.items())[:_WALK_ITEMS]):
                if _SURROGATE.search(key):
                    return f"{path}.<key>" if path else "<key>"
                stack.append((v, f"{path}." if path else "", key[:50]))
        elif isinstance(item, list):
            path = f"{parent}{part}"
            stack.extend((item[i], path, f"[{i}]") for i in range(min(len(item), _WALK_ITEMS) - 1, -1, -1))
    return None


# JSON inside a string (tool calls' arguments, a model's output): read strictly, within bounds. Python's json takes
# NaN, Infinity and 1e999 (as inf), which JSON does not, and recurses once per level: 100,000 "[" raise RecursionError.
MAX_JSON_DEPTH = 128
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _double(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {shown(text, 20)} is beyond a double")
    return value


_STRICT = json.JSONDecoder(parse_constant=_no_constant, parse_float=_double)


def deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and objects more than ``limit`` deep (level by level, not a recursion)."""
    level = [value]
    for _ in range(limit):
        nested = []
        for item in level:
            for v in item.values() if type(item) is dict else item:
                if type(v) is dict or type(v) is list:
                    nested.append(v)
        if not nested:
            return False
        level = nested
    return True


def read_json(text: str, at: int = 0) -> tuple[Any, int]:
    """The JSON value at ``text[at:]`` (after any JSON whitespace) and the index where it ends; ValueError saying why
    when there is none: not JSON, NaN / Infinity / a number beyond a double, nested more than MAX_JSON_DEPTH deep, or
    a lone surrogate. Linear in the text's length, whatever the text."""
    at = _JSON_SPACE.match(text, at).end()
    try:
        value, end = _STRICT.raw_decode(text, at)
    except RecursionError:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} deep") from None
    if isinstance(value, (dict, list)) and text.count("[", at, end) + text.count("{", at, end) > MAX_JSON_DEPTH \
            and deeper_than(value, MAX_JSON_DEPTH):
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} deep")
    if _lone_surrogate(text[at:end].encode("utf-8", "surrogatepass")):
        raise ValueError("a lone UTF-16 surrogate (\\ud800-\\udfff) is not Unicode text")
    return value, end


def json_value(text: str) -> Any:
    """``text`` as one JSON value (``read_json``'s, with nothing but whitespace after it); ValueError otherwise."""
    value, end = read_json(text)
    if _JSON_SPACE.match(text, end).end() != len(text):
        raise ValueError(f"extra text after the JSON value, at character {end}")
    return value


# The most items of a list or an object in a request whose size nothing else bounds (prompts of a batch, messages,
# stop_token_ids, logit_bias, ...): pydantic validates a body on the event loop, and a 16 MiB one of two million
# small lists took seconds, during which no stream moved.
MAX_ITEMS = 65536


def _at_most_max_items(value: Any) -> Any:
    if isinstance(value, (list, dict)) and len(value) > MAX_ITEMS:
        raise ValueError(f"at most {MAX_ITEMS} items, got {len(value)}")
    return value


# The most guided_choice strings: compiling the grammar of 65,536 took llguidance seconds on the engine thread (every
# stream waited) before it gave up; 4,096 take milliseconds.
MAX_CHOICES = 4096


def _at_most_max_choices(value: Any) -> Any:
    if isinstance(value, list) and len(value) > MAX_CHOICES:
        raise ValueError(f"at most {MAX_CHOICES} choices, got {len(value)}")
    return value


def _list(item: Any) -> Any:
    """A list of at most MAX_ITEMS items, refused at its first bad item (not with an error for each of a million)."""
    return Annotated[list[item], Field(fail_fast=True), BeforeValidator(_at_most_max_items)]


def _prompt_kind(value: Any) -> str:
    """Which of a prompt's shapes ``value`` is meant to be, read from its first item: only that shape is validated
    (a union tries each, with an error per item of a list that is not it)."""
    if not isinstance(value, list):
        return "text"
    return "texts" if value and isinstance(value[0], str) else _ids_kind(value)


def _ids_kind(value: Any) -> str:
    """"batch" for a list of lists (of token ids), else "ids" (one prompt's)."""
    return "batch" if isinstance(value, list) and value and isinstance(value[0], list) else "ids"


# A completion's prompt: a string, a list of them, a list of token ids, or a list of such lists.
Prompt = Annotated[Union[Annotated[str, Tag("text")], Annotated[_list(str), Tag("texts")],
                         Annotated[_list(int), Tag("ids")], Annotated[_list(_list(int)), Tag("batch")]],
                   Discriminator(_prompt_kind)]


class _Open(BaseModel):
    """Unknown fields are kept (not dropped) so that ``check_extras`` can refuse them by name."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool | None = None


class JsonSchema(_Open):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _Request(_Open):
    """Fields shared by /v1/completions and /v1/chat/completions, as the API names and types them (null means "not
    given"); ``sampling_params`` maps them."""

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extra
    n: int | None = None
    best_of: int | None = None
    stop: str | _list(str) | None = None
    stop_token_ids: _list(int) | None = None  # vLLM's extra
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # vLLM's extra
    min_tokens: int | None = None  # vLLM's extra
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra
    logit_bias: Annotated[dict[str, float], BeforeValidator(_at_most_max_items)] | None = None
    user: str | None = None  # accepted and ignored
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's extras
    guided_regex: str | None = None
    guided_choice: Annotated[_list(str), BeforeValidator(_at_most_max_choices)] | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: each prompt token's logprob and the top N


class CompletionBody(_Request):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool | None = None


class ToolCallFunction(_Open):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Open):
    role: str
    content: str | _list(dict[str, Any]) | None = None
    name: str | None = None  # accepted; chat templates do not use it
    tool_calls: _list(ToolCall) | None = None  # an assistant's calls, in a history
    tool_call_id: str | None = None  # a tool message's answer to


class ToolFunction(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"]
    function: ToolFunction


class _ChoiceFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: _ChoiceFunction


class ChatBody(_Request):
    messages: _list(ChatMessage)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: _list(Tool) | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class LoadBody(BaseModel):
    lora_name: str
    lora_path: str

    @field_validator("lora_path")
    @classmethod
    def _a_path(cls, path: str) -> str:
        """What the file system could not even look up is a bad value, not a server error: a NUL, a name longer than
        a file name can be, an unknown user's ``~user``."""
        if "\x00" in path or len(path) > 4096 or any(len(part) > 255 for part in path.split("/")):
            raise ValueError("not a path: a NUL character, or more than 4096 characters or 255 in one name")
        try:
            Path(path).expanduser()
        except RuntimeError as e:
            raise ValueError(f"not a path: {e}") from None
        return path


class UnloadBody(BaseModel):
    lora_name: str


def check_extras(model: BaseModel, where: str = "") -> None:
    """400 naming every field lorakit does not know that carries a value (null counts as absent)."""
    extra = {k: v for k, v in (model.model_extra or {}).items() if v is not None}
    for name, value in model:
        if isinstance(value, BaseModel):
            check_extras(value, f"{where}{name}.")
    if extra:
        names = ", ".join(shown(f"{where}{k}") for k in sorted(extra)[:10])
        raise ApiError(400, f"unsupported parameter(s): {names}; lorakit does not implement them (docs/serve.md "
                            f"lists what it supports); remove them", param=f"{where}{sorted(extra)[0]}"[:100])


def chat_messages(body: ChatBody) -> list[dict[str, str]]:
    """The messages as a chat template takes them: known roles only, text content only."""
    if not body.messages:
        raise ApiError(400, "messages is empty; give at least one message", param="messages")
    out = []
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        check_extras(m, f"{where}.")
        if m.role == "function":
            raise ApiError(400, f"{where}.role: 'function' messages are OpenAI's deprecated form; send 'tool' "
                                f"messages (with tool_call_id)", param=f"{where}.role")
        if m.role not in CHAT_ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {shown(m.role)}",
                           param=f"{where}.role")
        if isinstance(m.content, list):
            parts = []
            for j, part in enumerate(m.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"{where}.content[{j}] must be {{'type': 'text', 'text': <string>}} "
                                        f"(lorakit serves text models), got {str(part)[:100]}",
                                   param=f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        elif m.content is None and m.role != "assistant":
            raise ApiError(400, f"{where}.content is missing", param=f"{where}.content")
        else:
            content = m.content or ""
        message = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(400, f"{where}.tool_calls: only assistant messages carry tool calls",
                               param=f"{where}.tool_calls")
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json_value(call.function.arguments)
                except ValueError as e:
                    raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments is not JSON a template can "
                                        f"render: {e}", param=f"{where}.tool_calls[{j}].function.arguments") from None
                # the templates take the arguments as an object (and some want the id)
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            message["tool_calls"] = calls
        if m.role == "tool":
            if not m.tool_call_id:
                raise ApiError(400, f"{where}.tool_call_id is missing: a tool message answers one call",
                               param=f"{where}.tool_call_id")
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def structured_param(body: _Request) -> str | None:
    """The body's field that asks for structured output (a 400 for more than one), None when none does."""
    given = [k for k, v in (("response_format", body.response_format), ("guided_json", body.guided_json),
                            ("guided_regex", body.guided_regex), ("guided_choice", body.guided_choice))
             if v is not None and not (k == "response_format" and v.type == "text")]
    if len(given) > 1:
        raise ApiError(400, f"give at most one of {', '.join(given)}", param=sorted(given)[1])
    return given[0] if given else None


def _structured(body: _Request) -> StructuredOutput | None:
    """The body's structured output, checked for shape (its grammar is checked when the engine compiles it:
    ``ServerState.check_grammar``)."""
    name = structured_param(body)
    if name is None:
        return None
    value = getattr(body, name)
    try:
        if name == "response_format":
            if value.type == "json_object":
                return StructuredOutput.json_schema(True)
            if value.json_schema is None or value.json_schema.schema_ is None:
                raise ApiError(400, "response_format of type 'json_schema' needs json_schema.schema",
                               param="response_format")
            return StructuredOutput.json_schema(value.json_schema.schema_)
        if name == "guided_json":
            return StructuredOutput.json_schema(value)
        if name == "guided_regex":
            return StructuredOutput(regex=value)
        return StructuredOutput(choice=tuple(value))
    except ValueError as e:
        raise ApiError(400, f"{name}: {e}", param=name) from None


def _max_tokens(body: _Request, prompt_len: int, max_seq_len: int, limit: int, default: int | None) -> int:
    """What the request asked for, checked against the context and the server's limit (400s, as vLLM)."""
    asked = [v for v in (body.max_tokens, body.max_completion_tokens) if v is not None]
    if len(set(asked)) > 1:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree; give one", param="max_tokens")
    if not asked:  # the endpoint's default, cut to what fits
        return fit_max_tokens(prompt_len, max_seq_len, default=limit if default is None else default)
    max_tokens = asked[0]
    if max_tokens == 0 and getattr(body, "echo", False):  # the prompt alone, scored: one token run, not shown
        return 0
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}",
                       param="max_tokens")
    if max_tokens > limit:
        raise ApiError(400, f"max_tokens={max_tokens} is above this server's limit of {limit}", param="max_tokens")
    try:
        return fit_max_tokens(prompt_len, max_seq_len, asked=max_tokens)
    except ContextOverflow as e:
        raise ApiError(400, str(e), param="max_tokens") from None


# The body's fields that SamplingParams has under the same name and meaning, passed through as given; the rest are
# mapped below (max_tokens checked against the context, chat's logprobs a flag, logit_bias keyed by strings).
_PASSED = tuple(f.name for f in dataclasses.fields(SamplingParams)
                if f.name in _Request.model_fields and f.name not in ("max_tokens", "logprobs", "logit_bias"))


def sampling_params(body: CompletionBody | ChatBody, *, prompt_len: int, max_seq_len: int, max_tokens_limit: int,
                    default_max_tokens: int | None) -> SamplingParams:
    """The one mapping from an OpenAI body to ``SamplingParams`` (400 for anything out of range or refused).

    ``prompt_len``: the longest prompt's token count. ``default_max_tokens``: when the body gives none (None:
    whatever room the context leaves, up to the server's limit).
    """
    check_extras(body)
    n = samples(body)
    if body.best_of is not None and body.best_of != n:
        raise ApiError(400, f"best_of={body.best_of} (other than n) is not supported", param="best_of")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise ApiError(400, f"top_logprobs must be in [0, 20], got {body.top_logprobs}", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise ApiError(400, f"logprobs must be in [0, 20], got {body.logprobs}", param="logprobs")
        logprobs = body.logprobs
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if token_id(key) is None:
            raise ApiError(400, f"logit_bias keys must be token ids, got {shown(key)}", param="logit_bias")
        bias[token_id(key)] = value
    given = {name: getattr(body, name) for name in _PASSED if getattr(body, name) is not None}
    if not body.stop:  # "" or []: none
        given.pop("stop", None)
    if isinstance(body, CompletionBody) and body.echo and logprobs is not None:  # the echoed prompt's logprobs too
        given["prompt_logprobs"] = max(given.get("prompt_logprobs") or 0, logprobs)
    max_tokens = max(1, _max_tokens(body, prompt_len, max_seq_len, max_tokens_limit, default_max_tokens))
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, logit_bias=bias,
                              structured_output=_structured(body), **given)
    except ValueError as e:
        message = str(e).replace("SamplingParams.", "")
        raise ApiError(400, message, param=message.split(" ", 1)[0]) from None


def token_id(key: str) -> int | None:
    """A logit_bias key as an int: ASCII digits with an optional sign, at most 20 of them (None otherwise: int()
    reads "²" as no number, and refuses 5,000 digits)."""
    return int(key) if re.fullmatch(r"-?[0-9]{1,20}", key) else None


def samples(body: CompletionBody | ChatBody) -> int:
    """The request's ``n``, samples per prompt (400 outside [1, 16])."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {shown(n)}", param="n")
    return n


def nth_sample(params: SamplingParams, k: int) -> SamplingParams:
    """The k-th of n samples of one request: its seed plus k, so that the samples differ and each repeats."""
    if params.seed is None or k == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + k) % 2**63)

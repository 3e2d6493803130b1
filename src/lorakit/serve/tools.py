"""OpenAI tool calling on ``/v1/chat/completions``, for the base model and every adapter alike.

The tools are rendered by the model's own chat template; "required" and a named function constrain the output
(structured output), "auto" parses it with the model family's parser (``PARSERS``). A call is an offered function
with strict-JSON object arguments, else the output is content; parsing is linear and never raises (it runs on the
path that delivers every stream's output). What a client gets, streamed and not: docs/serve.md.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

from lorakit.engine.outputs import FinishReason
from lorakit.engine.structured import StructuredOutput
from lorakit.serve.protocol import (MAX_JSON_DEPTH, ApiError, NamedToolChoice, Tool, deeper_than, json_value, read_json,
                                    shown)

__all__ = ["PARSERS", "NamedToolChoice", "Tool", "ToolCalls", "checked_tools", "parser_for", "stream_deltas",
           "tool_grammar"]

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # the most calls one "required" answer holds with parallel_tool_calls (a bounded grammar)

logger = logging.getLogger("lorakit.serve")


_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def checked_tools(tools: list[Tool] | None, tool_choice) -> tuple[list[dict], str | None, str | None]:
    """(the tools as a chat template takes them, the choice: "none" / "auto" / "required" / "named" or None without
    tools, the named function); a 400 naming what is wrong."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools; give the tools it chooses from", "tool_choice")
        return [], None, None
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    names = []
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not _NAME.fullmatch(name):
            raise ApiError(400, f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got "
                                f"{shown(name)}", f"tools[{i}].function.name")
        if name in names:
            raise ApiError(400, f"tools[{i}].function.name {shown(name)} is given twice", f"tools[{i}].function.name")
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema of an object",
                           f"tools[{i}].function.parameters")
        if parameters is not None and deeper_than(parameters, MAX_JSON_DEPTH):
            raise ApiError(400, f"tools[{i}].function.parameters nests objects and lists more than {MAX_JSON_DEPTH} "
                                f"deep; flatten it, or name its parts in $defs", f"tools[{i}].function.parameters")
        names.append(name)
    named = None
    if isinstance(tool_choice, NamedToolChoice):
        named = tool_choice.function.name
        if named not in names:
            raise ApiError(400, f"tool_choice names {shown(named)}, which is not among the tools ({', '.join(names)})",
                           "tool_choice")
        choice = "named"
    elif tool_choice is None:
        choice = "auto"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    else:
        raise ApiError(400, f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                            f"{{'name': ...}}}}, got {shown(tool_choice)}", "tool_choice")
    return [t.model_dump(exclude_none=True) for t in tools], choice, named


def _arguments_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def tool_grammar(tools: list[dict], choice: str, named: str | None, parallel: bool) -> StructuredOutput | None:
    """The structured output that enforces ``choice`` ("required" or "named"); None for "auto" and "none". For
    "required", each tool's schema sits in the wrapper's ``$defs`` under its name, its local refs moved with it."""
    if choice == "named":
        tool = next(t for t in tools if t["function"]["name"] == named)
        return StructuredOutput.json_schema(_arguments_schema(tool))
    if choice != "required":
        return None
    names = [t["function"]["name"] for t in tools]
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{name}"}},
              "required": ["name", "arguments"], "additionalProperties": False} for name in names]
    return StructuredOutput.json_schema({
        "$defs": {name: _moved(_arguments_schema(t), f"#/$defs/{name}") for name, t in zip(names, tools)},
        "type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls}})


# The keywords whose value is a schema or a list of schemas, and those whose value maps names to schemas.
_SUBSCHEMAS = {"items", "prefixItems", "additionalItems", "additionalProperties", "unevaluatedItems",
               "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "contains",
               "propertyNames", "contentSchema"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}


def _moved(schema: dict, base: str) -> dict:
    """``schema`` for a place under another document's ``base`` ("#/$defs/NAME"): each local JSON-pointer ref ("#",
    "#/$defs/node") prefixed with it, so that each resolves as in the schema's own document. Its subschemas are
    copied (the tool's own schema is left as it was); one with an ``$id`` (other than draft 7's "#anchor") is a
    resource of its own, whose refs resolve against it: it is kept as it is."""
    if _resource(schema):
        return schema
    moved = dict(schema)
    stack = [moved]
    while stack:
        node = stack.pop()
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = base + ref[1:]
        for key in node.keys() & _SUBSCHEMAS:
            value = node[key]
            node[key] = [_queued(v, stack) for v in value] if isinstance(value, list) else _queued(value, stack)
        for key in node.keys() & _SCHEMA_MAPS:
            if isinstance(node[key], dict):
                node[key] = {name: _queued(v, stack) for name, v in node[key].items()}
    return moved


def _queued(subschema: Any, stack: list[dict]) -> Any:
    """A copy of a subschema, pushed on ``stack`` to be moved; a boolean schema or a resource of its own as it is."""
    if not isinstance(subschema, dict) or _resource(subschema):
        return subschema
    copy = dict(subschema)
    stack.append(copy)
    return copy


def _resource(schema: dict) -> bool:
    return isinstance(schema.get("$id"), str) and not schema["$id"].startswith("#")


# The parsers of "auto": text -> (content, [(name, arguments dict)]). Each finds its family's calls and leaves the
# rest as content; text that holds no call, or a call that does not parse, is content whole. Each is linear in the
# text: str.find and JSON decoding, no backtracking pattern, no recursion (read_json bounds the depth).
Call = tuple[str, dict]
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BETWEEN_CALLS = re.compile(r"[ \t\n\r;]*")


def _hermes(text: str) -> tuple[str, list[Call]]:
    """Hermes / Qwen 2.5+: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number; the last one's
    closing tag may be missing (the model stopped after the JSON)."""
    calls, content, at = [], [], 0
    while (start := text.find(_OPEN, at)) >= 0:
        end = text.find(_CLOSE, start)
        end = len(text) if end < 0 else end
        call = _call(text[start + len(_OPEN):end])
        if call is None:
            return text, []
        calls.append(call)
        content.append(text[at:start])
        at = end + len(_CLOSE)
    content.append(text[at:])
    return ("".join(content).strip(), calls) if calls else (text, [])


def _llama3_json(text: str) -> tuple[str, list[Call]]:
    """Llama 3.1+: the whole answer a JSON call ``{"name": ..., "parameters": {...}}`` (after an optional
    ``<|python_tag|>``), several separated by ";" (outside their strings)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls, at = [], 0
    while at < len(body):
        try:
            item, at = read_json(body, at)
        except ValueError:
            return text, []
        call, gap = _call(item), _BETWEEN_CALLS.match(body, at).end()
        if call is None or (gap < len(body) and ";" not in body[at:gap]):
            return text, []
        calls.append(call)
        at = gap
    return "", calls


def _mistral(text: str) -> tuple[str, list[Call]]:
    """Mistral: ``[TOOL_CALLS]`` and a JSON array of calls; the text before it is content."""
    head, sep, tail = text.partition("[TOOL_CALLS]")
    if not sep:
        return text, []
    items = _json(tail)
    calls = [_call(item) for item in (items if isinstance(items, list) else [items])]
    return (head.strip(), calls) if calls and None not in calls else (text, [])


def _json(text: str) -> Any:
    """``text`` as strict JSON within bounds (``protocol.json_value``); None when it is not."""
    try:
        return json_value(text)
    except ValueError:
        return None


def _call(item: Any) -> Call | None:
    """(name, arguments) of one call: a JSON object (or its text) with a string "name" and an object of "arguments"
    or "parameters" (or its JSON text); None for anything else."""
    if isinstance(item, str):
        item = _json(item)
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json(arguments)
    return (item["name"], arguments) if isinstance(arguments, dict) else None


PARSERS: dict[str, Callable[[str], tuple[str, list[Call]]]] = {
    "hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}


def parser_for(template: str, chosen: str | None = None) -> str:
    """The parser for a chat template: ``chosen`` (``--tool-call-parser``) when given, else the family its template
    speaks (Hermes and Qwen's ``<tool_call>``, Mistral's ``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>`` / ipython);
    Hermes when it says nothing of them."""
    if chosen and chosen != "auto":
        return chosen
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


class ToolCalls:
    """One request's tools: how each choice's output becomes its message or stream (see the module docstring)."""

    def __init__(self, tools: list[dict], choice: str, named: str | None, parser: str):
        self.tools, self.choice, self.named, self.parse = tools, choice, named, PARSERS[parser]
        self.names = {t["function"]["name"] for t in tools}

    @property
    def active(self) -> bool:
        """Whether the output may hold calls (anything but "none")."""
        return self.choice != "none"

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """(content or None, OpenAI's tool_calls) of a whole output. Calls are only of offered functions, with
        arguments a JSON object; an output with any other call is content whole. Never raises: a parser's error
        (a bug) is logged and the output is content."""
        try:
            content, calls = self._parsed(text)
        except Exception:  # noqa: BLE001 - on the path that delivers every stream's output: logged, never raised
            logger.exception("the %s tool-call parser failed on an output of %d characters; it is sent as content",
                             self.choice, len(text))
            content, calls = text, []
        if any(name not in self.names for name, _ in calls):
            content, calls = text, []
        return content or None, _openai_calls(calls)

    def answer(self, text: str, finish_reason: FinishReason | None) -> tuple[str | None, list[dict], str | None]:
        """(content or None, tool_calls, finish_reason) of a finished output: ``split``'s, but an output that
        "required" or a named function held to calls and ``max_tokens`` cut (LENGTH) keeps the calls begun so far
        whose name is known (``begun``): content None, finish_reason LENGTH."""
        content, calls = self.split(text)
        if calls or finish_reason != FinishReason.LENGTH or self.choice not in ("named", "required"):
            return content, calls, self.finish(calls, finish_reason)
        begun = self.begun(text)
        return (None, begun, FinishReason.LENGTH) if begun else (content, calls, finish_reason)

    def begun(self, text: str) -> list[dict]:
        """OpenAI's tool_calls of an enforced output cut short: for a named function, the call with the text as its
        arguments; for "required", each whole call of the array and then the cut one once its name is read, with
        the rest as its arguments (partial JSON, as generated). [] when there is none, or for a function not
        offered. Linear in the text; never raises (a bug is logged and gives [])."""
        try:
            calls = [(self.named, text)] if self.choice == "named" else _begun_array(text)
        except Exception:  # noqa: BLE001 - on the path that delivers every stream's output: logged, never raised
            logger.exception("reading the calls of a cut output of %d characters failed; it is sent as content",
                             len(text))
            return []
        return _openai_calls(calls) if all(name in self.names for name, _ in calls) else []

    def _parsed(self, text: str) -> tuple[str, list[Call]]:
        if self.choice == "named":
            arguments = _json(text)
            return ("", [(self.named, arguments)]) if isinstance(arguments, dict) else (text, [])
        if self.choice == "required":
            items = _json(text)
            calls = [_call(item) for item in items] if isinstance(items, list) else []
            return ("", calls) if calls and None not in calls else (text, [])
        return self.parse(text)

    @staticmethod
    def finish(calls: list[dict], finish_reason: FinishReason | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" (OpenAI's alone, not the engine's) for a finished answer that holds
        calls."""
        return "tool_calls" if calls and finish_reason in (FinishReason.STOP, FinishReason.LENGTH) else finish_reason


def _openai_calls(calls: list[tuple[str, dict | str]]) -> list[dict]:
    """OpenAI's tool_calls of (name, arguments): an object as JSON text, a string (a cut call's) as it is."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else
                          json.dumps(arguments, ensure_ascii=False)}} for name, arguments in calls]


_ARRAY_OPEN = re.compile(r"[ \t\n\r]*\[")
_ITEM_GAP = re.compile(r"[ \t\n\r]*,?")
_NAME_KEY = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"name"[ \t\n\r]*:')
_ARGUMENTS_KEY = re.compile(r'[ \t\n\r]*,[ \t\n\r]*"arguments"[ \t\n\r]*:[ \t\n\r]*')


def _begun_array(text: str) -> list[tuple[str, dict | str]]:
    """The calls of a "required" array cut short: its whole items (name, arguments), then the cut item's (name, the
    text after its "arguments" key, if any) once its name is whole; [] if a whole item is not a call."""
    head = _ARRAY_OPEN.match(text)
    if head is None:
        return []
    calls, at = [], head.end()
    while True:
        try:
            item, end = read_json(text, at)
        except ValueError:
            break
        call = _call(item)
        if call is None:
            return []
        calls.append(call)
        at = _ITEM_GAP.match(text, end).end()
    key = _NAME_KEY.match(text, at)
    if key is not None:
        try:
            name, end = read_json(text, key.end())
        except ValueError:
            return calls
        arguments = _ARGUMENTS_KEY.match(text, end)
        if isinstance(name, str):
            calls.append((name, "" if arguments is None else text[arguments.end():]))
    return calls


def stream_deltas(content: str | None, calls: list[dict]) -> list[dict]:
    """A finished choice's deltas, as OpenAI streams them: its content, then each call's index, id and name (empty
    arguments), then its arguments."""
    deltas = [{"content": content}] if content else []
    for i, call in enumerate(calls):
        deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
    return deltas

"""OpenAI tool calling on ``/v1/chat/completions``, for the base model and every adapter alike.

The tools are rendered by the model's own chat template (``apply_chat_template(tools=...)``); a template that
does not mention them cannot render them, and a request with tools is refused by name. What the model answers:

- ``tool_choice: "required"`` or a named function: the output is constrained by the structured-output machinery,
  so a call always parses whatever the model (random weights included): for "required" a JSON array of
  ``{"name": ..., "arguments": {...}}`` whose arguments match that tool's JSON schema (at most one item unless
  ``parallel_tool_calls``), for a named function the arguments object itself.
- ``"auto"`` (the default with tools): the output is free and parsed by the parser of the model's family
  (``PARSERS``, chosen from the chat template, or ``--tool-call-parser``); text that is not a call stays content.
- ``"none"``: the tools are rendered, the output is content.

A call comes back as OpenAI gives it: ``message.tool_calls`` (``id``, ``type: "function"``, ``function.name`` and
``function.arguments`` as a JSON string), ``finish_reason: "tool_calls"``; streamed, a choice's output is held until
it ends and then sent as ``delta.tool_calls`` (each call's index, id and name first, then its arguments) after any
content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable

from lorakit.engine.structured import StructuredOutput
from lorakit.serve.protocol import ApiError, NamedToolChoice, Tool, shown

__all__ = ["PARSERS", "NamedToolChoice", "Tool", "ToolCalls", "checked_tools", "parser_for", "stream_deltas",
           "tool_grammar"]

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # the most calls one "required" answer holds with parallel_tool_calls (a bounded grammar)


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
    """The structured output that enforces ``choice`` ("required" or "named"); None for "auto" and "none"."""
    if choice == "named":
        tool = next(t for t in tools if t["function"]["name"] == named)
        return StructuredOutput.json_schema(_arguments_schema(tool))
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": _arguments_schema(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return StructuredOutput.json_schema({"type": "array", "minItems": 1,
                                         "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
                                         "items": calls[0] if len(calls) == 1 else {"anyOf": calls}})


# The parsers of "auto": text -> (content, [(name, arguments dict)]). Each finds its family's calls and leaves the
# rest as content; text that holds no call, or a call that does not parse, is content whole.

def _hermes(text: str) -> tuple[str, list[tuple[str, dict]]]:
    """Hermes / Qwen 2.5+: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number."""
    calls, spans = [], []
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL):
        call = _call(m.group(1))
        if call is None:
            return text, []
        calls.append(call)
        spans.append(m.span())
    content = text
    for start, end in reversed(spans):
        content = content[:start] + content[end:]
    return content.strip() if calls else text, calls


def _llama3_json(text: str) -> tuple[str, list[tuple[str, dict]]]:
    """Llama 3.1+: the whole answer a JSON call ``{"name": ..., "parameters": {...}}`` (after an optional
    ``<|python_tag|>``), several separated by ";"."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(part) for part in body.split(";") if part.strip()]
    return ("", calls) if calls and all(c is not None for c in calls) else (text, [])


def _mistral(text: str) -> tuple[str, list[tuple[str, dict]]]:
    """Mistral: ``[TOOL_CALLS]`` and a JSON array of calls; the text before it is content."""
    head, sep, tail = text.partition("[TOOL_CALLS]")
    if not sep:
        return text, []
    try:
        items = json.loads(tail.strip())
    except ValueError:
        return text, []
    calls = [_call(item) for item in (items if isinstance(items, list) else [items])]
    return (head.strip(), calls) if calls and all(c is not None for c in calls) else (text, [])


def _call(item) -> tuple[str, dict] | None:
    """(name, arguments) of one call: a JSON object (or its text) with "name" and "arguments" or "parameters"."""
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except ValueError:
            return None
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return (item["name"], arguments) if isinstance(arguments, dict) else None


PARSERS: dict[str, Callable[[str], tuple[str, list[tuple[str, dict]]]]] = {
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

    @property
    def active(self) -> bool:
        """Whether the output may hold calls (anything but "none")."""
        return self.choice != "none"

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """(content or None, OpenAI's tool_calls) of a whole output."""
        calls: list[tuple[str, dict]] = []
        content: str | None = text
        if self.choice == "named":
            try:
                arguments = json.loads(text)
                calls, content = [(self.named, arguments)], None
            except ValueError:
                pass
        elif self.choice == "required":
            try:
                items = json.loads(text)
                parsed = [_call(item) for item in items] if isinstance(items, list) else []
                if parsed and all(c is not None for c in parsed):
                    calls, content = parsed, None
            except ValueError:
                pass
        else:
            content, calls = self.parse(text)
            content = content or None
        return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                         for name, arguments in calls]

    @staticmethod
    def finish(calls: list[dict], finish_reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" for a finished answer that holds calls."""
        return "tool_calls" if calls and finish_reason in ("stop", "length") else finish_reason


def stream_deltas(content: str | None, calls: list[dict]) -> list[dict]:
    """A finished choice's deltas, as OpenAI streams them: its content, then each call's index, id and name (empty
    arguments), then its arguments."""
    deltas = [{"content": content}] if content else []
    for i, call in enumerate(calls):
        deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
    return deltas

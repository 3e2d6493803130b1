"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, by the tokenizer of
the model a request names (an adapter's own, with the tokens it adds, where its folder has one; the base model's when
``model`` is absent). Their bodies and handlers, plain functions of (body, ServerState), as openai.py's are.

``/tokenize`` refuses text past ``--max-prompt-chars`` before tokenizing it, but not a text longer than the context:
its answer's ``count`` and ``max_model_len`` let a client see that (lm-evaluation-harness tokenizes whole documents and
cuts them into windows itself). A chat is rendered and checked as ``/v1/chat/completions`` renders it.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from lorakit.frontend.client import Adapter
from lorakit.serve.protocol import ApiError, ChatMessage, Tool, _list, _Open, chat_messages, check_extras
from lorakit.serve.state import INLINE_SIZE, ServerState
from lorakit.serve.tools import checked_tools

__all__ = ["DetokenizeBody", "TokenizeBody", "detokenize", "tokenize", "tokenizer_info"]

# tokenizer_config.json's keys that name files on the server, not how the tokenizer works: left out of the info
_PATH_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only")


class TokenizeBody(_Open):
    """``/tokenize``'s two forms, as vLLM's: a text ``prompt`` (``add_special_tokens`` by default, as a completion's
    prompt gets them: a BOS), or chat ``messages`` (and ``tools``) through the chat template, as a chat completion
    renders them (with the generation prompt, the template's own special tokens and no others)."""

    model: str | None = None
    prompt: str | None = None
    messages: _list(ChatMessage) | None = None
    tools: _list(Tool) | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # the text form's default: true; the chat form's: false
    return_token_strs: bool | None = False


class DetokenizeBody(_Open):
    model: str | None = None
    tokens: _list(int)


async def tokenize(body: TokenizeBody, state: ServerState) -> dict:
    """POST /tokenize: {count, max_model_len, tokens, token_strs} (token_strs null unless ``return_token_strs``)."""
    check_extras(body)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give either prompt (text) or messages (a chat) to tokenize, not "
                            f"{'both' if body.prompt is not None else 'neither'}", "prompt")
    adapter = state.adapter_of(body.model)
    tokenizer = _tokenizer(state, adapter)
    if body.messages is not None:
        ids = await _chat_ids(body, state, adapter)
    else:
        if body.tools is not None:
            raise ApiError(400, "tools are rendered with chat messages only; send messages, or drop tools", "tools")
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await _text_ids(body.prompt, special, tokenizer, state)
    strs = None
    if body.return_token_strs:
        strs = await _inline_or_off(state, len(ids), tokenizer.convert_ids_to_tokens, ids)
    return {"count": len(ids), "max_model_len": state.engine.max_seq_len, "tokens": ids, "token_strs": strs}


async def detokenize(body: DetokenizeBody, state: ServerState) -> dict:
    """POST /detokenize: {prompt}, the text of ``tokens`` (special tokens kept), which must be in the model's
    vocabulary (and the tokens its adapter adds)."""
    check_extras(body)
    adapter = state.adapter_of(body.model)
    tokenizer = _tokenizer(state, adapter)
    added = frozenset() if adapter is None else adapter.added
    vocab = state.engine.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab and t not in added]
    if bad:
        whose = " and the tokens its adapter adds" if added else ""
        raise ApiError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {vocab}){whose}; send ids that "
                            f"/tokenize gave for this model", "tokens")
    return {"prompt": await _inline_or_off(state, len(body.tokens), tokenizer.decode, body.tokens)}


async def tokenizer_info(model: str | None, state: ServerState) -> dict:
    """GET /tokenizer_info: the tokenizer's config (tokenizer_config.json's settings, special tokens as their text, no
    file paths), its ``tokenizer_class``, ``chat_template`` where it has one, and always ``eos_token``,
    ``bos_token`` and ``pad_token`` (null when it has none); ``model``, a query parameter, picks an adapter's."""
    tokenizer = _tokenizer(state, state.adapter_of(model))
    return await state.off_loop(_info, tokenizer)  # a tokenizer may carry thousands of added tokens


def _tokenizer(state: ServerState, adapter: Adapter | None):
    tokenizer = state.tokenizer(adapter)
    if tokenizer is None:
        raise ApiError(400, "this server's engine has no tokenizer; give `lorakit serve` a model folder with one, "
                            "or tokenize on the client", "model")
    return tokenizer


async def _text_ids(text: str, special: bool, tokenizer, state: ServerState) -> list[int]:
    """``text``'s ids as a completion's prompt gets them (``tokenizer.encode``), within ``max_prompt_chars``."""
    if len(text) > state.max_prompt_chars:
        raise ApiError(400, f"prompt has {len(text)} characters; this server tokenizes at most "
                            f"{state.max_prompt_chars} (--max-prompt-chars); shorten it", "prompt")
    return await _inline_or_off(state, len(text), lambda: list(tokenizer.encode(text, add_special_tokens=special)))


async def _chat_ids(body: TokenizeBody, state: ServerState, adapter: Adapter | None) -> list[int]:
    """The chat's ids, by ``ServerState.chat_ids``: it renders with the generation prompt and adds no special
    tokens, so the other settings are refused rather than ignored."""
    if body.continue_final_message or not body.add_generation_prompt:
        param = "continue_final_message" if body.continue_final_message else "add_generation_prompt"
        raise ApiError(400, f"{param}: lorakit renders a chat with the generation prompt, as a chat completion does; "
                            f"send add_generation_prompt true and continue_final_message false, or tokenize the text "
                            f"you rendered with the text form ({{\"prompt\": ...}})", param)
    if body.add_special_tokens:
        raise ApiError(400, "add_special_tokens: a chat prompt holds the special tokens its template writes and no "
                            "others, as a chat completion's does; send add_special_tokens false",
                       "add_special_tokens")
    tools, _, _ = checked_tools(body.tools, None)
    return await state.chat_ids(chat_messages(body), adapter, tools or None)


async def _inline_or_off(state: ServerState, size: int, fn, *args):
    """fn(*args) on the event loop when ``size`` (characters or ids) is at most INLINE_SIZE, as a completion's
    prompt is tokenized; else on the tokenizing thread."""
    return fn(*args) if size <= INLINE_SIZE else await state.off_loop(fn, *args)


def _info(tokenizer) -> dict:
    info = {k: _plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in _PATH_KEYS}
    info = {k: v for k, v in info.items() if v is not _DROP}
    for name in ("eos_token", "bos_token", "pad_token"):  # lm-eval's remote tokenizer reads these
        info[name] = _plain(getattr(tokenizer, name, None))
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        info["chat_template"] = _plain(template)  # a string, or a dict of named templates
    info["tokenizer_class"] = type(tokenizer).__name__
    return info


_DROP = object()  # a value JSON cannot carry (a tokenizer object passed at construction)


def _plain(value: Any) -> Any:
    """``value`` as JSON carries it: an AddedToken (of tokenizers or transformers) as its text, dict keys as strings;
    _DROP for anything else."""
    if isinstance(getattr(value, "content", None), str):
        return value.content
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        items = ((str(k), _plain(v)) for k, v in value.items())
        return {k: v for k, v in items if v is not _DROP}
    if isinstance(value, (list, tuple)):
        return [v for v in map(_plain, value) if v is not _DROP]
    return _DROP


# Routes: app.py binds them to their paths.

async def tokenize_route(body: TokenizeBody, request: Request):
    return await tokenize(body, request.app.state.server)


async def detokenize_route(body: DetokenizeBody, request: Request):
    return await detokenize(body, request.app.state.server)


async def tokenizer_info_route(request: Request, model: str | None = None):
    return await tokenizer_info(model, request.app.state.server)

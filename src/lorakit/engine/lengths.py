"""How many tokens a request may generate under the context: one rule, for every route and for the engine.

A ``max_tokens`` a client asked for that does not fit after its prompt is refused, naming the numbers (every HTTP
route answers 400 with this message). A default (nothing asked) is cut to what fits; the engine reads the
``max_tokens`` of the ``SamplingParams`` it is given as such a default. A prompt that leaves no room at all is
refused before this, by ``check_prompt``.
"""

from __future__ import annotations

import dataclasses

from lorakit.engine.sampling import SamplingParams

__all__ = ["ContextOverflow", "fit_max_tokens", "fit_params"]


class ContextOverflow(ValueError):
    """An asked ``max_tokens`` that does not fit in the context after the prompt."""


def fit_max_tokens(prompt_len: int, max_seq_len: int, *, asked: int | None = None, default: int | None = None,
                   name: str = "max_tokens") -> int:
    """The output tokens a request gets: ``asked`` if it fits (else ``ContextOverflow``, calling it ``name`` as the
    client did), or ``default`` cut to the room the prompt leaves (None: all of it); at least 1."""
    room = max_seq_len - prompt_len
    if asked is None:
        return max(1, room if default is None else min(default, room))
    if asked > room:
        raise ContextOverflow(f"this model's context is {max_seq_len} tokens, but {prompt_len + asked} were asked "
                              f"for ({prompt_len} in the prompt, {asked} for the output); shorten the prompt or lower "
                              f"{name}")
    return asked


def fit_params(params: SamplingParams, prompt_len: int, max_seq_len: int) -> SamplingParams:
    """``params`` with max_tokens (and min_tokens) cut to what fits in the context after the prompt (the engine's
    reading: its max_tokens is a default)."""
    max_tokens = fit_max_tokens(prompt_len, max_seq_len, default=params.max_tokens)
    if max_tokens == params.max_tokens:
        return params
    return dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))

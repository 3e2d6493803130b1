"""What a request must pass before it is queued: its prompt and logit bias inside its vocabulary, and where an
activated LoRA starts to apply. Plain functions of the request and the engine's facts: a server checks with them too.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lorakit.engine.sampling import SamplingParams
from lorakit.peft import activation_start

__all__ = ["NOT_INVOKED", "check_logit_bias", "check_prompt", "lora_start"]

# Request.lora_start of an activated LoRA's request whose prompt lacks the invocation: past every position, so the
# adapter never applies (its slot is held all the same).
NOT_INVOKED = sys.maxsize


def check_prompt(prompt: str | Sequence[int], tokenizer, vocab_size: int, added: frozenset[int], max_seq_len: int,
                 adapter: str | None = None) -> list[int]:
    """A prompt's token ids (text: by ``tokenizer``), checked: not empty, in the vocabulary (``vocab_size`` plus the
    ``added`` tokens of ``adapter``), leaving room under ``max_seq_len``; ValueError naming the problem."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("a prompt must be a string or a list of int token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size and t not in added]
    if bad:
        whose = f" and the {len(added)} tokens adapter {adapter!r} adds" if added else ""
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}){whose}; "
                         f"a token another adapter adds is not in this request's vocabulary")
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    if len(ids) >= max_seq_len:
        raise ValueError(f"the prompt has {len(ids)} tokens; at most {max_seq_len - 1} fit "
                         f"(max_seq_len={max_seq_len}); shorten it")
    return ids


def check_logit_bias(params: SamplingParams, vocab_size: int, added: frozenset[int]) -> None:
    """ValueError if a logit_bias token id is outside the request's vocabulary (``vocab_size`` plus ``added``)."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size and t not in added]
    if bad:
        raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def lora_start(prompt_ids: list[int], info) -> int:
    """The first position an activated LoRA applies to: where its invocation last starts in the prompt, or
    ``NOT_INVOKED`` (never: PEFT runs the base model throughout) when the prompt lacks it; 0 for other adapters."""
    invocation = None if info is None else info.invocation_tokens
    if invocation is None:
        return 0
    start = activation_start(prompt_ids, invocation)
    return NOT_INVOKED if start is None else start

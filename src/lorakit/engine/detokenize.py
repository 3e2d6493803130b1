"""Incremental detokenization with stop strings: one request's tokens in, safe-to-show text deltas out.

Text is emitted only once it is final: a character whose bytes are not all decoded yet, and any tail of the
text that could still become a stop string, are held back until they complete or can no longer match.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

from lorakit.engine.finish import FinishReason
from lorakit.engine.sampling import SamplingParams

__all__ = ["IncrementalDetokenizer", "rust_tokenizer"]

# Prompt tokens decoded ahead of the output, so tokenizers that render a token by its left neighbour
# (SentencePiece's leading space) give the output's first token its in-context text (as vLLM does).
_PROMPT_CONTEXT = 5
# A UTF-8 character has at most 4 bytes and a token at least one: a character that began more than 3 tokens ago
# and is still not complete never will be (its "\ufffd" is final). Once this many tokens wait behind a "\ufffd",
# the window moves past all but the last few, so the cost of a token never grows with the output.
_MAX_PENDING = 8
_UTF8_TOKENS = 4


class IncrementalDetokenizer:
    """Decodes one request's generated tokens as they come and finds its stop strings.

    ``append(token_id, finish_reason)`` takes the next token and the engine's finish for it (``token_finish``:
    STOP for a stop token, LENGTH at max_tokens, None while it runs) and returns the text that became final
    with it and the request's ``FinishReason``: the engine's, or STOP for a ``params.stop`` string. A stop token is
    kept in ``token_ids`` but its text is not emitted; a stop string and everything after it are dropped. Stop
    strings are looked for from token ``params.min_tokens`` on. On finishing, all held-back text not cut by a stop
    string is emitted, an incomplete character as "\\ufffd". ``tokenizer`` None: no text, no stop strings.

    Decoding follows vLLM: ``tokenizer.decode(ids, skip_special_tokens=True)`` of a short window of recent
    tokens, diffed against the decode of the window without the newest ones; the window moves on once its
    text no longer ends in "\\ufffd", and until then the text before the trailing "\\ufffd" is already final.
    Bytes that never become a character (tokens that each end in an incomplete sequence, say) would keep the
    window from moving; after ``_MAX_PENDING`` such tokens it moves to a cut that splits no character, and the
    "\\ufffd" before it are emitted as final (as ``decode`` of the whole output shows them). Each token costs a
    bounded number of decodes of a bounded window, whatever the bytes.

    A transformers fast tokenizer that cleans up no spaces decodes in one call a token instead: the tokenizers
    library's streaming decoder (``DecodeStream``, the same diff of two decodes, in Rust: 0.5 us a token against
    about 4 for the two decodes from Python). Where it is not sure (text still waiting on a character's bytes past
    ``_MAX_PENDING`` tokens, a finish while it waits, or an error), the request goes on by the decodes above from
    the tokens it had not turned into text yet, with the same context: the text is the same either way.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self._decode = _decoder(tokenizer) if tokenizer is not None else None
        self._params = params
        self._ids: list[int] = []
        self._window = list(prompt_ids[-_PROMPT_CONTEXT:])  # tokens from the decode window's start on
        self._read = len(self._window)  # window[:read] is already in self._decoded
        self._taken = 0  # characters of window[read:]'s text already in self._decoded
        self._decoded = ""  # final text of the output so far (incomplete characters excluded)
        self._emitted = 0  # self._decoded[:emitted] has been returned
        self._finish_reason: FinishReason | None = None
        # The streaming decoder, while it is used: (the Rust tokenizer, its DecodeStream); the window then holds the
        # last _PROMPT_CONTEXT tokens turned into text and, from read on, those it has not turned into text yet.
        self._stream = _stream_decoder(tokenizer, self._window)

    @property
    def text(self) -> str:
        """All text emitted so far; never a stop string nor anything after one."""
        return self._decoded[: self._emitted]

    @property
    def token_ids(self) -> list[int]:
        """All generated tokens, a final stop token included."""
        return list(self._ids)

    @property
    def finish_reason(self) -> FinishReason | None:
        """STOP, LENGTH, or None while the request runs."""
        return self._finish_reason

    def append(self, token_id: int, finish_reason: FinishReason | None = None) -> tuple[str, FinishReason | None]:
        """Add the next generated token and the engine's finish for it; return (text delta safe to emit now, finish
        reason or None)."""
        if self._finish_reason is not None:
            raise RuntimeError(
                f"IncrementalDetokenizer.append({token_id}) after the request finished "
                f"({str(self._finish_reason)!r}); start a new detokenizer for a new request"
            )
        self._ids.append(token_id)
        reason = finish_reason
        if self._decode is None:
            self._finish_reason = reason
            return "", reason
        if reason != FinishReason.STOP:  # a stop token's text is never shown
            self._window.append(token_id)
            if self._stream is not None:
                self._decoded += self._stream_new(token_id)
        if self._stream is None or (reason is not None and self._read < len(self._window)):
            self._stream = None  # a finish flushes what the stream still waits on, by the decodes
            self._decoded += self._decode_new(flush=reason is not None)
        end = len(self._decoded)
        if self._params.stop and len(self._ids) >= self._params.min_tokens:
            cut = self._find_stop_string()
            if cut is not None:
                end, reason = cut, FinishReason.STOP
                self._decoded = self._decoded[:cut]
        if reason is None and self._params.stop:
            end -= self._stop_prefix_len()
        delta = self._decoded[self._emitted : end]
        self._emitted = end
        self._finish_reason = reason
        return delta, reason

    def _stream_new(self, token_id: int) -> str:
        """The text the streaming decoder makes final with ``token_id`` (just appended to the window); it gives way
        to the decodes (``_stream`` None, the window as they need it) when it waits too long or fails."""
        rust, stream = self._stream
        try:
            text = stream.step(rust, token_id)
        except Exception:  # noqa: BLE001 - its prefix check failed (a decoder that is not byte-wise): decode instead
            text = None
            self._stream = None
        window = self._window
        if text is not None:
            if len(window) > 4 * _PROMPT_CONTEXT:
                del window[: len(window) - _PROMPT_CONTEXT]
            self._read, text, self._taken = len(window), text[self._taken:], 0
            return text
        if self._stream is None or len(window) - self._read > _MAX_PENDING:
            self._stream = None
            return ""
        # It waits on a character's bytes: the text before that character is final already (decoded, rarely).
        prefix = self._decode(window[: self._read])
        ready = self._decode(window)[len(prefix):].rstrip("\ufffd")
        delta, self._taken = ready[self._taken:], max(self._taken, len(ready))
        return delta

    def _decode_new(self, flush: bool) -> str:
        """Text the newest tokens add, up to an incomplete last character (all of it when flushing)."""
        prefix_text = self._decode(self._window[: self._read])
        full_text = self._decode(self._window)
        complete = not full_text.endswith("\ufffd")
        new_text = full_text[len(prefix_text) :]
        ready = new_text if complete or flush else new_text.rstrip("\ufffd")
        delta = ready[self._taken :]
        if complete and len(full_text) > len(prefix_text):
            del self._window[: self._read]
            self._read, self._taken = len(self._window), 0
            return delta
        self._taken = max(self._taken, len(ready))
        if len(self._window) - self._read > _MAX_PENDING:
            delta += self._move_past_final(prefix_text, full_text)
        return delta

    def _move_past_final(self, prefix_text: str, full_text: str) -> str:
        """Move the window's start to a cut ``k`` at least ``_UTF8_TOKENS`` tokens back whose text is a prefix of
        the window's (no character spans the cut, so any "\\ufffd" before it is final); return the text before
        the cut not taken yet."""
        window, read = self._window, self._read
        for k in range(len(window) - _UTF8_TOKENS, read, -1):
            head = self._decode(window[:k])
            if len(head) > len(prefix_text) and full_text.startswith(head):
                break
        else:  # no clean cut (a decoder that is not byte-wise): wait, unless the window keeps growing
            if len(window) - read <= 8 * _MAX_PENDING:
                return ""
            k = len(window) - _UTF8_TOKENS
            head = self._decode(window[:k])
        final = head[len(prefix_text):]
        delta = final[self._taken:]
        self._taken = max(0, self._taken - len(final))
        keep = min(k, _PROMPT_CONTEXT)  # tokens before the cut, decoded as context from now on
        del window[: k - keep]
        self._read = keep
        return delta

    def _find_stop_string(self) -> int | None:
        """Start of the earliest stop string in the unemitted text, or None."""
        starts = [i for s in self._params.stop if (i := self._decoded.find(s, self._emitted)) >= 0]
        return min(starts, default=None)

    def _stop_prefix_len(self) -> int:
        """Length of the longest unemitted suffix of the text that is a proper prefix of a stop string."""
        tail = self._decoded[self._emitted :]
        lengths = (j for s in self._params.stop for j in range(1, min(len(s), len(tail) + 1)) if tail.endswith(s[:j]))
        return max(lengths, default=0)


def rust_tokenizer(tokenizer):
    """The tokenizers library's ``Tokenizer`` behind a transformers fast tokenizer (None for any other): what its
    ``decode`` and ``__call__`` call, without the Python around them."""
    rust = getattr(tokenizer, "_tokenizer", None)
    if isinstance(tokenizer, PreTrainedTokenizerBase) and rust is not None and hasattr(rust, "encode"):
        return rust
    return None


def _stream_decoder(tokenizer, context: list[int]):
    """(the Rust tokenizer, a ``DecodeStream`` primed with ``context``) for a transformers fast tokenizer whose
    ``decode`` is the Rust one's (no clean-up of spaces), else None."""
    rust = rust_tokenizer(tokenizer)
    if DecodeStream is None or rust is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        return rust, DecodeStream(ids=list(context), skip_special_tokens=True)
    except TypeError:  # tokenizers < 0.22: no priming with a context
        return None


def _decoder(tokenizer):
    """``tokenizer.decode(ids, skip_special_tokens=True)`` for a list of ints. A transformers tokenizer's ``decode``
    converts its argument first (``to_py_obj``: a Python pass over every id, costlier than the decoding itself) and
    then calls ``_decode``; the ids here are a list of ints already, so ``_decode`` is called directly."""
    if isinstance(tokenizer, PreTrainedTokenizerBase) and hasattr(tokenizer, "_decode"):
        decode = tokenizer._decode
        return lambda ids: decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)

"""Structured output: a request's tokens constrained to a JSON schema, a regex, a list of choices or a grammar.

``StructuredOutput`` says what the output must match and is checked when it is made (a bad schema or regex
raises ValueError naming the problem). ``Grammars`` turns it into one llguidance matcher per request
(``Constraint``) and, each step, into a packed bitmask of the tokens each constrained row may take next
(``[B, ceil(V / 32)]`` int32, bit ``v % 32`` of word ``v // 32``); the sampler unpacks it on the device and sets the rest to -inf.
Rows without a constraint allow every token. Matchers live on the host and advance by the sampled tokens; the
mask is filled while the device runs the step's forward.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lorakit.ops import cdiv

__all__ = ["Constraint", "Grammars", "StructuredOutput", "unpack_mask"]

logger = logging.getLogger("lorakit.structured")

# JSON as people write it on one line, '{"a": 1, "b": [2, 3]}': no free whitespace, which a model could
# otherwise emit until max_tokens (a schema's "x-guidance" options override this).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: ``json`` (a JSON schema as a JSON string; ``'{"type": "object"}'`` for any JSON object),
    ``regex``, ``choice`` (the output is one of these strings) or ``lark`` (a Lark grammar, llguidance's
    dialect)."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    lark: str | None = None

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "lark") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"StructuredOutput takes exactly one of json, regex, choice, lark; got {given or 'none'}")
        if self.choice is not None:
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"StructuredOutput.choice must be a non-empty list of non-empty strings, got {choice!r}")
            object.__setattr__(self, "choice", choice)
        for name in ("json", "regex", "lark"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"StructuredOutput.{name} must be a string, got {type(value).__name__}")
        error = _llguidance().LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ValueError(f"invalid {given[0]} for structured output: {error.strip()}")

    @staticmethod
    def json_schema(schema: dict[str, Any] | str | bool) -> StructuredOutput:
        """From a schema given as a dict, a JSON string, or True (any JSON object)."""
        if schema is True:
            return StructuredOutput(json='{"type": "object"}')
        if isinstance(schema, str):
            try:
                json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            return StructuredOutput(json=schema)
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return StructuredOutput(json=json.dumps(schema))

    def grammar(self) -> str:
        """The constraint in llguidance's grammar format."""
        matcher = _llguidance().LLMatcher
        if self.json is not None:
            return matcher.grammar_from_json_schema(self.json, defaults=_JSON_STYLE)
        if self.regex is not None:
            return matcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return matcher.grammar_from_lark(self.lark)


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:  # a declared dependency; say how to get it back
        raise ImportError("structured output needs llguidance: pip install 'llguidance>=1.1'") from e
    return llguidance


class Constraint:
    """One request's matcher: which tokens may come next, advanced by each sampled token.

    ``error`` is set, and the request must end, when the matcher fails (a grammar past llguidance's parser
    limits, say); it never raises into the step, so no other request is touched.
    """

    def __init__(self, matcher, n_vocab: int):
        self._matcher = matcher
        self.words = cdiv(n_vocab, 32)  # the mask's width in int32 words, as the tokenizer's vocabulary needs
        self._own = torch.zeros((1, self.words), dtype=torch.int32)  # scratch for a batch of another width
        self.error: str | None = None

    def fill(self, row: Tensor) -> None:
        """Write the allowed next tokens into ``row`` (int32 words); ids past the tokenizer are never allowed."""
        row.zero_()
        if self.error is not None:
            return
        self._own.zero_()
        self._matcher.unsafe_compute_mask_ptr(self._own.data_ptr(), self._own.nbytes)
        if self._matcher.is_error():
            self._fail()
            return
        n = min(self._own.shape[1], row.shape[0])
        row[:n] = self._own[0, :n]

    def advance(self, token_id: int) -> None:
        """Feed the sampled token (one the mask allowed: always accepted, unless the matcher failed)."""
        if self.error is None and not self._matcher.consume_token(token_id):
            self._fail()

    def _fail(self) -> None:
        first = (self._matcher.get_error() or "unknown error").strip().splitlines()[0]
        self.error = f"structured output failed: {first}"
        logger.warning("%s\n%s", self.error, self._matcher.get_error())


class Grammars:
    """Makes each constrained request's ``Constraint``, and each step's packed mask for a batch.

    The llguidance view of a tokenizer is built once per tokenizer object (one per adapter version at most).
    """

    def __init__(self, eos_token_id: int | list[int] | None):
        self._eos = eos_token_id
        self._tokenizers: dict[int, tuple[Any, Any, int]] = {}  # id(tokenizer) -> (tokenizer, LLTokenizer, n_vocab)
        self._executor = None  # llguidance's thread pool, made at the first batch that needs it

    def constraint(self, spec: StructuredOutput, tokenizer, vocab_size: int) -> Constraint:
        """A fresh constraint for one request; ``tokenizer`` is the request's Hugging Face tokenizer."""
        llg = _llguidance()
        key = id(tokenizer)
        if key not in self._tokenizers:  # the tokenizer is kept too, so its id is never reused
            n_vocab = max(vocab_size, len(tokenizer))
            self._tokenizers[key] = (tokenizer, llg.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=self._eos),
                                     n_vocab)
        _, lltok, n_vocab = self._tokenizers[key]
        matcher = llg.LLMatcher(lltok, spec.grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output: {matcher.get_error()}")
        return Constraint(matcher, n_vocab)

    def masks(self, constraints: list[Constraint | None], vocab_size: int, pin: bool) -> Tensor:
        """[B, ceil(vocab_size / 32)] int32 on the host: row b's allowed next tokens, every bit set where
        ``constraints[b]`` is None. Rows as wide as the batch's mask are filled by llguidance's thread pool in
        one call (without the GIL); the rest (an adapter's tokenizer of another size) one by one."""
        words = cdiv(vocab_size, 32)
        mask = torch.full((len(constraints), words), -1, dtype=torch.int32, pin_memory=pin)
        rows = [(row, c) for row, c in enumerate(constraints) if c is not None]
        together = [(row, c) for row, c in rows if c.words == words and c.error is None]
        if len(together) > 1:
            if self._executor is None:
                self._executor = _llguidance().LLExecutor()
            self._executor.unsafe_compute_mask_ptr([(c._matcher, row) for row, c in together], mask.data_ptr(),
                                                   words * 4, len(constraints))
            for row, c in together:
                if c._matcher.is_error():
                    c._fail()
                    mask[row].zero_()
        done = {row for row, _ in together} if len(together) > 1 else set()
        for row, c in rows:
            if row not in done:
                c.fill(mask[row])
        return mask


def unpack_mask(packed: Tensor, vocab_size: int) -> Tensor:
    """[B, W] int32 bitmask -> [B, vocab_size] bool (True: allowed), on ``packed``'s device."""
    shifts = torch.arange(32, device=packed.device, dtype=torch.int32)
    bits = (packed[:, :, None] >> shifts) & 1
    return bits.view(packed.shape[0], -1)[:, :vocab_size].bool()

"""Structured output: a request's tokens constrained to a JSON schema, a regex, a list of choices or a grammar.

``StructuredOutput`` says what the output must match; making one checks only its shape (cheap: it is built on the
server's event loop and decoded again in the engine core). ``Grammars.compile`` compiles it for a tokenizer on a
worker thread, within a budget of bytes and seconds, once per grammar and tokenizer (a cache), and tries it on its
first tokens (``lorakit.engine.grammar``): whatever llguidance cannot compile or follow is refused there, before a
request is queued. Each sequence's ``Constraint`` is a copy of the compiled matcher. Each step, ``Grammars.masks``
turns the batch's constraints into a packed bitmask of the tokens each constrained row may take next
(``[B, ceil(V / 32)]`` int32, bit ``v % 32`` of word ``v // 32``); the sampler unpacks it on the device and sets the
rest to -inf. Rows without a constraint allow every token. Matchers live on the host and advance by the sampled
tokens; the mask is filled while the device runs the step's forward.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lorakit.engine.grammar import (Compile, CompileQueue, Constraint, Grammar, GrammarError, Pending, bounded,
                                    build_grammar, unpack_mask)
from lorakit.ops import cdiv

__all__ = ["Constraint", "Grammar", "GrammarError", "Grammars", "Pending", "StructuredOutput", "unpack_mask"]

logger = logging.getLogger("lorakit.structured")

# JSON as people write it on one line, '{"a": 1, "b": [2, 3]}': no free whitespace, which a model could
# otherwise emit until max_tokens (a schema's "x-guidance" options override this).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# The budget of one grammar (EngineConfig's defaults): its source's bytes, and the seconds its compile may take. A
# 128 KiB JSON schema is some 4,000 properties (OpenAI's structured outputs take at most 5,000); on one CPU core
# llguidance compiles a schema of 3,000 required properties in 0.3 s, one of 8,000 optional properties in 15 s.
MAX_GRAMMAR_BYTES = 128 * 2**10
MAX_GRAMMAR_SECONDS = 5.0
COMPILE_WORKERS = 2  # compiles at once: each takes a core (without the GIL), the rest wait their turn
MAX_GRAMMAR_QUEUE = 16  # compiles waiting for a worker, all clients together: each leaves within MAX_GRAMMAR_SECONDS
CACHE_SIZE = 64  # grammars kept compiled (and refusals kept), the least recently asked for out first


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: ``json`` (a JSON schema as a JSON string; ``'{"type": "object"}'`` for any JSON object),
    ``regex``, ``choice`` (the output is one of these strings) or ``lark`` (a Lark grammar, llguidance's
    dialect). Made, it is checked for shape only (ValueError); whether llguidance can compile and follow the
    grammar is checked when ``Grammars.compile`` compiles it (``GrammarError``, a ValueError)."""

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
                raise ValueError(f"StructuredOutput.choice must be a non-empty list of non-empty strings, got "
                                 f"{bounded(repr(choice), 100)}")
            object.__setattr__(self, "choice", choice)
        for name in ("json", "regex", "lark"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"StructuredOutput.{name} must be a string, got {type(value).__name__}")

    @property
    def kind(self) -> str:
        """Which of json, regex, choice and lark it is."""
        return next(k for k in ("json", "regex", "choice", "lark") if getattr(self, k) is not None)

    @property
    def size(self) -> int:
        """Its source's size in bytes, as the budget counts it (choices: their bytes and one per choice)."""
        if self.choice is not None:
            return sum(len(c.encode()) + 1 for c in self.choice)
        return len(getattr(self, self.kind).encode())

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
        """The constraint in llguidance's grammar format (not checked: compiling it checks it)."""
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


class Grammars:
    """Compiles each constrained request's grammar (``compile``), and makes each step's packed mask for a batch.

    ``max_bytes`` and ``max_seconds``: one grammar's budget (``--max-grammar-bytes``, ``--max-grammar-seconds``, the
    seconds counted from the request: see ``Pending``); ``max_queued`` and ``workers``: the ``CompileQueue``'s bounds.
    ``compile`` may be called from any thread: it looks up its cache and queues the work for a worker, which also
    builds the llguidance view of a tokenizer the first time one is needed, once per tokenizer object (one per adapter
    version at most). ``compiles`` counts the grammars llguidance compiled.
    """

    def __init__(self, eos_token_id: int | list[int] | None, max_bytes: int = MAX_GRAMMAR_BYTES,
                 max_seconds: float = MAX_GRAMMAR_SECONDS, max_queued: int = MAX_GRAMMAR_QUEUE,
                 workers: int = COMPILE_WORKERS):
        self._eos, self.max_bytes, self.max_seconds = eos_token_id, max_bytes, max_seconds
        self._tokenizers: dict[int, tuple[Any, Any, int]] = {}  # id(tokenizer) -> (tokenizer, LLTokenizer, n_vocab)
        self._building = threading.Lock()  # the tokenizers (held while one is built, on a worker)
        self._cache: OrderedDict[tuple, Compile] = OrderedDict()
        self._lock = threading.Lock()  # the cache (held for a lookup only, never while calling the queue)
        self.queue = CompileQueue(workers, max_queued, "lorakit-grammar")
        self._executor = None  # llguidance's thread pool for masks, made at the first batch that needs it
        self.compiles = 0

    def compile(self, spec: StructuredOutput, tokenizer, vocab_size: int, client: Hashable = None) -> Pending:
        """``spec``'s grammar for ``tokenizer`` (the request's Hugging Face tokenizer), compiled or on its way: from
        the cache when the same grammar was asked for the same tokenizer before (compiled, compiling, or refused),
        else queued for a worker, in ``client``'s turn (whoever sent the request: an API key, an address; None: not
        known, a turn of its own). Returns at once and never raises: a grammar past ``max_bytes``, or one the full
        queue has no room for, comes back refused already."""
        if spec.size > self.max_bytes:
            return Pending(self.max_seconds, f"the {spec.kind} is {spec.size} bytes; this server compiles grammars "
                                             f"of at most {self.max_bytes} bytes (--max-grammar-bytes)")
        key = (spec, id(tokenizer), vocab_size)
        with self._lock:
            job = self._cache.get(key)
            if job is not None and not job.dropped:
                self._cache.move_to_end(key)
                return Pending(self.max_seconds, compile=job)
            job = self._cache[key] = Compile(self.max_seconds, client, lambda: self._build(spec, tokenizer, vocab_size),
                                             lambda: self._forget(key, job))
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        pending = Pending(self.max_seconds, compile=job)  # before it is queued: its wait keeps it there
        self.queue.put(job)
        return pending

    def constraint(self, spec: StructuredOutput, tokenizer, vocab_size: int) -> Constraint:
        """A fresh constraint for one sequence, compiled first if need be (this thread waits, within the budget)."""
        return self.compile(spec, tokenizer, vocab_size).wait().constraint()

    def _forget(self, key: tuple, job: Compile) -> None:
        """A compile dropped unstarted (the server was busy): the next request for its grammar compiles it."""
        with self._lock:
            if self._cache.get(key) is job:
                del self._cache[key]

    def _build(self, spec: StructuredOutput, tokenizer, vocab_size: int) -> Grammar:
        """On a worker."""
        started = time.monotonic()
        llg = _llguidance()
        lltok, n_vocab = self._lltokenizer(tokenizer, vocab_size)
        try:
            source = spec.grammar()
        except ValueError as e:  # a schema that is not a JSON object
            raise GrammarError(f"invalid {spec.kind} for structured output: {bounded(str(e))}") from None
        with self._lock:
            self.compiles += 1
        try:
            return build_grammar(llg, lltok, source, spec.kind, n_vocab, tokenizer)
        finally:
            seconds = time.monotonic() - started
            if seconds > self.max_seconds:
                logger.warning("a %s grammar of %d bytes took %.1f s to compile, past the budget of %g s: refused",
                               spec.kind, spec.size, seconds, self.max_seconds)

    def _lltokenizer(self, tokenizer, vocab_size: int) -> tuple[Any, int]:
        with self._building:
            key = id(tokenizer)
            if key not in self._tokenizers:  # the tokenizer is kept too, so its id is never reused
                n_vocab = max(vocab_size, len(tokenizer))
                lltok = _llguidance().hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=self._eos)
                self._tokenizers[key] = (tokenizer, lltok, n_vocab)
            _, lltok, n_vocab = self._tokenizers[key]
        return lltok, n_vocab

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

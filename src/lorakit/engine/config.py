"""``EngineConfig``: every setting of an engine, validated once, with its one default.

``Engine``, ``LLM`` and ``lorakit serve`` all read it: the engine takes a config (or its fields as keywords),
and the CLI's engine flags are generated from the fields' metadata (flag, metavar, help), so a default or a
check lives here only. Checks that need the model (``max_seq_len`` against its context, ``num_blocks`` against
one full request) are the engine's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from lorakit.adapters.pool import CPU_BUDGET_BYTES, MAX_VERSIONS
from lorakit.engine.structured import MAX_GRAMMAR_BYTES, MAX_GRAMMAR_QUEUE, MAX_GRAMMAR_SECONDS
from lorakit.layers.patch import PatchConfig
from lorakit.layers.quant import SCHEMES, check_scheme


# Prompt tokens a step takes beside decodes by default: few enough that the decodes keep their pace (why 384, and
# what it was measured on: docs/engine.md#chunked-prefill).
MAX_PREFILL_TOKENS = 384


def _opt(default, help: str, flag: str | None = None, metavar: str | None = None, min: int = 1,
         off: str | None = None, choices: tuple[str, ...] | None = None):
    """A field with its CLI flag (None: the API only), help text and, for ints, the least value; ``off``, for a
    switch that is on by default, what its flag does (default: "turn off: " and the help); ``choices``, for a
    string, the values it takes."""
    return field(default=default, metadata={"flag": flag, "metavar": metavar, "help": help, "min": min, "off": off,
                                            "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
    """See each field's help (``lorakit serve --help`` prints the same)."""

    max_loras: int | None = _opt(None, "adapters resident on the device at once; any number can be registered "
                                 "(default: auto, as many as a tenth of the device's free memory holds at max_rank, "
                                 "1 to 64; see docs/engine.md)", "--max-loras", "N|auto")
    max_rank: int = _opt(PatchConfig.max_rank, "the largest adapter rank", "--max-rank", "R")
    max_num_seqs: int = _opt(256, "requests running at once", "--max-num-seqs", "N")
    max_seq_len: int | None = _opt(None, "prompt + output tokens of one request (default: the model's "
                                   "max_position_embeddings, at most 4096)", "--max-seq-len", "N", min=2)
    max_num_batched_tokens: int = _opt(2048, "tokens per step; longer prompts are prefilled in chunks",
                                       "--max-num-batched-tokens", "N")
    max_prefill_tokens: int | None = _opt(MAX_PREFILL_TOKENS, "prompt tokens a step takes while other requests "
                                          "decode: long prompts are prefilled in chunks this long, so the decodes "
                                          "keep their pace (None: max_num_batched_tokens; the default is picked from "
                                          "bench_step's chunk sweep, docs/engine.md)", "--max-prefill-tokens", "N")
    block_size: int = _opt(16, "tokens per KV-cache block", "--block-size", "N")
    num_blocks: int | None = _opt(None, "KV-cache blocks (default: room for max_num_seqs full-length requests, or "
                                  "half the free GPU memory less the adapter slots at max_rank if less; on the CPU "
                                  "2 GiB less the slots)", "--num-blocks", "N")
    prefix_cache: bool = _opt(True, "reuse the KV-cache blocks of earlier requests with the same prompt prefix under "
                              "the same weights (keyed by the adapter's content hash, never its name)",
                              "--no-prefix-cache")
    patience: int = _opt(16, "steps the oldest waiting request may be bypassed by requests whose adapters are "
                         "resident", "--patience", "STEPS", min=0)
    cuda_graphs: bool = _opt(True, "replay steps from CUDA graphs captured at startup (on a GPU)",
                             "--no-cuda-graphs")
    compile: bool = _opt(False, "capture the decode graphs from a torch.compile'd forward: faster steps, ~20 s per "
                         "batch bucket at startup", "--compile")
    graph_sizes: tuple[int, ...] | None = _opt(None, "batch-size buckets of the decode graphs (default 1, 2, 4, 8, "
                                               "16, 32, ... up to max_num_seqs)")
    graph_token_sizes: tuple[int, ...] | None = _opt(None, "token buckets of the graphs of mixed steps (with a prompt "
                                                     "chunk; default 64, 128, 256, ... and max_num_batched_tokens); "
                                                     "() captures none: such steps run eagerly")
    async_scheduling: bool = _opt(True, "prepare each step on the host while the device runs the one before (steps "
                                  "are synchronous while a request with structured output, penalties or a logit "
                                  "bias runs)", "--no-async-scheduling")
    cpu_budget_bytes: int = _opt(CPU_BUDGET_BYTES, "bytes of the adapter pool's CPU tier")
    max_versions_per_adapter: int = _opt(MAX_VERSIONS, "versions of one adapter alive at once: the current one and "
                                         "replaced ones that requests admitted before still run on; a new version "
                                         "(a load or push) past it is refused (429) until those requests end",
                                         "--max-versions-per-adapter", "N")
    tensor_parallel_size: int = _opt(1, "processes (one per GPU; gloo processes on the CPU) the model is split "
                                     "over, Megatron-style; the scheduler and adapter pool run in the first",
                                     "--tensor-parallel-size", "N")
    max_grammar_bytes: int = _opt(MAX_GRAMMAR_BYTES, "the largest structured-output grammar (a JSON schema, regex, "
                                  "choices or Lark grammar), in bytes; larger ones are refused (400) before they are "
                                  "compiled", "--max-grammar-bytes", "N")
    max_grammar_seconds: float = _opt(MAX_GRAMMAR_SECONDS, "the longest a structured-output grammar may wait for "
                                      "a worker thread (counted from the request; past it, 429) and then take to "
                                      "compile there, while the engine steps (past it, 400)", "--max-grammar-seconds",
                                      "S")
    max_grammar_queue: int = _opt(MAX_GRAMMAR_QUEUE, "structured-output grammars waiting for a worker thread, all "
                                  "clients together, each client's turn in a round; past it the client with the "
                                  "most waiting has its newest refused (429)", "--max-grammar-queue", "N")
    lora_strict: bool = _opt(True, "refuse an adapter whose weights and adapter_config.json targets disagree",
                             "--lora-non-strict", off="load an adapter whose weights and adapter_config.json targets "
                             "disagree as PEFT loads it, with a warning (weights of modules its config does not adapt "
                             "dropped, adapted modules without weights left untrained) (default: refused)")
    base_twins: bool = _opt(True, "steps without adapter tokens run without LoRA kernels, decode steps from base twins "
                            "of the decode graphs captured with the LoRA ops silenced (False: they run their empty "
                            "LoRA kernels)")
    quantization: str | None = _opt(None, "store the base model's linear layers quantized, at load: fp8 (e4m3, a scale "
                                    "per output channel: half the bytes of bf16) or int4 (4-bit, a scale and zero "
                                    "per 128 inputs: a quarter), weight-only; adapters stay in the model's dtype "
                                    "(default: none, the checkpoint's dtype; docs/patch.md#quantized-bases)",
                                    "--quantization", "fp8|int4", choices=SCHEMES)
    fuse_siblings: bool = _opt(True, "sibling projections that read one input (q/k/v, gate/up) run one base GEMM over "
                               "their weights, moved into one buffer (False: one GEMM each)")

    def __post_init__(self):
        # max_loras (None: auto) and max_rank, checked as patch() checks them
        PatchConfig(1 if self.max_loras is None else self.max_loras, self.max_rank)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            _check_int(name, getattr(self, name), 1)
        if self.block_size & (self.block_size - 1):  # the attention kernels index a block by shifts and masks
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {self.block_size}")
        if self.max_seq_len is not None:
            _check_int("max_seq_len", self.max_seq_len, 2)
        if self.max_prefill_tokens is not None:
            _check_int("max_prefill_tokens", self.max_prefill_tokens, 1)
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks, 1)
        _check_int("patience", self.patience, 0)
        _check_int("cpu_budget_bytes", self.cpu_budget_bytes, 0)
        _check_int("max_grammar_bytes", self.max_grammar_bytes, 1)
        _check_int("max_grammar_queue", self.max_grammar_queue, 1)
        seconds = self.max_grammar_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (math.isfinite(seconds)
                                                                                      and seconds > 0):
            raise ValueError(f"max_grammar_seconds must be a number of seconds > 0, got {seconds!r}")
        object.__setattr__(self, "max_grammar_seconds", float(seconds))
        for name in ("cuda_graphs", "compile", "lora_strict", "async_scheduling", "prefix_cache", "base_twins",
                     "fuse_siblings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.quantization is not None:
            check_scheme(self.quantization)
        for name, empty in (("graph_sizes", False), ("graph_token_sizes", True)):
            value = getattr(self, name)
            if value is None:
                continue
            sizes = tuple(value)
            positive = all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)
            if not positive or not (sizes or empty):
                raise ValueError(f"{name} must be positive ints{' (or none)' if empty else ''}, got {value!r}")
            object.__setattr__(self, name, sizes)

    @classmethod
    def cli_fields(cls) -> list[dataclasses.Field]:
        """The fields ``lorakit serve`` has a flag for."""
        return [f for f in dataclasses.fields(cls) if f.metadata.get("flag")]


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

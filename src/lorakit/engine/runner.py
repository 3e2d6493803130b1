"""The model runner: lorakit's paged KV cache and attention inside any transformers causal LM, unchanged.

Each step's tokens go through the model as one packed ``[1, T]`` sequence with one ``PagedStep`` (the model's
``lorakit_step`` keyword), which the LoRA layers and the registered "lorakit" attention function read. The runner
owns the KV cache and the CUDA graphs (decode buckets, mixed token buckets, base twins) and syncs with the host
once a step, to read the sampled tokens. How and why: docs/engine.md ("CUDA graphs, and one host sync").
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import numpy as np
import torch
import transformers
from torch import nn
from tqdm import tqdm

from lorakit.engine.errors import FatalEngineError, TensorParallelError
from lorakit.engine.scheduler import Request, StepPlan
from lorakit.layers.context import StepContext
from lorakit.ops import cdiv, no_adapter_tokens, paged_attention, write_kv

logger = logging.getLogger("lorakit.runner")

ATTENTION_NAME = "lorakit"


@dataclass
class PagedStep(StepContext):
    """One engine step as the model's layers read it: the adapter ids, and the attention function's KV cache."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    kv_index: torch.Tensor  # [T] int64, each token's row of the cache (block * block_size + offset), -1 for padding
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32, KV length including the new tokens
    query_start: torch.Tensor  # [S + 1] int32


PROGRAM_ORDER = {"reorder_for_locality": False, "reorder_for_peak_memory": False}  # Inductor options


def lorakit_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask=None, scaling: float | None = None, dropout: float = 0.0,
                      softcap: float | None = None, sliding_window: int | None = None,
                      lorakit_step: PagedStep | None = None, **kwargs):
    """transformers' attention interface: query [1, Hq, T, D], key/value [1, Hkv, T, D] of the new tokens."""
    step = lorakit_step
    if not isinstance(step, PagedStep):
        raise RuntimeError("the 'lorakit' attention runs only inside lorakit's engine, which sets up the KV cache; "
                           "switch the model back with model.set_attn_implementation('sdpa') to use it alone")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} has no layer_idx; lorakit needs it to find the layer's KV cache")
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    write_kv(step.k_caches[layer], step.v_caches[layer], k, v, step.kv_index)
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    out = paged_attention(q, step.k_caches[layer], step.v_caches[layer], step.block_tables, step.seq_lens,
                          step.query_start, scale, float(softcap or 0.0), int(sliding_window or 0))
    return out.unsqueeze(0), None


transformers.AttentionInterface.register(ATTENTION_NAME, lorakit_attention)


def kv_shape(model: nn.Module) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) from the model's config: of this rank's shard on a tensor-parallel model (its
    k/v projections keep ``kv_heads / world_size`` heads, see ``lorakit.parallel.shard_model``)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    world_size = getattr(model, "_lorakit_tensor_parallel", (0, 1))[1]
    return config.num_hidden_layers, kv_heads // world_size, head_dim


def graph_buckets(sizes: list[int] | None, max_num_seqs: int) -> list[int]:
    """The decode batch sizes that get a CUDA graph, largest first (the order of capture): ``sizes`` (default
    1, 2, 4, 8, then every multiple of 16) capped at max_num_seqs, which always gets one."""
    sizes = sizes or [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({min(s, max_num_seqs) for s in sizes} | {max_num_seqs}, reverse=True)


def token_buckets(sizes: list[int] | None, max_num_batched_tokens: int | None) -> list[int]:
    """The token counts of mixed steps that get a CUDA graph, largest first: ``sizes`` (default every multiple of 64
    up to 512, of 256 up to 1024, then of 512: a step pads at most 64 tokens where steps are common, with decodes
    and a prompt chunk of ``max_prefill_tokens``, and at most a third past that; at least 2, a mixed step's least)
    capped at max_num_batched_tokens, which always gets one; none when ``sizes`` is empty or the step's token budget
    is not given."""
    if max_num_batched_tokens is None or max_num_batched_tokens < 2 or (sizes is not None and len(sizes) == 0):
        return []  # (a step of one token decodes)
    sizes = sizes or [s for s in [*range(64, 513, 64), 768, *range(1024, max_num_batched_tokens, 512)]
                      if s < max_num_batched_tokens]
    return sorted({min(s, max_num_batched_tokens) for s in sizes if s >= 2} | {max_num_batched_tokens}, reverse=True)


class Fill(NamedTuple):
    """Input tokens the host does not know yet: ``input_ids[index[i]] = tokens[rows[i]]``, on the device (``index``
    and ``rows`` int64 on the device, ``tokens`` the sampled tokens of the step before, still being computed)."""

    index: torch.Tensor
    rows: torch.Tensor
    tokens: torch.Tensor
    host: tuple[list[int], list[int]] | None = None  # index and rows on the host (sent to tensor-parallel workers)


def _fill(input_ids: torch.Tensor, fill: Fill | None) -> None:
    if fill is not None:
        input_ids.index_copy_(0, fill.index, fill.tokens.index_select(0, fill.rows))


class Bucket(NamedTuple):
    """The padded shape of a graph's step: ``tokens`` T, ``rows`` S; decode graphs give every token's logits,
    mixed graphs those of each sequence's last token."""

    tokens: int
    rows: int
    decode: bool


# A step's tensors in the packed buffer: int64 [4, T] (these four), then int64 keep (room for max(S, T, 1): a step
# whose items keep every position's logits keeps up to T), then int32
# seq_lens [S], query_start [S + 1], block_tables [S, max_blocks]. The graphs read views of a static copy of it.
STEP_TENSORS = ("input_ids", "positions", "lora_ids", "kv_index", "seq_lens", "query_start", "block_tables")


def _sizes(rows: int, tokens: int, max_blocks: int) -> tuple[int, int]:
    """The int64 and int32 entries of a packed step of ``rows`` sequences and ``tokens`` tokens."""
    return 4 * tokens + max(rows, tokens, 1), 2 * rows + 1 + rows * max_blocks


def packed_bytes(rows: int, tokens: int, max_blocks: int) -> int:
    n64, n32 = _sizes(rows, tokens, max_blocks)
    return 8 * n64 + 4 * n32


def _split(buf, rows: int, tokens: int, max_blocks: int, int64, int32) -> dict:
    """Views of a step's tensors (and "keep") in a packed byte buffer: a numpy array or a tensor, with its int64 and
    int32 dtypes."""
    n64, n32 = _sizes(rows, tokens, max_blocks)
    a = buf[: 8 * n64].view(int64)
    b = buf[8 * n64: 8 * n64 + 4 * n32].view(int32)
    parts = dict(zip(STEP_TENSORS[:4], (a[i * tokens: (i + 1) * tokens] for i in range(4))))
    parts.update(keep=a[4 * tokens:], seq_lens=b[:rows], query_start=b[rows: 2 * rows + 1],
                 block_tables=b[2 * rows + 1:].reshape(rows, max_blocks))
    return parts


@contextlib.contextmanager
def _ranks_in_step():
    """Rank 0 of a tensor-parallel group, from the moment a step goes to the workers until its forward returns: the
    ranks are in it together, so a failure here (a peer gone mid-collective surfaces as gloo's RuntimeError, or
    anything else) leaves them out of step. It is a ``TensorParallelError``, never one request's fault."""
    try:
        yield
    except FatalEngineError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever it was, the ranks no longer agree on where they are
        raise TensorParallelError(f"rank 0's part of a tensor-parallel step failed once the workers had it "
                                  f"({type(e).__name__}: {e}); the ranks are out of step") from e


class ModelRunner:
    """Runs a scheduled step through the model and returns the logits of the positions that sample.

    ``max_num_batched_tokens`` (the scheduler's token budget) bounds the mixed graphs' token buckets
    (``graph_token_sizes``, empty for none); without it mixed steps run eagerly. Counters: ``decode_replays``,
    ``mixed_replays`` (``graph_replays`` both), ``eager_steps``, ``base_steps`` (of these, the steps without adapter
    tokens, run without LoRA kernels); ``gpu_seconds`` over ``timed_steps``, the device
    time of the forwards read back by ``poll()`` (each ``execute`` polls first), 0 on the CPU.

    ``base_twins``: steps without adapter tokens run without LoRA kernels, and decode buckets get base twins (see the
    module docstring); False: they run (and replay the full graphs with) their empty LoRA kernels.
    ``fuse_siblings``: sibling projections (q/k/v, gate/up) run one fused base GEMM (``handle.fuse_sibling_gemms``)
    where their layers allow; False keeps one GEMM per projection. Both are the engine config's (``EngineConfig``).
    """

    def __init__(self, model: nn.Module, handle, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_seq_len: int, cuda_graphs: bool = True, graph_sizes: list[int] | None = None,
                 compile: bool = False, max_num_batched_tokens: int | None = None,
                 graph_token_sizes: list[int] | None = None, base_twins: bool = True, fuse_siblings: bool = True,
                 mirror: Callable[..., None] | None = None):
        self.model = model
        # Tensor parallel, on rank 0: mirror(method name, *args) makes the same call on every other rank's runner
        # (each forward as run_packed, each recapture), set by the executor (lorakit.parallel.executor).
        self.mirror = mirror
        self.handle = handle
        self.device = handle.device
        self.block_size = block_size
        self.max_blocks = cdiv(max_seq_len, block_size)
        self.max_num_seqs = max_num_seqs
        layers, kv_heads, head_dim = kv_shape(model)
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
        self.kv_bytes = 2 * layers * self.k_caches[0].nbytes
        model.set_attn_implementation(ATTENTION_NAME)
        self.base_twins = base_twins
        self.fused_groups = handle.fuse_sibling_gemms() if fuse_siblings else 0
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.graph_sizes = graph_buckets(graph_sizes, max_num_seqs)
        self.token_sizes = token_buckets(graph_token_sizes, max_num_batched_tokens)
        self.buckets = sorted([Bucket(s, s, True) for s in self.graph_sizes]
                              + [Bucket(t, self._mixed_rows(t), False) for t in self.token_sizes], reverse=True)
        # Each bucket's graph, its output and static views; decode buckets also have a base twin: keys (bucket, base).
        self._graphs: dict[tuple[Bucket, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, dict]] = {}
        self._graph_layout: int | None = None
        self._static: torch.Tensor | None = None  # the graphs' packed step (see _split), written by each replay's copy
        self._compiles = 0  # decode forwards compiled (with compile=True): one per bucket and slot layout
        self.graph_captures = 0  # times every bucket was captured: once at startup, again after each rank growth
        self.decode_replays = self.mixed_replays = self.eager_steps = self.base_steps = 0
        self.gpu_seconds, self.timed_steps = 0.0, 0
        self._timing: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()  # steps not yet read by poll()
        self._spare_events: list[torch.cuda.Event] = []
        # Two pinned host buffers used in turn, each with the event of the copy that last read it.
        pinned = self.device.type == "cuda"
        self._host = [torch.zeros(1 << 16, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self._copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._turn = 0
        # Every request's block-table row (see _table_rows), and the rows of requests that are gone.
        self._tables = np.zeros((max_num_seqs, self.max_blocks), np.int32)
        self._free_rows: list[int] = []
        self._used_rows = 0
        self._rows: weakref.WeakKeyDictionary[Request, list[int]] = weakref.WeakKeyDictionary()  # the runner's own
        # Decode graphs may capture a torch.compile'd forward (fused elementwise work; one compile per bucket), in
        # program order: a LoRA delta launched before its base GEMM runs beside it (layers/linear.py).
        self._decode_model = torch.compile(model, fullgraph=True, dynamic=False, options=PROGRAM_ORDER) \
            if compile and self.cuda_graphs else model
        if self.cuda_graphs:
            self._capture()  # every rank's runner captures once as it is built

    @property
    def graph_replays(self) -> int:
        return self.decode_replays + self.mixed_replays

    def _mixed_rows(self, tokens: int) -> int:
        # A mixed step has fewer sequences than tokens; the head's input (one row per sequence) must be shorter than
        # the layers' (one per token) for the LoRA context to give it the kept rows' adapters.
        return min(self.max_num_seqs, tokens - 1)

    # Host side: the step's metadata, packed and copied once.

    def _table_rows(self, requests: list[Request]) -> list[int]:
        """Each request's row of ``self._tables``, brought up to date. A request's blocks only grow while it runs and
        are all freed when it is preempted or ends (the scheduler's contract): a row is extended from the length it
        had, rebuilt after a preemption, and returned to the free rows when the request is collected."""
        marks = [self._rows.get(r) for r in requests]  # [row, blocks written, preemptions]
        stale = [k for k, (r, m) in enumerate(zip(requests, marks))
                 if m is None or m[1] != len(r.blocks) or m[2] != r.preemptions]
        for k in stale:
            marks[k] = self._write_row(requests[k], marks[k])
        return [m[0] for m in marks]

    def _write_row(self, request: Request, mark: list[int] | None) -> list[int]:
        blocks = request.blocks
        if mark is None:
            row = self._free_rows.pop() if self._free_rows else self._new_row()
            weakref.finalize(request, self._free_rows.append, row)
            have = 0
        else:
            row, have, preemptions = mark
            if preemptions != request.preemptions or len(blocks) < have:
                have = 0
        if have == 0:
            self._tables[row] = 0
        self._tables[row, have: len(blocks)] = blocks[have:]
        mark = [row, len(blocks), request.preemptions]
        self._rows[request] = mark
        return mark

    def _new_row(self) -> int:
        if self._used_rows == len(self._tables):
            self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
        self._used_rows += 1
        return self._used_rows - 1

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """The next pinned buffer, once the copy that last read it has run (it has, unless the device is two steps
        behind the host)."""
        self._turn ^= 1
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()
        if self._host[self._turn].numel() < nbytes:
            self._host[self._turn] = torch.zeros(max(nbytes, 2 * self._host[self._turn].numel()), dtype=torch.uint8,
                                                 pin_memory=self.device.type == "cuda")
        return self._host[self._turn]

    def _pack(self, plan: StepPlan, rows: int, tokens: int, per_sequence: bool) -> tuple[torch.Tensor, int]:
        """Fill the next host buffer with the step padded to ``rows`` sequences and ``tokens`` tokens (see _split);
        returns the packed bytes and the number of "keep" entries: the token positions that sample, or with
        ``per_sequence`` the sequences that do (their rows of a graph's logits); the last one when none does."""
        items = plan.items
        n = len(items)
        requests = [i.request for i in items]
        lens = np.array([len(i.tokens) for i in items], np.int64)
        starts = np.array([i.start for i in items], np.int64)
        slots = np.array([r.slot for r in requests], np.int64)
        lora_starts = np.array([r.lora_start for r in requests], np.int64)  # activated LoRA: base model before it
        sample = np.array([i.sample for i in items], bool)
        t = int(lens.sum())
        if n > rows or t > tokens:
            raise ValueError(f"a step of {n} sequences and {t} tokens does not fit {rows} rows and {tokens} tokens")
        nbytes = packed_bytes(rows, tokens, self.max_blocks)
        host = self._host_buffer(nbytes)
        h = _split(host.numpy(), rows, tokens, self.max_blocks, np.int64, np.int32)
        qs, seq_lens, tables = h["query_start"], h["seq_lens"], h["block_tables"]
        qs[0] = 0
        np.cumsum(lens, out=qs[1: n + 1])
        qs[n + 1:] = t
        seq_lens[:n] = starts + lens
        seq_lens[n:] = 0
        if n:
            table_rows = self._table_rows(requests)  # first: it may grow self._tables
            np.take(self._tables, table_rows, axis=0, out=tables[:n], mode="clip")
        tables[n:] = 0
        if t == n:  # one token each: the items' values are the tokens'
            seq, pos, lora = np.arange(n), starts, np.where(starts >= lora_starts, slots, -1)
            h["input_ids"][:t] = [i.tokens[0] for i in items]
        else:
            seq = np.repeat(np.arange(n), lens)
            pos = np.arange(t) + np.repeat(starts - qs[:n], lens)
            lora = np.where(pos >= np.repeat(lora_starts, lens), np.repeat(slots, lens), -1)
            h["input_ids"][:t] = np.fromiter(chain.from_iterable(i.tokens for i in items), np.int64, t)
        h["positions"][:t] = pos
        h["lora_ids"][:t] = lora
        h["kv_index"][:t] = tables[seq, pos // self.block_size] * np.int64(self.block_size) + pos % self.block_size
        for name, pad in (("input_ids", 0), ("positions", 0), ("lora_ids", -1), ("kv_index", -1)):
            h[name][t:] = pad
        if per_sequence:
            keep = np.flatnonzero(sample)
        elif any(i.all_logits for i in items):  # every position of those items, the last of the others that sample
            keep = np.concatenate([np.arange(qs[k], qs[k + 1]) if i.all_logits else qs[k + 1: k + 2] - 1
                                   for k, i in enumerate(items) if i.all_logits or i.sample] or [np.zeros(0, np.int64)])
        else:
            keep = qs[1: n + 1][sample] - 1
        h["keep"][: max(len(keep), 1)] = keep if len(keep) else max((n if per_sequence else t) - 1, 0)
        return host[:nbytes], max(len(keep), 1)

    def _upload(self, packed: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """The packed step on the device, in ``into`` (the graphs' static buffer) or a new tensor: one copy."""
        if into is not None:
            dev = into[: len(packed)]
            dev.copy_(packed, non_blocking=True)
        else:
            dev = packed.to(self.device, non_blocking=True) if packed.is_pinned() else packed.clone()
        if self._copied[self._turn] is not None:
            self._copied[self._turn].record()
        return dev

    def _metadata(self, plan: StepPlan, rows: int, tokens: int, per_sequence: bool = False,
                  into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The step's tensors (STEP_TENSORS, and "keep", see _pack) on the device, padded to ``rows`` and ``tokens``."""
        packed, keep = self._pack(plan, rows, tokens, per_sequence)
        parts = _split(self._upload(packed, into), rows, tokens, self.max_blocks, torch.int64, torch.int32)
        parts["keep"] = parts["keep"][:keep]
        return parts

    # Device side.

    def _forward(self, m: dict[str, torch.Tensor], keep: torch.Tensor | None, model: nn.Module | None = None):
        step = PagedStep(m["lora_ids"][None], self.k_caches, self.v_caches, m["kv_index"], m["block_tables"],
                         m["seq_lens"], m["query_start"])
        model = self.model if model is None else model
        kwargs = {} if keep is None else {"logits_to_keep": keep}
        return model(input_ids=m["input_ids"][None], position_ids=m["positions"][None], lorakit_step=step,
                     use_cache=False, **kwargs).logits[0]

    def _bucket_forward(self, m: dict[str, torch.Tensor], bucket: Bucket) -> torch.Tensor:
        """What a bucket's graph captures: every token's logits for decode, each sequence's last token's for mixed
        steps (a padded sequence's row repeats the row before it)."""
        if bucket.decode:
            return self._forward(m, None, self._decode_model)
        last = (m["query_start"][1:].long() - 1).clamp_(min=0)
        return self._forward(m, last)

    def _bucket(self, n: int, t: int) -> Bucket | None:
        """The smallest graph bucket that holds a step of ``n`` sequences and ``t`` tokens, None when none does."""
        if t == n:
            size = min((s for s in self.graph_sizes if s >= n), default=None)
            return None if size is None else Bucket(size, size, True)
        size = min((s for s in self.token_sizes if s >= t), default=None)
        return None if size is None or n > self.max_num_seqs else Bucket(size, self._mixed_rows(size), False)  # n < t

    def _run_bucket(self, plan: StepPlan, bucket: Bucket, fill: Fill | None = None) -> torch.Tensor:
        """The step padded to ``bucket``, its graph replayed. Returns the logits of the items that sample."""
        packed, keep = self._pack(plan, bucket.rows, bucket.tokens, per_sequence=True)
        if self.mirror is not None:
            with _ranks_in_step():
                self._send_step(packed, keep, bucket, fill)
                return self._replay(packed, keep, bucket, fill)
        return self._replay(packed, keep, bucket, fill)

    def _send_step(self, packed: torch.Tensor, keep: int, shape: Bucket | tuple[int, int], fill: Fill | None) -> None:
        """Tensor parallel, rank 0: the step to the other ranks (their ``run_packed``), then (async scheduling) the
        tokens its placeholders take, broadcast on the device from the step in flight (``run_packed`` receives them)."""
        if fill is not None and fill.host is None:
            raise RuntimeError("a tensor-parallel step's Fill needs its host index and rows")
        spec = None if fill is None else (*fill.host, fill.tokens.numel(), fill.tokens.dtype)
        self.mirror("run_packed", packed.numpy(), keep, shape, spec)  # pickled (copied) at once
        if fill is not None:
            torch.distributed.broadcast(fill.tokens.contiguous(), 0)

    def _base_only(self, packed: torch.Tensor, rows: int, tokens: int) -> bool:
        """Whether no token of a packed step (on the host) uses an adapter."""
        if not self.base_twins:
            return False
        ids = _split(packed.numpy(), rows, tokens, self.max_blocks, np.int64, np.int32)["lora_ids"]
        return not (ids >= 0).any()

    def _replay(self, packed: torch.Tensor, keep: int, bucket: Bucket, fill: Fill | None = None) -> torch.Tensor:
        base = bucket.decode and self._base_only(packed, bucket.rows, bucket.tokens)
        self._upload(packed, self._static)
        graph, out, view = self._graphs[bucket, base]
        self.base_steps += base
        _fill(view["input_ids"], fill)
        start = self._record()
        graph.replay()
        self._timing.append((start, self._record()))
        if bucket.decode:
            self.decode_replays += 1
        else:
            self.mixed_replays += 1
        return out[view["keep"][:keep]]

    @torch.inference_mode()
    def execute(self, plan: StepPlan, fill: Fill | None = None) -> torch.Tensor:
        """Logits [number of sampling items, vocab] for the plan's items with ``sample``, in order; an item with
        ``all_logits`` gives a row for each of its positions instead (its last one the sampling row, if it samples),
        and such a step runs eagerly. ``fill``: input tokens not known on the host yet (sampled by the step still on
        the device), copied in on the device."""
        self.poll()
        n, t = len(plan.items), plan.num_tokens
        every = any(i.all_logits for i in plan.items)
        bucket = self._bucket(n, t) if self.cuda_graphs and not every else None
        if bucket is not None:
            if self.handle.slots.layout_version != self._graph_layout:  # slot buffers were reallocated: recapture
                self.capture_graphs()
            return self._run_bucket(plan, bucket, fill)
        packed, keep = self._pack(plan, n, t, per_sequence=False)
        if self.mirror is not None:
            with _ranks_in_step():
                self._send_step(packed, keep, (n, t), fill)
                return self._eager(packed, keep, n, t, fill)
        return self._eager(packed, keep, n, t, fill)

    def _eager(self, packed: torch.Tensor, keep: int, rows: int, tokens: int, fill: Fill | None = None):
        m = _split(self._upload(packed), rows, tokens, self.max_blocks, torch.int64, torch.int32)
        m["keep"] = m["keep"][:keep]
        _fill(m["input_ids"], fill)
        base = self._base_only(packed, rows, tokens)
        self.base_steps += base
        start = self._record()
        with no_adapter_tokens(base):
            logits = self._forward(m, m["keep"])
        if start is not None:
            self._timing.append((start, self._record()))
        self.eager_steps += 1
        return logits

    @torch.inference_mode()
    def run_packed(self, packed: np.ndarray, keep: int, shape: Bucket | tuple[int, int], spec=None) -> torch.Tensor:
        """Rank 0's step, as its ``mirror`` sent it (see ``_send_step``): the same packed metadata through this
        rank's shard, the same graph bucket (a ``Bucket``) or eagerly (``(rows, tokens)``), with the placeholder
        tokens rank 0 broadcasts (``spec``: index, rows, count, dtype). Tensor-parallel workers run this."""
        fill = None
        if spec is not None:
            index, rows, count, dtype = spec
            tokens = torch.empty(count, dtype=dtype, device=self.device)
            torch.distributed.broadcast(tokens, 0)
            both = torch.tensor([index, rows], dtype=torch.int64, pin_memory=self.device.type == "cuda")
            both = both.to(self.device, non_blocking=True)
            fill = Fill(both[0], both[1], tokens)
        host = self._host_buffer(len(packed))[: len(packed)]
        host.numpy()[:] = packed
        if isinstance(shape, Bucket):
            return self._replay(host, keep, shape, fill)
        return self._eager(host, keep, *shape, fill)

    # Device time, without a sync.

    def _record(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = self._spare_events.pop() if self._spare_events else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def poll(self) -> None:
        """Add the device time of the steps that have finished to ``gpu_seconds`` (and count them in
        ``timed_steps``); steps still running wait for a later call."""
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.popleft()
            self.gpu_seconds += start.elapsed_time(end) / 1e3
            self.timed_steps += 1
            self._spare_events += (start, end)

    def capture_graphs(self) -> None:
        """Capture every bucket's graph again (the slot buffers were reallocated), on every rank."""
        if self.mirror is not None:
            self.mirror("capture_graphs")
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture the graph of every bucket, decode and mixed, largest first into one memory pool (the smaller
        graphs reuse what the larger ones freed), each reading its views of one static buffer that holds an empty
        step until a replay's copy."""
        start = time.perf_counter()
        self._graphs.clear()  # frees the old graphs' pool
        pool = torch.cuda.graph_pool_handle()
        if self._static is None:
            size = max(packed_bytes(b.rows, b.tokens, self.max_blocks) for b in self.buckets)
            self._static = torch.zeros(size, dtype=torch.uint8, device=self.device)
        # With compile=True every decode bucket of every slot layout is one more compile of the same forward, as
        # expected; past dynamo's recompile limit (8 by default) a fullgraph compile fails.
        self._compiles += len(self.graph_sizes)
        # The limit counts per code object, and every model of a class shares its forward's: count what other
        # compiled models of the process hold too (a generous bound; no recompile happens after capture).
        limit = max(self._compiles + 64, torch._dynamo.config.recompile_limit)
        with torch._dynamo.config.patch(recompile_limit=limit):
            for bucket in tqdm(self.buckets, desc="capturing CUDA graphs", unit="graph"):
                view = self._metadata(StepPlan([], []), bucket.rows, bucket.tokens, per_sequence=True,
                                      into=self._static)
                # A replay takes its first k "keep" entries: the view holds all of them, not the empty step's one.
                view["keep"] = _split(self._static, bucket.rows, bucket.tokens, self.max_blocks, torch.int64,
                                      torch.int32)["keep"]
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._bucket_forward(view, bucket)
                torch.cuda.current_stream(self.device).wait_stream(side)
                for base in (False, True) if bucket.decode and self.base_twins else (False,):
                    graph = torch.cuda.CUDAGraph()
                    with no_adapter_tokens(base), torch.cuda.graph(graph, pool=pool):
                        out = self._bucket_forward(view, bucket)
                    self._graphs[bucket, base] = (graph, out, view)
        self._graph_layout = self.handle.slots.layout_version
        self.graph_captures += 1
        logger.info("captured %d decode graphs and their base twins (batch %d down to %d) and %d mixed graphs "
                    "(%s tokens) in %.1f s",
                    len(self.graph_sizes), self.graph_sizes[0], self.graph_sizes[-1], len(self.token_sizes),
                    "/".join(map(str, self.token_sizes)) or "no", time.perf_counter() - start)

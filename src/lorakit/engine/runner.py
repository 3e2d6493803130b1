"""The model runner: lorakit's paged KV cache and attention inside any transformers causal LM.

The model is not changed: lorakit registers an attention function with transformers' attention interface
("lorakit") and switches the model to it. Each step's tokens, from every scheduled request, go through the
model as one packed sequence ``[1, T]`` with their own positions, and one ``PagedStep`` passed as the model's
``lorakit_step`` keyword: the LoRA layers read its adapter ids, and the attention function (to which
transformers passes the keyword on) writes each layer's new keys and values into the paged cache
(``lorakit::write_kv``) and attends over each request's cached tokens (``lorakit::paged_attention``). No
per-architecture code: the layer index comes from the attention module's ``layer_idx``, and scaling, softcap
and sliding window from the arguments transformers passes.

A step whose requests all decode one token replays the CUDA graph of the smallest batch-size bucket that fits,
from static input buffers; other steps (prefill chunks) run eagerly. The graphs are captured when the runner
starts, largest first into one memory pool, and again whenever the adapters' slot buffers are reallocated.
The step's metadata goes to the device in one pinned copy; the only host sync is reading the sampled tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from tqdm import tqdm

from lorakit.engine.scheduler import StepPlan
from lorakit.layers.context import StepContext
from lorakit.ops import cdiv, paged_attention, write_kv

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
    """(layers, kv heads, head dim) from the model's config."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def graph_buckets(sizes: list[int] | None, max_num_seqs: int) -> list[int]:
    """The decode batch sizes that get a CUDA graph, largest first (the order of capture): ``sizes`` (default
    1, 2, 4, 8, then every multiple of 16) capped at max_num_seqs, which always gets one."""
    sizes = sizes or [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({min(s, max_num_seqs) for s in sizes} | {max_num_seqs}, reverse=True)


# A step's tensors, in the order _metadata packs them (then "keep"); the graphs read static copies of them.
STEP_TENSORS = ("input_ids", "positions", "lora_ids", "kv_index", "seq_lens", "query_start", "block_tables")


class ModelRunner:
    """Runs a scheduled step through the model and returns the logits of the positions that sample."""

    def __init__(self, model: nn.Module, handle, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_seq_len: int, cuda_graphs: bool = True, graph_sizes: list[int] | None = None,
                 compile: bool = False):
        self.model = model
        self.handle = handle
        self.device = handle.device
        self.block_size = block_size
        self.max_blocks = cdiv(max_seq_len, block_size)
        layers, kv_heads, head_dim = kv_shape(model)
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
        self.kv_bytes = 2 * layers * self.k_caches[0].nbytes
        model.set_attn_implementation(ATTENTION_NAME)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.graph_sizes = graph_buckets(graph_sizes, max_num_seqs)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_layout: int | None = None
        self._static: dict[str, torch.Tensor] = {}
        self._compiles = 0  # decode forwards compiled (with compile=True): one per bucket and slot layout
        self.graph_captures = 0  # times every bucket was captured: once at startup, again after each rank growth
        self.graph_replays = 0
        # Decode graphs may capture a torch.compile'd forward (fused elementwise work; one compile per bucket).
        self._decode_model = torch.compile(model, fullgraph=True, dynamic=False) if compile and self.cuda_graphs \
            else model
        if self.cuda_graphs:
            self.capture_graphs()

    # Host side: the step's metadata as one int64 vector, copied once.

    def _metadata(self, plan: StepPlan, rows: int, tokens: int) -> dict[str, torch.Tensor]:
        ids, pos, lora, kv_index, seq_lens, starts, keep = [], [], [], [], [], [0], []
        tables = []
        for item in plan.items:
            r = item.request
            n = len(item.tokens)
            ids += item.tokens
            pos += range(item.start, item.start + n)
            lora += [r.slot] * n
            kv_index += [r.blocks[p // self.block_size] * self.block_size + p % self.block_size
                         for p in range(item.start, item.start + n)]
            seq_lens.append(item.start + n)
            starts.append(starts[-1] + n)
            if item.sample:
                keep.append(starts[-1] - 1)
            tables += r.blocks + [0] * (self.max_blocks - len(r.blocks))
        pad_t, pad_s = tokens - len(ids), rows - len(plan.items)
        flat = (ids + [0] * pad_t, pos + [0] * pad_t, lora + [-1] * pad_t, kv_index + [-1] * pad_t,
                seq_lens + [0] * pad_s, starts + [starts[-1]] * pad_s, tables + [0] * (pad_s * self.max_blocks),
                keep or [max(len(ids) - 1, 0)])
        sizes = [len(f) for f in flat]
        host = torch.tensor([x for f in flat for x in f], dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        parts = dict(zip(STEP_TENSORS + ("keep",), torch.split(dev, sizes)))
        for name in ("seq_lens", "query_start", "block_tables"):
            parts[name] = parts[name].to(torch.int32)
        parts["block_tables"] = parts["block_tables"].view(rows, self.max_blocks)
        return parts

    def _forward(self, m: dict[str, torch.Tensor], keep: torch.Tensor | None, model: nn.Module | None = None):
        step = PagedStep(m["lora_ids"][None], self.k_caches, self.v_caches, m["kv_index"], m["block_tables"],
                         m["seq_lens"], m["query_start"])
        model = self.model if model is None else model
        kwargs = {} if keep is None else {"logits_to_keep": keep}
        return model(input_ids=m["input_ids"][None], position_ids=m["positions"][None], lorakit_step=step,
                     use_cache=False, **kwargs).logits[0]

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits [number of sampling items, vocab] for the plan's items with ``sample``, in order."""
        n = len(plan.items)
        if self.cuda_graphs and plan.is_decode and n <= self.graph_sizes[0]:
            if self.handle.slots.layout_version != self._graph_layout:  # slot buffers were reallocated: recapture
                self.capture_graphs()
            size = min(s for s in self.graph_sizes if s >= n)
            m = self._metadata(plan, size, size)
            for name in STEP_TENSORS:
                self._static[name][: len(m[name])].copy_(m[name])
            graph, out = self._graphs[size]
            graph.replay()
            self.graph_replays += 1
            return out[m["keep"]]
        m = self._metadata(plan, n, plan.num_tokens)
        return self._forward(m, m["keep"])

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the decode graph of every bucket, largest first, into one memory pool (the smaller graphs
        reuse what the larger ones freed), from static buffers that hold an empty step until a replay."""
        start = time.perf_counter()
        self._graphs.clear()  # frees the old graphs' pool
        pool = torch.cuda.graph_pool_handle()
        empty = self._metadata(StepPlan([], []), self.graph_sizes[0], self.graph_sizes[0])
        self._static = {name: empty[name].clone() for name in STEP_TENSORS}
        # With compile=True every bucket of every slot layout is one more compile of the same forward, as
        # expected; past dynamo's recompile limit (8 by default) a fullgraph compile fails.
        self._compiles += len(self.graph_sizes)
        # The limit counts per code object, and every model of a class shares its forward's: count what other
        # compiled models of the process hold too (a generous bound; no recompile happens after capture).
        limit = max(self._compiles + 64, torch._dynamo.config.recompile_limit)
        with torch._dynamo.config.patch(recompile_limit=limit):
            for size in tqdm(self.graph_sizes, desc="capturing CUDA graphs", unit="graph"):
                view = {name: self._static[name][: size + (name == "query_start")] for name in STEP_TENSORS}
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._forward(view, None, self._decode_model)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(view, None, self._decode_model)
                self._graphs[size] = (graph, out)
        self._graph_layout = self.handle.slots.layout_version
        self.graph_captures += 1
        logger.info("captured %d decode graphs (batch %d down to %d) in %.1f s", len(self._graphs),
                    self.graph_sizes[0], self.graph_sizes[-1], time.perf_counter() - start)

"""What every benchmark in bench/ shares: its command line, GPU timing, the rooflines measured beside it, the setup
that goes with every result, the report it writes, and the Llama-3-8B-shaped model and random adapters.

Benchmarks run as scripts (``python bench/bench_x.py``), so bench/ is on ``sys.path`` and they ``import common``.
Each owns its workload and its tables; how a number is timed, which facts describe a run and where the report
goes are decided here, once.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
import transformers
import triton
from safetensors.torch import save_file

# ---------------------------------------------------- command line


def arg_parser(doc: str, out_help: str = "folder for the .md and .json reports",
               smoke: bool = False) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc`` with ``--out DIR``; ``smoke`` adds ``--device`` (default
    cuda) and ``--tiny``, the CPU smoke run of the model benchmarks."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help=out_help)
    if smoke:
        p.add_argument("--device", default="cuda")
        p.add_argument("--tiny", action="store_true", help="a tiny model (smoke run)")
    return p


def parse_args(p: argparse.ArgumentParser, argv=None, needs_cuda: bool = True) -> argparse.Namespace:
    """Parse ``argv``; stop with a message if the run is on CUDA and there is none; create ``--out``."""
    args = p.parse_args(argv)
    if needs_cuda and getattr(args, "device", "cuda") == "cuda" and not torch.cuda.is_available():
        smoke = " (or --device cpu --tiny for a smoke run)" if hasattr(args, "tiny") else ""
        raise SystemExit(f"{p.prog} needs a CUDA device{smoke}; torch.cuda.is_available() is False")
    args.out.mkdir(parents=True, exist_ok=True)
    return args


# ---------------------------------------------------------- timing

ROTATION_BYTES = 256 << 20  # the copies of one timed problem hold at least this much (the H200's L2 is 60 MB)
MAX_COPIES = 1024


def median_ms(fn) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (its default warmup and repetitions)."""
    return triton.testing.do_bench(fn, return_mode="median")


def cuda_graph(fn, warmup=None) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after three calls of ``warmup`` (default ``fn``) on a side stream: kernels
    compile and the allocator settles outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            (warmup or fn)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_us(fn) -> float:
    """Median microseconds of one replay of ``fn`` captured in a CUDA graph."""
    return 1e3 * median_ms(cuda_graph(fn).replay)


def rotation_method(inputs: str) -> str:
    """How ``rotating_us`` times, in words, for a report; ``inputs`` names what each copy holds."""
    return (f"Per call, replayed from a CUDA graph that makes one call on each of N independent copies of {inputs}, "
            f"N chosen so the copies hold >= {ROTATION_BYTES >> 20} MB (at least 2), so no call finds its data in "
            "L2; median of triton.testing.do_bench over replays, divided by N.")


def rotating_us(run, make_copy, graph: bool = True) -> tuple[float, int]:
    """Median microseconds per call of ``run`` over N copies ``make_copy(i)`` (dicts of tensors), and N.

    With ``graph``, N is chosen so the copies hold >= ROTATION_BYTES and one CUDA graph makes one call on each
    (warmed up on copy 0); without, runs that cannot be captured (host syncs, 0.1-13 ms a call, far from L2
    effects) are timed eagerly over two copies."""
    copies = [make_copy(0)]
    nbytes = sum(v.nbytes for v in copies[0].values() if isinstance(v, torch.Tensor))
    n_copies = min(MAX_COPIES, max(2, -(-ROTATION_BYTES // nbytes))) if graph else 2
    copies += [make_copy(i) for i in range(1, n_copies)]

    def run_all():
        for c in copies:
            run(c)

    if graph:
        ms = median_ms(cuda_graph(run_all, warmup=lambda: run(copies[0])).replay)
    else:
        ms = median_ms(run_all)
    copies.clear()  # the graph is gone already: give the copies' memory back before the next problem
    torch.cuda.empty_cache()
    return 1e3 * ms / n_copies, n_copies


# ----------------------------- rooflines, measured in the same run


def copy_gbps(numel: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes) of ``numel`` bf16 elements: 2 GiB by default;
    bench_patch and bench_engine copy 1 GiB (``1 << 29``), as their published results did."""
    src = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.nbytes / (median_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def matmul_tflops(n: int = 8192) -> float:
    """bf16 matmul rate in TFLOP/s at n^3."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / (median_ms(lambda: a @ b) * 1e-3) / 1e12


def pinned_gbps(device: str = "cuda") -> float:
    """Host-to-device bandwidth from pinned memory in GB/s: median of 10 copies of 512 MB (after one more),
    timed by events."""
    src = torch.empty(512 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(src.shape, dtype=torch.uint8, device=device)
    times = []
    for _ in range(11):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return src.nbytes / statistics.median(times[1:]) / 1e9


# ---------------------------------------------- the setup of a run


def commit() -> str:
    """The commit measured: $LORAKIT_COMMIT when set (scripts/gpu-check sets it: the GPU machine's git may be
    stale), else git's HEAD, else "unknown"."""
    if os.environ.get("LORAKIT_COMMIT"):
        return os.environ["LORAKIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


# Every fact a setup can name. "gpu" and "device" are the same fact under the two keys results already use;
# "date_utc" is minutes in UTC, "date" the local day.
FACTS = {
    "gpu": _device_name,
    "device": _device_name,
    "torch": lambda device: torch.__version__,
    "triton": lambda device: triton.__version__,
    "transformers": lambda device: transformers.__version__,
    "cuda": lambda device: torch.version.cuda,
    "commit": lambda device: commit(),
    "date_utc": lambda device: datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    "date": lambda device: datetime.date.today().isoformat(),
}


def setup(*facts: str, device: str = "cuda", **fields) -> dict:
    """The setup dict of a result: the named ``facts`` (keys of FACTS) about this run on ``device``, then
    ``fields`` (shapes, options, rooflines)."""
    return {name: FACTS[name](device) for name in facts} | fields


def setup_line(s: dict) -> str:
    """The facts of setup ``s`` as a report's first line: "NVIDIA H200, torch 2.11, ..., commit abc1234, date"."""
    labels = {"torch": "torch", "triton": "triton", "transformers": "transformers", "cuda": "CUDA", "commit": "commit"}
    parts = [s["gpu"] if "gpu" in s else s["device"]] + [f"{label} {s[k]}" for k, label in labels.items() if k in s]
    return ", ".join(parts + [f"{s['date_utc']} UTC" if "date_utc" in s else s["date"]])


# --------------------------------------------------------- reports


def fmt(v, spec: str = ".1f") -> str:
    """A table cell: "-" for None, yes / NO for a bool, else ``format(v, spec)``."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return format(v, spec)


def table(head: str, rows) -> str:
    """A markdown table: ``head`` ("| a | b |"), its rule, and one line per row of cells."""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    lines += ["| " + " | ".join(map(str, cells)) + " |" for cells in rows]
    return "\n".join(lines)


def write_report(out: Path, name: str, markdown: str, results: dict) -> None:
    """Print ``markdown`` and write it to OUT/NAME.md, and ``results`` (with its setup) to OUT/NAME.json."""
    print("\n" + markdown.rstrip("\n"))
    (out / f"{name}.md").write_text(markdown.rstrip("\n") + "\n")
    (out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")


# --------------------------------------------- models and adapters

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# SmolLM2-135M's shape (the bundled model's), for random-weight runs without the bundled model.
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0)


def make_model(layers: int, tiny: bool, device: str) -> torch.nn.Module:
    """A Llama-3-8B-shaped model of ``layers`` layers with random weights (bf16; float32 on the CPU); ``tiny``:
    hidden 64, vocabulary 256."""
    if tiny:
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2)
    else:
        config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def write_adapter(model: torch.nn.Module, folder: Path, rank: int, seed: int, **config_fields) -> Path:
    """A PEFT-format adapter folder with random weights on every projection (no PEFT needed); ``config_fields``
    go into its adapter_config.json (e.g. alora_invocation_tokens)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS and hasattr(module, "in_features") and hasattr(module, "out_features"):
            # nn.Linear, or a quantized linear layer (lorakit.layers.quant) of a model made quantized
            weights[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) * 0.01
            weights[f"base_model.model.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(weights, folder / "adapter_model.safetensors")
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), bias="none",
                  **config_fields)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def random_weights(config_dir: Path):
    """(model, tokenizer): a model of ``config_dir``'s config with random bf16 weights (seed 0) on the CPU, and
    that folder's tokenizer; for ``--random-weights`` on a machine without the bundled model."""
    config = transformers.AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model, transformers.AutoTokenizer.from_pretrained(config_dir)


def word_tokenizer(vocab_size: int):
    """A tokenizer of ``vocab_size`` words, "w0" .. "w{n-1}", token id i the word "w{i}", decoded with a space
    between words, and "w0" its eos: for a random-weight model saved as a folder ``lorakit serve`` can load
    (it needs a tokenizer), fed token-id prompts. Every token decodes to text, so each streamed token shows."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # no decoder: decoding joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w0", clean_up_tokenization_spaces=False)


# --------------------------------------------- lorakit serve, as a process


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def lorakit_server(serve_args: list[str], log: Path, ready_timeout_s: float = 900.0):
    """``python -m lorakit serve SERVE_ARGS --port P`` as a child process, its output in ``log``; yields its base
    URL once ``/health`` answers. Whatever happens inside (an exception, Ctrl-C), the server is stopped on the way
    out: terminated, given 30 s to drain, then killed. A benchmark killed outright (SIGKILL: no ``finally`` runs)
    takes the server with it: the kernel kills it with this process (``lifeline.parent_death_signal``, where there is
    one), and its engine core dies with it in turn. Call it from the main thread: the kernel's signal follows the
    thread that started the server."""
    from lorakit.engine.lifeline import parent_death_signal

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as log_file:
        server = subprocess.Popen([sys.executable, "-m", "lorakit", "serve", *serve_args, "--port", str(port)],
                                  stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=parent_death_signal())
        try:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                try:
                    httpx.get(f"{url}/health", timeout=1).raise_for_status()
                    break
                except httpx.HTTPError:
                    if server.poll() is not None:
                        raise RuntimeError(f"lorakit serve exited ({server.returncode}) before it was ready; its "
                                           f"log: {log}") from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"lorakit serve was not ready after {ready_timeout_s:.0f} s; its log: "
                                           f"{log}") from None
                    time.sleep(0.25)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text page, {name: value} (labelled series and comments skipped)."""
    samples = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value and not line.startswith("#") and "{" not in name:
            samples[name] = float(value.split()[0])
    return samples

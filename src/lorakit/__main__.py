"""The ``lorakit`` command. ``lorakit serve``: the OpenAI-compatible server (lorakit.serve.cli).
``lorakit demo``: one layer's LoRA delta for a mixed batch of three adapters and the base model, through
lorakit's ops, checked against the float64 reference."""

from __future__ import annotations

import argparse
import sys

from lorakit import __version__

COMMANDS = {  # name -> its line in ``lorakit --help``
    "demo": "run one layer's multi-adapter delta and check it against the reference",
    "serve": "an OpenAI-compatible server; each request's `model` picks its adapter",
    "serve-ray": "replicas of `lorakit serve` behind Ray Serve, routed by adapter",
}
DESCRIPTION = "Serve many LoRA adapters on one base model."


def demo(device: str | None) -> int:
    import torch

    from lorakit.ops import add_lora, build_lora_meta
    from lorakit.ops.reference import lora_ref_by_slot

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    num_slots, r_max, h_in, widths = 4, 64, 512, [512, 128, 128]  # a q/k/v projection under GQA
    names = ["sql (r=8)", "chat (r=64)", "pirate (r=16)"]
    ranks = torch.tensor([[8] * 3, [64] * 3, [16] * 3, [0] * 3], dtype=torch.int32)
    A = torch.randn(num_slots, 3, r_max, h_in, generator=gen) / h_in**0.5
    B = (torch.randn(num_slots, r_max, sum(widths), generator=gen) / r_max**0.5).transpose(1, 2)
    scales = torch.full((num_slots, 3), 2.0)
    # Eleven sequences' tokens: three adapters and the base model (-1) mixed in one batch.
    slots = torch.tensor([0, 0, 0, -1, 1, 1, 2, -1, 2, 2, 0])
    x = torch.randn(len(slots), h_in, generator=gen)
    y = torch.randn(len(slots), sum(widths), generator=gen)
    x, y, A, B = (t.to(device, dtype) for t in (x, y, A, B))
    ranks, scales, slots = ranks.to(device), scales.to(device), slots.to(device)

    out = y.clone()
    add_lora(out, x, A, B, ranks, scales, build_lora_meta(slots, num_slots), widths)
    ref = lora_ref_by_slot(y, x, A, B, ranks, scales, slots, widths)
    print(f"lorakit demo on {device} ({dtype}): q/k/v widths {widths}, {num_slots} slots of R_max {r_max}")
    print(f"{'token':>5}  {'adapter':<14} {'|delta|':>8}  {'rel. error vs float64':>22}")
    for t, s in enumerate(slots.tolist()):
        delta = (out[t].double() - y[t].double()).norm().item()
        err = (out[t].double() - ref[t]).norm().item() / ref[t].norm().item()
        print(f"{t:>5}  {names[s] if s >= 0 else 'base':<14} {delta:>8.3f}  {err:>22.1e}")
    worst = ((out.double() - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
    ok = worst < (2e-2 if dtype == torch.bfloat16 else 1e-5)
    print(f"worst relative error {worst:.1e}: {'OK' if ok else 'WRONG'}")
    return 0 if ok else 1


def _top_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(prog="lorakit", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"lorakit {__version__}")
    return parser, parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")


def parser() -> argparse.ArgumentParser:
    """The ``lorakit`` command's parser, with every command's options."""
    from lorakit.serve import cli as serve_cli

    top, sub = _top_parser()
    run = sub.add_parser("demo", help=COMMANDS["demo"])
    run.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    serve_cli.add_parser(sub, COMMANDS["serve"])
    serve_cli.add_ray_parser(sub, COMMANDS["serve-ray"])
    return top


HELP_COLUMNS = 100  # the width the saved help is written at (lorakit/_help.py)


def command_help(command: str) -> str:
    """``lorakit COMMAND --help`` as the full parser writes it, at HELP_COLUMNS (imports the server: slow)."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"COLUMNS": str(HELP_COLUMNS)}):
        top = parser()
        sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
        return sub.choices[command].format_help()


def write_saved_help() -> None:
    """Rewrite lorakit/_help.py from the parser: ``python -m lorakit --write-help`` after changing an option."""
    from pathlib import Path

    saved = {name: command_help(name) for name in ("serve", "serve-ray")}
    body = "".join(f"    {name!r}: (\n" + "".join(f"        {line!r}\n" for line in text.splitlines(keepends=True))
                   + "    ),\n" for name, text in saved.items())  # a line of source per line of help: readable diffs
    Path(__file__).with_name("_help.py").write_text(
        '"""``lorakit serve --help`` and ``lorakit serve-ray --help``, saved so that they answer without importing '
        'torch.\nWritten by ``python -m lorakit --write-help``; tests/test_cli.py checks it against the parser."""\n\n'
        f"PYTHON = {tuple(sys.version_info[:2])!r}  # argparse's layout differs between Python versions\n"
        "HELP = {\n" + body + "}\n")


def saved_help(argv: list[str]) -> str | None:
    """The saved help of ``lorakit serve`` or ``serve-ray`` when ``argv`` asks for it and this Python lays it out as
    the one that saved it, else None (the parser answers)."""
    if argv and argv[0] in ("serve", "serve-ray") and ("-h" in argv or "--help" in argv):
        from lorakit._help import HELP, PYTHON

        return HELP[argv[0]] if PYTHON == sys.version_info[:2] else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--write-help"]:
        write_saved_help()
        return 0
    if (text := saved_help(argv)) is not None:  # answered without importing torch or the server, as argparse would
        print(text, end="")
        raise SystemExit(0)
    if not any(arg in COMMANDS for arg in argv):
        # --version, --help, or no command (argparse's usage error): answered without importing torch or the server
        top, sub = _top_parser()
        for name, help_ in COMMANDS.items():
            sub.add_parser(name, help=help_, add_help=False)
        top.parse_args(argv)
    from lorakit.serve import cli as serve_cli

    args = parser().parse_args(argv)
    if args.command == "serve":
        return serve_cli.run(args)
    if args.command == "serve-ray":
        return serve_cli.run_ray(args)
    return demo(args.device)


if __name__ == "__main__":
    sys.exit(main())

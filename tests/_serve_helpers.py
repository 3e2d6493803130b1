"""A tiny model, tokenizer and adapters for server tests, and `lorakit serve` live on loopback over them."""

import asyncio
import copy
import gc
import os
import threading
import time
from pathlib import Path

import openai
import torch
import transformers
import uvicorn
from peft import LoraConfig

from _peft_models import save_adapter
from _tokenizers import bpe_tokenizer
from lorakit.engine import LLM, Engine, SamplingParams
from lorakit.serve import ServeConfig, create_app, uvicorn_config

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def make_tokenizer():
    return bpe_tokenizer(["What is the capital of France? Paris is.", "hello world, the quick brown fox"],
                         chat_template=CHAT_TEMPLATE)


def build_world(tmp, chat_template: str | None = None, max_position_embeddings: int | None = None,
                save_model: bool = False):
    """(base model, tokenizer, adapter root, {name: adapter folder}) for adapters sql, chat and v2 under ``tmp``.

    After the adapters are saved: ``chat_template`` replaces the tokenizer's (on a copy of it), and
    ``max_position_embeddings`` the base model's config value (RoPE is computed, not tabled); ``save_model``
    saves the base model and tokenizer to ``tmp / "model"`` (the adapter root's sibling), for a server process."""
    tokenizer = make_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    root = tmp / "adapters"
    adapters = {}
    for seed, (name, rank) in enumerate((("sql", 4), ("chat", 8), ("v2", 16))):
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "down_proj"],
                         init_lora_weights=False)
        adapters[name] = save_adapter(base, name, cfg, root, seed=seed, std=0.3).path
    if chat_template is not None:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = chat_template
    if max_position_embeddings is not None:
        base.config.max_position_embeddings = max_position_embeddings
    if save_model:
        base.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
    return base, tokenizer, root, adapters


def run_state(state, body_of):
    """``body_of(state)`` (a coroutine) on an event loop of its own, ``state`` (a ServerState) started before it and
    stopped after it, however it ends; its result."""
    async def main():
        state.start()
        try:
            return await body_of(state)
        finally:
            state.stop()
    return asyncio.run(main())


class LiveServer:
    """``app`` served on loopback as `lorakit serve` serves it (uvicorn_config; ``http``: uvicorn's protocol class)."""

    def __init__(self, app, http=None):
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, http=http, log_level="warning",
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:  # uvicorn's thread ends without `started` if the app cannot start
            assert self.thread.is_alive() and time.monotonic() < deadline, "the live server did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # As `lorakit serve` freezes its heap once up (frontend.core.freeze_heap), without the collection before it
        # (0.1-0.5 s each, late in a run): a full collection of this process's heap (every earlier test's objects)
        # took up to 0.44 s on the server's thread, a bystander's gap a stall test cannot tell from the server's.
        gc.freeze()

    def client(self, key="none"):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        gc.unfreeze()


def start(world, adapters=("sql", "chat"), engine_options=None, http=None, **config):
    """A live server named "tiny" with ``adapters`` registered, two GPU slots, runtime loads from the root;
    ``engine_options``: other EngineConfig fields (e.g. a cpu_budget_bytes that forces CPU-tier evictions); ``http``:
    uvicorn's HTTP protocol class (default: the one it picks)."""
    base, tokenizer, root, paths = world
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=2, adapters={n: paths[n] for n in adapters},
                    block_size=4, patience=4, **(engine_options or {}))
    return LiveServer(create_app(engine, ServeConfig(model_name="tiny", lora_roots=[root], **config)), http=http)


def reference(world, prompt, adapter, adapter_path=None, **params):
    """What LLM.generate makes of ``prompt`` on ``adapter`` (None: the base model)."""
    base, tokenizer, _, adapters = world
    llm = LLM(copy.deepcopy(base), tokenizer, max_loras=1, adapters={"a": adapter_path or adapters[adapter]}
              if adapter else None, block_size=4)
    return llm.generate([prompt], SamplingParams(**params), adapters=["a" if adapter else None])[0]


class Bystander:
    """A greedy stream that runs while something hostile happens, then must finish with exactly its solo text and
    never wait longer than ``max_gap`` seconds between two chunks::

        with Bystander(server, world) as b:
            ...hostile requests...
        b.check()
    """

    PROMPT = "What is the capital of France?"

    def __init__(self, server: LiveServer, world, model: str = "tiny", adapter: str | None = None,
                 max_tokens: int = 48, max_gap: float = 5.0):
        self.server, self.model, self.max_gap = server, model, max_gap
        self.solo = reference(world, self.PROMPT, adapter, max_tokens=max_tokens, temperature=0.0,
                              ignore_eos=True).text
        self.max_tokens = max_tokens
        self.text, self.gaps, self.error = "", [], None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            stream = self.server.client().completions.create(
                model=self.model, prompt=self.PROMPT, max_tokens=self.max_tokens, temperature=0.0, stream=True,
                extra_body={"ignore_eos": True})
            last = time.perf_counter()
            for chunk in stream:
                now = time.perf_counter()
                self.gaps.append(now - last)
                last = now
                self.text += chunk.choices[0].text if chunk.choices else ""
        except Exception as e:  # noqa: BLE001 - reported by check()
            self.error = e

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.thread.join(120)

    def check(self):
        assert self.error is None, f"the bystander stream failed: {self.error!r}"
        assert self.text == self.solo, "the bystander's text differs from its solo run"
        assert max(self.gaps, default=0.0) < self.max_gap, f"the bystander waited {max(self.gaps):.1f} s for a chunk"


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), None for no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2:].split()


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie nobody reaped yet counts: it runs no more)."""
    fields = _stat(pid)
    return fields is None or fields[0] in ("Z", "X")


def children(pid: int) -> list[int]:
    """The pids of the live processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def wait_gone(pids, within: float) -> float:
    """Seconds until every process of ``pids`` has ended; fails the test if one still runs after ``within``."""
    start = time.monotonic()
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() - start < within, f"still running after {within} s: " \
                                                  f"{[pid for pid in pids if not gone(pid)]}"
        time.sleep(0.02)
    return time.monotonic() - start


def engine_pid(url: str) -> int:
    """The engine core's pid, as a server's /metrics gives it."""
    import httpx

    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    pid = int(float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("lorakit_engine_pid "))))
    assert pid > 0 and pid != os.getpid()  # (0 would signal this test's own group)
    return pid


def check_pushes(world, live, model_name: str = "tiny") -> None:
    """Adapters pushed over HTTP to ``PUT /v1/lora_adapters/NAME`` (``lorakit.serve.push``): each push a version that
    answers as the folder with the same weights does, the same content the same sha256; bad bodies refused by name
    (400) with the previous version answering after; the base model's name refused."""
    import json as _json
    from pathlib import Path

    import httpx
    from safetensors.torch import load_file

    from lorakit.serve.push import IPC_CONTENT_TYPE, push_adapter, push_body

    prompt = "What is the capital of France?"
    folders = world[3]

    def state_dict(name):
        folder = Path(folders[name])
        return (load_file(folder / "adapter_model.safetensors"),
                _json.loads((folder / "adapter_config.json").read_text()))

    def text(model):
        r = httpx.post(f"{live.url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                            "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    answers = []
    for version, source in enumerate(("sql", "chat", "sql"), start=1):
        answer = push_adapter(live.url, "pushed", *state_dict(source))
        assert (answer["lora_name"], answer["version"]) == ("pushed", version)
        answers.append(answer)
        assert text("pushed") == reference(world, prompt, source, max_tokens=8, temperature=0.0).text, source
    assert answers[0]["sha256"] == answers[2]["sha256"] != answers[1]["sha256"]
    # which version answered, and a version named: the current one, or one that is gone (no request runs on it)
    r = httpx.post(f"{live.url}/v1/completions", json={"model": "pushed@3", "prompt": prompt, "max_tokens": 8,
                                                        "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["lorakit"] == {"adapter": "pushed", "version": 3,
                                                            "sha256": answers[2]["sha256"]}, r.text
    assert text("pushed@3") == reference(world, prompt, "sql", max_tokens=8, temperature=0.0).text
    for gone in ("pushed@1", "pushed@99", "pushed@x"):
        r = httpx.post(f"{live.url}/v1/completions", json={"model": gone, "prompt": prompt, "max_tokens": 8})
        assert r.status_code == 404 and "version" in r.json()["error"]["message"], (gone, r.text)
    body = push_body(*state_dict("chat"))
    url = f"{live.url}/v1/lora_adapters/pushed"
    for bad, phrase in ((body[:-64], "not a readable safetensors file"),
                        (body[:6], "has 6 bytes: not a readable safetensors file"),
                        (push_body(state_dict("chat")[0], {}) .replace(b"adapter_config", b"adapter_confog"),
                         "no 'adapter_config'")):
        r = httpx.put(url, content=bad, timeout=120)
        assert r.status_code == 400 and phrase in r.json()["error"]["message"], r.text
    # through CUDA IPC: a malformed description, and a handle that cannot be opened here (no CUDA device on the CPU;
    # on a GPU, not a live allocation), each refused by name
    ipc = {"content-type": IPC_CONTENT_TYPE}
    shared = {"device": 0, "handle": "aGFuZGxl", "size": 1024, "storage_offset": 0, "ref_counter": "L3RvcmNoXzFfMl8z",
              "ref_counter_offset": 0, "event": "", "event_sync_required": False,
              "tensors": [["base_model.model.x.lora_A.weight", "float32", [2, 2], 0]]}
    for bad, phrase in (({"config": {}}, "malformed"), ({"config": {}, "cuda_ipc": {**shared, "size": "big"}},
                                                        "malformed"),
                        ({"config": state_dict("chat")[1], "cuda_ipc": shared}, "CUDA")):
        r = httpx.put(url, content=_json.dumps(bad), headers=ipc, timeout=120)
        assert r.status_code == 400 and phrase in r.json()["error"]["message"], r.text
    assert text("pushed") == reference(world, prompt, "sql", max_tokens=8, temperature=0.0).text  # v3 still
    r = httpx.put(f"{live.url}/v1/lora_adapters/{model_name}", content=body, timeout=60)
    assert r.status_code == 400 and "base model's name" in r.text
    # a push naming its version (a training step): above every number the name has had, else 409 and v3 serves on
    assert push_adapter(live.url, "pushed", *state_dict("chat"), version=40)["version"] == 40
    for taken, status in (("40", 409), ("7", 409), ("0", 400), ("x", 400)):
        r = httpx.put(f"{url}?version={taken}", content=body, timeout=60)
        assert r.status_code == status and "version" in r.json()["error"]["message"], (taken, r.text)
    assert text("pushed") == reference(world, prompt, "chat", max_tokens=8, temperature=0.0).text
    assert push_adapter(live.url, "pushed", *state_dict("sql"))["version"] == 41
    assert httpx.post(f"{live.url}/v1/unload_lora_adapter", json={"lora_name": "pushed"}).status_code == 200

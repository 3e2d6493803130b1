"""vLLM's /tokenize, /detokenize and /tokenizer_info on one live tiny server: round trips against the model's and an
adapter's own tokenizer (with the tokens it adds), the errors in OpenAI's shape, and lm-evaluation-harness's
local-completions scoring a multiple-choice task with only ``model`` and ``base_url`` (its remote tokenizer)."""

import copy
import json
import logging

import httpx
import pytest
from peft import LoraConfig, get_peft_model

from _serve_helpers import CHAT_TEMPLATE, build_world, start
from lorakit.serve.protocol import error_status

ADDED = ["<sql>", "</sql>"]


def tagged_adapter(world, tmp):
    """An adapter folder under the root that adds ADDED (trainable rows for the new ids, on the embedding and the
    head) and carries its tokenizer, which knows them."""
    base, tokenizer, root, _ = world
    vocab = base.config.vocab_size
    model = copy.deepcopy(base)
    model.resize_token_embeddings(vocab + len(ADDED), mean_resizing=False)
    new = list(range(vocab, vocab + len(ADDED)))
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False,
                                            trainable_token_indices={"embed_tokens": new, "lm_head": new}))
    folder = root / "tagged"
    peft.save_pretrained(folder)
    own = copy.deepcopy(tokenizer)
    own.add_tokens(ADDED, special_tokens=True)
    own.save_pretrained(folder)
    return folder, own


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """(server, world, the tagged adapter's tokenizer): one server for the module, with sql and tagged registered."""
    tmp = tmp_path_factory.mktemp("tokenize")
    world = build_world(tmp)
    folder, own = tagged_adapter(world, tmp)
    base, tokenizer, root, paths = world
    server = start((base, tokenizer, root, {**paths, "tagged": folder}), adapters=("sql", "tagged"))
    yield server, world, own
    server.close()


def post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, (r.status_code, r.text[:500])
    return r.json()


def error_of(r: dict, status: int, param: str | None) -> str:
    error = r["error"]
    assert set(error) == {"message", "type", "param", "code"} and error_status(error["code"]) == status, error
    assert error["param"] == param, error
    return error["message"]


TEXT = "hello world, the quick brown fox"


def test_tokenize_is_the_tokenizers_encode_and_detokenize_inverts_it(live):
    server, world, _ = live
    tokenizer = world[1]
    for model in (None, "tiny", "sql"):  # no model: the base model's, as vLLM
        named = {} if model is None else {"model": model}
        for special in (True, False):
            ids = tokenizer.encode(TEXT, add_special_tokens=special)
            got = post(server, "/tokenize", {**named, "prompt": TEXT, "add_special_tokens": special})
            assert got == {"count": len(ids), "max_model_len": 128, "tokens": ids, "token_strs": None}
        got = post(server, "/tokenize", {**named, "prompt": TEXT, "return_token_strs": True})
        assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
        assert post(server, "/detokenize", {**named, "tokens": got["tokens"]}) == {"prompt": TEXT}
    eos = post(server, "/tokenize", {"prompt": "<eos>", "add_special_tokens": False})["tokens"]
    assert eos == [tokenizer.eos_token_id]
    assert post(server, "/detokenize", {"tokens": eos + eos}) == {"prompt": "<eos><eos>"}  # special tokens kept
    assert post(server, "/tokenize", {"prompt": ""})["tokens"] == tokenizer.encode("")  # vLLM: no 400


def test_an_adapters_tokenizer_and_its_added_tokens(live):
    """The tagged adapter's own tokenizer reads <sql> as one added id; the base model's does not, and refuses to
    detokenize it (a token only that adapter has)."""
    server, world, own = live
    text = "hello <sql>world</sql>"
    got = post(server, "/tokenize", {"model": "tagged", "prompt": text, "return_token_strs": True})
    assert got["tokens"] == own.encode(text) and own.convert_tokens_to_ids("<sql>") in got["tokens"]
    assert "<sql>" in got["token_strs"]
    assert post(server, "/detokenize", {"model": "tagged", "tokens": got["tokens"]}) == {"prompt": text}
    plain = post(server, "/tokenize", {"prompt": text})["tokens"]
    assert plain == world[1].encode(text) and not set(plain) & set(own.convert_tokens_to_ids(ADDED))
    message = error_of(post(server, "/detokenize", {"tokens": got["tokens"]}, 400), 400, "tokens")
    assert "outside the vocabulary [0, " in message
    info = httpx.get(f"{server.url}/tokenizer_info", params={"model": "tagged"}, timeout=60).json()
    assert "<sql>" in json.dumps(info["added_tokens_decoder"])


def test_the_chat_form_is_what_a_chat_completion_renders(live):
    server, world, own = live
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello <sql>"}]
    rendered = "<system>be brief\n<user>hello <sql>\n<assistant>"
    for model, tokenizer in (("sql", world[1]), ("tagged", own)):
        got = post(server, "/tokenize", {"model": model, "messages": messages})
        assert got["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
        r = post(server, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1})
        assert r["usage"]["prompt_tokens"] == got["count"]
    for field, value in (("add_generation_prompt", False), ("continue_final_message", True),
                         ("add_special_tokens", True)):
        message = error_of(post(server, "/tokenize", {"messages": messages, field: value}, 400), 400, field)
        assert "send" in message


def test_tokenizer_info_has_what_lm_evals_remote_tokenizer_reads(live):
    server, world, _ = live
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=60).json()
    assert info["tokenizer_class"] == type(world[1]).__name__
    assert info["eos_token"] == "<eos>" and info["bos_token"] is None and "pad_token" in info
    assert info["chat_template"] == CHAT_TEMPLATE
    assert not {"name_or_path", "vocab_file", "tokenizer_file"} & set(info)  # no file paths of the server


def test_unknown_models_and_bad_bodies_are_openai_errors(live):
    server, _, _ = live
    for path, body in (("/tokenize", {"model": "nope", "prompt": "hi"}), ("/detokenize", {"model": "nope",
                                                                                            "tokens": [1]})):
        assert "the model 'nope' does not exist" in error_of(post(server, path, body, 404), 404, "model")
    r = httpx.get(f"{server.url}/tokenizer_info", params={"model": "nope"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    bad = [("/tokenize", {"model": "tiny"}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
           ("/tokenize", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
           ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
           ("/tokenize", {"messages": []}, "messages"),
           ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
           ("/detokenize", {"tokens": "hi"}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
           ("/detokenize", {"tokens": [2**70]}, "tokens"), ("/detokenize", {"tokens": [[1]]}, "tokens.0")]
    for path, body, param in bad:
        error_of(post(server, path, body, 400), 400, param)
    r = httpx.post(f"{server.url}/tokenize", content=b"{", headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"
    message = error_of(post(server, "/tokenize", {"prompt": "x" * (32 * 128 + 1)}, 400), 400, "prompt")
    assert "--max-prompt-chars" in message
    long = post(server, "/tokenize", {"prompt": "hello world " * 200})  # past the context: counted, not refused
    assert long["count"] > long["max_model_len"]


def test_the_api_key_guards_them(tmp_path):
    world = build_world(tmp_path)
    server = start(world, adapters=(), api_key="sekret")
    try:
        for method, path, body in (("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/tokenizer_info", None)):
            assert httpx.request(method, server.url + path, json=body, timeout=60).status_code == 401
            r = httpx.request(method, server.url + path, json=body, headers={"Authorization": "Bearer sekret"},
                              timeout=60)
            assert r.status_code == 200, r.text
    finally:
        server.close()


TASK = """task: lorakit_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
QUESTIONS = [("What is the capital of France?", ["Paris", "the fox", "world"], 0),
             ("hello", ["world", "brown", "quick"], 0),
             ("the quick brown", ["fox", "France", "capital"], 0),
             ("Paris is", ["the capital", "hello", "quick"], 1)]


def test_lm_eval_local_completions_scores_a_task_with_only_model_and_base_url(live, tmp_path, monkeypatch, caplog):
    """lm-eval finds the remote tokenizer itself (tokenizer_backend "auto": /tokenizer_info, then /tokenize), so no
    tokenizer is named or downloaded; its loglikelihood requests (token ids, echo, logprobs, max_tokens 1) all get a
    200, and each choice's loglikelihood is the server's own score of that continuation's tokens."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # no download: it would fail
        monkeypatch.setenv(name, "1")  # (before datasets is imported: it reads them then)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    server, world, _ = live
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=data))
    caplog.set_level(logging.INFO)
    before = responses(server)
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args={"model": "sql", "base_url": f"{server.url}/v1/completions"},
        tasks=["lorakit_tiny_mc"], log_samples=True,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False))  # not its thousands of tasks
    acc = results["results"]["lorakit_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    tokenizer = world[1]
    assert len(results["samples"]["lorakit_tiny_mc"]) == len(QUESTIONS)
    for sample in results["samples"]["lorakit_tiny_mc"]:
        for (context, continuation), [(loglikelihood, _)] in zip(sample["arguments"], sample["resps"]):
            whole = tokenizer.encode(context + continuation, add_special_tokens=False)
            start = len(tokenizer.encode(context, add_special_tokens=False))
            assert loglikelihood == pytest.approx(scored(server, whole, start), abs=1e-4)
    assert "Using remote tokenizer" in caplog.text
    seen = {key: n - before.get(key, 0) for key, n in responses(server).items() if n > before.get(key, 0)}
    assert {status for _, status in seen} == {"200"}, seen  # the server saw no error
    assert {endpoint for endpoint, _ in seen} >= {"/tokenizer_info", "/tokenize", "/v1/completions"}, seen


def scored(server, ids: list[int], start: int) -> float:
    """The log-probability of ids[start:] after ids[:start], as the server scores a prompt (echo, max_tokens 0)."""
    r = post(server, "/v1/completions", {"model": "sql", "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})
    return sum(r["choices"][0]["logprobs"]["token_logprobs"][start:len(ids)])


def responses(server) -> dict[tuple[str, str], float]:
    """The server's responses so far, by (endpoint, status), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    return {(s.labels["endpoint"], s.labels["status"]): s.value for family in text_string_to_metric_families(text)
            if family.name == "lorakit_requests" for s in family.samples if s.name.endswith("_total")}

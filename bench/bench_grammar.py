"""Hostile structured-output grammars beside a bystander: ``lorakit serve`` (the engine core process by default) on
a tiny random Llama on the CPU, one attack at a time while a greedy stream runs and /health is polled.

Measured per attack: the bystander's largest wait for a chunk (from sending a request to its first chunk, and
between chunks; a new stream starts as soon as one ends), /health's slowest answer, and the attack's request time
(its slowest request) and HTTP statuses. Before any attack, the same numbers with nothing else running. The
attacks are those of lorakit issue 29: a JSON schema of 8,000 optional properties, 8 concurrent schemas of 2,000
(each its own), a 60,000-value enum, a 60,000-way regex, and a 600-property schema for 4 prompts x n=16.

    PYTHONPATH=src python bench/bench_grammar.py --out DIR [--engine-in-process] [-- other lorakit serve flags]
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
import transformers
from common import arg_parser, lorakit_server, parse_args, setup, setup_line, table, write_report

PROMPT = "What is the capital of France?"


def byte_tokenizer():
    """A byte-level BPE of 300 tokens trained here on a little English and JSON (every string is expressible)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([PROMPT + " Paris is.", '{"name": "value", "count": 3}', "hello world"] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False)


def tiny_model(folder: Path) -> Path:
    tokenizer = byte_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def schema(properties: int, prefix: str = "p") -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"{prefix}{i:04d}": {"type": "string"} for i in range(properties)}}}}


def attacks() -> dict[str, list[dict]]:
    """Each attack's request bodies (sent at once)."""
    one = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return {
        "8,000 optional properties": [one | {"response_format": schema(8000)}],
        "8 concurrent 2,000-property": [one | {"response_format": schema(2000, f"s{k}_")} for k in range(8)],
        "60,000-value enum": [one | {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"enum": [f"value{i}" for i in range(60000)]}}}}],
        "60,000-way regex": [one | {"guided_regex": "|".join(f"w{i}" for i in range(60000))}],
        "600 properties, 4 prompts x n=16": [one | {"prompt": [PROMPT] * 4, "n": 16, "max_tokens": 4,
                                                    "temperature": 0.7, "response_format": schema(600)}],
    }


class Watch:
    """The bystander streams and the /health poller, each keeping its largest wait since ``reset``."""

    def __init__(self, url: str):
        self.url, self.stop = url, threading.Event()
        self.gap = self.health = 0.0
        self.texts: set[str] = set()
        self.threads = [threading.Thread(target=self._stream, daemon=True),
                        threading.Thread(target=self._poll, daemon=True)]
        for thread in self.threads:
            thread.start()

    def reset(self) -> None:
        self.gap = self.health = 0.0

    def _stream(self) -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                last, text = time.perf_counter(), ""
                with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            now = time.perf_counter()
                            self.gap, last = max(self.gap, now - last), now
                            text += json.loads(line[6:])["choices"][0]["text"]
                self.texts.add(text)

    def _poll(self) -> None:
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                client.get(f"{self.url}/health")
                self.health = max(self.health, time.perf_counter() - start)
                time.sleep(0.05)


def attack(url: str, bodies: list[dict]) -> tuple[float, list[int], str]:
    """Every body sent at once: the slowest request's seconds, the statuses, the first error's message."""
    def send(body):
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        return time.perf_counter() - start, r.status_code, r.json().get("error", {}).get("message", "") \
            if r.status_code != 200 else ""
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(send, bodies))
    return max(s for s, _, _ in results), sorted(c for _, c, _ in results), next((m for *_, m in results if m), "")


def main(argv=None) -> None:
    p = arg_parser(__doc__)
    p.add_argument("--engine-in-process", action="store_true", help="the engine on a thread of the server")
    p.add_argument("serve_flags", nargs="*", help="more lorakit serve flags (after --)")
    args = parse_args(p, argv, needs_cuda=False)
    folder = tiny_model(args.out / "model")
    flags = ["--model", str(folder), "--served-model-name", "tiny", "--device", "cpu", "--block-size", "4",
             *(["--engine-in-process"] if args.engine_in_process else []), *args.serve_flags]
    rows, results = [], {}
    with lorakit_server(flags, args.out / "bench_grammar_server.log") as url:
        watch = Watch(url)
        time.sleep(3)
        watch.reset()
        time.sleep(3)
        rows.append(["nothing (3 s)", f"{watch.gap:.2f}", f"{watch.health:.2f}", "-", "-", ""])
        results["idle"] = {"gap_s": watch.gap, "health_s": watch.health}
        for name, bodies in attacks().items():
            watch.reset()
            seconds, statuses, message = attack(url, bodies)
            time.sleep(0.5)
            rows.append([name, f"{watch.gap:.2f}", f"{watch.health:.2f}", f"{seconds:.2f}",
                         ",".join(map(str, sorted(set(statuses)))), message[:90].replace("|", "/")])
            results[name] = {"gap_s": watch.gap, "health_s": watch.health, "request_s": seconds,
                             "statuses": statuses, "message": message[:300]}
            print(rows[-1], flush=True)
        watch.stop.set()
        results["bystander_texts"] = len(watch.texts)  # one: every bystander stream got the same greedy text
    log = (args.out / "bench_grammar_server.log").read_bytes()
    s = setup("device", "torch", "commit", "date_utc", device="cpu", log_bytes=len(log),
              engine="in-process" if args.engine_in_process else "core process", flags=flags[6:])
    markdown = "\n\n".join([
        "# Hostile grammars beside a bystander (lorakit serve, tiny random Llama, CPU)",
        setup_line(s) + f"; engine: {s['engine']}; server log: {len(log)} bytes; bystander texts: "
                        f"{results['bystander_texts']}",
        table("| attack | bystander largest gap (s) | /health slowest (s) | request (s) | status | error |", rows)])
    write_report(args.out, "bench_grammar", markdown, {"setup": s, "results": results})


if __name__ == "__main__":
    sys.exit(main())

"""What per-request logit processing costs a decode step: penalties, logit_bias and structured output.

The engine on the bundled SmolLM2-135M-Instruct (bf16, CUDA graphs), a batch of B requests over the base model and the three demo adapters, all decoding.
Rows: every request plain (greedy), with presence + frequency + repetition penalties, with a logit_bias of 3
ids, constrained by a regex that keeps it going, or by a JSON schema. Reported per row: the median wall time of
a decode step with all B requests running, and its ratio to the plain step measured in the same run (the
forward pass is the same CUDA graph in every row; the difference is the host's mask and metadata work and the
few elementwise kernels on [B, V] logits).

    PYTHONPATH=src python bench/bench_logits.py --out DIR [--batch 64] [--steps 48] [--random-weights CONFIG_DIR]

``--random-weights`` runs random weights of the config and tokenizer in CONFIG_DIR (same shapes and work per
token) on a machine without the bundled model.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from common import (arg_parser, fmt, parse_args, random_weights, setup, setup_line, table,
                    write_report)  # bench/ is on sys.path when this file runs as a script

from lorakit import LLM, SamplingParams
from lorakit.engine.structured import StructuredOutput
from lorakit.serve.model import bundled_adapters, load_model

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 400},
                                           "notes": {"type": "array", "items": {"type": "string"}}},
          "required": ["answer", "notes"]}
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Name a fruit that is yellow.",
             "Who wrote Hamlet?"]


def rows(steps: int) -> dict[str, SamplingParams]:
    base = dict(max_tokens=steps + 1, temperature=0.0)
    return {
        "plain": SamplingParams(**base, ignore_eos=True),
        "penalties": SamplingParams(**base, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3,
                                    repetition_penalty=1.2),
        "logit_bias": SamplingParams(**base, ignore_eos=True, logit_bias={11: 2.0, 198: -5.0, 1000: 1.0}),
        "regex": SamplingParams(**base, structured_output=StructuredOutput(regex=f"[a-z ,.]{{{4 * steps}}}")),
        "json_schema": SamplingParams(**base, structured_output=StructuredOutput.json_schema(SCHEMA)),
    }


def step_times(llm: LLM, prompts: list[list[int]], adapters: list[str | None], params: SamplingParams,
               steps: int) -> tuple[float, int]:
    """Median wall ms of the decode steps in which every request is running, and how many there were."""
    engine = llm.engine
    for prompt, adapter in zip(prompts, adapters):
        engine.add_request(prompt, params, adapter)
    times = []
    while engine.has_unfinished():
        full = len(engine.scheduler.running) == len(prompts) and not engine.scheduler.waiting
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = engine.step()
        torch.cuda.synchronize()  # the step's own token read already waits; this only fences the timer
        if full and all(not o.finished for o in outs) and len(outs) == len(prompts):
            times.append(1e3 * (time.perf_counter() - start))
    return (statistics.median(times[2:]) if len(times) > 2 else float("nan")), len(times)


def main(argv=None) -> int:
    p = arg_parser(__doc__)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--random-weights", type=Path, metavar="CONFIG_DIR")
    args = parse_args(p, argv)
    if args.random_weights:
        model, tokenizer = random_weights(args.random_weights)
        model = model.cuda().eval()
    else:
        model, tokenizer, _ = load_model(None, "cuda", "bfloat16")
    adapters = bundled_adapters()
    llm = LLM(model, tokenizer, max_loras=4, adapters=adapters, max_num_seqs=args.batch, max_seq_len=512)
    names = [None, *adapters]
    prompts, which = [], []
    for i in range(args.batch):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                            add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        which.append(names[i % len(names)])
    step_times(llm, prompts, which, rows(8)["plain"], 8)  # warm up: graphs captured, adapters resident
    results = {}
    for name, params in rows(args.steps).items():
        ms, n = step_times(llm, prompts, which, params, args.steps)
        results[name] = {"step_ms": ms, "steps_timed": n}
    plain = results["plain"]["step_ms"]
    s = setup("gpu", "torch", "triton", "commit", "date", batch=args.batch, steps=args.steps,
              model=("random weights of SmolLM2-135M-Instruct's shape" if args.random_weights else
                     "bundled SmolLM2-135M-Instruct") + ", bf16, CUDA graphs, base + 3 demo adapters round robin")
    rows_md = table("| every request | step ms (median) | / plain | steps timed |",
                    ([name, fmt(r["step_ms"], ".2f"), fmt(r["step_ms"] / plain, ".2f"), r["steps_timed"]]
                     for name, r in results.items()))
    report = (f"# bench_logits: decode step with per-request logit processing, batch {args.batch}\n\n"
              f"{setup_line(s)}. {s['model']}.\n\n{rows_md}")
    write_report(args.out, "bench_logits", report, {"setup": s, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

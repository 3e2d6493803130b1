"""One owner per setting: ``EngineConfig`` validates once, holds the one default the CLI, ``Engine``, ``LLM`` and
``patch`` share, and an engine refuses a model patched with another layout instead of ignoring its settings;
an adapter's tokenizer is read when it is registered, never later."""

import argparse
import copy
import dataclasses
import pathlib

import pytest

import lorakit
from _peft_models import save_adapter, tiny_model
from helpers import word_tokenizer
from lorakit.engine import Engine, EngineConfig
from lorakit.adapters.pool import CPU_BUDGET_BYTES, AdapterPool
from lorakit.layers import PatchConfig
from lorakit.serve import cli


@pytest.mark.parametrize("field, value, message", [
    ("max_loras", 0, "max_loras must be a positive int"), ("max_rank", -1, "max_rank must be a positive int"),
    ("max_num_seqs", 0, "max_num_seqs must be an int >= 1, got 0"), ("max_seq_len", 1, "max_seq_len must be an int >= 2"),
    ("block_size", "16", "block_size must be an int >= 1, got '16'"), ("num_blocks", 0, "num_blocks must be"),
    ("block_size", 12, "block_size must be a power of two .8, 16, 32, ...., got 12"),
    ("patience", -1, "patience must be an int >= 0"), ("cuda_graphs", 1, "cuda_graphs must be True or False"),
    ("graph_sizes", (4, 0), "graph_sizes must be positive ints"), ("cpu_budget_bytes", -5, "cpu_budget_bytes must"),
])
def test_bad_settings_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_one_default_for_each_setting():
    config = EngineConfig()
    assert config.max_rank == PatchConfig.max_rank and config.max_loras is None  # auto: from the device's memory
    assert config.cpu_budget_bytes == CPU_BUDGET_BYTES
    for fn in (lorakit.patch, AdapterPool.__init__):
        defaults = {k: v.default for k, v in __import__("inspect").signature(fn).parameters.items()}
        assert defaults.get("max_rank", config.max_rank) == config.max_rank
        assert defaults.get("cpu_budget_bytes", config.cpu_budget_bytes) == config.cpu_budget_bytes
    assert EngineConfig(graph_sizes=[1, 8]).graph_sizes == (1, 8)  # frozen: a tuple


def test_serve_flags_are_the_config_fields():
    sub = argparse.ArgumentParser(prog="lorakit").add_subparsers()
    cli.add_parser(sub)
    parser = sub.choices["serve"]
    flags = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for f in EngineConfig.cli_fields():
        assert f.metadata["flag"] in flags, f.name
    assert cli.engine_config(parser.parse_args([])) == EngineConfig()
    assert parser.parse_args(["--max-loras", "auto"]).max_loras is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-loras", "many"])
    args = parser.parse_args(["--max-loras", "3", "--no-cuda-graphs", "--compile", "--patience", "0"])
    assert cli.engine_config(args) == EngineConfig(max_loras=3, cuda_graphs=False, compile=True, patience=0)
    unexposed = {f.name for f in dataclasses.fields(EngineConfig)} - {f.name for f in EngineConfig.cli_fields()}
    # API-only, on purpose
    assert unexposed == {"graph_sizes", "graph_token_sizes", "cpu_budget_bytes", "base_twins", "fuse_siblings"}


def test_engine_takes_a_config_or_keywords_and_resolves_it():
    base = tiny_model("llama", seed=1)
    engine = Engine(copy.deepcopy(base), config=EngineConfig(max_loras=2), block_size=4)
    assert engine.config.max_loras == 2 and engine.config.block_size == 4
    assert engine.config.max_seq_len == engine.max_seq_len and engine.config.num_blocks == engine.blocks.num_free
    assert engine.pool.num_slots == engine.handle.num_slots == 2
    with pytest.raises(TypeError, match="max_lora"):
        Engine(copy.deepcopy(base), max_lora=2)  # a misspelt setting is not ignored


def test_a_model_patched_with_another_layout_is_refused():
    model = copy.deepcopy(tiny_model("llama", seed=1))
    lorakit.patch(model, max_loras=2, max_rank=32)
    with pytest.raises(ValueError, match="already patched with max_loras=2, max_rank=32.*asks for max_loras=8, "
                                         "max_rank=64"):
        Engine(model, max_loras=8)
    with pytest.raises(ValueError, match="already patched with max_loras=2, max_rank=32.*asks for max_loras=2, "
                                         "max_rank=64"):
        Engine(model)  # auto: the slots it has
    assert Engine(model, max_loras=2, max_rank=32).pool.num_slots == 2


def test_an_adapters_tokenizer_is_read_at_registration_only(tmp_path):
    from peft import LoraConfig

    base = tiny_model("llama", seed=1)
    folder = pathlib.Path(save_adapter(base, "a", LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False),
                          tmp_path, seed=0).path)
    engine = Engine(copy.deepcopy(base), word_tokenizer(), max_loras=1, adapters={"a": folder})
    word_tokenizer(["<x>"]).save_pretrained(folder)  # added after registration: not read
    assert engine.registry.tokenizer_for("a") is engine.tokenizer
    engine.register_adapter("a", folder)  # a new version reads it
    own = engine.registry.tokenizer_for("a")
    assert own is not engine.tokenizer and "<x>" in own.get_vocab()
    (folder / "tokenizer.json").write_text("{ not json")
    with pytest.raises(lorakit.AdapterError, match="adapter 'b' at .*its tokenizer cannot be read"):
        engine.register_adapter("b", folder)
    assert "b" not in engine.pool.adapters


def test_slot_buffers_fit_the_startup_adapters_before_any_request(tmp_path):
    """The engine grows the slot buffers to the ranks of the adapters it starts with, so its CUDA graphs (captured
    at startup) are never recaptured for them while serving: no layout change from the first requests."""
    from peft import LoraConfig

    from lorakit.engine import SamplingParams

    base = tiny_model("llama", seed=1)
    folders = {f"r{r}": pathlib.Path(save_adapter(base, f"r{r}", LoraConfig(r=r, target_modules=["q_proj", "v_proj"],
                                                                             init_lora_weights=False),
                                                  tmp_path, seed=r).path) for r in (4, 24)}
    engine = Engine(copy.deepcopy(base), max_loras=2, adapters=folders)
    version = engine.handle.slots.layout_version
    assert version >= 1 and engine.pool.stats.loads == 0  # grown from the headers, no weights read
    assert {layer.r_max for name, layer in engine.handle.layers.items() if "q_proj" in name} == {32}
    for name in (*folders, None):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0), name)
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.stats.loads == 2 and engine.handle.slots.layout_version == version


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_slot_bytes_read_before_patching_are_what_a_slot_takes(family):
    from lorakit.layers.patch import slot_bytes

    model = copy.deepcopy(tiny_model(family, seed=1))
    before = {r: slot_bytes(model, r) for r in (8, 16, 40, 64)}
    handle = lorakit.patch(model, max_loras=3)
    assert before == {r: handle.slot_bytes(r) // 3 for r in before}


def test_max_loras_auto_takes_a_tenth_of_the_memory_and_the_kv_cache_shares_the_rest(monkeypatch):
    """auto: as many slots as ADAPTER_SHARE of the free memory holds at max_rank (1 to 64); the KV cache gets KV_SHARE
    of it less what the slots will take at max_rank (one budget: more slots, fewer KV blocks)."""
    from lorakit.engine import build as build_module
    from lorakit.engine.runner import kv_shape
    from lorakit.layers.patch import slot_bytes

    base = tiny_model("llama", seed=1)
    per_slot = slot_bytes(base, 64)
    layers, heads, dim = kv_shape(base)
    per_block = 2 * layers * 4 * heads * dim * 4  # block_size 4, float32
    for slots in (3, 1, 64):
        memory = int(slots * per_slot / build_module.ADAPTER_SHARE) + 1000
        monkeypatch.setattr(build_module, "CPU_MEMORY", memory)
        engine = Engine(copy.deepcopy(base), block_size=4, max_num_seqs=10**6, max_seq_len=64)
        assert engine.config.max_loras == engine.pool.num_slots == slots
        budget = int(build_module.KV_SHARE * memory) - engine.handle.slot_bytes(64)
        assert engine.config.num_blocks == budget // per_block
    monkeypatch.setattr(build_module, "CPU_MEMORY", 1000 * 64 * per_slot)
    assert Engine(copy.deepcopy(base), block_size=4).config.max_loras == build_module.AUTO_MAX_LORAS
    monkeypatch.setattr(build_module, "CPU_MEMORY", per_slot)
    assert Engine(copy.deepcopy(base), block_size=4, num_blocks=64).config.max_loras == 1  # at least one
    assert Engine(copy.deepcopy(base), max_loras=5, block_size=4, num_blocks=64).config.max_loras == 5  # as asked

"""PEFT adapter folders: every module's A, B, rank and scale equal PEFT's own (and give PEFT's forward), and
every adapter lorakit cannot serve is refused with a message naming the adapter, the module and the problem."""

import copy
import json
import logging
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.config import MontecloraConfig, VeloraConfig
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.pytorch_utils import Conv1D

from helpers import edit_config
from lorakit.peft import (AdapterError, BaseModule, ModuleLora, PeftAdapter, inspect_peft_adapter,
                          load_peft_adapter, read_adapter_config)

pytestmark = pytest.mark.filterwarnings("ignore")  # PEFT warns about fan_in_fan_out, embedding saving, ...

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"]
Q = "model.layers.0.self_attn.q_proj"  # a module name in the base model
QKEY = f"base_model.model.{Q}"  # and its prefix in the weights file


def tiny_llama(**kw):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128, **kw)).eval()


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)).eval()


def base_modules_of(model) -> dict[str, BaseModule]:
    """What lorakit.patch finds: every linear and embedding, the input embedding and output head marked."""
    out = {}
    for name, m in model.named_modules():
        role = ("input" if m is model.get_input_embeddings() else
                "output" if m is model.get_output_embeddings() else None)
        if isinstance(m, torch.nn.Linear):
            out[name] = BaseModule("linear", m.in_features, m.out_features, role)
        elif isinstance(m, Conv1D):  # GPT-2 stores weight [in, out]
            out[name] = BaseModule("linear", m.weight.shape[0], m.weight.shape[1], role)
        elif isinstance(m, torch.nn.Embedding):
            out[name] = BaseModule("embedding", m.num_embeddings, m.embedding_dim, role)
    return out


def save_peft(model, config: LoraConfig, path, seed=0):
    """Wrap ``model`` (in place), give every LoRA weight random nonzero values, save; returns the PEFT model."""
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(path)
    return peft_model.eval()


def is_tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def load_like_peft(model, config: LoraConfig, path, dtype=torch.float32):
    base, tied = base_modules_of(model), is_tied(model)
    peft_model = save_peft(model, config, path)
    return load_peft_adapter("sql", path, base, dtype, tied=tied), peft_model


def check_matches_peft(adapter: PeftAdapter, peft_model):
    """Same modules, A, B, rank and scale as PEFT's layers, and the same output delta on random inputs."""
    ref = {name: m for name, m in peft_model.base_model.model.named_modules()
           if isinstance(m, LoraLayer) and ("default" in m.lora_A or "default" in m.lora_embedding_A)}
    assert set(adapter.modules) == set(ref)
    gen = torch.Generator().manual_seed(1)
    for name, layer in ref.items():
        got = adapter.modules[name]
        assert got.rank == layer.r["default"] and got.scale == layer.scaling["default"], name
        with torch.no_grad():
            if "default" in layer.lora_A:
                A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
                x = torch.randn(5, got.A.shape[1], generator=gen)
                ours = got.scale * (x @ got.A.T) @ got.B.T
            else:
                A, B = layer.lora_embedding_A["default"], layer.lora_embedding_B["default"]
                x = torch.randint(0, got.A.shape[1], (5,), generator=gen)
                ours = got.scale * F.embedding(x, got.A.T) @ got.B.T
            want = layer(x) - layer.base_layer(x)
        assert torch.equal(got.A, A) and torch.equal(got.B, B), name
        assert (ours - want).norm() <= 1e-5 * want.norm(), name


def test_llama_every_target_with_patterns_matches_peft(tmp_path):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS, init_lora_weights=False,
                        rank_pattern={"layers.0": 7, "model.layers.1.mlp.down_proj": 6, "proj": 3, "q_proj": 5,
                                      "self_attn.q_proj": 1, "v_proj": 2},  # sorted, as PEFT saves them
                        alpha_pattern={"o_proj": 3, "layers.0.self_attn.q_proj": 5, "embed_tokens": 16})
    adapter, peft_model = load_like_peft(tiny_llama(), config, tmp_path / "a")
    check_matches_peft(adapter, peft_model)
    assert adapter.modules["model.layers.1.mlp.down_proj"].rank == 6 and adapter.max_rank == 6
    assert adapter.modules["model.layers.0.self_attn.q_proj"].scale == 5 / 5  # first matching pattern wins
    assert adapter.modules["model.layers.0.self_attn.k_proj"].rank == 4  # "proj" and "layers.0" match no name
    assert adapter.modules["model.embed_tokens"].A.shape == (4, 128)  # [rank, num_embeddings]
    assert adapter.nbytes() == sum(m.A.nbytes + m.B.nbytes for m in adapter.modules.values())
    assert adapter.name == "sql" and adapter.config == read_adapter_config("sql", tmp_path / "a")


def test_rslora_regex_targets_and_layers_to_transform_match_peft(tmp_path):
    for i, config in enumerate([
        LoraConfig(r=9, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "down_proj", "lm_head"],
                   rank_pattern={"down_proj": 3}, alpha_pattern={"q_proj": 2.5}),
        LoraConfig(r=3, target_modules=r".*\.layers\.1\..*(q_proj|up_proj)$"),
        LoraConfig(r=5, target_modules=["k_proj", "gate_proj", "embed_tokens"], layers_to_transform=[1],
                   layers_pattern="layers"),
        LoraConfig(r=2, target_modules=["v_proj"], layers_to_transform=0),
    ]):
        adapter, peft_model = load_like_peft(tiny_llama(), config, tmp_path / str(i))
        check_matches_peft(adapter, peft_model)


def test_gpt2_conv1d_with_fan_in_fan_out_matches_peft(tmp_path):
    config = LoraConfig(r=4, lora_alpha=16, fan_in_fan_out=True,
                        target_modules=["c_attn", "c_proj", "c_fc", "wte", "lm_head"],
                        rank_pattern={"h.1.attn.c_attn": 7})
    adapter, peft_model = load_like_peft(tiny_gpt2(), config, tmp_path / "gpt2")
    check_matches_peft(adapter, peft_model)
    qkv = adapter.modules["transformer.h.1.attn.c_attn"]
    assert qkv.A.shape == (7, 32) and qkv.B.shape == (96, 7)  # [r, in] and [out, r] whatever the Conv1D layout


def test_tied_embeddings_and_inference_only_variants_match_peft(tmp_path):
    cases = [
        (tiny_llama(tie_word_embeddings=True), LoraConfig(r=4, target_modules=["embed_tokens", "lm_head"],
                                                          ensure_weight_tying=True)),
        (tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], velora_config=VeloraConfig(num_groups=4))),
        (tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "up_proj"], monteclora_config=MontecloraConfig())),
        (tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], init_lora_weights="mica")),
    ]
    for i, (model, config) in enumerate(cases):
        adapter, peft_model = load_like_peft(model, config, tmp_path / str(i))
        check_matches_peft(adapter, peft_model)


def test_weights_are_cast_and_contiguous(tmp_path):
    adapter, peft_model = load_like_peft(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]),
                                         tmp_path / "a", dtype=torch.bfloat16)
    ref = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    lora = adapter.modules[Q]
    assert lora.A.dtype == lora.B.dtype == torch.bfloat16 and lora.A.is_contiguous() and lora.B.is_contiguous()
    assert torch.equal(lora.B, ref.lora_B["default"].weight.to(torch.bfloat16))
    assert lora.A.device.type == "cpu"


@settings(max_examples=10)
@given(r=st.integers(1, 16), alpha=st.one_of(st.integers(1, 64), st.floats(0.25, 64)), rslora=st.booleans(),
       targets=st.lists(st.sampled_from(LLAMA_TARGETS), min_size=1, max_size=5, unique=True),
       rank_pattern=st.dictionaries(st.sampled_from(["v_proj", "mlp.up_proj", "model.layers.1.self_attn.q_proj",
                                                     "embed_tokens", r"layers\.0\..*_proj", "proj", "layers.1"]),
                                    st.integers(1, 16), max_size=2),
       alpha_pattern=st.dictionaries(st.sampled_from(["o_proj", "lm_head", "layers.1.mlp.down_proj"]),
                                     st.integers(1, 64), max_size=2),
       layers=st.sampled_from([None, 0, [1], [0, 1]]))
def test_random_configs_match_peft(r, alpha, rslora, targets, rank_pattern, alpha_pattern, layers):
    assume(layers is None or set(targets) - {"embed_tokens"})  # with layers_to_transform, embed_tokens has no layer
    # PEFT writes the patterns sorted (json sort_keys) and matches the first that fits, so where patterns overlap
    # only a sorted dict means the same before and after saving.
    config = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                        rank_pattern=dict(sorted(rank_pattern.items())),
                        alpha_pattern=dict(sorted(alpha_pattern.items())),
                        layers_to_transform=layers)
    with tempfile.TemporaryDirectory() as tmp:
        adapter, peft_model = load_like_peft(tiny_llama(), config, Path(tmp) / "a")
        check_matches_peft(adapter, peft_model)


# ---- adapters lorakit refuses ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny_llama()
    base = base_modules_of(model)
    path = tmp_path_factory.mktemp("saved") / "sql"
    save_peft(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"],
                                rank_pattern={"v_proj": 2}), path)
    return path, base


@pytest.fixture
def folder(saved, tmp_path):
    """A fresh copy of a valid saved adapter, to break."""
    return Path(shutil.copytree(saved[0], tmp_path / "sql"))


@pytest.fixture
def base(saved):
    return dict(saved[1])


def refused(path, base, *needles, dtype=torch.float32):
    with pytest.raises(AdapterError) as info:
        load_peft_adapter("sql", path, base, dtype)
    msg = str(info.value)
    assert msg.startswith(f"adapter 'sql' at {path}"), msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def edit_weights(folder, fn):
    sd = load_file(folder / "adapter_model.safetensors")
    save_file(fn(sd) or sd, folder / "adapter_model.safetensors", metadata={"format": "pt"})


def test_the_valid_copy_loads(folder, base):
    attn = {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")}
    modules = load_peft_adapter("sql", folder, base, torch.float32).modules
    assert set(modules) == {"model.embed_tokens", "lm_head", *attn}


def test_missing_or_broken_files(folder, base, tmp_path):
    refused(tmp_path / "nope", base, "no such folder")
    refused(folder / "adapter_config.json", base, "not a folder")
    refused(tmp_path, base, "adapter subfolders ['sql']")
    (folder / "adapter_config.json").write_text("{not json")
    refused(folder, base, "not readable, valid JSON")
    (folder / "adapter_config.json").write_text("[1, 2]")
    refused(folder, base, "JSON object")
    (folder / "adapter_config.json").unlink()
    refused(folder, base, "no adapter_config.json")
    (folder / "config.json").write_text("{}")
    refused(folder, base, "full model")


def test_missing_or_corrupt_weights(folder, base):
    data = (folder / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    refused(folder, base, "not a readable safetensors file", "save_pretrained")
    (folder / "adapter_model.safetensors").write_bytes(b"garbage")
    refused(folder, base, "not a readable safetensors file")
    (folder / "adapter_model.safetensors").unlink()
    refused(folder, base, "no adapter_model.safetensors")


def test_pickle_weights_are_refused_never_unpickled(folder, base, monkeypatch):
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.bin").write_bytes(pickle.dumps({"x": 1}))

    def unpickle(*args, **kwargs):
        raise AssertionError("lorakit must never unpickle an adapter")
    for mod, fn in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(mod, fn, unpickle)
    refused(folder, base, "adapter_model.bin", "safetensors only", "save_pretrained(", "safe_serialization=True")


@pytest.mark.parametrize("field, value, needle", [
    ("use_qalora", True, "use_qalora"),
    ("lora_bias", True, "lora_bias"),
    ("alora_invocation_tokens", [5, -6], "alora_invocation_tokens must be null or a list"),  # accepted: test_alora
    ("use_bdlora", {"nblocks": 2}, "use_bdlora"),
    ("arrow_config", {"top_k": 2}, "arrow_config"),
    ("kasa_config", {"beta": 1.0}, "kasa_config"),
    ("megatron_config", {"tp": 2}, "megatron_config"),
    ("layer_replication", [[0, 2], [1, 2]], "layer_replication"),
    ("target_parameters", ["experts.down_proj"], "target_parameters"),
    ("bias", "all", "bias='all' is not supported yet"),
    ("bias", "lora_only", "bias='lora_only'"),
    ("peft_type", "IA3", "peft_type is 'IA3'"),
    ("peft_type", None, "LoRA adapters only"),
    ("init_lora_weights", "pissa", "path_initial_model_for_weight_conversion"),
    ("init_lora_weights", "pissa_niter_4", "PEFT changed the base weights"),
    ("init_lora_weights", "olora", "olora"),
    ("init_lora_weights", "corda", "corda"),
    ("init_lora_weights", "lora_ga", "lora_ga"),
    ("init_lora_weights", "loftq", "LoftQ"),
    ("init_lora_weights", "fancy", "init_lora_weights='fancy' is not one lorakit knows"),
    ("shiny_new_variant", {"on": True}, "['shiny_new_variant']"),
])
def test_unsupported_config_features(folder, base, field, value, needle):
    edit_config(folder, **{field: value})
    refused(folder, base, "adapter_config.json", needle)


@pytest.mark.parametrize("field, value, needle", [
    ("r", "4", "r must be a positive int"), ("r", 0, "r must be"), ("r", True, "r must be"),
    ("lora_alpha", "8", "lora_alpha must be a finite number"), ("lora_alpha", float("nan"), "lora_alpha"),
    ("use_rslora", "yes", "use_rslora must be true or false"), ("fan_in_fan_out", 1, "fan_in_fan_out"),
    ("target_modules", 3, "target_modules must be"), ("target_modules", ["q_proj", 1], "target_modules must be"),
    ("exclude_modules", {"a": 1}, "exclude_modules must be"), ("layers_pattern", 5, "layers_pattern must be"),
    ("layers_to_transform", "1", "layers_to_transform must be"), ("layers_to_transform", [0, 1.5], "must be"),
    ("rank_pattern", {"q_proj": 0}, "rank_pattern must map"), ("rank_pattern", [["q_proj", 2]], "must map"),
    ("alpha_pattern", {"q_proj": "x"}, "alpha_pattern must map"),
    ("rank_pattern", {"q_proj(": 2}, "not a valid regular expression"),
])
def test_malformed_config_values(folder, base, field, value, needle):
    edit_config(folder, **{field: value})
    refused(folder, base, needle)


def test_inconsistent_layer_options(folder, base):
    edit_config(folder, target_modules=".*q_proj", layers_to_transform=[0])
    refused(folder, base, "cannot be used when target_modules is a regex")
    edit_config(folder, target_modules=["q_proj"], layers_to_transform=None, layers_pattern="layers")
    refused(folder, base, "layers_pattern is set but layers_to_transform is not")


def test_inert_config_values_are_accepted(folder, base):
    for changes in ({"init_lora_weights": "gaussian"}, {"init_lora_weights": "eva"}, {"init_lora_weights": True},
                    {"task_type": "CAUSAL_LM", "lora_dropout": 0.1, "base_model_name_or_path": "x", "revision": "y"},
                    {"some_future_field": None, "another": False, "modules_to_save": [], "use_dora": False}):
        edit_config(folder, **changes)
        assert load_peft_adapter("sql", folder, base, torch.float32).max_rank == 4
    assert read_adapter_config("sql", folder)["another"] is False


def test_non_finite_weights_name_the_module(folder, base):
    def poke(sd):
        sd[f"{QKEY}.lora_B.weight"][3, 1] = float("nan")
    edit_weights(folder, poke)
    refused(folder, base, f"module '{Q}'", "B holds NaN or inf")
    edit_weights(folder, lambda sd: sd.update({f"{QKEY}.lora_B.weight": torch.zeros(32, 4),
                                               f"{QKEY}.lora_A.weight": torch.full((4, 32), float("inf"))}))
    refused(folder, base, f"module '{Q}'", "A holds NaN or inf")
    edit_weights(folder, lambda sd: sd.update({f"{QKEY}.lora_A.weight": torch.full((4, 32), 1e6)}))
    refused(folder, base, f"module '{Q}'", "overflows torch.float16", dtype=torch.float16)
    assert load_peft_adapter("sql", folder, base, torch.bfloat16).modules[Q].A.isfinite().all()


@pytest.mark.parametrize("extra, needle", [
    (f"{QKEY}.lora_B.bias", "lora_bias"),
    (f"{QKEY}.base_layer.bias", "bias='all'"),
    ("base_model.model.model.norm.weight", "full module weights"),
    ("base_model.model.model.norm.token_adapter.trainable_tokens_delta", "trainable tokens"),
    (f"{QKEY}.lora_velora_embed", "lora_velora_embed"),  # VeLoRA state without velora_config
    (f"{Q}.lora_A.weight", "prefix"),
])
def test_unexpected_keys_are_named(folder, base, extra, needle):
    edit_weights(folder, lambda sd: sd.update({extra: torch.ones(32)}))
    refused(folder, base, extra, needle, "not plain LoRA A/B")


def test_adapter_name_inside_keys(folder, base):
    def rename(name):
        return lambda sd: {k.replace(".lora_A.", f".lora_A.{name}.").replace(".lora_B.", f".lora_B.{name}.")
                           .replace("lora_embedding_A", f"lora_embedding_A.{name}")
                           .replace("lora_embedding_B", f"lora_embedding_B.{name}"): v for k, v in sd.items()}
    want = load_peft_adapter("sql", folder, base, torch.float32)
    edit_weights(folder, rename("default"))  # what PeftModel.from_pretrained(model, path) itself loads
    got = load_peft_adapter("sql", folder, base, torch.float32)
    assert all(torch.equal(got.modules[m].B, want.modules[m].B) for m in want.modules)


def test_other_adapter_name_inside_keys(folder, base):
    edit_weights(folder, lambda sd: {k.replace(".lora_A.", ".lora_A.code."): v for k, v in sd.items()})
    refused(folder, base, "PEFT adapter name 'code'", "save_pretrained()")


def test_incomplete_or_duplicated_pairs(folder, base):
    edit_weights(folder, lambda sd: sd.update({f"{QKEY}.lora_A.default.weight": sd[f"{QKEY}.lora_A.weight"].clone()}))
    refused(folder, base, f"module '{Q}' has lora_A twice")
    edit_weights(folder, lambda sd: {k: v for k, v in sd.items() if "lora_A" not in k or "default" not in k})
    edit_weights(folder, lambda sd: {k: v for k, v in sd.items() if k != f"{QKEY}.lora_B.weight"})
    refused(folder, base, f"module '{Q}' has ['lora_A']", "needs exactly lora_A and lora_B")
    edit_weights(folder, lambda sd: {k: v for k, v in sd.items() if "lora_" not in k})
    refused(folder, base, "holds no LoRA weights")


def test_modules_the_model_lacks_or_shapes_it_cannot_take(folder, base):
    missing = {k: v for k, v in base.items() if k != Q}
    refused(folder, missing, f"the model has no module '{Q}' that this adapter targets")
    inner = {k.removeprefix("model."): v for k, v in base.items()}  # names from LlamaModel, not ...ForCausalLM
    refused(folder, inner, "it has 'embed_tokens': are base_modules named from a different root module?")
    refused(folder, missing, "did you mean 'model.layers.1.self_attn.q_proj'?")
    refused(folder, {**base, Q: BaseModule("embedding", 32, 32)}, f"module '{Q}' is an embedding in the model",
            "lora_A/lora_B")
    refused(folder, {**base, "model.embed_tokens": BaseModule("linear", 128, 32)},
            "module 'model.embed_tokens' is a linear in the model", "lora_embedding_A/B")
    refused(folder, {**base, Q: BaseModule("linear", 48, 32)}, f"module '{Q}'", "do not fit", "(4, 48)")
    refused(folder, {**base, "model.embed_tokens": BaseModule("embedding", 130, 32)}, "resized")


def test_rank_must_match_config_and_weights(folder, base):
    edit_config(folder, r=8)
    refused(folder, base, "module 'lm_head'", "the weights have rank 4 but adapter_config.json gives rank 8 (from r)")
    edit_config(folder, r=4, rank_pattern={"v_proj": 3})
    refused(folder, base, "rank_pattern['v_proj']", "rank 2")
    edit_config(folder, rank_pattern={"v_proj": 2})
    edit_weights(folder, lambda sd: sd.update({f"{QKEY}.lora_B.weight": torch.ones(32, 3)}))
    refused(folder, base, f"module '{Q}'", "A has rank 4", "B has rank 3")
    edit_weights(folder, lambda sd: sd.update({f"{QKEY}.lora_B.weight": torch.ones(32, 4, dtype=torch.int32)}))
    refused(folder, base, "B must be a 2-D floating-point tensor")


def test_base_weight_copies(folder, base):
    edit_weights(folder, lambda sd: sd.update({"base_model.model.lm_head.base_layer.weight": torch.ones(130, 32)}))
    refused(folder, base, "module 'lm_head'", "shape [130, 32]", "[128, 32]", "resized")
    edit_weights(folder, lambda sd: sd.update({"base_model.model.lm_head.base_layer.weight": torch.ones(128, 32),
                                               "base_model.model.model.norm.base_layer.weight": torch.ones(32, 32)}))
    refused(folder, base, "'model.norm', which has no LoRA weights")


def test_argument_and_dataclass_checks(folder, base):
    with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype"):
        load_peft_adapter("sql", folder, base, torch.int8)
    with pytest.raises(ValueError, match="kind must be 'linear' or 'embedding'"):
        BaseModule("conv", 3, 3)
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        BaseModule("linear", 0, 3)
    with pytest.raises(ValueError, match="rank=2"):
        ModuleLora(torch.ones(3, 8), torch.ones(4, 3), rank=2, scale=1.0)
    with pytest.raises(ValueError, match="at least one module"):
        PeftAdapter("sql", folder, {}, {})


# ---- the file against its config: what PEFT drops or leaves untrained is refused unless strict=False -----------

def peft_wrapped(peft_model) -> set[str]:
    """The modules PEFT put a LoRA layer on."""
    return {name for name, m in peft_model.base_model.model.named_modules()
            if isinstance(m, LoraLayer) and ("default" in m.lora_A or "default" in m.lora_embedding_A)}


PEFT_SAVED = {  # LoraConfig keywords: every way of naming targets, with and without token modules
    "attn": dict(target_modules=["q_proj", "v_proj"]),
    "all-linear": dict(target_modules="all-linear"),
    "all-linear-but": dict(target_modules="all-linear", exclude_modules=["down_proj", "layers.0.self_attn.q_proj"]),
    "regex": dict(target_modules=r".*\.layers\.1\..*(q_proj|up_proj)$"),
    "exclude-regex": dict(target_modules=["o_proj", "gate_proj"], exclude_modules=r".*\.0\..*"),
    "layers": dict(target_modules=["k_proj", "gate_proj", "embed_tokens"], layers_to_transform=[1],
                   layers_pattern="layers"),
    "layer-int": dict(target_modules=["v_proj", "model.layers.0.mlp.up_proj"], layers_to_transform=1),
    "embeddings": dict(target_modules=["q_proj", "embed_tokens", "lm_head"]),
    "tie-both": dict(target_modules=["embed_tokens", "lm_head"], ensure_weight_tying=True),
    "tie-embed": dict(target_modules=["q_proj", "embed_tokens"], ensure_weight_tying=True),
    "head": dict(target_modules=["lm_head", "down_proj"]),
    "mts": dict(target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"]),
    "mts-head": dict(target_modules=["q_proj", "lm_head"], modules_to_save=["lm_head"]),  # lm_head: copied, no LoRA
    "mts-tie": dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True),
    "tti": dict(target_modules=["q_proj", "v_proj"], trainable_token_indices=[3, 5]),
    "tti-both": dict(target_modules=["o_proj"], trainable_token_indices={"embed_tokens": [3], "lm_head": [3]}),
}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_peft_saved_adapter_loads_strictly(tied, tmp_path):
    """However a config names its targets, PEFT saves weights for exactly the modules it adapts: lorakit resolves
    the same modules from the config (strict), in the loader and in the header-only check alike."""
    import lorakit

    model = tiny_llama(tie_word_embeddings=tied)
    handle = lorakit.patch(copy.deepcopy(model), max_loras=1, max_rank=8)
    assert handle.tied == tied
    for name, kw in PEFT_SAVED.items():
        peft_model = save_peft(copy.deepcopy(model), LoraConfig(r=4, **kw), tmp_path / name)
        adapter = handle.read_adapter(name, tmp_path / name)
        info = handle.inspect_adapter(name, tmp_path / name)
        assert set(adapter.modules) == set(info.modules) == peft_wrapped(peft_model), name
    # PEFT saves "all-linear" resolved to full names; the shorthand itself resolves the same way
    edit_config(tmp_path / "all-linear", target_modules="all-linear")
    assert set(handle.read_adapter("x", tmp_path / "all-linear").modules) == {
        n for n, m in handle.base_modules.items() if m.kind == "linear" and n != "lm_head"}


def test_gpt2_all_linear_loads_strictly(tmp_path):
    import lorakit

    model = tiny_gpt2()
    handle = lorakit.patch(copy.deepcopy(model), max_loras=1)
    peft_model = save_peft(copy.deepcopy(model), LoraConfig(r=4, target_modules="all-linear"), tmp_path / "a")
    edit_config(tmp_path / "a", target_modules="all-linear")
    assert set(handle.read_adapter("a", tmp_path / "a").modules) == peft_wrapped(peft_model)


@pytest.fixture
def mismatched(tmp_path):
    """Folders whose file and config disagree, from adapters PEFT saved: "extra" has an attention config and
    attention + MLP weights (PEFT drops the MLP's), "missing" an attention + MLP config and attention weights
    (PEFT runs the MLP untrained)."""
    model = tiny_llama()
    attn, mlp = tmp_path / "attn", tmp_path / "mlp"
    save_peft(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), attn, seed=1)
    save_peft(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
              mlp, seed=2)
    extra, missing = Path(shutil.copytree(mlp, tmp_path / "extra")), Path(shutil.copytree(attn, tmp_path / "missing"))
    shutil.copy(attn / "adapter_config.json", extra)
    shutil.copy(mlp / "adapter_config.json", missing)
    return model, extra, missing


MLP = [f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("down_proj", "up_proj")]
ATTN = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]


def test_weights_the_config_does_not_adapt_are_refused(mismatched, caplog):
    model, extra, _ = mismatched
    base = base_modules_of(model)
    msg = refused(extra, base, f"holds LoRA weights of 4 module(s) {MLP}", "does not adapt",
                  "PEFT ignores them", "save_pretrained()", "strict=False", "--lora-non-strict")
    with pytest.raises(AdapterError) as info:
        inspect_peft_adapter("sql", extra, base)
    assert str(info.value) == msg  # the registration check refuses it the same way
    with caplog.at_level(logging.WARNING, logger="lorakit.adapter"):
        adapter = load_peft_adapter("sql", extra, base, torch.float32, strict=False)
    assert set(adapter.modules) == set(ATTN)
    assert set(inspect_peft_adapter("sql", extra, base, strict=False).modules) == set(ATTN)
    assert [r.name for r in caplog.records] == ["lorakit.adapter"] * 2
    assert f"dropping the LoRA weights of 4 module(s) {MLP}" in caplog.records[0].getMessage()
    # what remains is what PEFT serves: its forward drops the MLP weights too
    check_matches_peft(adapter, PeftModel.from_pretrained(copy.deepcopy(model), extra).eval())


def test_adapted_modules_without_weights_are_refused(mismatched, caplog):
    model, _, missing = mismatched
    base = base_modules_of(model)
    msg = refused(missing, base, f"the config adapts 4 module(s) {MLP}", "that have no LoRA weights",
                  "PEFT runs them untrained", "strict=False")
    with pytest.raises(AdapterError) as info:
        inspect_peft_adapter("sql", missing, base)
    assert str(info.value) == msg
    with caplog.at_level(logging.WARNING, logger="lorakit.adapter"):
        adapter = load_peft_adapter("sql", missing, base, torch.float32, strict=False)
    assert set(adapter.modules) == set(ATTN)
    assert f"serving 4 module(s) {MLP} untrained" in caplog.text
    # PEFT (default init: lora_B = 0) runs the MLP modules with no delta, as lorakit serves them
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), missing).eval()
    for name in MLP:
        layer = peft_model.base_model.model.get_submodule(name)
        x = torch.randn(3, layer.in_features)
        with torch.no_grad():
            assert torch.equal(layer(x), layer.base_layer(x))
    for name in ATTN:
        ref = peft_model.base_model.model.get_submodule(name)
        assert torch.equal(adapter.modules[name].B, ref.lora_B["default"].weight)


def test_a_long_disagreement_names_the_first_modules_and_counts(folder, base):
    edit_config(folder, target_modules="all-linear", trainable_token_indices=[3])
    msg = refused(folder, base, "adapts 10 module(s) ['model.layers.0.mlp.down_proj', 'model.layers.0.mlp.gate_proj', "
                  "'model.layers.0.mlp.up_proj', 'model.layers.0.self_attn.k_proj'] and 6 more",
                  "holds LoRA weights of 2 module(s) ['lm_head', 'model.embed_tokens']",
                  "trains token rows of 1 module(s) ['model.embed_tokens']",
                  "adapter_model.safetensors does not match what adapter_config.json adapts: ")
    assert "lm_head'] and" not in msg


@pytest.mark.parametrize("change, needle", [
    (dict(target_modules=None), "names no target_modules"),
    (dict(target_modules=["q_proj", "v_proj", "embed_tokens"]), "['lm_head'] that target_modules="),
    (dict(exclude_modules=["lm_head"]), "['lm_head'] that target_modules="),
    (dict(layers_to_transform=[1]), "3 module(s) ['model.embed_tokens', 'model.layers.0.self_attn.q_proj', "
                                    "'model.layers.0.self_attn.v_proj']"),  # embed_tokens: in no layer
    (dict(modules_to_save=["lm_head"]), "['lm_head'] that target_modules="),  # and its copy is missing
    (dict(target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head", "o_proj"]), "adapts 2 module(s)"),
    (dict(target_modules=r".*\.(q|v)_proj"), "['lm_head', 'model.embed_tokens'] that target_modules="),
])
def test_config_edits_that_disagree_with_the_file(folder, base, change, needle):
    edit_config(folder, **change)
    refused(folder, base, needle, "strict=False")
    assert load_peft_adapter("sql", folder, base, torch.float32, strict=False).modules


def test_stray_or_missing_token_rows(folder, base, caplog):
    key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    edit_weights(folder, lambda sd: sd.update({key: torch.ones(2, 32)}))
    refused(folder, base, "holds trainable-token rows of 1 module(s) ['model.embed_tokens']",
            "trainable_token_indices does not name", "strict=False")
    with caplog.at_level(logging.WARNING, logger="lorakit.adapter"):
        assert not load_peft_adapter("sql", folder, base, torch.float32, strict=False).tokens
    assert "dropping the token rows of 1 module(s) ['model.embed_tokens']" in caplog.text
    edit_weights(folder, lambda sd: {k: v for k, v in sd.items() if k != key})
    edit_config(folder, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"])
    edit_weights(folder, lambda sd: {k: v for k, v in sd.items() if "embed_tokens" not in k and "lm_head" not in k}
                 | {"base_model.model.lm_head.weight": torch.ones(128, 32)})
    refused(folder, base, "trains token rows of 1 module(s) ['model.embed_tokens'] (trainable_token_indices or "
            "modules_to_save) that have none")
    adapter = load_peft_adapter("sql", folder, base, torch.float32, {"lm_head": torch.zeros(128, 32)}, strict=False)
    assert set(adapter.tokens) == {"lm_head"} and adapter.tokens["lm_head"].ids.numel() == 128


def test_bad_target_regex_is_named(folder, base):
    edit_config(folder, target_modules="q_proj(")
    refused(folder, base, "holds an invalid regular expression")


TARGET_NAMES = ["q_proj", "v_proj", "o_proj", "down_proj", "mlp.up_proj", "self_attn.k_proj", "embed_tokens",
                "lm_head", "model.layers.1.mlp.gate_proj", "layers.0.self_attn.q_proj", "proj"]


@st.composite
def target_configs(draw) -> dict:
    """LoraConfig keywords PEFT accepts: a regex string goes without layers_to_transform, layers_pattern with it."""
    regex = draw(st.booleans())
    if regex:
        target = draw(st.sampled_from(["all-linear", r".*\.layers\.1\..*", r".*(q|k)_proj", r"model\.embed_tokens",
                                       r".*\.mlp\.(up|down)_proj|lm_head"]))
        layers = pattern = None
    else:
        target = draw(st.lists(st.sampled_from(TARGET_NAMES), min_size=1, max_size=4, unique=True))
        layers = draw(st.sampled_from([None, 0, [1], [0, 1]]))
        pattern = None if layers is None else draw(st.sampled_from([None, "layers", ["h", "layers"]]))
    exclude = draw(st.one_of(st.none(), st.lists(st.sampled_from(TARGET_NAMES), max_size=2, unique=True),
                             st.sampled_from([r".*\.0\..*", r".*_proj"])))
    return dict(r=2, target_modules=target, exclude_modules=exclude, layers_to_transform=layers,
                layers_pattern=pattern, modules_to_save=draw(st.sampled_from([None, ["lm_head"], ["embed_tokens"],
                                                                               ["v_proj"]])),
                ensure_weight_tying=draw(st.booleans()))


@settings(max_examples=25, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(tied=st.booleans(), kw=target_configs())
def test_targets_resolve_as_peft_resolves_them(tied, kw):
    """lorakit's reading of target_modules (and the fields that narrow it) picks the very modules PEFT wraps."""
    from lorakit.peft.targets import lora_targets

    kw = copy.deepcopy(kw)  # PEFT edits the lists it is given
    model = tiny_llama(tie_word_embeddings=tied)
    try:
        peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(**kw))
    except (ValueError, TypeError, AttributeError):  # nothing matched, a module PEFT cannot wrap, a tie it cannot make
        assume(False)
    config = json.loads(json.dumps(peft_model.peft_config["default"].to_dict(), default=sorted))  # as saved
    assert lora_targets(config, base_modules_of(model), tied, "x") == peft_wrapped(peft_model), config


def test_a_pattern_built_to_backtrack_forever_is_refused(folder, base):
    """target_modules / rank_pattern come from whoever wrote the folder: a catastrophic pattern is refused within
    the match time limit instead of holding the registering thread."""
    import json
    import time

    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = "(.|.)*[0-9]"  # Python's re: 150 s on one module name
    (folder / "adapter_config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    with pytest.raises(AdapterError, match="takes too long to match"):
        load_peft_adapter("sql", folder, base, torch.float32)
    assert time.perf_counter() - start < 5

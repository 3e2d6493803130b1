"""Adapters with token rows (PEFT trainable tokens, added tokens, modules_to_save copies of the embedding and
head, and the whole resized matrices PEFT saves when a fine-tune grew the vocabulary, as its guide for new tokens
does) served per slot beside plain adapters and base rows, against PEFT on a resized model; and the engine
generating an added token for its adapter only."""

import copy
import json
import shutil

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

import lorakit
from _lora_cases import TOLERANCE
from helpers import WORD_VOCAB, rel_err, word_tokenizer
from lorakit.engine import LLM, SamplingParams
from lorakit.peft import AdapterError

V, ADD = WORD_VOCAB, 3  # base vocabulary (word_tokenizer's), tokens the adapters add (ids V .. V+ADD-1)


def tiny(tied: bool):
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def resized(base):
    """The model the fine-tuner trained on: the base with ADD new token rows."""
    model = copy.deepcopy(base)
    model.resize_token_embeddings(V + ADD, mean_resizing=False)
    return model


def save(base, folder, seed, **config):
    """A PEFT adapter on the resized model with random LoRA weights, token rows and module copies."""
    torch.manual_seed(seed)
    peft = get_peft_model(resized(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False, **config))
    for name, p in peft.named_parameters():
        if "trainable_tokens_delta" in name:
            p.data = torch.randn_like(p) * 0.5
        elif "modules_to_save" in name:  # a few retrained rows and every added row
            p.data[[2, 11]] = torch.randn(2, p.shape[1])
            p.data[V:] = torch.randn(ADD, p.shape[1])
    peft.save_pretrained(folder)
    return folder


def adapters_for(base, tmp_path, tied: bool) -> dict:
    out = {"plain": save(base, tmp_path / "plain", 1),
           "tt": save(base, tmp_path / "tt", 2, trainable_token_indices=[3, 7])}
    if tied:  # the head shares the embedding's token adapter, added ids included
        out["add"] = save(base, tmp_path / "add", 3, trainable_token_indices=[5, V, V + 1])
        # and its copy: PEFT saves the head's (tied) copy as lm_head.weight, not named in modules_to_save
        out["mts"] = save(base, tmp_path / "mts", 4, modules_to_save=["embed_tokens"], ensure_weight_tying=True)
    else:
        out["add"] = save(base, tmp_path / "add", 3,
                          trainable_token_indices={"embed_tokens": [5, V, V + 1], "lm_head": [9, V, V + 1]})
        out["mts"] = save(base, tmp_path / "mts", 4, modules_to_save=["embed_tokens", "lm_head"])
    return out


ADDS = {"add": [V, V + 1], "mts": [V, V + 1, V + 2]}  # the ids each adapter adds


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def check_rows_match_peft(base, model, handle, folders: dict, adds: dict, device):
    """Each row of a batch mixing the base model and every adapter (twice) gives PEFT's logits on the resized
    model; an added token's logit is its adapter's own, -inf for every other row."""
    names = [None, *folders, *folders]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in names:
        ids = torch.randint(0, V, (6,), generator=gen)
        ids[1], ids[3], ids[4] = 3, 5, 7  # trainable tokens of several adapters, in every row
        if adds.get(name):
            ids[2], ids[5] = adds[name][0], adds[name][-1]  # its own added tokens
        rows.append(ids)
    input_ids = torch.stack(rows).to(device)
    with torch.no_grad():
        ours = model(input_ids, lora_ids=handle.ids(names)).logits
    for row, name in enumerate(names):
        ref_model = resized(base) if name is None else PeftModel.from_pretrained(resized(base), folders[name])
        with torch.no_grad():
            ref = ref_model.to(device)(input_ids[row: row + 1]).logits[0]
        assert rel_err(ours[row, :, :V], ref[:, :V]) < TOLERANCE[torch.float32], name
        for t in range(V, handle.vocab_size):
            if t in adds.get(name, []):  # its own added tokens: PEFT's logits
                assert rel_err(ours[row, :, t], ref[:, t]) < TOLERANCE[torch.float32], (name, t)
            else:  # anyone else's: never sampled
                assert torch.isinf(ours[row, :, t]).all() and (ours[row, :, t] < 0).all(), (name, t)
    return names, input_ids, ours


def soft_capped(tied: bool):
    """A Gemma 2 that soft-caps its logits at 3 (small, so the cap shapes the logits of this tiny model)."""
    config = transformers.Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       tie_word_embeddings=tied, max_position_embeddings=64,
                                       final_logit_softcapping=3.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_soft_capped_logits_keep_other_adapters_added_tokens_at_minus_inf(tied, tmp_path):
    """Issue 29: on Gemma 2 an added token of another adapter came out at -30 (the soft cap of -inf), not -inf, so
    it kept a small probability. The head now caps, then masks: every row still equals PEFT (the cap included),
    and another adapter's added ids are -inf."""
    base = soft_capped(tied)
    folders = adapters_for(base, tmp_path, tied)
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=4)
    for name, folder in folders.items():
        handle.load_adapter(name, folder)
    _, _, ours = check_rows_match_peft(base, model, handle, folders, ADDS, "cpu")
    finite = ours[torch.isfinite(ours)]
    assert finite.abs().max() <= 3.0 and finite.abs().max() > 1.0  # capped, once


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_token_rows_match_peft_per_row(tied, device, tmp_path):
    base = tiny(tied)
    folders = adapters_for(base, tmp_path, tied)
    model = copy.deepcopy(base).to(device)
    handle = lorakit.patch(model, max_loras=4)
    for name, folder in folders.items():
        handle.load_adapter(name, folder)
    assert handle.vocab_size == V + ADD
    names, input_ids, ours = check_rows_match_peft(base, model, handle, folders, ADDS, device)
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)(input_ids, lora_ids=handle.ids(names)).logits
    assert torch.equal(torch.isinf(ours), torch.isinf(compiled))
    finite = torch.isfinite(ours)
    assert rel_err(compiled[finite], ours[finite]) < TOLERANCE[torch.float32]


def test_bad_token_adapters_are_refused_and_change_nothing(tmp_path):
    base = tiny(tied=False)
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=2, max_token_rows=2)
    good = save(base, tmp_path / "good", 1, trainable_token_indices=[3, 4])
    handle.load_adapter("good", good)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cases = {
        # an added token with no head row (untied head): its logits are unknowable
        "half": (dict(trainable_token_indices=[5, V]), r"adds token ids \[64\] to only one of"),
        "many": (dict(trainable_token_indices=[1, 2, 3]), "above max_token_rows=2"),
        "where": (None, "'model.layers.0.self_attn.q_proj' is not a token embedding or output head"),
    }
    for name, (config, message) in cases.items():
        if config is None:  # PEFT itself would not train this: a config edited by hand
            folder = tmp_path / name
            shutil.copytree(good, folder)
            edited = json.loads((folder / "adapter_config.json").read_text())
            edited["trainable_token_indices"] = {"layers.0.self_attn.q_proj": [3, 4]}
            (folder / "adapter_config.json").write_text(json.dumps(edited))
        else:
            folder = save(base, tmp_path / name, 2, **config)
        with pytest.raises(AdapterError, match=message):
            handle.load_adapter(name, folder)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert handle.adapters == {"good": 0}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.quick])])
def test_engine_generates_an_added_token_for_its_adapter_only(device, tmp_path):
    """The "add" adapter's head row for its new token V points along the hidden state after the prompt, so
    greedy decoding emits V and then reads it back through its own embedding row; lorakit's engine equals
    PEFT's generate on the resized model, and the base and another adapter never produce V."""
    base = tiny(tied=False)
    folder = save(base, tmp_path / "add", 3,
                  trainable_token_indices={"embed_tokens": [5, V, V + 1], "lm_head": [9, V, V + 1]})
    prompt = [1, 5, 9, 12, 30]
    peft = PeftModel.from_pretrained(resized(base), folder)
    with torch.no_grad():
        h = peft(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "adapter_model.safetensors")
    key = next(k for k in weights if "lm_head" in k)
    weights[key][1] = h * (40 / h.dot(h))  # the row of id V: logit 40 after this prompt
    save_file(weights, folder / "adapter_model.safetensors")
    peft = PeftModel.from_pretrained(resized(base), folder)
    with torch.no_grad():
        ref = peft.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert ref[0] == V
    llm = LLM(copy.deepcopy(base).to(device), max_loras=2, adapters={"add": folder, "tt": save(base, tmp_path / "tt", 2,
                                                                                    trainable_token_indices=[3])})
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ours, other, plain = llm.generate([prompt, prompt, prompt], greedy, adapters=["add", "tt", None])
    assert ours.token_ids == ref
    assert V not in other.token_ids and V not in plain.token_ids
    with pytest.raises(ValueError, match="outside the vocabulary"):  # another adapter's added token
        llm.generate([[1, V]], greedy, adapters=["tt"])
    assert llm.generate([[1, V]], greedy, adapters=["add"])[0].token_ids  # its own: fine


def test_an_adapters_own_tokenizer_reads_and_writes_its_added_tokens(tmp_path):
    """An adapter folder that carries its tokenizer (with added tokens): text prompts on that adapter are
    tokenized with it (``<sql>`` becomes id V), and its outputs are detokenized with it; other requests keep
    the base tokenizer, which does not know ``<sql>``."""
    base = tiny(tied=True)
    folder = save(base, tmp_path / "sql", 3, trainable_token_indices=[5, V, V + 1])
    word_tokenizer(["<sql>", "</sql>"]).save_pretrained(folder)
    llm = LLM(copy.deepcopy(base), word_tokenizer(), max_loras=1, adapters={"sql": folder})
    assert llm.engine.prompt_ids("w1 <sql> w2", "sql") == [1, V, 2]
    assert V not in llm.engine.prompt_ids("w1 <sql> w2")
    out = llm.generate(["w1 <sql> w2"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       adapters=["sql"])[0]
    own = llm.engine.registry.tokenizer_for("sql")
    prompt = [1, V, 2]
    assert out.text == own.decode(prompt + out.token_ids)[len(own.decode(prompt)):]
    ref = PeftModel.from_pretrained(resized(base), folder)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([[1, V, 2]]), max_new_tokens=8, do_sample=False,
                                eos_token_id=10_000,  # run the 8 tokens, as ignore_eos does
                                attention_mask=torch.ones(1, 3, dtype=torch.long))[0, 3:].tolist()
    assert out.token_ids == expected


# ---- PEFT's guide for new tokens: resize the model, train the new ids with trainable tokens, save with defaults ----

def guide_save(base, tmp_path, name, seed, **config):
    """PEFT's recipe for adding tokens: the base model loaded from a folder, resize_token_embeddings (the default
    mean resizing draws the new rows at random), LoRA with trainable_token_indices on the new ids, "trained"
    (random rows and LoRA weights), saved with PEFT's defaults. The vocabulary grew, so save_embedding_layers="auto"
    saves the whole resized embedding and head next to the trainable-token rows."""
    folder = tmp_path / "base"
    if not folder.exists():
        base.save_pretrained(folder)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(V + ADD)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False, **config))
    for pname, p in peft.named_parameters():
        if "trainable_tokens_delta" in pname:
            p.data = torch.randn_like(p) * 0.5
        elif "modules_to_save" in pname:  # a few retrained rows and every added row
            p.data[[2, 11]] = torch.randn(2, p.shape[1])
            p.data[V:] = torch.randn(ADD, p.shape[1])
    peft.save_pretrained(tmp_path / name)
    return tmp_path / name


def guide_adapters(base, tmp_path, tied: bool) -> dict:
    out = {"guide": guide_save(base, tmp_path, "guide", 5, trainable_token_indices=[5, V, V + 1]),
           "resized": guide_save(base, tmp_path, "resized", 6)}  # plain LoRA after resizing: whole matrices only
    if not tied:
        out["guide-head"] = guide_save(base, tmp_path, "guide-head", 7, trainable_token_indices={
            "embed_tokens": [5, V, V + 1], "lm_head": [9, V, V + 2]})
        out["mts"] = guide_save(base, tmp_path, "mts", 8, modules_to_save=["embed_tokens", "lm_head"])
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_peft_add_tokens_guide_matches_peft_per_row(tied, device, tmp_path):
    base = tiny(tied)
    folders = guide_adapters(base, tmp_path, tied)
    from safetensors import safe_open

    with safe_open(folders["guide"] / "adapter_model.safetensors", "pt") as f:  # what PEFT wrote
        whole = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if "lora_" not in k}
    head = "lm_head.token_adapter.base_layer.weight" if tied else "lm_head.weight"  # tied: the head's tied adapter
    assert whole[f"base_model.model.{head}"] == whole[
        "base_model.model.model.embed_tokens.token_adapter.base_layer.weight"] == (V + ADD, 32)
    assert whole["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"] == (3, 32)
    model = copy.deepcopy(base).to(device)
    handle = lorakit.patch(model, max_loras=len(folders), max_token_rows=16)
    for name, folder in folders.items():
        # the registration check agrees with the loader on the tokens the adapter adds: all the resized rows
        added = handle.inspect_adapter(name, folder).added_tokens
        loaded = handle.read_adapter(name, folder).tokens["model.embed_tokens"].ids
        assert added == {int(i) for i in loaded if i >= V} == set(range(V, V + ADD)), name
        handle.load_adapter(name, folder)
    assert handle.vocab_size == V + ADD
    check_rows_match_peft(base, model, handle, folders, {name: list(range(V, V + ADD)) for name in folders}, device)


def test_guide_rows_are_the_changed_and_added_rows_with_trainable_rows_on_top(tmp_path):
    """The rows lorakit keeps from the guide's file: of the whole resized matrix, the added rows (the base rows are
    unchanged); over them the trainable-token rows, which PEFT writes into the loaded matrix, so they win."""
    from safetensors.torch import load_file, save_file

    base = tiny(tied=False)
    folder = guide_save(base, tmp_path, "guide", 5, trainable_token_indices=[5, V, V + 1])
    weights = load_file(folder / "adapter_model.safetensors")
    whole = weights["base_model.model.model.embed_tokens.token_adapter.base_layer.weight"]
    whole[7] += 1.0  # a base row the file changes: PEFT loads it too
    save_file(weights, folder / "adapter_model.safetensors")
    delta = weights["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"]
    handle = lorakit.patch(copy.deepcopy(base), max_loras=1)
    tokens = handle.read_adapter("guide", folder).tokens
    emb = tokens["model.embed_tokens"]
    assert emb.ids.tolist() == [5, 7, V, V + 1, V + 2]
    assert torch.equal(emb.rows, torch.stack([delta[0], whole[7], delta[1], delta[2], whole[V + 2]]))
    head = tokens["lm_head"]
    assert head.ids.tolist() == [V, V + 1, V + 2]
    assert torch.equal(head.rows, weights["base_model.model.lm_head.weight"][V:])
    peft = PeftModel.from_pretrained(resized(base), folder)
    merged = peft.base_model.model.model.embed_tokens.token_adapter.get_merged_weights(["default"])
    assert torch.equal(merged[emb.ids], emb.rows)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bad_guide_files_are_refused(tied, tmp_path):
    from safetensors.torch import load_file, save_file

    base = tiny(tied)
    folder = guide_save(base, tmp_path, "guide", 5, trainable_token_indices=[5, V, V + 1])
    handle = lorakit.patch(copy.deepcopy(base), max_loras=1)
    good = load_file(folder / "adapter_model.safetensors")
    key = "base_model.model.model.embed_tokens.token_adapter.base_layer.weight"
    cases = {
        "narrow": ({key: good[key][:, :16].contiguous()}, "rows are 32 wide"),
        "short": ({key: good[key][: V - 1].contiguous()}, "fewer than the model's vocabulary"),
        "few": ({key: good[key][: V + 1].contiguous()}, f"trainable token id {V + 1} is past the {V + 1} rows"),
    }
    if tied:  # the head's tied adapter must give the embedding's rows
        head = "base_model.model.lm_head.token_adapter.base_layer.weight"
        cases["untied"] = ({head: good[head] + 1}, "different token rows")
    for name, (change, message) in cases.items():
        save_file(good | change, folder / "adapter_model.safetensors")
        with pytest.raises(AdapterError, match=message):
            handle.read_adapter(name, folder)
        if name != "untied":  # a check of the headers: the registration refuses it too
            with pytest.raises(AdapterError, match=message):
                handle.inspect_adapter(name, folder)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_engine_generates_a_guide_adapters_new_token_as_peft_does(tied, device, tmp_path):
    """The guide's adapter with the head row of new token V set along the hidden state after the prompt: greedy
    decoding emits V, then reads it back through the adapter's own embedding row; lorakit's engine equals PEFT's
    generate on the resized model, and the base model never produces V."""
    from safetensors.torch import load_file, save_file

    base = tiny(tied)
    folder = guide_save(base, tmp_path, "guide", 5, trainable_token_indices=[5, V, V + 1])
    prompt = [1, 5, 9, 12, 30]
    with torch.no_grad():
        h = PeftModel.from_pretrained(resized(base), folder)(
            torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
    weights = load_file(folder / "adapter_model.safetensors")
    if tied:  # the head's row of V is the embedding's, a trainable row: both copies of it
        for key in ("model.embed_tokens", "lm_head"):
            weights[f"base_model.model.{key}.token_adapter.trainable_tokens_delta"][1] = h * (40 / h.dot(h))
    else:  # the head's row of V comes from the whole resized head PEFT saved
        weights["base_model.model.lm_head.weight"][V] = h * (40 / h.dot(h))
    save_file(weights, folder / "adapter_model.safetensors")
    peft = PeftModel.from_pretrained(resized(base), folder)
    with torch.no_grad():
        ref = peft.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=10_000,
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert ref[0] == V
    llm = LLM(copy.deepcopy(base).to(device), max_loras=1, adapters={"guide": folder})
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ours, plain = llm.generate([prompt, prompt], greedy, adapters=["guide", None])
    assert ours.token_ids == ref
    assert V not in plain.token_ids


def test_changed_rows_are_found_across_chunks():
    from lorakit.peft.tokens import changed_rows

    base = torch.randn(10, 4)
    matrix = torch.cat([base, torch.randn(2, 4)]).to(torch.bfloat16)  # rows past the vocabulary are not compared
    matrix[[0, 2, 3, 9]] += 1
    for chunk in (1, 3, 4, 10, 64):
        assert changed_rows(matrix, base, 10, chunk).tolist() == [0, 2, 3, 9]

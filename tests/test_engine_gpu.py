"""The engine on a GPU with CUDA graphs, in bfloat16, against PEFT in float32.

Tolerance (bf16): lorakit's greedy tokens cannot be compared with PEFT's token for token (a near tie in bf16
flips one token, and everything after differs). So the check is teacher-forced: PEFT in float32 scores
lorakit's whole output, and at every generated position lorakit's token must be PEFT's argmax or within
0.1 of PEFT's largest logit there (logits here are about 2.5-3.5, where one bf16 step is 0.016: 0.1 is about
6 steps; the largest gap seen on the H200 was 0.055); and at least 90 % of positions must be PEFT's argmax."""

import copy

import pytest
import torch
import transformers
from peft import LoraConfig

from _peft_models import save_adapter
from lorakit.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = {"r8": 8, "r16": 16, "r32": 32}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    tmp = tmp_path_factory.mktemp("engine_gpu")
    saved = {}
    for seed, (name, rank) in enumerate(RANKS.items()):
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        saved[name] = save_adapter(base, name, cfg, tmp, seed=seed, std=0.05)
    return base, saved


@pytest.mark.quick
def test_mixed_batch_with_cuda_graphs_matches_peft(setup):
    base, saved = setup
    engine = Engine(copy.deepcopy(base).to("cuda", torch.bfloat16), max_loras=2, max_num_seqs=16,
                    max_num_batched_tokens=256, adapters={n: a.path for n, a in saved.items()}, patience=4)
    gen = torch.Generator().manual_seed(1)
    names = [None, "r8", "r16", "r32"] * 3
    prompts = [torch.randint(0, 32000, (int(torch.randint(3, 300, (1,), generator=gen)),), generator=gen).tolist()
               for _ in names]
    got = {}
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        got[engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), name)] = []
        if i % 3 == 2:
            for out in engine.step():
                got[out.request_id] += out.token_ids
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert engine.runner.graph_replays > 0, "no decode step replayed a CUDA graph"
    assert engine.runner.graph_captures == 1, "graphs recaptured while serving the adapters registered at start"
    exact = total = 0
    gap = 0.0
    for (rid, tokens), prompt, name in zip(got.items(), prompts, names):
        assert len(tokens) == 24
        model = (base if name is None else saved[name].peft_model).to("cuda")
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
        model.to("cpu")
        scores = logits[len(prompt) - 1: -1]  # the distribution each generated token was drawn from
        best = scores.max(-1).values
        chosen = scores.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        gap = max(gap, (best - chosen).max().item())
        assert gap <= 0.1, (rid, name, gap)
        exact += int((scores.argmax(-1) == torch.tensor(tokens, device="cuda")).sum())
        total += len(tokens)
    print(f"lorakit bf16 vs PEFT fp32: {exact}/{total} tokens are PEFT's argmax; largest logit gap {gap:.4f}")
    assert exact >= 0.9 * total, (exact, total)


def test_compiled_graphs_captured_at_startup_and_again_after_growth(tmp_path):
    """Engine(compile=True) compiles and captures every bucket at startup; an adapter of a higher rank registered
    later grows the slots and forces one recapture (10 compiles of one forward, past dynamo's default limit of 8);
    greedy tokens equal those of the engine without compile."""
    from _peft_models import tiny_model

    base = tiny_model("llama", seed=3)
    a = save_adapter(base, "a", LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                           init_lora_weights=False), tmp_path, seed=1, std=0.2).path
    b = save_adapter(base, "b", LoraConfig(r=48, target_modules=["q_proj", "o_proj", "up_proj"],
                                           init_lora_weights=False), tmp_path, seed=2, std=0.2).path
    outs = {}
    for compile in (False, True):
        engine = Engine(copy.deepcopy(base).to("cuda", torch.bfloat16), max_loras=2, max_num_seqs=16, compile=compile,
                        adapters={"a": a}, graph_token_sizes=())  # the 5 decode buckets only (88 s with mixed ones)
        assert engine.runner.graph_captures == 1
        engine.register_adapter("b", b)  # rank 48 > the 16 reserved at start: growth, one recapture
        gen = torch.Generator().manual_seed(0)
        got = {}
        for i, name in enumerate([None, "a", "b"] * 4):
            prompt = torch.randint(0, 90, (5 + i,), generator=gen).tolist()
            got[engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), name)] = []
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.token_ids
        assert engine.runner.graph_captures == 2 and engine.runner.graph_replays > 0
        outs[compile] = list(got.values())
    torch._dynamo.reset()  # the compiled frames of this model class would count against later tests' compiles
    assert outs[True] == outs[False]


@pytest.mark.parametrize("compile", [False, True], ids=["eager-graphs", "compiled-graphs"])
def test_base_steps_replay_graphs_without_lora_kernels(tmp_path, compile):
    """Every decode bucket has a base twin captured with the LoRA ops silenced: decode steps of base requests alone
    replay it and give the same tokens, bit for bit, as the graph with (empty) LoRA kernels; steps with an adapter
    token replay the full graph."""
    from _peft_models import tiny_model

    base = tiny_model("llama", seed=3)
    a = save_adapter(base, "a", LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                           init_lora_weights=False), tmp_path, seed=1, std=0.2).path
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 90, (5 + i,), generator=gen).tolist() for i in range(6)]
    outs = {}
    for twins in (True, False):
        # base_twins=False: every step replays the graphs with LoRA kernels
        engine = Engine(copy.deepcopy(base).to("cuda", torch.bfloat16), max_loras=2, max_num_seqs=8, compile=compile,
                        base_twins=twins, adapters={"a": a})
        runner = engine.runner
        assert len(runner._graphs) == len(runner.graph_sizes) * (1 + twins) + len(runner.token_sizes)
        got = []
        for names in ([None] * 6, [None, "a"] * 3):
            ids = [engine.add_request(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), n)
                   for p, n in zip(prompts, names)]
            tokens = {i: [] for i in ids}
            while engine.has_unfinished():
                for out in engine.step():
                    tokens[out.request_id] += out.token_ids
            got.append(list(tokens.values()))
            if names[1] is None:
                assert (runner.base_steps > 0) == twins and runner.decode_replays > 0
        outs[twins] = got
    torch._dynamo.reset()
    assert outs[True] == outs[False]

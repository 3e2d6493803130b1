"""DoRA on a GPU: the expand kernel's rescale at Llama-3-8B's shapes in bf16, a Qwen2-shaped bf16 model (biases on
q/k/v: the shift) with DoRA and plain adapters in one batch against float32 PEFT, and the engine from CUDA graphs."""

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel

import lorakit
from _lora_cases import make_case
from _peft_models import TARGETS, save_adapter
from helpers import (FLOAT32_GRAPHS, QWEN2_2048_VOCAB as VOCAB, assert_rows_match_peft,
                     assert_same_tokens_but_at_near_ties, greedy, greedy_with_top2, qwen2_2048, qwen2_2048_requests,
                     rel_err)
from lorakit.engine import Engine
from lorakit.ops import add_lora, build_lora_meta
from lorakit.ops.reference import lora_ref_by_slot

pytestmark = pytest.mark.gpu
KERNEL_TOLERANCE = 1e-2  # bf16 output against float64, relative to the output


@pytest.mark.parametrize("tokens", [1, pytest.param(64, marks=pytest.mark.quick), 512])
@pytest.mark.parametrize("sizes", [[4096, 1024, 1024], [4096], [14336, 14336]])
@pytest.mark.parametrize("rows", [1, 2])
def test_dora_expand_at_llama_8b_shapes(tokens, sizes, rows):
    case = make_case(tokens, 4096, sizes, 64, 8, "some-base", torch.bfloat16, seed=tokens + rows, min_rank=1)
    case = case.to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    dora = torch.rand(8, rows, sum(sizes), device="cuda", generator=gen) - 0.5
    dora[3] = 0  # a plain LoRA slot
    y = case.y.clone()
    add_lora(y, case.x, case.A, case.B, case.ranks, case.scales, build_lora_meta(case.slots, 8), sizes, dora=dora)
    ref = lora_ref_by_slot(case.y, case.x, case.A, case.B, case.ranks, case.scales, case.slots, sizes)
    on = case.slots >= 0
    d = dora.double()[case.slots.clamp(min=0)]  # [T, rows, out]
    ref = torch.where(on[:, None], ref + d[:, 0] * ref + (d[:, 1] if rows == 2 else 0.0), ref)
    assert rel_err(y, ref) < KERNEL_TOLERANCE
    assert torch.equal(y[~on], case.y[~on])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dora-gpu")
    base = qwen2_2048(torch.float32)
    folders = {}
    for i, (r, targets, dora) in enumerate([(16, TARGETS["llama"][:7], True), (64, ["q_proj", "v_proj", "down_proj"], True),
                                            (8, ["o_proj", "up_proj", "lm_head"], False)]):
        cfg = LoraConfig(r=r, lora_alpha=16, target_modules=targets, init_lora_weights=False, use_dora=dora)
        folders[f"a{i}"] = save_adapter(base, f"a{i}", cfg, tmp, seed=i, std=0.02).path
    return folders


@pytest.mark.quick
def test_bfloat16_dora_mixed_batch_matches_float32_peft(adapters):
    ref_base = qwen2_2048(torch.float32).cuda()
    model = qwen2_2048(torch.bfloat16).cuda()
    handle = lorakit.patch(model, max_loras=4)
    for name, folder in adapters.items():
        handle.load_adapter(name, folder)
    handle.fuse_sibling_gemms()
    names = ["a0", None, "a1", "a2", "a0", None]
    input_ids = torch.randint(0, VOCAB, (len(names), 17), generator=torch.Generator().manual_seed(0)).cuda()
    assert_rows_match_peft(model, handle, ref_base, adapters, names, input_ids, "dora")


def test_float32_dora_engine_from_cuda_graphs_equals_peft_generate(adapters):
    ref_base = qwen2_2048(torch.float32).cuda()
    engine = Engine(qwen2_2048(torch.float32).cuda(), max_loras=4, max_num_seqs=8, max_seq_len=64, num_blocks=64,
                    adapters=adapters, **FLOAT32_GRAPHS)
    got = greedy(engine, qwen2_2048_requests(), 8)
    for tokens, (prompt, adapter) in zip(got, qwen2_2048_requests()):
        ref_model = ref_base if adapter is None else PeftModel.from_pretrained(copy.deepcopy(ref_base),
                                                                               adapters[adapter]).eval()
        with torch.no_grad():
            want = ref_model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8, do_sample=False,
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
        assert tokens == want[0, len(prompt):].tolist(), adapter


def test_bfloat16_dora_engine_replays_graphs_as_it_runs_eagerly(adapters):
    outputs = []
    for graphs in (False, True):
        engine = Engine(qwen2_2048(torch.bfloat16).cuda(), max_loras=4, max_num_seqs=8, max_seq_len=64,
                        num_blocks=64, adapters=adapters, cuda_graphs=graphs, graph_sizes=(1, 2, 4, 8))
        outputs.append(greedy_with_top2(engine, qwen2_2048_requests(), 8))
        del engine
        torch.cuda.empty_cache()
    assert_same_tokens_but_at_near_ties(*outputs)

"""Quantized bases on a GPU: the fp8 and int4 kernels at Llama-3-8B's shapes, a Qwen2-shaped model (biases on q/k/v) under three
adapters against PEFT on the dequantized base, and the engine serving fp8 and int4 bases from CUDA graphs."""

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel

import lorakit
from _peft_models import TARGETS, save_adapter
from helpers import (FLOAT32_GRAPHS, QWEN2_2048_VOCAB, assert_rows_match_peft, assert_same_tokens_but_at_near_ties,
                     dequantized, greedy, greedy_with_top2, qwen2_2048, qwen2_2048_requests, rel_err)
from lorakit.engine import Engine
from lorakit.layers.quant import Fp8Linear, Int4Linear, quantize
from lorakit.ops.quant import _launch_fp8_linear, _launch_int4_linear, dequantize_int4, quantize_fp8, quantize_int4

pytestmark = pytest.mark.gpu
VOCAB = QWEN2_2048_VOCAB
# Relative error of a bf16 result against the same computation in float64 (one rounding of the output, bf16
# inputs); a bf16 model's logits against float32 PEFT: helpers.BF16_PEFT_LOGITS_TOLERANCE.
KERNEL_TOLERANCE = 1e-2


@pytest.mark.parametrize("m", [1, pytest.param(16, marks=pytest.mark.quick), 64, 128, 256, 300, 2048])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_kernels_at_llama_8b_shapes(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    for layer in (Fp8Linear.from_linear(_linear(w, bias)), Int4Linear.from_linear(_linear(w, bias))):
        ref = x.double() @ layer.dequantized_weight(torch.float64).T + bias.double()
        y = layer(x)
        assert y.dtype == torch.bfloat16 and rel_err(y, ref) < KERNEL_TOLERANCE, (layer.scheme, m, n, k)
    # fp8 with float32 activations: IEEE float32 dots, the weight exact in float32
    fp8 = Fp8Linear.from_linear(_linear(w.float(), None))
    ref = x.double() @ fp8.dequantized_weight(torch.float64).T
    assert rel_err(fp8(x.float()), ref) < 1e-6


def test_fp8_kernel_keeps_bfloat16_activations_beyond_float16s_range():
    """The kernel's float16 dot is taken only for tiles of x inside float16's range: a "massive activation" of 3e5
    in one row gives that row's product as float64 does, not inf."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4, 4096, device="cuda", generator=gen).bfloat16()
    layer = Fp8Linear.from_linear(_linear((torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02).bfloat16(),
                                          None))
    x[2, 100] = 3e5
    y = layer(x)
    ref = x.double() @ layer.dequantized_weight(torch.float64).T
    assert torch.isfinite(y).all() and rel_err(y, ref) < KERNEL_TOLERANCE


@pytest.mark.parametrize("m", [1, 16, 64])
def test_fp8_decode_kernel_and_int4_kernel_forms_at_llama_8b_shapes(m):
    """The decode kernel (each config family the sweep times: tensor cores, and CUDA cores for one row) and the
    int4 kernel's forms, in bfloat16 at real sizes, against float64; a massive activation stays finite."""
    for n, k in ((6144, 4096), (4096, 14336)):
        gen = torch.Generator(device="cuda").manual_seed(m + n)
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        x[0, 7] = 3e5
        w8, scale = quantize_fp8(w)
        ref = x.double() @ (w8.double() * scale.double()[:, None]).T
        configs = [dict(KERNEL="decode", DOT=True, F16=True, BLOCK_M=max(16, m), BLOCK_N=32, BLOCK_K=256,
                        num_warps=4, num_stages=3)]
        if m == 1:
            configs.append(dict(KERNEL="decode", DOT=False, F16=False, BLOCK_M=1, BLOCK_N=16, BLOCK_K=512,
                                num_warps=4, num_stages=2))
        for config in configs:
            y = _launch_fp8_linear(x, w8, scale, None, config)
            assert torch.isfinite(y).all() and rel_err(y, ref) < KERNEL_TOLERANCE, config
        q4, s4, z4 = quantize_int4(w.bfloat16(), 128)
        ref = x.double() @ dequantize_int4(q4, s4, z4, 128, torch.float64).T
        int4_configs = [None, dict(BLOCK_M=16 if m <= 16 else 64, BLOCK_N=32, GROUPS=4, DOT=True, SPLIT_K=4,
                                   num_warps=4, num_stages=2)]
        if m == 1:
            int4_configs += [dict(BLOCK_M=1, BLOCK_N=16, GROUPS=8, DOT=False, SPLIT_K=split_k, num_warps=4,
                                  num_stages=3) for split_k in (1, 4)]
        for config in int4_configs:
            y = _launch_int4_linear(x, q4, s4, z4, 128, None, config)
            assert torch.isfinite(y).all() and rel_err(y, ref) < KERNEL_TOLERANCE, config


def _linear(w, bias):
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quant-gpu")
    base = qwen2_2048(torch.float32)
    folders = {}
    for i, (r, targets) in enumerate([(8, TARGETS["llama"]), (64, ["q_proj", "v_proj", "down_proj"]),
                                      (16, ["o_proj", "up_proj", "lm_head"])]):
        cfg = LoraConfig(r=r, lora_alpha=16, target_modules=targets, init_lora_weights=False)
        folders[f"a{i}"] = save_adapter(base, f"a{i}", cfg, tmp, seed=i, std=0.02).path
    return folders


@pytest.mark.quick
@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_bfloat16_quantized_mixed_batch_matches_peft_on_the_dequantized_base(scheme, adapters):
    model = qwen2_2048(torch.bfloat16).cuda()
    quantize(model, scheme)
    ref_base = dequantized(model).float()  # the weights the kernels multiply by, in float32
    handle = lorakit.patch(model, max_loras=4)
    for name, folder in adapters.items():
        handle.load_adapter(name, folder)
    handle.fuse_sibling_gemms()
    names = ["a0", None, "a1", "a2", "a0", None]
    input_ids = torch.randint(0, VOCAB, (len(names), 17), generator=torch.Generator().manual_seed(0)).cuda()
    assert_rows_match_peft(model, handle, ref_base, adapters, names, input_ids, scheme)


def test_float32_fp8_engine_from_cuda_graphs_equals_generate_on_the_dequantized_base(adapters):
    """Greedy tokens equal, token for token: fp8 weights are exact in float32, and the kernel's float32 dots are."""
    model = qwen2_2048(torch.float32).cuda()
    quantize(model, "fp8")
    ref_base = dequantized(model)
    engine = Engine(model, max_loras=4, max_num_seqs=8, max_seq_len=64, num_blocks=64, adapters=adapters,
                    **FLOAT32_GRAPHS)
    got = greedy(engine, qwen2_2048_requests(), 8)
    for tokens, (prompt, adapter) in zip(got, qwen2_2048_requests()):
        ref_model = ref_base if adapter is None else PeftModel.from_pretrained(copy.deepcopy(ref_base),
                                                                               adapters[adapter]).eval()
        with torch.no_grad():
            want = ref_model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8, do_sample=False,
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
        assert tokens == want[0, len(prompt):].tolist(), adapter


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_bfloat16_engine_replays_quantized_graphs_as_it_runs_eagerly(scheme, adapters):
    outputs = []
    for graphs in (False, True):
        engine = Engine(qwen2_2048(torch.bfloat16).cuda(), max_loras=4, max_num_seqs=8, max_seq_len=64,
                        num_blocks=64, adapters=adapters, quantization=scheme, cuda_graphs=graphs,
                        graph_sizes=(1, 2, 4, 8))
        assert engine.runner.fused_groups == 4
        outputs.append(greedy_with_top2(engine, qwen2_2048_requests(), 8))
        del engine
        torch.cuda.empty_cache()
    assert_same_tokens_but_at_near_ties(*outputs)
    # and the fused GEMM computes what the members compute alone
    model = qwen2_2048(torch.bfloat16).cuda()
    quantize(model, scheme)
    x = torch.randn(5, 2048, device="cuda", dtype=torch.bfloat16)
    attn = model.model.layers[0].self_attn
    alone = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    handle = lorakit.patch(model, max_loras=2)
    handle.fuse_sibling_gemms()
    group = model.model.layers[0].self_attn.q_proj.group
    for got, want in zip(group.outputs(x, None), alone):
        assert torch.equal(got, want)
    assert F.mse_loss(attn.q_proj.base_layer(x), alone[0]) == 0  # a member called alone (a view of the fused)

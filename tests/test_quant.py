"""Quantized bases (fp8, int4) under LoRA: the kernels against their torch paths, and patched models against PEFT on
the dequantized base (each quantized layer replaced by an nn.Linear holding the weight it multiplies by).

On the CPU both kernels run under the Triton interpreter (float32 and float16; the models on their torch paths).
"""

import copy
import json
import logging
import os

import pytest
import torch
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file, save_file

import lorakit
from _lora_cases import TOLERANCE
from _peft_models import TARGETS, save_adapter
from helpers import QUANT_VOCAB, dequantized, greedy, quant_model, rel_err
from lorakit.engine import LLM, Engine, EngineConfig, SamplingParams
from lorakit.layers.checkpoint import load_causal_lm, load_quantized
from lorakit.layers.patch import slot_bytes
from lorakit.layers.quant import Fp8Linear, Int4Linear, QuantizedLinear, quantize, weight_bytes
from lorakit.ops.quant import (FP8_DEQUANT_ROWS, INT4_DEQUANT_ROWS, QUANT_GEMM_ROWS, _fp8_linear_torch,
                               _int4_linear_torch, _launch_fp8_linear, _launch_int4_linear, dequantize_fp8,
                               dequantize_int4, fp8_config, int4_codes, int4_config, int4_linear, pack_int4_rows,
                               quantize_fp8, quantize_int4, unpack_int4_rows)

VOCAB = QUANT_VOCAB
# Relative error of a patched quantized model's logits against PEFT on its dequantized base, float32: the same
# weights, multiplied in another order (the fp8 scale after the dot, not in the weight).
LOGITS_TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["fp8", "int4"])
def quantized_setup(request, tmp_path_factory):
    """(scheme, quantized base, PEFT on its dequantized base per adapter, adapter folders): three adapters trained on
    the full-precision base (as users' are), of ranks 4, 8 and 16 on different targets; qwen2's q/k/v have biases."""
    scheme = request.param
    tmp = tmp_path_factory.mktemp(f"quant-{scheme}")
    base = quant_model("qwen2", seed=1)
    folders = {}
    for i, (rank, targets) in enumerate([(8, TARGETS["llama"]), (4, ["q_proj", "v_proj", "down_proj"]),
                                         (16, ["o_proj", "gate_proj", "up_proj", "lm_head"])]):
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        folders[f"a{i}"] = save_adapter(base, f"a{i}", cfg, tmp, seed=i, std=0.05).path
    quantize(base, scheme)
    ref_base = dequantized(base)
    peft = {name: PeftModel.from_pretrained(copy.deepcopy(ref_base), folder).eval() for name, folder in folders.items()}
    return scheme, base, ref_base, peft, folders


def reference_rows(ref_base, peft, names, input_ids):
    rows = []
    with torch.no_grad():
        for b, name in enumerate(names):
            model = ref_base if name is None else peft[name]
            rows.append(model(input_ids=input_ids[b: b + 1], use_cache=False).logits[0])
    return torch.stack(rows)


def test_quantize_swaps_every_linear_but_the_head():
    for scheme, cls in (("fp8", Fp8Linear), ("int4", Int4Linear)):
        model = quant_model("llama")
        full = sum(p.nbytes for p in model.parameters())
        assert quantize(model, scheme) == 14  # 7 projections x 2 layers
        assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
        assert all(type(m) is cls for n, m in model.named_modules() if n.endswith("_proj"))
        size = weight_bytes(model)
        assert sum(size.values()) < full
        assert size["quantized"] < (0.3 if scheme == "fp8" else 0.16) * 4 * 14 * 128 * 256  # float32 was 4 bytes


def test_quantized_weights_are_close_to_the_originals():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen)
    w8, scale = quantize_fp8(w)
    assert w8.dtype == torch.float8_e4m3fn and rel_err(dequantize_fp8(w8, scale), w) < 0.04
    codes, scale, zero = int4_codes(w, 128)
    assert 0 <= int(codes.min()) and int(codes.max()) <= 15
    packed = pack_int4_rows(codes, 128)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 128) and torch.equal(unpack_int4_rows(packed, 128), codes)
    assert rel_err(dequantize_int4(packed, scale, zero, 128), w) < 0.12


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton kernels on the CPU need TRITON_INTERPRET=1")
@settings(max_examples=12, deadline=None)
@example(m=130, n=40, k=48, dtype=torch.float16, bias=True, seed=1)  # GEMM tiles, always
@example(m=400, n=40, k=48, dtype=torch.float16, bias=True, seed=2)  # the widened path, always
@given(m=st.sampled_from([1, 3, 16, 33, 70, 130]), n=st.sampled_from([8, 40, 64, 96]), k=st.sampled_from([16, 48, 160]),
       dtype=st.sampled_from([torch.float32, torch.float16]), bias=st.booleans(), seed=st.integers(0, 1000))
def test_fp8_kernel_matches_the_torch_path_interpreted(m, n, k, dtype, bias, seed):
    """The Triton kernel (the tiles its heuristic picks: GEMM tiles from 128 rows; from FP8_DEQUANT_ROWS in float16
    the weight widened by the dequant kernel, then one matmul) against the CPU path and the dequantized weight."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w8, scale = quantize_fp8(torch.randn(n, k, generator=gen))
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = _launch_fp8_linear(x, w8, scale, b)
    ref = x.double() @ dequantize_fp8(w8, scale, torch.float64).T + (0 if b is None else b.double())
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, ref) < TOLERANCE[dtype]
    if m < 128:  # K split over 3 programs (partials summed in order by the reduce kernel): the same within rounding
        split = _launch_fp8_linear(x, w8, scale, b, dict(fp8_config(100, n, k), BLOCK_K=16, SPLIT_K=3))
        assert rel_err(split, ref) < TOLERANCE[dtype]
    for config in DECODE_CONFIGS:  # a program per column block over the whole of K, tensor or CUDA cores
        if m <= config["BLOCK_M"]:
            decode = _launch_fp8_linear(x, w8, scale, b, config)
            assert decode.dtype == dtype and rel_err(decode, ref) < TOLERANCE[dtype], config
    assert rel_err(_fp8_linear_torch(x, w8, scale, b), ref) < TOLERANCE[dtype]


DECODE_CONFIGS = [dict(KERNEL="decode", DOT=True, F16=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4,
                       num_stages=2),
                  dict(KERNEL="decode", DOT=False, F16=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=32, num_warps=4,
                       num_stages=2)]


def test_the_decode_kernel_refuses_more_rows_than_its_block():
    x = torch.randn(2, 32)
    w8, scale = quantize_fp8(torch.randn(8, 32))
    with pytest.raises(ValueError, match="up to BLOCK_M rows"):
        _launch_fp8_linear(x, w8, scale, None, DECODE_CONFIGS[1])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton kernels on the CPU need TRITON_INTERPRET=1")
@settings(max_examples=10, deadline=None)
@example(m=128, n=40, groups=3, group_size=64, block_n=16, per_step=2, split_k=1, dot=True, bias=True,
         seed=0)  # GEMM tiles
@example(m=300, n=40, groups=2, group_size=32, block_n=16, per_step=1, split_k=1, dot=True, bias=False,
         seed=1)  # widened first
@given(m=st.sampled_from([1, 5, 17]), n=st.sampled_from([16, 40]), groups=st.sampled_from([1, 3, 4]),
       group_size=st.sampled_from([32, 64, 128]), block_n=st.sampled_from([8, 16, 32]), per_step=st.sampled_from([1, 2]),
       split_k=st.sampled_from([1, 2, 3]), dot=st.booleans(), bias=st.booleans(), seed=st.integers(0, 1000))
def test_int4_kernel_matches_the_dequantized_weight_interpreted(m, n, groups, group_size, block_n, per_step, split_k,
                                                                dot, bias, seed):
    """The int4 kernel (codes exact into the tensor cores' dot, or into float32 products on the CUDA cores for one
    row; scale and zero after each group's sum), its default configs (GEMM tiles from 128 rows) and, from
    INT4_DEQUANT_ROWS, the weight widened then one matmul, against x @ dequant(W).T in float64 and the CPU path, in
    float16 (the interpreter's bfloat16 dot is wrong; bfloat16 runs on the GPU). A step of two groups over three
    falls back to one; K split in up to three parts (one part may be empty: K's groups fewer than the splits), the
    bias added after the parts."""
    gen = torch.Generator().manual_seed(seed)
    k = groups * group_size
    packed, scale, zero = quantize_int4(torch.randn(n, k, generator=gen), group_size)
    scale, zero = scale.half(), zero.half()
    x = torch.randn(m if dot else 1, k, generator=gen).half()
    b = torch.randn(n, generator=gen).half() if bias else None
    config = dict(BLOCK_M=16 if dot else 1, BLOCK_N=max(block_n, 16) if dot else block_n, GROUPS=per_step, DOT=dot,
                  SPLIT_K=split_k, num_warps=4, num_stages=2)
    ref = x.double() @ dequantize_int4(packed, scale, zero, group_size, torch.float64).T
    ref = ref + (0 if b is None else b.double())
    served = None if m >= QUANT_GEMM_ROWS else config
    for y in (_launch_int4_linear(x, packed, scale, zero, group_size, b, served),
              _launch_int4_linear(x, packed, scale, zero, group_size, b)):
        assert y.dtype == torch.float16 and y.shape == ref.shape and rel_err(y, ref) < TOLERANCE[torch.float16]
    assert rel_err(_int4_linear_torch(x, packed, scale, zero, group_size, b), ref) < TOLERANCE[torch.float16]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton kernels on the CPU need TRITON_INTERPRET=1")
def test_int4_kernel_reads_a_fused_member_s_column_views_interpreted():
    """A member of a fused int4 layer (q of qkv) holds column views of the group's scale and zero: the kernel reads
    them through their strides, as the member's own contiguous tensors would give."""
    gen = torch.Generator().manual_seed(3)
    layers = [Int4Linear.from_linear(torch.nn.Linear(256, n, dtype=torch.float16)) for n in (48, 16, 16)]
    own = [(m.weight_scale.clone(), m.weight_zero.clone()) for m in layers]
    fused = Int4Linear.cat(layers)
    x = torch.randn(3, 256, generator=gen).half()
    q = layers[0]
    assert not q.weight_scale.is_contiguous() and q.weight_scale.data_ptr() == fused.weight_scale.data_ptr()
    y = _launch_int4_linear(x, q.weight, q.weight_scale, q.weight_zero, 128, q.bias)
    want = _launch_int4_linear(x, q.weight, *own[0], 128, q.bias)
    assert torch.equal(y, want)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton kernels on the CPU need TRITON_INTERPRET=1")
def test_the_widened_path_reads_a_weight_through_its_row_stride_interpreted():
    """The kernels and their widened path (a step of FP8_DEQUANT_ROWS / INT4_DEQUANT_ROWS rows or more) read the
    weight through its row stride: a weight that is a column slice of a wider one gives the product of its own copy."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(24, 384, generator=gen)
    w8, scale = quantize_fp8(w)
    packed, s4, z4 = quantize_int4(w, 128)
    w8_view, packed_view = w8[:, :256], packed[:, :128]  # rows 384 and 192 bytes apart
    assert w8_view.stride(0) != 256 and packed_view.stride(0) != 128
    for m in (FP8_DEQUANT_ROWS, INT4_DEQUANT_ROWS, 3):
        x = torch.randn(m, 256, generator=gen).half()
        assert torch.equal(_launch_fp8_linear(x, w8_view, scale, None),
                           _launch_fp8_linear(x, w8_view.contiguous(), scale, None))
        s, z = s4[:2].half(), z4[:2].half()
        assert torch.equal(_launch_int4_linear(x, packed_view, s, z, 128, None),
                           _launch_int4_linear(x, packed_view.contiguous(), s, z, 128, None))


def test_int4_kernel_refuses_what_it_cannot_compute():
    packed, scale, zero = quantize_int4(torch.randn(16, 256), 128)
    with pytest.raises(ValueError, match=r"scale must be \[K / group size, N\] = \[2, 16\]"):
        int4_linear(torch.randn(1, 256), packed, scale.T.contiguous(), zero.T.contiguous(), 128)
    with pytest.raises(ValueError, match="a group size in"):
        int4_linear(torch.randn(1, 256), packed, scale, zero, 96)
    with pytest.raises(ValueError, match=r"weight \[N, 128\]"):
        int4_linear(torch.randn(1, 256), packed[:, :64], scale, zero, 128)
    with pytest.raises(ValueError, match="one row a program"):
        _launch_int4_linear(torch.randn(2, 256).half(), packed, scale.half(), zero.half(), 128, None,
                            dict(BLOCK_M=16, BLOCK_N=16, GROUPS=1, DOT=False))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        _launch_int4_linear(torch.randn(2, 256), packed, scale, zero, 128, None,
                            dict(BLOCK_M=16, BLOCK_N=16, GROUPS=1, DOT=True))


def test_int4_config_reads_each_weight_byte_once_a_block_of_rows():
    """The int4 kernel's tiles at 8B's shapes for every row count at decode (below the GEMM tiles): every row of up to
    16 or 64 in one block (so a decode step reads each weight byte once), the tensor cores' form, and enough programs
    (column blocks x splits of K) to fill 132 SMs."""
    for m in range(1, QUANT_GEMM_ROWS):
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            config = int4_config(m, n)
            assert config["DOT"] and config["BLOCK_M"] in (16, 64), (m, n, config)
            assert m > 64 or m <= config["BLOCK_M"], (m, n, config)
            assert (n // config["BLOCK_N"]) * config["SPLIT_K"] >= 132, (m, n, config)
            assert (k // 128) % config["GROUPS"] == 0


def test_steps_of_128_rows_and_more_take_gemm_tiles_until_the_widened_path():
    """From QUANT_GEMM_ROWS up to each scheme's widened path both kernels take 128-row GEMM tiles (the H100 sweep's:
    128 x 256 for fp8's wide layers, K split in two elsewhere); the launcher widens the weight only from there."""
    assert QUANT_GEMM_ROWS < INT4_DEQUANT_ROWS <= FP8_DEQUANT_ROWS
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        for m in (QUANT_GEMM_ROWS, INT4_DEQUANT_ROWS - 1):
            config = int4_config(m, n)
            assert config["BLOCK_M"] == 128 and config["DOT"] and config["SPLIT_K"] == (1 if n >= 16384 else 2)
        for m in (QUANT_GEMM_ROWS, FP8_DEQUANT_ROWS - 1):
            config = fp8_config(m, n, k, "H100")
            assert "KERNEL" not in config and config["BLOCK_M"] == 128 and config["num_warps"] == 8
            assert (config["BLOCK_N"], config["SPLIT_K"]) == ((256, 1) if n >= 16384 else (128, 2))


def test_fp8_config_takes_each_gpu_s_swept_tiles():
    """Each swept GPU's table: at 8B's shapes every row count up to the dequant path gets a config its kernel
    takes (the decode kernel: no more rows than its block; the CUDA cores: one row), and enough column blocks to
    fill the GPU; a GPU not swept takes the H200's."""
    for gpu in ("H200", "H100"):
        for m in (1, 2, 16, 17, 64, 65, 127):
            for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096)):
                config = fp8_config(m, n, k, gpu)
                if config.get("KERNEL") == "decode":
                    assert m <= config["BLOCK_M"] and (config["DOT"] or config["BLOCK_M"] == 1), (gpu, m, n, k)
                    assert config["F16"] == config["DOT"]
                else:
                    assert config["F16"] and config["BLOCK_M"] in (16, 64)
                assert n // config["BLOCK_N"] >= 16, (gpu, m, n, k, config)
    assert fp8_config(1, 28672, 4096, "NVIDIA A100-SXM4-80GB") == fp8_config(1, 28672, 4096, "H200")
    assert fp8_config(1, 28672, 4096, "H100")["KERNEL"] == "decode"  # the CUDA cores' kernel won there


def test_mixed_batch_matches_peft_on_the_dequantized_base(quantized_setup):
    scheme, base, ref_base, peft, folders = quantized_setup
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=4)
    for name, folder in folders.items():
        handle.load_adapter(name, folder)
    names = ["a0", None, "a1", "a2", "a0", None]
    input_ids = torch.randint(0, VOCAB, (len(names), 7), generator=torch.Generator().manual_seed(0))
    ref = reference_rows(ref_base, peft, names, input_ids)
    for fused in (False, True):
        if fused:
            assert handle.fuse_sibling_gemms() == 4  # q/k/v and gate/up of each layer, quantized weights fused
        with torch.no_grad():
            out = model(input_ids=input_ids, lora_ids=handle.ids(names), use_cache=False).logits
        for b, name in enumerate(names):
            err = rel_err(out[b], ref[b])
            assert err < LOGITS_TOLERANCE, f"{scheme} fused={fused} row {b} ({name}): relative error {err:.2e}"
    with torch.no_grad():  # without lora_ids: the quantized base alone
        assert rel_err(model(input_ids=input_ids, use_cache=False).logits,
                       ref_base(input_ids=input_ids, use_cache=False).logits) < LOGITS_TOLERANCE


def test_compiled_quantized_model_matches_eager_without_recompiles(quantized_setup):
    scheme, base, _, _, folders = quantized_setup
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=4)
    for name, folder in folders.items():
        handle.load_adapter(name, folder)
    handle.fuse_sibling_gemms()
    input_ids = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for names in (["a0", None, "a1", "a2"], [None] * 4, ["a2", "a2", "a0", None]):
            ids = handle.ids(names)
            eager = model(input_ids=input_ids, lora_ids=ids, use_cache=False).logits
            comp = compiled(input_ids=input_ids, lora_ids=ids, use_cache=False).logits
            assert rel_err(comp, eager) < LOGITS_TOLERANCE, (scheme, names)


def test_the_engine_serves_a_quantized_base_as_generate_on_the_dequantized_one(quantized_setup):
    scheme, base, ref_base, peft, folders = quantized_setup
    engine = Engine(quant_model("qwen2", seed=1), max_loras=2, max_num_seqs=4, max_num_batched_tokens=16,
                    block_size=4, num_blocks=64, max_seq_len=40, quantization=scheme, adapters=folders)
    assert sum(isinstance(m, QuantizedLinear) for m in engine.model.modules()) == 14
    assert engine.runner.fused_groups == 4  # q/k/v and gate/up: one quantized GEMM each
    gen = torch.Generator().manual_seed(2)
    requests = [(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), adapter)
                for n, adapter in ((5, None), (11, "a0"), (3, "a1"), (9, "a2"), (7, "a0"))]
    for tokens, (prompt, adapter) in zip(greedy(engine, requests, ignore_eos=False), requests):
        model = ref_base if adapter is None else peft[adapter]
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        assert tokens == want.tolist(), (scheme, adapter)


def test_refusals_name_the_problem(caplog):
    model = quant_model("llama")
    with pytest.raises(ValueError, match=r"'nf4' is not supported.*\['fp8', 'int4'\]"):
        quantize(model, "nf4")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="awq")
    lorakit.patch(model, max_loras=2)
    with pytest.raises(ValueError, match="before lorakit.patch"):
        quantize(model, "fp8")
    with pytest.raises(ValueError, match="needs an unpatched model"):
        Engine(model, max_loras=2, quantization="fp8")
    small = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    with pytest.raises(ValueError, match="no linear layer of LlamaForCausalLM can be quantized.*divide by"):
        quantize(small, "int4")  # in_features 32 and 48: not multiples of int4's group of 128
    mixed = quant_model("llama")
    mixed.model.layers[0].mlp.down_proj = torch.nn.Linear(250, 128)  # an input no group size divides
    mixed.model.layers[0].mlp.up_proj = torch.nn.Linear(128, 250)
    mixed.model.layers[0].mlp.gate_proj = torch.nn.Linear(128, 250)
    with caplog.at_level(logging.INFO, logger="lorakit.quant"):
        assert quantize(mixed, "fp8") == 13  # all but that down_proj
    assert "model.layers.0.mlp.down_proj (in_features 250 does not divide by 16)" in caplog.text


def test_slot_bytes_count_the_adapters_dtype_not_the_quantized_weights():
    model = quant_model("llama")
    before = slot_bytes(model, 16)
    quantize(model, "fp8")
    assert slot_bytes(model, 16) == before


def test_an_engine_given_a_model_already_quantized_keeps_it():
    model = quant_model("llama")
    quantize(model, "int4")
    with pytest.raises(ValueError, match=r"already quantized as \['int4'\]"):
        Engine(model, max_loras=1, quantization="fp8")
    engine = Engine(model, max_loras=1, num_blocks=16, max_seq_len=32, quantization="int4")
    assert engine.model is model


# ------------------------------------------------------------------------- checkpoints, a tensor at a time


def _saved(tmp_path, arch="llama"):
    model = quant_model(arch, seed=4)
    folder = tmp_path / "bf16"
    model.save_pretrained(folder)
    return folder


def _logits(model, seed=0):
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_a_checkpoint_quantized_as_it_loads_equals_quantizing_the_loaded_model(scheme, tmp_path):
    folder = _saved(tmp_path, "qwen2")
    loaded = load_quantized(folder, scheme, torch.float32, "cpu")
    whole = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    quantize(whole, scheme)
    assert sum(isinstance(m, QuantizedLinear) for m in loaded.modules()) == 14
    assert not any(t.device.type == "meta" for t in [*loaded.parameters(), *loaded.buffers()])
    assert torch.equal(_logits(loaded), _logits(whole))


def _compressed_tensors_fp8(tmp_path, strategy: str):
    """A checkpoint as llm-compressor saves FP8_DYNAMIC (per channel) or FP8 (per tensor, static input scales):
    fp8 weights, their scales [out, 1] or [1], the head in full precision (the ignore list); and the model it holds."""
    model = quant_model("qwen2", seed=5)
    folder = tmp_path / f"fp8-{strategy}"
    model.save_pretrained(folder)
    quantize(model, "fp8")
    state = {k: v for k, v in load_file(folder / "model.safetensors").items()}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            weight, scale = module.weight, module.weight_scale
            if strategy == "tensor":  # one scale for the whole weight
                full = module.dequantized_weight()
                one = full.abs().max() / 448
                weight, scale = (full / one).to(torch.float8_e4m3fn), one.expand(module.out_features).clone()
                module.weight.data, module.weight_scale.data = weight, scale
            state[f"{name}.weight"] = weight
            state[f"{name}.weight_scale"] = scale[:1] if strategy == "tensor" else scale[:, None]
            if strategy == "tensor":
                state[f"{name}.input_scale"] = torch.ones(1)  # static activation scales: not read (weight-only)
    save_file(state, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, model


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_a_compressed_tensors_fp8_checkpoint_loads_as_saved(strategy, tmp_path):
    folder, want = _compressed_tensors_fp8(tmp_path, strategy)
    loaded = load_causal_lm(folder, torch.float32, "cpu")  # no scheme asked: the saved one is read
    assert sum(type(m) is Fp8Linear for m in loaded.modules()) == 14 and type(loaded.lm_head) is torch.nn.Linear
    # the same weights; attention is sdpa here and eager in the model the test made: 1e-6
    assert rel_err(_logits(loaded), _logits(want)) < 1e-6
    assert rel_err(_logits(load_quantized(folder, "fp8", torch.float32, "cpu")), _logits(want)) < 1e-6
    with pytest.raises(ValueError, match="saved quantized as fp8; it cannot be loaded as int4"):
        load_quantized(folder, "int4", torch.float32, "cpu")
    from lorakit.parallel import load_sharded
    with pytest.raises(ValueError, match="saved quantized"):  # bf16 slices of fp8 weights would be garbage
        load_sharded(folder, 0, 1)


@pytest.mark.parametrize("quantization_config,message", [
    ({"quant_method": "gptq", "bits": 4}, "GPTQ int4"),
    ({"quant_method": "awq", "bits": 4}, "AWQ int4"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise fp8"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, "int 4-bit by group"),
])
def test_a_checkpoint_saved_in_a_scheme_lorakit_does_not_read_is_refused_by_name(quantization_config, message,
                                                                                 tmp_path):
    folder = _saved(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(ValueError, match=message):
        load_causal_lm(folder, torch.float32, "cpu")


def test_llm_loads_a_folder_quantized(tmp_path):
    folder = _saved(tmp_path)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer())
    llm = LLM(folder, tokenizer, quantization="int4", max_loras=1, num_blocks=16, max_seq_len=32, device="cpu")
    assert sum(type(m) is Int4Linear for m in llm.engine.model.modules()) == 14
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_the_serve_flag_reaches_the_engine_config():
    import argparse

    from lorakit.serve import cli

    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    cli.add_parser(sub)
    serve = sub.choices["serve"]
    assert cli.engine_config(serve.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    assert cli.engine_config(serve.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        serve.parse_args(["--quantization", "nf4"])  # argparse: invalid choice 'nf4' (choose from fp8, int4)


# ---------------------------------------------------------------------------------------- tensor parallel


def load_float32(folder: str) -> torch.nn.Module:
    """The factory each tensor-parallel rank calls (module level: pickled by reference into the worker)."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_a_quantized_base_split_over_two_ranks_gives_the_tokens_of_one(scheme, tmp_path):
    """Each rank quantizes its shard as the unsharded layer is quantized (row-parallel fp8 with the whole row's
    scales, all-reduced; int4 groups lie inside a shard), so at tensor_parallel_size=2 (gloo, one worker process)
    greedy tokens equal tensor_parallel_size=1's for base rows and adapters; a hidden of 256 leaves the
    row-parallel shards 128 inputs wide, int4's group."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    base.save_pretrained(tmp_path / "base")
    folders = {}
    for i, (rank, targets) in enumerate([(8, TARGETS["llama"][:7]), (4, ["q_proj", "o_proj", "down_proj"])]):
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        folders[f"a{i}"] = save_adapter(base, f"a{i}", cfg, tmp_path, seed=i, std=0.05).path
    gen = torch.Generator().manual_seed(1)
    requests = [(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), a)
                for n, a in ((5, None), (9, "a0"), (3, "a1"), (12, "a0"))]
    settings = dict(max_loras=2, max_num_seqs=4, max_seq_len=32, num_blocks=32, device="cpu", quantization=scheme,
                    adapters=folders)
    outputs = []
    for tp in (1, 2):
        import functools

        engine = Engine(functools.partial(load_float32, str(tmp_path / "base")), tensor_parallel_size=tp, **settings)
        try:
            if tp == 2:
                down = engine.model.model.layers[0].mlp.down_proj.base_layer
                assert type(down).__name__ == "RowParallelLinear" and down.quantized.scheme == scheme
            outputs.append(greedy(engine, requests))
        finally:
            engine.close()
    assert outputs[0] == outputs[1]

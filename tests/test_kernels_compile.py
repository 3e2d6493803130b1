"""The Triton kernels compile for Hopper (sm_90) through Triton's whole pipeline, on any machine.

The interpreter runs the kernels' logic on the CPU but skips the compiler; this catches what only the
compiler rejects (type mismatches between branches, unsupported ops), without a GPU. It runs in a
subprocess because the test session's kernels are interpreted ones.
"""

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lorakit.ops.expand import _expand_kernel
from lorakit.ops.experts import _expert_expand_kernel, _expert_shrink_kernel
from lorakit.ops.quant import (_fp8_decode_kernel, _fp8_dequant_kernel, _fp8_linear_kernel, _int4_dequant_kernel,
                               _int4_kernel, _split_k_reduce_kernel)
from lorakit.ops.shrink import _shrink_kernel

POINTERS = {"h_ptr": "*fp32", "scales_ptr": "*fp32", "ranks_ptr": "*i32", "order_ptr": "*i32", "tiles_ptr": "*i32",
            "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "ws_ptr": "*fp32", "d_ptr": "*fp32"}


def compile_for_hopper(fn, constexprs, dtype, y_dtype=None, num_warps=4):
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Y0", "Y1", "Y2", "Y3"):
            signature[name] = "*" + (y_dtype or dtype)
        elif name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, "*" + dtype)
        else:
            signature[name] = "i32"
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


dtype = sys.argv[1]
try:
    compile_for_hopper(_shrink_kernel, dict(BLOCK_M=16, SUB_TILES=1, BLOCK_R=64, BLOCK_K=128, SPLIT_K=4,
                                            IEEE=False), dtype)
except RuntimeError as e:
    if "ptxas" in str(e).lower():
        print("SKIP: no ptxas:", e)
        sys.exit(0)
    raise
# A 1-wide slice with unit row stride is specialised to constexpr 1 by the launcher: compile that too.
# (and with DoRA's rescale: a gain, a gain and a shift)
for dora in (0, 1, 2):
    compile_for_hopper(_expand_kernel, dict(BLOCK_M=16, BLOCK_N=128, SPLIT_K=4, IEEE=False, N1=1, SYT1=1, DORA=dora),
                       dtype)
# the fp8 weight-only GEMM: its decode and prefill tiles, with a bias
for tiles in (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=512, GROUP_M=1), dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=8)):
    for f16 in (False, True):
        for split_k in (1, 4):
            compile_for_hopper(_fp8_linear_kernel, dict(HAS_BIAS=True, IEEE=False, F16=f16, SPLIT_K=split_k, **tiles),
                               dtype)
# and its GEMM tiles (from 128 rows), as served: 8 warps
compile_for_hopper(_fp8_linear_kernel, dict(HAS_BIAS=True, IEEE=False, F16=True, SPLIT_K=1, BLOCK_M=128, BLOCK_N=128,
                                            BLOCK_K=64, GROUP_M=8), dtype, num_warps=8)
for block_m, dot in ((1, False), (16, True), (64, True)):
    compile_for_hopper(_fp8_decode_kernel, dict(HAS_BIAS=True, IEEE=False, F16=dot, DOT=dot, BLOCK_M=block_m,
                                                BLOCK_N=32, BLOCK_K=256), dtype)
POINTERS["out_ptr"] = "*" + dtype
compile_for_hopper(_fp8_dequant_kernel, dict(BLOCK_N=32, BLOCK_K=256), dtype)
POINTERS.update(ws_ptr="*fp32", y_ptr="*" + dtype)
compile_for_hopper(_split_k_reduce_kernel, dict(HAS_SCALE=True, HAS_BIAS=True, SPLIT_K=4, BLOCK=1024), dtype)
# int4: the weight's bytes, a scale and zero in x's dtype; several groups a step (unrolled), split K
int4_pointers = dict(POINTERS, w_ptr="*u8", s_ptr="*" + dtype, z_ptr="*" + dtype)
POINTERS, saved = int4_pointers, POINTERS
for block_m, dot in ((1, False), (16, True), (64, True)):
    for groups, split_k in ((1, 1), (4, 2)):
        compile_for_hopper(_int4_kernel, dict(GROUP=128, GROUPS=groups, MAGIC=128 if dtype == "bf16" else 1024,
                                              DOT=dot, HAS_BIAS=True, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=32),
                           dtype)
compile_for_hopper(_int4_kernel, dict(GROUP=128, GROUPS=1, MAGIC=128 if dtype == "bf16" else 1024, DOT=True,
                                      HAS_BIAS=True, SPLIT_K=1, BLOCK_M=128, BLOCK_N=128), dtype, num_warps=8)
compile_for_hopper(_int4_dequant_kernel, dict(GROUP=128, BLOCK_N=32), dtype)
POINTERS = saved
# MoE expert LoRA: the shrink and expand keyed by (slot, expert), decode and prefill tiles
POINTERS["y_ptr"] = "*" + dtype
for block_m in (16, 64):
    compile_for_hopper(_expert_shrink_kernel, dict(BLOCK_M=block_m, BLOCK_R=64, BLOCK_K=128, SPLIT_K=4, IEEE=False),
                       dtype)
for block_m, block_r in ((16, 16), (64, 64)):
    compile_for_hopper(_expert_expand_kernel, dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_R=block_r, SPLIT_K=2,
                                                   IEEE=False), dtype)
print("OK")
'''


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_kernels_compile_for_sm90(dtype):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = pathlib.Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SCRIPT, dtype], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    if run.stdout.startswith("SKIP"):
        pytest.skip(run.stdout.strip())
    assert run.stdout.strip().endswith("OK")

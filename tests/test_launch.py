"""ops/_launch.py: the cached launcher is never different from ``kernel[grid](...)``.

On the CPU: what the cache key tells apart (everything Triton specializes on). On a GPU: results equal Triton's
own launch for every specialization (integers equal to 1 or divisible by 16, tensors aligned or not), one compiled
kernel kept per key, and launch hooks (profilers) still see every launch."""

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from lorakit.ops._launch import Launcher, _spec


def test_key_tells_apart_what_triton_specializes_on():
    x = torch.zeros(64, dtype=torch.float16)
    assert _spec(x) != _spec(x[1:])  # 16-byte aligned or not
    assert _spec(x) != _spec(x.float())  # dtype
    assert _spec(x[8:]) == _spec(x)  # 16 bytes further: aligned as well
    # 1; neither; % 16; int64 % 16; int64
    assert len({_spec(1), _spec(2), _spec(16), _spec(2**31), _spec(2**31 + 1)}) == 5
    assert _spec(17) == _spec(3)
    assert _spec(True) != _spec(1) and _spec(True) != _spec(False)
    assert _spec("a") is None and _spec(None) is None  # unknown: never cached


@triton.jit
def _axpy(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(y_ptr + offs, mask=mask) + alpha * tl.load(x_ptr + offs, mask=mask), mask=mask)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_launches_equal_triton_launches():
    launch = Launcher(_axpy)
    base = torch.randn(4096, device="cuda")
    for n in (1, 16, 17, 1000, 1, 16, 17, 1000):
        for offset in (0, 1, 4):  # 4 floats = 16 bytes: aligned again
            x, y = base[offset: offset + n], torch.randn(n, device="cuda")
            expected = y + 0.5 * x
            launch[(triton.cdiv(n, 128),)](x, y, n, 0.5, BLOCK=128)
            torch.testing.assert_close(y, expected, rtol=0, atol=0)
    # n: 1, 16 (% 16), 17 / 1000 (neither) x alignment: aligned (offsets 0 and 4) or not (offset 1)
    assert len(launch.cache) == 3 * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launch_hooks_see_every_launch(monkeypatch):
    launch = Launcher(_axpy)
    x, y = torch.randn(256, device="cuda"), torch.zeros(256, device="cuda")
    launch[(2,)](x, y, 256, 1.0, BLOCK=128)  # cached
    seen = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda meta: seen.append(meta))
    launch[(2,)](x, y, 256, 1.0, BLOCK=128)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert len(seen) == 1
    torch.testing.assert_close(y, 2 * x)

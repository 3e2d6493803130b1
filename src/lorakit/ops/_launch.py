"""Launching a Triton kernel without Triton's per-call bookkeeping.

``kernel[grid](...)`` binds every argument, rebuilds the specialization key, looks the compiled kernel up and
checks the kernel's globals on every call: 24-36 us of host time on an H200's host
(bench/results/bench_ops_*.md, "host time"), longer than a decode-sized LoRA kernel runs. ``Launcher`` keeps
the compiled kernel that first call returned, under a key of its own that is at least as fine as Triton's
specialization (each tensor's dtype and 16-byte alignment; each integer's equality to 1, divisibility by 16
and width; every constexpr and launch option), and calls the compiled kernel's launcher directly, with the
arguments Triton itself would pass (``JITFunction.run``, triton 3.4 to 3.9).

Anything it does not know (a launch hook such as a profiler's, an argument type outside the key, Triton's
interpreter) goes through ``kernel[grid](...)`` as before, so it can only be faster, never different.
"""

from __future__ import annotations

import torch
from triton import knobs

try:  # the interpreter replaces kernels by objects that return no compiled kernel
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover
    InterpretedFunction = ()

_INT32 = range(-(2**31), 2**31)
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _spec(value) -> object:
    """What Triton specializes a runtime argument on (a superset of it)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):  # before int: bool is an int
        return bool, value
    if isinstance(value, int):
        return int, value == 1, value % 16 == 0, value in _INT32
    if isinstance(value, float):
        return float
    return None  # unknown: not cached


class Launcher:
    """``Launcher(kernel)[grid](*args, **constexprs_and_options)``: as ``kernel[grid](...)``, faster once warm.

    Positional arguments are the kernel's runtime parameters in order; keywords its constexprs and launch
    options (num_warps, num_stages). All calls of one ``Launcher`` must pass the same keywords."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = list(kernel.arg_names)
        self.cache: dict[tuple, object] = {}
        self.fast = not isinstance(kernel, InterpretedFunction)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict):
        if not self.fast or knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None:
            return self.kernel[grid](*args, **kwargs)
        device = args[0].device
        specs = tuple(_spec(a) for a in args)
        if None in specs or device.type != "cuda":
            return self.kernel[grid](*args, **kwargs)
        key = (device.index, specs, *kwargs.items())
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if all(n in kwargs for n in self.names[len(args):]) and hasattr(compiled, "packed_metadata"):
                self.cache[key] = compiled  # else a call shape this launcher does not cover: never cached
            return compiled
        bound = (*args, *[kwargs[n] for n in self.names[len(args):]])
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device.index), compiled.function,
                     compiled.packed_metadata, None, None, None, *bound)
        return compiled

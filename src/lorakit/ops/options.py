"""``KernelOptions``: how the LoRA ops launch their kernels, never what they compute.

The options travel with the calls (``add_lora(..., options=...)``; the LoRA layers pass their context's, which
``lorakit.patch`` takes), so two models in one process can launch differently and nothing flips a module global.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PDL_KERNELS = ("shrink", "expand")  # the kernels that may launch with programmatic dependent launch

# The expand alone: it starts while the shrink runs, and a PDL shrink after an expand would take SMs from it (the
# measurements: docs/ops.md). LORAKIT_PDL=0 in the environment at import turns it off in the default options.
DEFAULT_PDL = frozenset() if os.environ.get("LORAKIT_PDL") == "0" else frozenset({"expand"})

# Decode-sized calls as one launch (ops/fused.py); LORAKIT_FUSED_MAX_TOKENS at import sets it (0: off).
DEFAULT_FUSED_MAX_TOKENS = int(os.environ.get("LORAKIT_FUSED_MAX_TOKENS", "0"))


@dataclass(frozen=True)
class KernelOptions:
    """pdl: the kernels ("shrink", "expand") launched with programmatic dependent launch (Hopper and later, a
    Triton with ``launch_pdl``; elsewhere every kernel launches plainly): a PDL kernel may start while the kernel
    before it finishes and waits for it before its first load, and the shrink lets a PDL expand launch early.
    direct_devices: the device types whose eager calls check their arguments and launch the Triton kernels
    themselves, skipping the dispatcher (35-50 us of host time per op on an H200, bench/NOTES.md, host time);
    "cpu" added runs them under the Triton interpreter (``TRITON_INTERPRET=1``) instead of the torch path.
    fused_max_tokens: calls of at most this many tokens run the shrink and expand as one launch (``lorakit::fused``,
    launched with PDL where "expand" is in ``pdl``); 0 turns it off."""

    pdl: frozenset[str] = DEFAULT_PDL
    direct_devices: frozenset[str] = frozenset({"cuda"})
    fused_max_tokens: int = DEFAULT_FUSED_MAX_TOKENS

    def __post_init__(self):
        pdl = frozenset(self.pdl)
        if not pdl <= set(PDL_KERNELS):
            raise ValueError(f"pdl must name kernels of {list(PDL_KERNELS)}, got {sorted(pdl)}")
        direct = frozenset(self.direct_devices)
        if not all(isinstance(d, str) for d in direct):
            raise ValueError(f"direct_devices must be device types (\"cuda\", \"cpu\"), got {sorted(map(str, direct))}")
        if not isinstance(self.fused_max_tokens, int) or self.fused_max_tokens < 0:
            raise ValueError(f"fused_max_tokens must be an int >= 0 (0: off), got {self.fused_max_tokens!r}")
        object.__setattr__(self, "pdl", pdl)
        object.__setattr__(self, "direct_devices", direct)

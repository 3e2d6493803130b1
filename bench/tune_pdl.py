"""Programmatic dependent launch, variant by variant, on chosen bench_ops shapes (a tuning run, not a report).

For each shape, ``add_lora`` alone (the bench_ops rotation: calls back to back) and the base GEMM + ``add_lora``
(a layer, as the engine runs it), with PDL off, on the expand (the default), on both kernels, on the shrink only.
Prints one line per shape and writes OUT/tune_pdl.json.

    PYTHONPATH=src python bench/tune_pdl.py --out DIR
"""

from __future__ import annotations

import json
from functools import partial
import sys

import torch
from bench_ops import Case, layer_copy, lorakit_copy, make_problem, run_layer, run_lorakit
from common import arg_parser, parse_args, rotating_us, setup

from lorakit.ops import KernelOptions

SHAPES = [  # mode, T, L, r, h_out: the rows PDL slowed at 9d1e71f, then rows it sped up
    ("decode", 16, 16, 16, 4096), ("decode", 64, 64, 16, 4096), ("decode", 256, 128, 16, 4096),
    ("prefill", 4096, 1, 16, 4096), ("decode", 64, 32, 16, 14336),
    ("decode", 1, 1, 16, 4096), ("decode", 64, 8, 16, 4096), ("decode", 16, 8, 16, 14336), ("decode", 64, 8, 64, 14336),
]
VARIANTS = {  # name: the kernels launched with PDL; the shrink triggers early whenever the expand is one
    "off": KernelOptions(pdl=frozenset()),
    "expand (the default)": KernelOptions(pdl=frozenset({"expand"})),
    "shrink and expand": KernelOptions(pdl=frozenset({"shrink", "expand"})),
    "shrink only": KernelOptions(pdl=frozenset({"shrink"})),
}


def main(argv=None) -> int:
    args = parse_args(arg_parser(__doc__), argv)
    out = {"setup": setup("gpu", "torch", "triton", "cuda", "commit", "date_utc"), "rows": []}
    print(out["setup"])
    for mode, T, L, r, h_out in SHAPES:
        case = Case(mode, T, L, h_out, r, (r,) * L)
        p = make_problem(case)
        row = {"shape": [mode, T, L, r, h_out]}
        for name, options in VARIANTS.items():
            row[name] = tuple(rotating_us(partial(run, options=options), lambda i: copy(p, case.num_slots))[0]
                              for run, copy in ((run_lorakit, lorakit_copy), (run_layer, layer_copy)))
        out["rows"].append(row)
        print(row["shape"], "  ".join(f"{k}: {v[0]:.1f}/{v[1]:.1f}" for k, v in row.items() if k != "shape"),
              flush=True)
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune_pdl.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

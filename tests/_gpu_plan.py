"""How scripts/gpu-check splits the GPU suite into parts: tests and benchmarks dealt out by their recorded durations.

One deterministic function, used twice: by scripts/gpu-check to pick a part's benchmarks, and by tests/conftest.py
(with ``LORAKIT_GPU_PART=K/N``) to keep a part's tests. Every part computes the same split, so the N parts together
run every test and every benchmark exactly once, with no coordination between the machines that run them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu_check_durations.json"
NEW_TEST_S = {"gpu": 20.0, "cpu": 3.0}  # a test the table does not know yet (seconds, as the table counts them)
SPLIT_FILE_S = 60.0  # a test file whose tests take longer than this together is dealt out test by test
PARALLEL_EFFICIENCY = 0.85  # W pytest-xdist workers run a test file's seconds in about 1 / (0.85 W) of them


def load_durations(path: Path = DURATIONS) -> dict:
    """The recorded table: {"setup": ..., "workers": W, "tests": {nodeid: s}, "benchmarks": {name: s}}."""
    if not path.exists():
        return {"workers": 1, "tests": {}, "benchmarks": {}}
    return json.loads(path.read_text())


def units_of_tests(seconds: dict[str, float], workers: int) -> dict[str, tuple[float, list[str]]]:
    """Test ids grouped into units of wall-clock seconds: a whole file where its tests are short together, else
    one unit per test. A file's seconds are spread over the ``workers`` xdist workers."""
    files = defaultdict(list)
    for nodeid in seconds:
        files[nodeid.split("::")[0]].append(nodeid)
    scale = 1.0 / (max(workers, 1) * PARALLEL_EFFICIENCY) if workers > 1 else 1.0
    units = {}
    for file, ids in files.items():
        total = sum(seconds[i] for i in ids)
        if total <= SPLIT_FILE_S:
            units[f"tests:{file}"] = (total * scale, sorted(ids))
        else:
            units.update({f"tests:{i}": (seconds[i] * scale, [i]) for i in ids})
    return units


def split(units: dict[str, tuple[float, list[str]]], parts: int) -> list[list[str]]:
    """The units' names dealt into ``parts`` lists of about equal seconds: longest first, each to the part with the
    fewest seconds so far (ties to the lower part); the same input gives the same split on every machine."""
    loads, out = [0.0] * parts, [[] for _ in range(parts)]
    for name, (seconds, _) in sorted(units.items(), key=lambda kv: (-kv[1][0], kv[0])):
        k = min(range(parts), key=lambda j: (loads[j], j))
        loads[k] += seconds
        out[k].append(name)
    return out


def plan(test_seconds: dict[str, float], bench_seconds: dict[str, float], workers: int,
         parts: int) -> list[dict]:
    """Each part's tests (node ids), benchmarks (names) and estimated seconds."""
    units = units_of_tests(test_seconds, workers) | {f"bench:{b}": (s, [b]) for b, s in bench_seconds.items()}
    out = []
    for names in split(units, parts):
        out.append(dict(
            tests=sorted(i for n in names if n.startswith("tests:") for i in units[n][1]),
            benchmarks=[units[n][1][0] for n in names if n.startswith("bench:")],
            seconds=sum(units[n][0] for n in names)))
    return out


def parse_part(text: str) -> tuple[int, int]:
    """'K/N' as (K, N), 1 <= K <= N, or a ValueError that says what was expected."""
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"a part is K/N with whole numbers, such as 2/3; got {text!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"a part K/N needs 1 <= K <= N; got {text!r}")
    return k, n


def tests_of_part(items, part: tuple[int, int], table: dict) -> set[str]:
    """The node ids among ``items`` (collected pytest items) that part K of N runs: the table's seconds for the
    tests it knows, NEW_TEST_S for the others (by their ``gpu`` mark)."""
    known = table.get("tests", {})
    seconds = {item.nodeid: known.get(item.nodeid, NEW_TEST_S["gpu" if "gpu" in item.keywords else "cpu"])
               for item in items}
    k, n = part
    return set(plan(seconds, table.get("benchmarks", {}), table.get("workers", 1), n)[k - 1]["tests"])

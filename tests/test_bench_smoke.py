"""The benchmarks on the CPU: every script in bench/ imports (so a moved lorakit name fails here, not on the GPU
machine), and bench_pool's smoke run (a tiny model, no timing value) writes the report the H200 results in
bench/results have: the same JSON keys and the same table rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def test_bench_scripts_import_and_pool_smoke_run(tmp_path):
    script = (f"import sys; sys.path.insert(0, {str(BENCH)!r})\n"
              "import bench_attention, bench_engine, bench_logits, bench_ops, bench_patch, bench_pool, bench_serve, "
              "bench_prefix, bench_step, bench_tp, bench_traffic, tune_pdl, bench_grammar\n"
              f"sys.exit(bench_pool.main(['--out', {str(tmp_path)!r}, '--device', 'cpu', '--tiny']))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]

    reference = sorted(BENCH.glob("results/bench_pool_*.json"))[-1]
    ours, theirs = json.loads((tmp_path / "bench_pool.json").read_text()), json.loads(reference.read_text())
    assert {k: list(v) for k, v in ours.items()} == {k: list(v) for k, v in theirs.items()}

    def row_labels(md: str) -> list[str]:
        return [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("|")]

    md = (tmp_path / "bench_pool.md").read_text()
    assert row_labels(md) == row_labels(reference.with_suffix(".md").read_text())
    assert md.splitlines()[2].startswith("cpu, torch ")


def test_bench_traffic_smoke_run(tmp_path):
    """bench_traffic end to end on the CPU: a tiny model behind a real ``lorakit serve``, six requests of the trace
    per workload; every request succeeds with exactly its tokens, and the report has both workloads."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(BENCH / "bench_traffic.py"), "--out", str(tmp_path), "--tiny", "--device", "cpu",
               "--requests", "6", "--rate", "4"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    result = json.loads((tmp_path / "bench_traffic.json").read_text())
    rows = {r["workload"]: r for r in result["rows"]}
    assert list(rows) == ["16 adapters", "base"]
    expected_tokens = round(result["trace"]["output_mean"] * result["trace"]["requests"])
    for row in rows.values():
        assert (row["requests"], row["failed"], row["errors"]) == (6, 0, [])
        assert row["output_tokens"] == expected_tokens
        assert row["engine_steps"] > 0 and row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0
    md = (tmp_path / "bench_traffic.md").read_text()
    assert md.splitlines()[2].startswith("cpu, torch ")
    assert "| 16 adapters | 6 | 0 |" in md and "| base | 6 | 0 |" in md


def test_bench_step_smoke_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(BENCH / "bench_step.py"), "--out", str(tmp_path), "--device", "cpu",
                           "--tiny", "--batches", "4", "--steps", "3"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "bench_step.json").read_text())["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [(4, "mixed eager")] and rows[0]["eager_steps"] > 0
    assert rows[0]["stream_ms"] > 0

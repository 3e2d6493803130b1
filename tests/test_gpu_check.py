"""scripts/gpu-check without a GPU: the split into parts covers every test and benchmark once and stays balanced,
each part's pytest keeps exactly its share of the collected tests, and a run's results fit in eight files."""

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _gpu_plan import load_durations, parse_part, plan, split, units_of_tests

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check"


def gpu_check():
    """scripts/gpu-check as a module (its file name has no .py)."""
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    loader.exec_module(module)
    return module


@given(seconds=st.dictionaries(st.text("abcdef", min_size=1, max_size=6), st.floats(0, 500), max_size=40),
       parts=st.integers(1, 9))
def test_split_deals_every_unit_once_and_balances_within_the_longest(seconds, parts):
    units = {name: (s, [name]) for name, s in seconds.items()}
    dealt = split(units, parts)
    assert len(dealt) == parts
    names = [n for part in dealt for n in part]
    assert sorted(names) == sorted(units)
    loads = [sum(units[n][0] for n in part) for part in dealt]
    if units:  # longest first to the lightest part: no part exceeds the mean by more than one unit
        assert max(loads) <= sum(loads) / parts + max(s for s, _ in units.values()) + 1e-6
    assert split(units, parts) == dealt  # the same on every machine


def test_a_long_test_file_is_dealt_test_by_test_and_a_short_one_whole():
    seconds = {"tests/a.py::x": 50.0, "tests/a.py::y": 40.0, "tests/b.py::x": 1.0, "tests/b.py::y": 2.0}
    units = units_of_tests(seconds, workers=1)
    assert set(units) == {"tests:tests/a.py::x", "tests:tests/a.py::y", "tests:tests/b.py"}
    assert units["tests:tests/b.py"] == (3.0, ["tests/b.py::x", "tests/b.py::y"])
    assert units_of_tests(seconds, workers=4)["tests:tests/b.py"][0] == pytest.approx(3.0 / (4 * 0.85))


def test_plan_puts_every_benchmark_and_test_in_one_part():
    table = load_durations()
    benches = {b.name: table["benchmarks"].get(b.name, 120.0) for b in gpu_check().BENCHMARKS}
    parts = plan(table["tests"], benches, table["workers"], 5)
    assert sorted(b for p in parts for b in p["benchmarks"]) == sorted(benches)
    assert sorted(t for p in parts for t in p["tests"]) == sorted(table["tests"])


@pytest.mark.parametrize("text, message", [("3", "K/N with whole numbers"), ("0/2", "1 <= K <= N"),
                                           ("3/2", "1 <= K <= N"), ("a/b", "K/N with whole numbers")])
def test_a_bad_part_is_refused_with_what_was_expected(text, message):
    with pytest.raises(ValueError, match=message):
        parse_part(text)
    assert parse_part("2/3") == (2, 3)


def collected(parts: list[str | None], table: Path) -> list[set[str]]:
    """The tests each part collects (None: every test), the collections run side by side."""
    procs = []
    for part in parts:
        env = dict(os.environ, LORAKIT_GPU_DURATIONS=str(table))
        env.pop("LORAKIT_GPU_PART", None)
        if part:
            env["LORAKIT_GPU_PART"] = part
        procs.append(subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                       "tests/test_config.py", "tests/test_ops_errors.py"], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    found = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-2000:] + err[-2000:]
        found.append({line for line in out.splitlines() if "::" in line})
    return found


def test_each_part_keeps_its_share_of_the_collected_tests(tmp_path):
    table = tmp_path / "durations.json"
    (everything,) = collected([None], table)  # no table yet: every test counts as new
    known = sorted(everything)[::2]  # half known, with long and short seconds; the rest new
    table.write_text(json.dumps(dict(workers=1, benchmarks={"x": 30.0},
                                     tests={t: float(i % 7) for i, t in enumerate(known)})))
    shares = collected([f"{k}/3" for k in (1, 2, 3)], table)
    assert set().union(*shares) == everything
    assert sum(map(len, shares)) == len(everything)  # disjoint
    assert all(shares)


def test_plan_needs_no_gpu_and_names_every_part():
    out = subprocess.run([sys.executable, str(SCRIPT), "--plan", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [line.split(":")[0] for line in out.stdout.splitlines() if line.startswith("part ")] == [
        f"part {k}/4" for k in range(1, 5)]


def test_a_run_on_a_machine_without_cuda_says_what_it_needs(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", str(tmp_path / "q")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "needs a CUDA device" in out.stderr


def test_a_runs_results_are_eight_files_at_most_and_a_cut_run_keeps_its_summary(tmp_path):
    module = gpu_check()
    out = tmp_path / "out"
    out.mkdir()
    run = module.Run(out, "gpu-check --part 1/2", 480)
    for name in ("ops", "traffic"):
        scratch = tmp_path / name
        (scratch / "server").mkdir(parents=True)
        (scratch / f"bench_{name}.md").write_text(f"# {name} table\n")
        (scratch / f"bench_{name}.json").write_text(json.dumps({"rows": [1, 2]}))
        (scratch / "plot.png").write_bytes(b"\x89PNG fake")
        (scratch / "server" / "serve.log").write_text("log line\n")
        run.steps.append(module.Step(f"bench {name}", status="passed", seconds=12.0, estimate=10.0))
        module.harvest(run, name, scratch)
        run.write()  # after every step: what a run cut off next leaves
    assert "| bench ops | passed | 12 | 10 |" in (out / "summary.md").read_text()
    assert "# ops table" in (out / "bench.md").read_text() and "# traffic table" in (out / "bench.md").read_text()
    reports = json.loads((out / "bench.json").read_text())
    assert reports["reports"]["traffic"]["bench_traffic.json"] == {"rows": [1, 2]}
    assert [s["name"] for s in reports["steps"]] == ["bench ops", "bench traffic"]
    with tarfile.open(out / "extras.tar") as tar:
        assert sorted(tar.getnames()) == ["ops/plot.png", "ops/server/serve.log", "traffic/plot.png",
                                          "traffic/server/serve.log"]
    assert len(list(out.iterdir())) <= 8


def test_every_benchmark_script_is_in_the_check_or_says_why_not():
    module = gpu_check()
    run = {part for b in module.BENCHMARKS for command in b.commands for part in command if part.startswith("bench/")}
    for script in sorted((ROOT / "bench").glob("*.py")):
        name = f"bench/{script.name}"
        if script.name.startswith(("bench_", "profile_", "plot_")):
            assert name in run or script.name in module.NOT_IN_CHECK, f"{name} is neither run nor excused"


def test_record_folds_measured_seconds_into_the_table(tmp_path):
    table = tmp_path / "durations.json"
    table.write_text(json.dumps(dict(workers=8, tests={"tests/a.py::x": 5.0}, benchmarks={"ops": 100.0})))
    out = tmp_path / "part"
    out.mkdir()
    (out / "summary.md").write_text("# gpu-check --part 1/3\n")
    (out / "tests.jsonl").write_text("\n".join(json.dumps(d) for d in [
        dict(nodeid="tests/a.py::x", when="setup", outcome="passed", seconds=1.0),
        dict(nodeid="tests/a.py::x", when="call", outcome="passed", seconds=2.5),
        dict(nodeid="tests/b.py::y", when="call", outcome="passed", seconds=4.0)]) + "\n")
    (out / "bench.json").write_text(json.dumps(dict(steps=[
        dict(name="bench ops", status="passed", seconds=80.0), dict(name="bench moe", status="timed out", seconds=9.0)])))
    subprocess.run([sys.executable, str(SCRIPT), "--record", str(out), "--durations", str(table)], check=True,
                   capture_output=True, timeout=120)
    got = json.loads(table.read_text())
    assert got["tests"] == {"tests/a.py::x": 3.5, "tests/b.py::y": 4.0}
    assert got["benchmarks"] == {"ops": 80.0}  # a benchmark that did not pass keeps its old figure

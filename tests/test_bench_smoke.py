"""The benchmarks on the CPU: every script in bench/ imports (so a moved lorakit name fails here, not on the GPU
machine), and bench_pool's smoke run (a tiny model, no timing value) writes the report the H200 results in
bench/results have: the same JSON keys and the same table rows. A server a benchmark starts dies with it.

The runs here take under a minute alone; their subprocess timeouts (HANG_S) only catch a hang, far past what a
loaded CI machine takes, and a run they stop takes the ``lorakit serve`` it started with it."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from _serve_helpers import children, engine_pid, gone, wait_gone

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
HANG_S = 900  # a subprocess timeout: a hang, not a slow machine (the runs take well under a minute alone)


def test_bench_frontend_smoke_run(tmp_path):
    """bench_frontend end to end, small: a fake core, one API server, streams that each get all their tokens."""
    from _serve_helpers import make_tokenizer

    make_tokenizer().save_pretrained(tmp_path / "tokenizer")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(BENCH / "bench_frontend.py"), "--out", str(tmp_path), "--tokenizer",
                           str(tmp_path / "tokenizer"), "--clients", "8", "--requests", "32", "--max-tokens", "8",
                           "--client-procs", "1"], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
    (row,) = json.loads((tmp_path / "bench_frontend.json").read_text())["rows"]
    assert row["requests"] == 32 and row["tokens"] == 32 * 8 and row["api_cpu_us_per_token"] > 0


def test_bench_scripts_import_and_pool_smoke_run(tmp_path):
    script = (f"import sys; sys.path.insert(0, {str(BENCH)!r})\n"
              "import bench_attention, bench_engine, bench_logits, bench_ops, bench_patch, bench_pool, bench_serve, "
              "bench_prefix, bench_step, bench_tp, bench_traffic, tune_pdl, bench_grammar, bench_frontend, bench_quant, "
              "bench_push, profile_push, bench_beside\n"
              f"sys.exit(bench_pool.main(['--out', {str(tmp_path)!r}, '--device', 'cpu', '--tiny']))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]

    reference = sorted(BENCH.glob("results/bench_pool_*.json"))[-1]
    ours, theirs = json.loads((tmp_path / "bench_pool.json").read_text()), json.loads(reference.read_text())
    assert {k: list(v) for k, v in ours.items()} == {k: list(v) for k, v in theirs.items()}

    def row_labels(md: str) -> list[str]:
        return [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("|")]

    md = (tmp_path / "bench_pool.md").read_text()
    assert row_labels(md) == row_labels(reference.with_suffix(".md").read_text())
    assert md.splitlines()[2].startswith("cpu, torch ")


def test_bench_beside_smoke_run(tmp_path):
    """bench_beside on a tiny model: a row of steps idle, and one paced and one not for each reading stage."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(BENCH / "bench_beside.py"), "--out", str(tmp_path), "--device", "cpu",
                           "--tiny", "--stages"], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "bench_beside.json").read_text())
    assert [(r["paced"], r["reads"] > 0, r["max"] >= r["p50"] > 0) for r in results["result"]] == \
        [(False, True, True), (True, True, True)] * 4
    assert results["setup"]["tensors"] == 2 * 7 * 2 and results["idle"]["p50"] >= 1e3 * 0.005


def test_bench_push_smoke_run(tmp_path):
    """bench_push on the CPU: a tiny model served with its engine in a core process, then in-process, two pushes over
    HTTP from a process of their own while a stream runs each time; the report has both engines' rows and latencies,
    and the stall tracer writes what each of the server's threads did."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(BENCH / "bench_push.py"), "--out", str(tmp_path), "--device", "cpu",
                           "--tiny", "--pushes", "2", "--trace"], env=env, capture_output=True, text=True,
                          timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "bench_push.json").read_text())["result"]
    assert results.keys() == {"core", "in-process"}
    for result in results.values():
        assert len(result["http_s"]) == 2 and 0 < result["http_ms"] < 60_000 and result["tokens_during_http"] > 0
    report = (tmp_path / "bench_push.md").read_text()
    assert "| core | HTTP push from host memory" in report and "| in-process | HTTP push" in report
    assert "lorakit-engine" in (tmp_path / "push_stalls_in-process_http.txt").read_text()
    assert "MainThread" in (tmp_path / "push_stalls_core_http.txt").read_text()


def test_bench_traffic_smoke_run(tmp_path):
    """bench_traffic end to end on the CPU: a tiny model behind a real ``lorakit serve``, six requests of the trace
    per workload; every request succeeds with exactly its tokens, and the report has both workloads."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(BENCH / "bench_traffic.py"), "--out", str(tmp_path), "--tiny", "--device", "cpu",
               "--requests", "6", "--rate", "4"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=HANG_S)
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
                          timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "bench_step.json").read_text())["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [(4, "mixed eager")] and rows[0]["eager_steps"] > 0
    assert rows[0]["stream_ms"] > 0


# A benchmark's part: a tiny model folder, then ``common.lorakit_server`` over it, its URL printed, then a wait (to be
# killed outright: no ``finally`` of its runs).
BENCH_SERVER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
import common
folder = Path({folder!r})
common.make_model(2, True, "cpu").save_pretrained(folder)
common.word_tokenizer(256).save_pretrained(folder)
args = ["--model", str(folder), "--device", "cpu", "--block-size", "4"]
with common.lorakit_server(args, folder / "serve.log") as url:
    print(url, flush=True)
    time.sleep(600)
"""


def test_a_server_a_benchmark_started_dies_with_it(tmp_path):
    """The benchmark SIGKILLed (as a test's timeout kills it): its ``lorakit serve`` and that server's engine core
    are gone within 2 s, instead of running on holding their memory."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    code = BENCH_SERVER.format(bench=str(BENCH), folder=str(tmp_path / "model"))
    bench = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    server = core = None
    try:
        url = bench.stdout.readline().strip()
        assert url.startswith("http://"), (bench.poll(), (tmp_path / "model" / "serve.log").read_text()[-3000:])
        [server] = children(bench.pid)
        core = engine_pid(url)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        bench.kill()
        bench.wait(10)
        wait_gone([server, core], within=2.0)
    finally:
        for pid in (server, core):
            if pid is not None and not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_bench_quant_smoke_run_and_its_model_made_layer_by_layer(tmp_path):
    """bench_quant's engine rows on a tiny model (CPU, no timing value), and the model it makes a layer at a time for
    70B: every projection quantized, no weight left on the meta device, rotary buffers computed, finite logits."""
    script = (f"import sys, json, torch, transformers; sys.path.insert(0, {str(BENCH)!r})\n"
              "import bench_quant\n"
              f"assert bench_quant.main(['--out', {str(tmp_path)!r}, '--device', 'cpu', '--tiny']) == 0\n"
              "config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, "
              "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)\n"
              "model = bench_quant.make_quantized(config, 'fp8', 'cpu')\n"
              "from lorakit.layers.quant import Fp8Linear\n"
              "assert sum(type(m) is Fp8Linear for m in model.modules()) == 14\n"
              "assert all(t.device.type == 'cpu' for t in [*model.parameters(), *model.buffers()])\n"
              "rotary = model.model.rotary_emb\n"
              "want = type(rotary)(config).inv_freq\n"
              "assert torch.equal(rotary.inv_freq, want)\n"
              "logits = model(torch.tensor([[1, 2, 3]])).logits\n"
              "assert torch.isfinite(logits).all() and logits.abs().max() > 0\n"
              "import argparse, pathlib, tempfile\n"
              "tiny = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, "
              "num_attention_heads=4, num_key_value_heads=2)\n"
              "with tempfile.TemporaryDirectory() as tmp:  # the 70B rows' code on a tiny shape: 8 adapters served\n"
              "    rows = bench_quant.seventy_b_rows(argparse.Namespace(device='cpu'), float('nan'), "
              "pathlib.Path(tmp), tiny)\n"
              "assert [(r['batch'], r['adapters']) for r in rows] == [(1, 0), (1, 1), (64, 0), (64, 8)]\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "bench_quant.json").read_text())["engine"]
    assert [(r["scheme"], r["what"], r["batch"]) for r in rows][:2] == [("bf16", "base", 1), ("bf16", "base", 64)]
    assert {r["scheme"] for r in rows} == {"bf16", "fp8", "int4"} and len(rows) == 12


def test_bench_moe_smoke_run(tmp_path):
    """bench_moe on tiny shapes (CPU, no timing value): a dense and an MoE layer, with 1 and 2 adapters, and the
    expert LoRA op alone on each expert parameter."""
    script = (f"import sys; sys.path.insert(0, {str(BENCH)!r})\n"
              "import bench_moe\n"
              f"assert bench_moe.main(['--out', {str(tmp_path)!r}, '--device', 'cpu', '--tiny', '--batch', '8', "
              "'--adapters', '1,2']) == 0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "bench_moe.json").read_text())
    assert [(r["layer"], r["adapters"]) for r in result["layers"]] == [("dense", 1), ("dense", 2), ("moe", 1), ("moe", 2)]
    assert {(r["op"], r["adapters"]) for r in result["ops"]} == {(p, n) for p in ("gate_up_proj", "down_proj")
                                                                 for n in (1, 2)}
    assert [r["adapters"] for r in result["ratios"]] == [1, 2]

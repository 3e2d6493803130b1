"""``lorakit serve-ray``: one command starts a local Ray cluster, the proxy on --port and the replicas; bad options
stop it before Ray starts; Ctrl-C stops everything. Skipped where Ray Serve is not installed."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'lorakit[ray]'")

from _serve_helpers import build_world  # noqa: E402
from lorakit.engine.lifeline import parent_death_signal  # noqa: E402

SRC = os.path.join(os.path.dirname(__file__), os.pardir, "src")


def lorakit(*args: str, log=subprocess.PIPE) -> subprocess.Popen:
    """``lorakit ARGS`` in a session of its own, dying with this test process; its output to ``log`` (a pipe
    unless given: a file for a command that runs while the test does other things, as a full pipe would block it)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "lorakit", *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=_ctrl_c_as_a_terminal_gives_it)


_DIE_WITH_TEST = parent_death_signal()


def _ctrl_c_as_a_terminal_gives_it() -> None:
    """In the child: SIGINT's default action back (a runner that starts this suite in the background has it ignored,
    and a Python started with SIGINT ignored never raises KeyboardInterrupt), and death with the test process."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _DIE_WITH_TEST is not None:
        _DIE_WITH_TEST()


def test_bad_options_stop_it_before_ray_starts(tmp_path):
    run = lorakit("serve-ray", "--lora-root", str(tmp_path / "nope"), "--device", "cpu")
    out, _ = run.communicate(timeout=120)
    assert run.returncode != 0 and "lorakit serve-ray: --lora-root" in out and "Traceback" not in out
    run = lorakit("serve-ray", "--replicas", "0")
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 2 and "--replicas: must be an integer >= 1" in out


def test_one_command_serves_the_fleet_and_ctrl_c_stops_it(tmp_path):
    base, tokenizer, root, _ = build_world(tmp_path)
    base.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve-ray.log", "w")  # a pipe nobody reads would block serve-ray once full (64 KiB)
    run = lorakit("serve-ray", "--model", str(tmp_path / "model"), "--served-model-name", "tiny",
                  "--lora-root", str(root), "--replicas", "2", "--adapters-per-replica", "2", "--device", "cpu",
                  "--port", str(port), "--num-cpus", "2", "--replica-cpus", "0.5", "--max-loras", "2",
                  "--block-size", "4", log=log)
    output = (tmp_path / "serve-ray.log").read_text
    try:
        deadline = time.monotonic() + 240
        with httpx.Client(timeout=60) as client:
            while True:
                assert run.poll() is None, output()[-2000:]
                try:
                    if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the fleet did not come up"
                time.sleep(1)
            for model in ("tiny", "sql", "chat", "v2"):
                reply = client.post(f"http://127.0.0.1:{port}/v1/completions",
                                    json={"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0})
                assert reply.status_code == 200 and reply.json()["model"] == model, reply.text
    finally:
        os.killpg(run.pid, signal.SIGINT)
        try:
            run.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            raise AssertionError(f"Ctrl-C did not stop it in 120 s: {output()[-2000:]}") from None
        finally:
            log.close()
    assert run.returncode in (0, -signal.SIGINT, 130), output()[-2000:]

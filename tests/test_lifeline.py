"""``lorakit.engine.lifeline``: a child ends within a fraction of a second of its parent's death, a SIGKILL too, by the
kernel's parent-death signal and by the polling thread alone (the way a child started off the main thread dies), and
a ``Popen`` child with ``parent_death_signal``. The processes here are plain Python (the module is loaded by path,
without torch), so each test takes about a second."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _serve_helpers import gone, wait_gone

ENGINE = Path(__file__).resolve().parents[1] / "src" / "lorakit" / "engine"

# The parent: starts the child, prints its pid, then waits to be killed.
PARENT = """
import subprocess, sys, time
sys.path.insert(0, {engine!r})
import lifeline
child = subprocess.Popen({child}, stdout=subprocess.PIPE, text=True{preexec})
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
time.sleep(600)
"""
# A Python child that calls die_with_parent (kernel: whether it may ask the kernel).
CHILD = """
import os, sys, time
sys.path.insert(0, {engine!r})
import lifeline
lifeline.die_with_parent(os.getppid(), "the test child", kernel={kernel})
print("ready", flush=True)
time.sleep(600)
"""


def run_parent(child: list[str], preexec: bool = False) -> tuple[subprocess.Popen, int]:
    code = PARENT.format(engine=str(ENGINE), child=repr(child),
                         preexec=", preexec_fn=lifeline.parent_death_signal()" if preexec else "")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = parent.stdout.readline()
    assert line.strip().isdigit(), f"the parent did not start its child (exit {parent.poll()})"
    return parent, int(line)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel-signal", "polling-alone"])
def test_a_child_dies_within_2s_of_its_parent_killed(kernel):
    parent, child = run_parent([sys.executable, "-c", CHILD.format(engine=str(ENGINE), kernel=kernel)])
    try:
        assert not gone(child)
        parent.kill()
        parent.wait(10)
        wait_gone([child], within=2.0)
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_popen_child_with_parent_death_signal_dies_with_its_parent():
    parent, child = run_parent([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                               preexec=True)
    try:
        parent.kill()
        parent.wait(10)
        wait_gone([child], within=2.0)
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_whose_parent_is_gone_already_exits_at_once():
    code = (f"import sys; sys.path.insert(0, {str(ENGINE)!r}); import lifeline\n"
            "lifeline.die_with_parent(1, 'orphan')\n"  # pid 1 is nobody's parent here: gone already
            "print('still here')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "still here" not in done.stdout

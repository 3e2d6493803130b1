"""The README tells the truth: its test command is the one CI runs, and its first command works (CI runs it
through scripts/try-it, whose installs must stay the README's)."""

import pathlib
import shlex

from lorakit.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index(next(line for line in ci if line.startswith("# README test command"))) + 1]
    assert command in (ROOT / "README.md").read_text()


def test_demo_runs_and_checks_itself(capsys):
    assert main(["demo", "--device", "cpu"]) == 0
    assert "worst relative error" in capsys.readouterr().out


def pip_installs(commands: list[str]) -> list[list[str]]:
    """The arguments of every ``.../bin/pip install`` among shell commands, in order."""
    words = [shlex.split(c) for c in commands if "/bin/pip" in c]
    return [w[2:] for w in words if len(w) > 2 and w[0].endswith("/bin/pip") and w[1] == "install"]


def test_try_it_script_installs_what_the_readme_says():
    readme = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(readme) if line.startswith("## Try it"))
    try_it = next(line for line in readme[start:] if line.startswith("python3 -m venv"))
    assert try_it.startswith("python3 -m venv .venv && ") and try_it.endswith(" && .venv/bin/lorakit serve"), try_it
    script = (ROOT / "scripts" / "try-it").read_text().splitlines()
    installs = pip_installs([line for line in script if not line.lstrip().startswith("#")])
    # First the CPU build of torch, pinned as .ci/run pins it; then the README's installs, from a wheel (no -e).
    assert installs[0] in pip_installs((ROOT / ".ci" / "run").read_text().splitlines()), installs[0]
    assert installs[0][-1].startswith("torch==")
    assert installs[1:] == [[a for a in args if a != "-e"] for args in pip_installs(try_it.split("&&"))]
    assert any('"$venv/bin/lorakit" serve' in line for line in script)
    assert "scripts/try-it" in (ROOT / ".ci" / "run").read_text().splitlines()

"""The README tells the truth: its test command is the one CI runs, and its first command works."""

import pathlib

from lorakit.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index(next(line for line in ci if line.startswith("# README test command"))) + 1]
    assert command in (ROOT / "README.md").read_text()


def test_demo_runs_and_checks_itself(capsys):
    assert main(["demo", "--device", "cpu"]) == 0
    assert "worst relative error" in capsys.readouterr().out

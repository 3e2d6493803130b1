"""The ``lorakit`` command: --version, a help that shows every default, and bad options (a missing model folder,
a bad --lora folder, runtime loading without a root) that stop ``lorakit serve`` at once, before any model is
loaded or converted, with a message that names the problem and no traceback."""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

import lorakit
from _tokenizers import bpe_tokenizer
from lorakit import _help
from lorakit.__main__ import main
from lorakit.serve import cli
from lorakit.serve.model import bundled_adapters
from lorakit.serve.vllm_flags import VLLM_ONLY

ROOT = pathlib.Path(__file__).resolve().parents[1]


def lorakit_command(*args, cache):
    """Run ``python -m lorakit ARGS`` with an empty LORAKIT_CACHE: (exit status, stdout + stderr)."""
    env = {**os.environ, "LORAKIT_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-m", "lorakit", *args], capture_output=True, text=True, env=env,
                          timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def serve_options() -> list[argparse.Action]:
    """lorakit serve's own options (vLLM's spellings are docs/vllm-flags.md's: tests/test_vllm_cli.py)."""
    sub = argparse.ArgumentParser().add_subparsers()
    cli.add_parser(sub)
    return [a for a in sub.choices["serve"]._actions if not isinstance(a, argparse._HelpAction) and a.option_strings
            and a.option_strings[0] not in VLLM_ONLY]


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    """In this process, loading or converting a model fails the test (the checks come first)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr("lorakit.serve.model.default_model_folder", refuse)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"lorakit {lorakit.__version__}"


def test_version_and_help_are_answered_without_torch_or_the_server():
    """``lorakit --version`` and ``lorakit --help`` took 6 s (25 s on a loaded machine) importing torch and the
    server stack for nothing; ``lorakit serve --help`` took 4.4-23 s (its saved text now: 0.08 s)."""
    probe = ("import sys\nfrom lorakit.__main__ import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    print('exit', e.code)\nprint(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in "
             "sys.modules))")
    cases = [(["--version"], f"lorakit {lorakit.__version__}"), (["--help"], "serve-ray"), ([], "required")]
    if _help.PYTHON == sys.version_info[:2]:  # the commands' saved help (another Python asks the parser)
        cases += [(["serve", "--help"], "--chat-template"), (["serve-ray", "--lora-root", "x", "-h"], "--replicas")]
    for args, shown in cases:
        proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        lines = proc.stdout.strip().splitlines()
        assert lines[-1] == "[]", (args, proc.stdout, proc.stderr)
        assert shown in proc.stdout + proc.stderr and lines[-2] == f"exit {2 if not args else 0}"


def test_allow_lora_repo_is_for_runtime_loading():
    with pytest.raises(SystemExit, match="add --allow-runtime-lora"):
        main(["serve", "--device", "cpu", "--allow-lora-repo", "org/*"])


def test_the_engine_on_a_cpu_leaves_a_core_to_each_api_server():
    assert [cli.engine_cpu_threads(servers, cores) for servers, cores in ((1, 2), (1, 1), (4, 16), (2, 8))] == \
        [1, 1, 12, 6]


def test_a_busy_port_stops_serve_before_the_model_loads(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as e:  # the autouse fixture fails the test if a model were looked for
            main(["serve", "--port", str(port), "--device", "cpu"])
    assert f"127.0.0.1:{port}" in str(e.value) and "--port" in str(e.value)


def test_saved_help_is_the_parsers():
    from lorakit._help import HELP, PYTHON
    from lorakit.__main__ import command_help

    if PYTHON != sys.version_info[:2]:
        pytest.skip(f"the help was saved by Python {PYTHON}, whose argparse lays it out differently")
    for command, saved in HELP.items():
        assert saved == command_help(command), f"{command}'s options changed: run python -m lorakit --write-help"


def test_serve_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    options = serve_options()
    for action in options:
        assert "(default: " in action.help, action.option_strings
        if action.default not in (None, False, []):
            assert f"(default: {action.default}" in text, action.option_strings
    assert "(default: auto: cuda when available, else cpu)" in text
    assert "(default: auto: bfloat16 on cuda, float32 on cpu)" in text
    assert "local transformers model folder" in text


def test_docs_table_lists_every_option_with_its_default():
    rows = {}
    for line in (ROOT / "docs" / "serve.md").read_text().splitlines():
        if line.startswith("| `--"):
            option, default, _ = (cell.strip() for cell in line.strip("|").split("|", 2))
            rows[option.strip("`").split()[0]] = default
    options = serve_options()
    assert set(rows) == {a.option_strings[0] for a in options}
    for action in options:
        if action.default not in (None, False, []):
            assert rows[action.option_strings[0]].strip("`").startswith(str(action.default)), action.option_strings


def test_missing_model_folder_fails_fast(tmp_path):
    code, out = lorakit_command("serve", "--model", str(tmp_path / "nope"), cache=tmp_path / "cache")
    assert code != 0 and "Traceback" not in out, out
    assert "--model" in out and "no such folder" in out and "local transformers model folder" in out, out
    assert "Hugging Face hub id ORG/NAME" in out and "loading the model" not in out, out

    with pytest.raises(SystemExit, match="no config.json in the folder"):
        main(["serve", "--model", str(tmp_path)])


def write_adapter(folder, config="copy", weights="copy"):
    """A copy of the pirate demo adapter, with its config and weights file replaced as asked."""
    pirate = bundled_adapters()["pirate"]
    folder.mkdir()
    if config == "copy":
        shutil.copy(f"{pirate}/adapter_config.json", folder)
    elif config is not None:
        (folder / "adapter_config.json").write_text(config)
    if weights == "copy":
        shutil.copy(f"{pirate}/adapter_model.safetensors", folder)
    elif weights is not None:
        (folder / weights[0]).write_bytes(weights[1])
    return folder


BAD_ADAPTERS = {
    "no such folder": None,
    "no adapter_config.json in the folder": dict(config=None),
    "is not readable, valid JSON": dict(config="{not json"),
    "peft_type is 'PREFIX_TUNING'": dict(config=json.dumps({"peft_type": "PREFIX_TUNING"})),
    "only adapter_model.bin (a pickle) is there": dict(weights=("adapter_model.bin", b"pickle")),
    "no adapter_model.safetensors in the folder": dict(weights=None),
    "is not a readable safetensors file": dict(weights=("adapter_model.safetensors", b"garbage")),
}


@pytest.mark.parametrize("why", list(BAD_ADAPTERS))
def test_bad_lora_is_refused_before_the_model_loads(tmp_path, why):
    folder = tmp_path / "mine"
    if BAD_ADAPTERS[why] is not None:
        write_adapter(folder, **BAD_ADAPTERS[why])
    with pytest.raises(SystemExit, match="adapter 'mine'") as e:
        main(["serve", "--lora", f"mine={folder}"])  # the bundled model: its loading fails the test
    assert why in str(e.value)


def test_bad_lora_fails_fast_in_a_process(tmp_path):
    """As a user sees it: the message, no traceback, no model loaded or converted (the cache stays empty)."""
    cache = tmp_path / "cache"
    code, out = lorakit_command("serve", "--lora", f"mine={write_adapter(tmp_path / 'mine', config='{')}",
                                cache=cache)
    assert code != 0 and "Traceback" not in out, out
    assert "adapter 'mine'" in out and "not readable, valid JSON" in out, out
    assert "loading the model" not in out and "converting" not in out and not cache.exists(), out


def test_runtime_lora_options_are_checked_first(tmp_path):
    with pytest.raises(SystemExit, match="--allow-runtime-lora needs at least one --lora-root"):
        main(["serve", "--allow-runtime-lora"])
    with pytest.raises(SystemExit, match="--lora-root .*: no such folder"):
        main(["serve", "--allow-runtime-lora", "--lora-root", str(tmp_path / "nope")])
    with pytest.raises(SystemExit, match="--lora takes NAME=PATH"):
        main(["serve", "--lora", "oops"])
    with pytest.raises(SystemExit, match="given twice"):
        main(["serve", "--lora", f"a={tmp_path}", "--lora", f"a={tmp_path}"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_without_a_device_is_refused():
    with pytest.raises(SystemExit, match="no CUDA device is available"):
        main(["serve", "--device", "cuda"])


def test_an_adapter_the_model_cannot_serve_exits_with_its_message(tmp_path):
    """Checked against the model once it is loaded (here: SmolLM2's pirate on a tiny llama): no traceback."""
    tokenizer = bpe_tokenizer(["hello world, the quick brown fox"])
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    with pytest.raises(SystemExit, match="adapter 'pirate'"):
        main(["serve", "--model", str(tmp_path / "tiny"), "--lora", f"pirate={bundled_adapters()['pirate']}",
              "--device", "cpu"])


def test_api_servers_auto_is_one_per_four_cores_up_to_four():
    assert [cli.auto_api_servers(cores) for cores in (1, 2, 4, 7, 8, 12, 16, 64)] == [1, 1, 1, 1, 2, 3, 4, 4]
    assert 1 <= cli.auto_api_servers() <= cli.MAX_API_SERVERS  # this machine's


def test_the_log_tells_the_cpus_available_memory_and_sizing_stays_bounded(monkeypatch):
    """The CPU's free memory was logged as a fixed 4.0 GiB: now MemAvailable, beside the figure sizing reads (at most
    CPU_MEMORY, so a big machine does not grow the KV cache of a small model)."""
    from lorakit.engine import build as build_module

    cpu = torch.device("cpu")
    if sys.platform.startswith("linux"):
        assert build_module.available_cpu_memory() > 0
    cap = build_module.CPU_MEMORY
    for available, sized in ((512 << 30, cap), (1 << 30, 1 << 30), (None, cap)):
        monkeypatch.setattr(build_module, "available_cpu_memory", lambda: available)
        assert build_module.free_memory(cpu) == sized
        shown = "unknown" if available is None else f"{available / 2**30:.1f} GiB"
        said = build_module.free_text(sized, cpu)
        assert said == f"{shown} available on the CPU, sized from {sized / 2**30:.1f} GiB"

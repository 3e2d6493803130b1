"""A ``vllm serve`` command line works with ``lorakit serve``: every row of docs/vllm-flags.md parses to the config it
says (no model loaded), or is refused in one line naming lorakit's flag; and ``--chat-template``."""

import copy
import pathlib
import shutil

import pytest

from _serve_helpers import build_world
from lorakit.__main__ import main, parser
from lorakit.serve import cli, vllm_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def parsed(*argv):
    """(args, EngineConfig) of ``lorakit serve ARGV``, as run() reads them before anything loads."""
    args = parser().parse_args(["serve", *argv])
    vllm_flags.model(args)
    return args, cli.engine_config(args)


JSON_MODULE = '{"name": "b", "path": "/p/b", "base_model_name": "org/base"}'
# vLLM flag -> (its arguments, what lorakit makes of them: a check of (args, config), or the text its refusal names)
EXAMPLES = {
    "MODEL": (["org/model"], lambda a, c: a.model == "org/model"),
    "--enable-lora": ([], lambda a, c: True),
    "--lora-modules": (["a=/p/a", JSON_MODULE], lambda a, c: a.lora == ["a=/p/a", "b=/p/b"]),
    "--max-lora-rank": (["32"], lambda a, c: c.max_rank == 32),
    "--max-loras": (["8"], lambda a, c: c.max_loras == 8),
    "--max-cpu-loras": (["4"], "bytes"),
    "--max-model-len": (["512"], lambda a, c: c.max_seq_len == 512),
    "--gpu-memory-utilization": (["0.9"], "--num-blocks"),
    "--enable-prefix-caching": ([], lambda a, c: c.prefix_cache),
    "--no-enable-prefix-caching": ([], lambda a, c: not c.prefix_cache),
    "--enable-auto-tool-choice": ([], lambda a, c: True),
    "--tool-call-parser": (["llama3_json"], lambda a, c: a.tool_call_parser == "llama3_json"),
    "--chat-template": (["t.jinja"], lambda a, c: a.chat_template == "t.jinja"),
    "--dtype": (["half"], lambda a, c: a.dtype == "float16"),
    "--served-model-name": (["m"], lambda a, c: a.served_model_name == "m"),
    "--max-num-seqs": (["3"], lambda a, c: c.max_num_seqs == 3),
    "--max-num-batched-tokens": (["64"], lambda a, c: c.max_num_batched_tokens == 64),
    "--block-size": (["32"], lambda a, c: c.block_size == 32),
    "--tensor-parallel-size": (["2"], lambda a, c: c.tensor_parallel_size == 2),
    "--quantization": (["fp8"], lambda a, c: c.quantization == "fp8"),
    "--host": (["0.0.0.0"], lambda a, c: a.host == "0.0.0.0"),
    "--port": (["9000"], lambda a, c: a.port == 9000),
    "--api-key": (["k"], lambda a, c: a.api_key == "k"),
}


def doc_rows() -> list[str]:
    rows = [line.split("|")[1].strip() for line in (ROOT / "docs" / "vllm-flags.md").read_text().splitlines()
            if line.startswith("| `")]
    return [row.split("`")[1] for row in rows]


def test_every_flag_in_the_doc_table_is_parsed_or_refused_by_name(capsys):
    rows = doc_rows()
    assert sorted(rows) == sorted(EXAMPLES), "docs/vllm-flags.md and EXAMPLES disagree"
    for flag, (values, expected) in EXAMPLES.items():
        argv = values if flag == "MODEL" else [flag, *values]
        if isinstance(expected, str):
            with pytest.raises(SystemExit) as e:
                parsed(*argv)
            err = capsys.readouterr().err
            assert e.value.code == 2 and len(err.strip().splitlines()) == 1, (flag, err)
            assert err.startswith(f"lorakit serve: {flag} is vLLM's") and expected in err, err
        else:
            assert expected(*parsed(*argv)), flag


def test_every_vllm_spelling_the_parser_takes_is_in_the_doc_table():
    spellings = {*vllm_flags.VLLM_ONLY, *(f for flags in vllm_flags.VLLM_ALIASES.values() for f in flags)}
    assert spellings <= set(doc_rows())
    options = parser()._subparsers._group_actions[0].choices["serve"]._option_string_actions
    assert spellings <= set(options)


def test_a_vllm_command_line_becomes_lorakits_options():
    args, config = parsed("HuggingFaceTB/SmolLM2-135M-Instruct", "--enable-lora", "--lora-modules", "a=/p/a",
                          "b=/p/b", "--max-lora-rank", "64", "--max-loras", "8", "--lora", "c=/p/c")
    assert args.model == "HuggingFaceTB/SmolLM2-135M-Instruct" and args.lora == ["a=/p/a", "b=/p/b", "c=/p/c"]
    assert (config.max_rank, config.max_loras) == (64, 8)
    assert parsed("m", "--model", "m")[0].model == "m"
    with pytest.raises(SystemExit, match="given twice, as MODEL 'a' and --model 'b'"):
        main(["serve", "a", "--model", "b"])


@pytest.mark.parametrize("bad, why", [("x", "takes NAME=PATH or JSON"), ("{nope", "is not valid JSON"),
                                      ('{"name": "a"}', "takes JSON"), ('{"name": "a", "path": "/p", "x": 1}', "x")])
def test_a_bad_lora_module_is_a_usage_error(bad, why, capsys):
    with pytest.raises(SystemExit) as e:
        parsed("--lora-modules", bad)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_chat_template_is_a_file_or_the_text_and_checked_at_startup(tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert cli.chat_template(str(tmp_path / "t.jinja")) == TEMPLATE
    assert cli.chat_template(TEMPLATE + "\\n") == TEMPLATE + "\n"  # vLLM reads backslash escapes in the text
    assert cli.chat_template("{{ 'é' }}") == "{{ 'é' }}"
    assert cli.chat_template(None) is None
    for given, why in [(str(tmp_path / "nope.jinja"), "no such file"),
                       ("{% for m in messages %}", "not a valid Jinja")]:
        with pytest.raises(SystemExit, match=f"--chat-template.*{why}"):  # before any model is looked for
            main(["serve", "--model", str(tmp_path / "no-model"), "--chat-template", given])


def test_chat_template_replaces_the_models_and_an_adapters_own_still_wins(tmp_path):
    from lorakit.engine import Engine
    from lorakit.frontend.client import InProcessClient

    base, tokenizer, _, paths = build_world(tmp_path)
    base.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    own = tmp_path / "own"  # the chat adapter with a tokenizer and template of its own
    shutil.copytree(paths["chat"], own)
    tokenizer.chat_template = "{{ 'own' }}"
    tokenizer.save_pretrained(own)
    templated = cli.templated_tokenizer(tmp_path / "model", TEMPLATE)
    engine = Engine(copy.deepcopy(base), templated, max_loras=2, adapters={"sql": paths["sql"], "own": own},
                    block_size=4, num_blocks=64)
    client = InProcessClient(engine)
    assert client.tokenizer_for(None).chat_template == TEMPLATE
    assert client.tokenizer_for(client.resolve("sql")).chat_template == TEMPLATE  # no tokenizer of its own
    assert client.tokenizer_for(client.resolve("own")).chat_template == "{{ 'own' }}"

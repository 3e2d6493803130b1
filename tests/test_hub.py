"""Models and adapters by Hugging Face hub id (``lorakit.adapters.hub``), without a network: a fake hub on
localhost speaks the two calls ``huggingface_hub`` makes (a revision's file list, each file's HEAD and GET), so the
cache the tests read is laid out by ``huggingface_hub``'s own download, then read again with ``HF_HUB_OFFLINE=1``."""

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import HUB_COMMITS as COMMITS, FakeHub
from lorakit.adapters.hub import ADAPTER_FILES, MODEL_FILES, hub_id

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hub(tmp_path):
    server = FakeHub()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, server.env(tmp_path / "hf")
    server.shutdown()


def resolve(spec: str, env: dict, files=MODEL_FILES, cwd=None) -> tuple[int, str]:
    """``local_or_hub(spec)`` in a process of its own (huggingface_hub reads its environment when imported)."""
    kind = "MODEL_FILES" if files is MODEL_FILES else "ADAPTER_FILES"
    probe = ("import sys\nfrom lorakit.adapters.hub import local_or_hub, MODEL_FILES, ADAPTER_FILES\ntry:\n"
             f"    print(local_or_hub(sys.argv[1], '--model', {kind}))\n"
             "except FileNotFoundError as e:\n    print('ERROR', e)\n    sys.exit(3)")
    proc = subprocess.run([sys.executable, "-c", probe, spec], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env})
    return proc.returncode, proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr


def test_ids_and_paths():
    assert hub_id("Qwen/Qwen2.5-7B-Instruct") == ("Qwen/Qwen2.5-7B-Instruct", None)
    assert hub_id("org/sql-lora@v1.2") == ("org/sql-lora", "v1.2")
    for path in ("/abs/folder", "./local", "folder", "a/b/c", "org/name@", "org/..x", "../up"):
        assert hub_id(path) is None, path


def test_a_hub_id_downloads_once_then_serves_from_the_cache_offline(hub, tmp_path):
    server, env = hub
    code, folder = resolve("org/tiny-model", env)
    assert code == 0, folder
    folder = Path(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert folder.name == COMMITS["main"] and folder.parent.name == "snapshots"  # the hub's own layout
    assert folder.is_relative_to(tmp_path / "hf" / "hub")
    assert not any("pytorch_model.bin" in r or ".py" in r for r in server.requests)  # no pickle, no code
    server.requests.clear()
    code, again = resolve("org/tiny-model", {**env, "HF_HUB_OFFLINE": "1"})
    assert (code, again) == (0, str(folder)) and server.requests == []
    code, old = resolve("org/tiny-model@v1", env)
    assert code == 0 and Path(old).name == COMMITS["v1"]
    assert (Path(old) / "model.safetensors").read_bytes() == b"old weights"


def test_an_id_that_cannot_be_had_is_one_line_naming_it_and_the_cache(hub, tmp_path):
    server, env = hub
    code, message = resolve("org/tiny-model", {**env, "HF_HUB_OFFLINE": "1"})
    assert code == 3 and "org/tiny-model" in message and str(tmp_path / "hf" / "hub") in message, message
    assert "HF_HUB_OFFLINE" in message
    code, message = resolve("org/missing", env)
    assert code == 3 and "no hub repo org/missing" in message, message
    code, message = resolve("org/tiny-model@nope", env)
    assert code == 3 and "no revision nope" in message, message
    code, message = resolve("org/tiny-model", env, files=ADAPTER_FILES)  # a model's repo, not an adapter's
    assert code == 3 and "has no adapter_model.safetensors" in message and "pickled" in message, message


def test_a_local_folder_wins_over_an_id_of_the_same_spelling(hub, tmp_path):
    server, env = hub
    (tmp_path / "org" / "tiny-model").mkdir(parents=True)
    code, folder = resolve("org/tiny-model", env, cwd=tmp_path)
    assert (code, folder) == (0, "org/tiny-model") and server.requests == []


def test_adapter_files_are_only_what_an_adapter_needs():
    assert "adapter_model.safetensors" in ADAPTER_FILES and not any(p.endswith((".bin", ".py")) for p in ADAPTER_FILES)
    assert not any(p.endswith((".bin", ".pt", ".py", ".pkl")) for p in MODEL_FILES)


@pytest.mark.parametrize("command", ["serve", "serve-ray"])
def test_serve_resolves_its_model_and_adapters_by_id_before_anything_starts(hub, tmp_path, command):
    """``lorakit serve --model ORG/NAME --lora NAME=ORG/ADAPTER@REV``: both replaced by their cache folders, the base
    model served under its id (as vLLM names it), and the log says where each came from. ``serve-ray`` resolves them
    the same way, before its replicas start (they read the one download)."""
    server, env = hub
    adder = "add_parser" if command == "serve" else "add_ray_parser"
    probe = ("import argparse, logging, sys\nlogging.basicConfig(level=logging.INFO)\n"
             f"from lorakit.serve import cli\nsub = argparse.ArgumentParser().add_subparsers()\ncli.{adder}(sub)\n"
             f"args = sub.choices['{command}'].parse_args(sys.argv[1:])\nname = cli.resolve_hub_ids(args)\n"
             "print(name, args.model, *args.lora)")
    proc = subprocess.run([sys.executable, "-c", probe, "--model", "org/tiny-model", "--lora",
                           "sql=org/tiny-model@v1", "--lora", "local=/no/such/folder"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env})
    assert proc.returncode == 0, proc.stderr
    name, model, sql, local = proc.stdout.split()
    assert name == "org/tiny-model" and Path(model).name == COMMITS["main"]
    assert sql.startswith("sql=") and Path(sql[4:]).name == COMMITS["v1"] and local == "local=/no/such/folder"
    assert "--model org/tiny-model: hub repo org/tiny-model" in proc.stderr, proc.stderr
    assert "--lora sql org/tiny-model@v1: hub repo org/tiny-model at revision v1" in proc.stderr, proc.stderr


def test_llm_takes_hub_ids_too(hub):
    """``LLM("ORG/NAME")`` resolves the id as ``lorakit serve`` does (the fake repo has no real weights: the folder it
    hands transformers is the id's snapshot)."""
    server, env = hub
    probe = ("import sys\nimport transformers\n"
             "transformers.AutoTokenizer.from_pretrained = lambda p, *a, **k: print('LOADED', p) or sys.exit(0)\n"
             "from lorakit import LLM\nLLM('org/tiny-model', device='cpu')")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env})
    assert proc.returncode == 0, proc.stderr
    (loaded,) = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("LOADED ")]
    assert Path(loaded).name == COMMITS["main"] and Path(loaded).parent.name == "snapshots", loaded


# Runtime loading by hub id is a security boundary: a revision names a commit, branch or tag of the repo, and what is
# read lies inside the repo's own folder of the hub cache. These build that cache on disk as huggingface_hub lays it
# out and read it offline, in this process (huggingface_hub's constants patched: it reads them at each call).

GOOD = "c" * 40  # org/good's one commit
ADAPTER = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"adapter weights"}
_READ: list[str] | None = None  # while recording: the paths opened or listed by this process (an audit hook)


def _audit(event: str, args: tuple) -> None:
    if _READ is not None and event in ("open", "os.listdir", "os.scandir") and isinstance(args[0], (str, bytes)):
        _READ.append(os.path.realpath(os.fsdecode(args[0])))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """org/good in an offline hub cache (snapshot GOOD, its files links into blobs/, named by the refs main, v1.0
    and feature/x), and outside it a folder an attacker could point at: ``outside/snap`` (an adapter) and
    ``outside/ref`` (a file whose text is that folder's path). Yields (the repo's cache folder, outside)."""
    global _READ
    from huggingface_hub import constants

    if not getattr(_audit, "added", False):
        sys.addaudithook(_audit)
        _audit.added = True
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "hf" / "hub" / "models--org--good"
    snapshot = repo / "snapshots" / GOOD
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, content in ADAPTER.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in ("main", "v1.0", "feature/x"):
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(GOOD)
    outside = tmp_path / "outside"
    (outside / "snap").mkdir(parents=True)
    for name, content in ADAPTER.items():
        (outside / "snap" / name).write_bytes(content)
    (outside / "ref").write_text(str(outside / "snap"))
    _READ = []
    yield repo, outside
    _READ = None


def read_outside(tmp_path) -> list[str]:
    """What this process opened or listed under ``tmp_path`` but outside the hub cache, since the fixture began."""
    tmp_path = tmp_path.resolve()  # the paths recorded are resolved
    return [p for p in _READ if Path(p).is_relative_to(tmp_path) and not Path(p).is_relative_to(tmp_path / "hf")]


def load_hub(spec: str, lora_roots: tuple[Path, ...] = ()) -> tuple[int, str, tuple | None]:
    """``POST /v1/load_lora_adapter`` with ``lora_path=spec`` to a server started with ``--allow-runtime-lora
    --allow-lora-repo 'org/*'`` (and each of ``lora_roots`` as ``--lora-root``), through its handler: (status,
    message, the (folder, roots) it would register)."""
    import asyncio

    from lorakit.serve.adapters import load
    from lorakit.serve.protocol import ApiError, LoadBody
    from lorakit.serve.state import ServeConfig

    class State:
        config = ServeConfig(allow_runtime_lora=True, allow_lora_repos=["org/*"], lora_roots=list(lora_roots))
        registered = None

        async def register_adapter(self, name, path, roots):
            self.registered = (path, roots)
            return 1

    state = State()
    try:
        asyncio.run(load(LoadBody(lora_name="hubbed", lora_path=spec), state))
    except ApiError as e:
        return e.status, e.message, state.registered
    return 200, "", state.registered


@pytest.mark.parametrize("there, missing, problem", [
    ("{outside}/ref", "{outside}/nothing", "starts with '/'"),  # the ref file's text is the folder loaded
    ("{rel}/ref", "{rel}/nothing", "'..'"),
    ("../snapshots", "../nothing", "'..'"),  # a folder: once a 500 where a missing one was a 400
    ("{outside}", "{outside}/nothing", "starts with '/'"),
], ids=["absolute ref", "relative ref", "a folder in the cache", "a folder outside"])
def test_a_revision_is_checked_before_the_cache_is_read(cache, tmp_path, there, missing, problem):
    """``org/good@REV`` with a REV that is no git name is one 400 naming the problem: the same message whether what
    it points at exists or not (no probe), nothing registered and nothing outside the cache read."""
    repo, outside = cache
    rel = os.path.relpath(outside, repo / "refs")
    answers = []
    for revision in (there.format(outside=outside, rel=rel), missing.format(outside=outside, rel=rel)):
        status, message, registered = load_hub(f"org/good@{revision}")
        assert (status, registered) == (400, None), message
        assert problem in message and "not a commit hash, branch or tag name" in message, message
        answers.append(message.replace(repr(revision), "REV"))
    assert answers[0] == answers[1]
    assert read_outside(tmp_path) == []


def _ref_is_a_path(repo, target):
    (repo / "refs" / "main").write_text(str(target))


def _ref_links_out(repo, target):
    (repo / "refs" / "main").unlink()
    (repo / "refs" / "main").symlink_to(target)


def _snapshot_links_out(repo, target):
    snapshot = repo / "snapshots" / GOOD
    for file in snapshot.iterdir():
        file.unlink()
    snapshot.rmdir()
    snapshot.symlink_to(target)


def _file_links_out(repo, target):
    weights = repo / "snapshots" / GOOD / "adapter_model.safetensors"
    weights.unlink()
    weights.symlink_to(target / "adapter_model.safetensors")


def _restore(repo):
    """org/good's cache as the fixture built it (refs/main and the snapshot folder), after a damage."""
    ref = repo / "refs" / "main"
    ref.unlink()
    ref.write_text(GOOD)
    snapshot = repo / "snapshots" / GOOD
    if snapshot.is_symlink():
        snapshot.unlink()
        snapshot.mkdir()
    for name, content in ADAPTER.items():
        (snapshot / name).unlink(missing_ok=True)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", hashlib.sha256(content).hexdigest()))


@pytest.mark.parametrize("damage", [_ref_is_a_path, _ref_links_out, _snapshot_links_out, _file_links_out])
def test_a_cache_that_leads_outside_the_repo_folder_is_refused(cache, tmp_path, damage):
    """A ref whose text is a path, or a ref, snapshot or file that links out of the repo's cache folder: one 400,
    the same whether the place outside exists or not, nothing registered and nothing outside read."""
    repo, outside = cache
    answers = []
    for target in (outside / "ref" if damage is _ref_links_out else outside / "snap", outside / "nothing"):
        damage(repo, target)
        status, message, registered = load_hub("org/good@main")
        assert (status, registered) == (400, None), message
        answers.append(message)
        _restore(repo)
    assert answers[0] == answers[1] and "org/good" in answers[0], answers
    assert read_outside(tmp_path) == []


@pytest.mark.parametrize("revision", [None, "main", "v1.0", "feature/x", GOOD])
def test_good_revisions_load_from_the_repo_folder(cache, revision):
    """A commit hash, a branch, a tag and a branch with a / inside each load the snapshot, confined to the repo's
    cache folder (every file the engine reads must lie in it)."""
    repo, _ = cache
    status, message, registered = load_hub("org/good" + (f"@{revision}" if revision else ""))
    assert status == 200, message
    folder, roots = registered
    assert Path(folder).resolve() == (repo / "snapshots" / GOOD).resolve() and roots == [repo.resolve()]


def test_at_run_time_a_folder_of_an_ids_spelling_wins_only_inside_a_lora_root(cache, tmp_path, monkeypatch):
    """``org/good`` is the hub repo unless a --lora-root holds that folder, whatever the server's working directory:
    one there (outside the roots) is neither loaded nor told apart from a missing one."""
    repo, outside = cache
    holds, empty = tmp_path / "roots", tmp_path / "empty"
    empty.mkdir()
    for base in (tmp_path, holds):
        (base / "org" / "good").mkdir(parents=True)
        for name, content in ADAPTER.items():
            (base / "org" / "good" / name).write_bytes(content)
    for cwd in (tmp_path, holds):
        monkeypatch.chdir(cwd)
        for roots, expected in [((empty,), (repo / "snapshots" / GOOD, [repo.resolve()])),  # org/good lies outside
                                ((empty, holds), ((holds / "org" / "good").resolve(), None))]:
            status, message, registered = load_hub("org/good", lora_roots=roots)
            assert status == 200 and registered == expected, (cwd, roots, message)


def test_a_relative_lora_path_is_taken_inside_the_lora_roots(cache, tmp_path, monkeypatch):
    """``lora_path`` relative: the first --lora-root where it exists, never the working directory; ``..`` or a link
    out of a root is outside, as an absolute path there is."""
    _, outside = cache
    first, second = tmp_path / "first", tmp_path / "second"
    for root in (first, second):
        (root / "mine").mkdir(parents=True)
        for name, content in ADAPTER.items():
            (root / "mine" / name).write_bytes(content)
    (first / "link").symlink_to(outside / "snap")
    monkeypatch.chdir(outside)  # its "snap" is not looked at: the first root's, missing, is what would load
    assert load_hub("mine", (first, second))[2] == ((first / "mine").resolve(), None)
    assert load_hub("./mine", (outside / "snap", second))[2] == ((second / "mine").resolve(), None)
    assert load_hub("snap", (first, second))[2] == ((first / "snap").resolve(), None)
    for escape in ("../outside/snap", "mine/../../outside/snap", "link", str(outside / "snap")):
        status, message, registered = load_hub(escape, (first, second))
        assert (status, registered) == (403, None) and "outside the allowed --lora-root folders" in message, escape


def test_revisions_are_what_git_names_a_commit_branch_or_tag():
    from lorakit.adapters.hub import check_revision

    for good in (GOOD, "main", "v1.0", "feature/x", "refs/pr/1", "release-2024.05_rc1", "a@b"):
        assert check_revision(good) == good
    for bad, problem in [("/abs", "starts with '/'"), ("x/", "ends with '/'"), ("a//b", "'//'"), ("a/../b", "'..'"),
                         ("..", "'..'"), ("a\\b", "'\\\\'"), ("a\0b", "control"), ("a\nb", "control"),
                         ("a b", "space"), ("x" * 256, "longer than 255"), ("a:b", "':'"), ("a~1", "'~'"),
                         ("a^", "'^'"), ("a?", "'?'"), ("a*", "'*'"), ("a[b", "'['"), ("a@{1}", "'@{'"),
                         ("@", "'@'"), (".hidden", "'.'"), ("a/.b", "'.'"), ("x.lock", "'.lock'"), ("x.", "'.'"),
                         ("", "empty")]:
        with pytest.raises(ValueError, match="not a commit hash, branch or tag name") as e:
            check_revision(bad)
        assert problem in str(e.value), (bad, str(e.value))


def test_from_hub_takes_only_repo_ids(cache, tmp_path):
    from lorakit.adapters.hub import from_hub

    for repo in ("../outside", "org/../x", "/abs", "org/good/extra", "org--x/y"):
        with pytest.raises(ValueError, match="not a hub repo id"):
            from_hub(repo, None, "--model", ADAPTER_FILES)
    assert read_outside(tmp_path) == []


def test_serve_refuses_a_bad_revision_at_startup(cache, tmp_path):
    """``--model ORG/NAME@REV`` and ``--lora NAME=ORG/ADAPTER@REV``: a REV that is no git name, or a cache that leads
    outside the repo's folder, stops ``lorakit serve`` with a ValueError naming it (``run`` prints it and exits)
    before anything outside the cache is read; good ones resolve."""
    import argparse

    from lorakit.serve import cli

    repo, outside = cache
    parser = argparse.ArgumentParser().add_subparsers()
    cli.add_parser(parser)

    def resolve(*argv):
        args = parser.choices["serve"].parse_args(argv)
        return cli.resolve_hub_ids(args), args

    for argv, where in [(["--model", f"org/good@{outside}/ref"], "--model org/good: "),
                        (["--lora", f"sql=org/good@{outside}/ref"], "--lora sql org/good: "),
                        (["--model", "org/good@../../../outside/ref"], "--model org/good: ")]:
        with pytest.raises(ValueError, match="is not a commit hash, branch or tag name") as e:
            resolve(*argv)
        assert str(e.value).startswith(where), str(e.value)
    _ref_is_a_path(repo, outside / "snap")
    with pytest.raises(ValueError, match="^--model org/good: the hub cache's refs/main holds no commit hash"):
        resolve("--model", "org/good")
    _restore(repo)
    assert read_outside(tmp_path) == []
    name, args = resolve("--model", "org/good@v1.0", "--lora", "sql=org/good@feature/x")
    assert name == "org/good" and Path(args.model).name == GOOD and args.lora == [f"sql={args.model}"]

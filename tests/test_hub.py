"""Models and adapters by Hugging Face hub id (``lorakit.adapters.hub``), without a network: a fake hub on
localhost speaks the two calls ``huggingface_hub`` makes (a revision's file list, each file's HEAD and GET), so the
cache the tests read is laid out by ``huggingface_hub``'s own download, then read again with ``HF_HUB_OFFLINE=1``."""

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lorakit.adapters.hub import ADAPTER_FILES, MODEL_FILES, hub_id

ROOT = Path(__file__).resolve().parents[1]
COMMITS = {"main": "a" * 40, "v1": "b" * 40}  # v1 holds an adapter's files too
FILES = {  # revision -> files of org/tiny-model
    "main": {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"weights", "tokenizer.json": b"{}",
             "pytorch_model.bin": b"a pickle", "modeling_evil.py": b"import os", "README.md": b"# tiny"},
    "v1": {"config.json": b'{"model_type": "llama", "v": 1}', "model.safetensors": b"old weights",
           "adapter_config.json": b"{}", "adapter_model.safetensors": b"adapter weights"},
}


class FakeHub(http.server.ThreadingHTTPServer):
    """``repos``: {repo id: {revision: {file: bytes}}} (default: org/tiny-model, FILES); revisions' commits are
    COMMITS'."""

    def __init__(self, repos: dict | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[str] = []
        self.repos = repos or {"org/tiny-model": FILES}

    def env(self, home) -> dict:
        """The environment that points huggingface_hub at this hub, with its cache under ``home``."""
        return {"HF_ENDPOINT": f"http://127.0.0.1:{self.server_address[1]}", "HF_HOME": str(home),
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, body: bytes | None):
        self.server.requests.append(f"{self.command} {self.path}")
        parts = self.path.split("?")[0].strip("/").split("/")
        if body is None:
            if parts[:1] == ["api"] and len(parts) >= 6 and parts[1] == "models" and parts[4] in ("revision", "tree"):
                repo, revision = "/".join(parts[2:4]), parts[5]
                revision = next((r for r, c in COMMITS.items() if c == revision), revision)
                files = self.server.repos.get(repo)
                if files is None:
                    return self._status(404, "Repository not found", {"X-Error-Code": "RepoNotFound"})
                if revision not in files:
                    return self._status(404, "Revision not found", {"X-Error-Code": "RevisionNotFound"})
                if parts[4] == "tree":  # the revision's files, as snapshot_download lists them
                    body = json.dumps([{"type": "file", "path": f, "size": len(c), "oid": hashlib.sha1(c).hexdigest()}
                                       for f, c in files[revision].items()]).encode()
                else:
                    body = json.dumps({"id": repo, "sha": COMMITS[revision],
                                       "siblings": [{"rfilename": f} for f in files[revision]]}).encode()
                return self._send(body, {"Content-Type": "application/json"})
            if len(parts) >= 5 and parts[2] == "resolve":
                revision = next((r for r, c in COMMITS.items() if c == parts[3]), parts[3])
                content = self.server.repos.get("/".join(parts[:2]), {}).get(revision, {}).get("/".join(parts[4:]))
                if content is None:
                    return self._status(404, "Entry not found", {"X-Error-Code": "EntryNotFound"})
                etag = hashlib.sha256(content).hexdigest()
                return self._send(content, {"X-Repo-Commit": COMMITS[revision], "ETag": f'"{etag}"',
                                            "Content-Type": "application/octet-stream"})
            return self._status(404, "not found", {})

    def _status(self, code, message, headers):
        self._send(json.dumps({"error": message}).encode(), {"Content-Type": "application/json", **headers}, code)

    def _send(self, body: bytes, headers: dict, code: int = 200):
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self):
        self._answer(None)

    def do_HEAD(self):
        self._answer(None)


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

"""``lorakit serve``: an OpenAI-compatible server over the engine (see app.py), and the bundled default model."""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import socket
import tempfile
from collections.abc import Callable

from lorakit.serve.adapters import confined
from lorakit.serve.app import create_app
from lorakit.serve.edge import uvicorn_config
from lorakit.serve.state import ServeConfig

__all__ = ["ServeConfig", "confined", "create_app", "run_server", "uvicorn_config"]


def run_server(engine, config: ServeConfig, host: str = "127.0.0.1", port: int = 8000, *, api_servers: int = 1,
               tokenizer: Callable | None = None) -> int:
    """Serve ``engine`` (an Engine, run on a thread, or an EngineClient such as a launched ``CoreClient``) until
    interrupted (SIGINT, SIGTERM); on shutdown, requests in flight get ``config.shutdown_grace`` seconds to finish,
    then those still running end with a 503 (``serve.server``). Returns the exit status: 1 when the engine died (its
    core process exited, or it cannot step any more: every request in flight got a 503, and a supervisor restarts the
    server), else 0, a Ctrl-C included.

    ``api_servers`` > 1 (a ``CoreClient`` launched for as many servers): this process and ``api_servers`` - 1 more
    serve the same port (SO_REUSEPORT: the kernel spreads connections over them, by a hash, not evenly), each with its
    own sockets to the one core and its own limits on what is in flight (by default, the engine's share for one of
    them: ``ServeConfig.in_flight``), and ``/metrics`` of any of them adds up all of theirs; ``tokenizer``: a
    picklable callable that loads the base tokenizer in each of them."""
    from lorakit.serve.server import Server

    metrics = None
    if api_servers > 1:
        from lorakit.serve.metrics import share_across_processes

        metrics = tempfile.mkdtemp(prefix="lorakit-metrics-")
        share_across_processes(metrics)
    app = create_app(engine, config)
    state = app.state.server
    server = Server(uvicorn_config(app, host, port, log_level="info"), state)
    client = state.engine
    client.on_death = lambda: setattr(server, "should_exit", True)  # from any thread: uvicorn looks every 0.1 s
    if api_servers == 1:
        server.run()
    else:
        if port == 0:
            raise ValueError("several API servers need a fixed port; give --port")
        spawn = multiprocessing.get_context("spawn")
        client.companions = [spawn.Process(target=_serve_more, name=f"lorakit-api-{i}", daemon=True,
                                           args=(client.addresses, i, client.core_pid, tokenizer, config, host, port))
                             for i in range(1, api_servers)]
        listening = _listen(host, port)
        for process in client.companions:
            process.start()
        try:
            server.run(sockets=[listening])
        finally:
            shutil.rmtree(metrics, ignore_errors=True)
    return 1 if client.crashed else 0


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port that other processes can bind too (SO_REUSEPORT)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _serve_more(addresses, index: int, core_pid: int, tokenizer: Callable | None, config: ServeConfig, host: str,
                port: int) -> None:
    """One more API server process: server ``index`` of the core that the first one launched."""
    from lorakit.engine.lifeline import name_process
    from lorakit.frontend.core_client import CoreClient
    from lorakit.serve.server import Server

    name_process(f"lorakit api-server {index}")
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s [api server {index}]: %(message)s")
    client = CoreClient(None, tokenizer() if tokenizer is not None else None)
    client.attach(addresses, index, core_pid)
    app = create_app(client, config)
    server = Server(uvicorn_config(app, host, port, log_level="warning"), app.state.server)
    client.on_death = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[_listen(host, port)])

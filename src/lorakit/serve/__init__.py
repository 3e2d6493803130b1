"""``lorakit serve``: an OpenAI-compatible server over the engine (see app.py), and the bundled default model."""

from lorakit.serve.adapters import confined
from lorakit.serve.app import create_app
from lorakit.serve.state import ServeConfig

__all__ = ["ServeConfig", "confined", "create_app", "run_server"]


def run_server(engine, config: ServeConfig, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Serve ``engine`` (an Engine, run on a thread, or an EngineClient such as a launched ``CoreClient``) until
    interrupted; on shutdown, requests in flight get 30 s to finish. Returns the exit status: 1 when the engine core
    died (every request in flight got an error; a supervisor restarts the server), else 0."""
    import uvicorn

    app = create_app(engine, config)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=30, log_level="info"))
    client = app.state.server.engine
    if hasattr(client, "on_death"):
        client.on_death = lambda: setattr(server, "should_exit", True)
    server.run()
    return 1 if getattr(client, "crashed", False) else 0

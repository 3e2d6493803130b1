"""``lorakit serve``: an OpenAI-compatible server over the engine (see app.py), and the bundled default model."""

from lorakit.serve.adapters import confined
from lorakit.serve.app import create_app
from lorakit.serve.state import ServeConfig

__all__ = ["ServeConfig", "confined", "create_app", "run_server"]


def run_server(engine, config: ServeConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until interrupted; on shutdown, requests in flight get 30 s to finish."""
    import uvicorn

    uvicorn.run(create_app(engine, config), host=host, port=port, timeout_graceful_shutdown=30, log_level="info")

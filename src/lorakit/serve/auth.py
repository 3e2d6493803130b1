"""The API key: where ``lorakit serve`` reads it from, and the one check of a request's ``Authorization`` header.

The key comes from exactly one of ``LORAKIT_API_KEY`` (the environment), ``--api-key-file PATH`` or ``--api-key KEY``
(visible to every user of the machine in the process table: a warning says so). A request carries it as
``Authorization: Bearer KEY``, the scheme in any case (HTTP's schemes are case-insensitive), compared in constant
time (``hmac.compare_digest``: how long a wrong key takes to refuse does not tell how much of it was right).
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from pathlib import Path

from fastapi.responses import JSONResponse

from lorakit.serve.protocol import ApiError

__all__ = ["ENV_KEY", "BearerAuth", "api_key", "authorized", "check_key"]

ENV_KEY = "LORAKIT_API_KEY"
MAX_KEY_CHARS = 4096

logger = logging.getLogger("lorakit.serve")


def check_key(key: str, where: str) -> str:
    """``key`` if a client can send it as a bearer token: 1-4096 visible ASCII characters (no space, no control
    character); ValueError naming ``where`` otherwise."""
    if not key:
        raise ValueError(f"{where} is empty; give a key, or none at all to serve without one")
    if len(key) > MAX_KEY_CHARS or not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{where} must be 1-{MAX_KEY_CHARS} visible ASCII characters (no spaces), as an "
                         f"'Authorization: Bearer' header carries it; got {len(key)} characters")
    return key


def api_key(flag: str | None, path: Path | None, environ=os.environ) -> str | None:
    """The key the server requires (None: none), from the one source given; ValueError for two, or a bad one."""
    given = {name: value for name, value in ((ENV_KEY, environ.get(ENV_KEY)), ("--api-key-file", path),
                                             ("--api-key", flag)) if value is not None}
    if len(given) > 1:
        raise ValueError(f"the API key is given {len(given)} ways ({', '.join(given)}); give one (unset {ENV_KEY} "
                         f"to use a flag)")
    if not given:
        return None
    (source, value), = given.items()
    if source == "--api-key":
        logger.warning("--api-key puts the key in the process table, where every user of this machine can read it; "
                       "use %s or --api-key-file instead", ENV_KEY)
        return check_key(value, "--api-key")
    if source == ENV_KEY:
        return check_key(value, ENV_KEY)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot read it ({e}); give a readable UTF-8 file holding the key"
                         ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("--api-key-file %s can be read by other users (mode %o); chmod 600 it", path, mode & 0o777)
    return check_key(text.strip(), f"the key in --api-key-file {path}")


def authorized(header: bytes | str | None, key: str) -> bool:
    """Whether an ``Authorization`` header's value carries ``key`` as a bearer token (scheme in any case)."""
    if header is None:
        return False
    raw = header.encode("latin-1", "replace") if isinstance(header, str) else header
    scheme, _, token = raw.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


class BearerAuth:
    """Requires the key (``authorized``) on every path but ``open_paths``; a 401 otherwise. Plain ASGI, so streamed
    responses pass straight through (a BaseHTTPMiddleware would relay every chunk through a task of its own)."""

    def __init__(self, app, key: str, open_paths: tuple[str, ...]):
        self.app, self.key, self.open_paths = app, key, open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            if not authorized(dict(scope["headers"]).get(b"authorization"), self.key):
                e = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                return await JSONResponse(e.body(), e.status)(scope, receive, send)
        await self.app(scope, receive, send)

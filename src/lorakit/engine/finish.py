"""Why a request ended: the closed set the engine, the output processor and the APIs share.

Its own module, below both ``outputs`` and ``detokenize`` (a stop string ends a request too), which import it.
"""

from __future__ import annotations

import enum

__all__ = ["FinishReason"]


class FinishReason(str, enum.Enum):
    """Why a request ended. A ``str`` enum: each member equals, prints and encodes (JSON, msgpack) as its value,
    the string the APIs send."""

    STOP = "stop"  # an eos or stop token, or a stop string
    LENGTH = "length"  # its max_tokens-th token
    ABORT = "abort"  # aborted: by its client, or by the server (the output's ``error`` then says why)
    ERROR = "error"  # it failed alone (the output's ``error`` says why)

    def __str__(self) -> str:  # the value, as 3.11's StrEnum prints it: f-strings and metric labels get "stop"
        return self.value

"""The wire between the server processes and the engine core process: msgspec structs, msgpack-encoded.

Each side decodes with a typed schema (``ToCore`` in the core, ``FromCore`` in a server), so a request's parameters
arrive as a ``SamplingParams``, checked again there, and a step's outputs as the engine's own ``RequestOutput``s.

    server -> core     Add (a request), Abort (requests); calls, each answered by a Reply: Register,
                       Push, Unregister, CompileGrammar, Shutdown
    core -> server     Ready | Failed (at start), Step (each step's outputs, stats), Reply (to a call),
                       Adapters (another server registered or removed one), Failed (cannot step any more), Beat

A Push's safetensors bytes travel as a second frame of its message (``to_frames``), sent and received without a copy:
encoding 84 MB into the message and copying it into zmq held the server's event loop (and its streams) ~100 ms. A
large body the server gathered in a memfd does not travel at all: the Push names where it lies (``BodyFile``) and the
core maps it (``lorakit.frontend.bodies``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import msgspec

from lorakit.engine.errors import Overloaded
from lorakit.engine.outputs import RequestOutput
from lorakit.adapters.pool import AdapterRef, TooManyVersions, VersionTaken
from lorakit.adapters.shared import SharedWeights
from lorakit.engine.sampling import SamplingParams
from lorakit.engine.stats import EngineStats
from lorakit.engine.structured import StructuredOutput
from lorakit.peft import AdapterError

__all__ = ["ERRORS", "Abort", "Adapters", "AdapterFacts", "Add", "Beat", "BodyFile", "BodyFileError", "Call",
           "CompileGrammar", "Failed", "FromCore", "Push", "Ready", "Register", "Reply", "Shutdown", "Step", "ToCore",
           "Unregister", "to_frames"]

# What a server sends ...

class Add(msgspec.Struct, tag=True, array_like=True):
    """A request: ``adapter`` is the version the server resolved its ``model`` to (None: the base model)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


# The calls: each is answered by a ``Reply`` with its ``call_id``, to server ``server``.

class Register(msgspec.Struct, tag=True, array_like=True):
    """Read, check and install the adapter folder ``path`` as ``name`` (every file inside ``roots`` when given);
    the reply's result: its ``AdapterFacts``."""

    call_id: int
    name: str
    path: str
    roots: list[str] | None = None
    server: int = 0


class BodyFile(NamedTuple):
    """A safetensors body the server holds in a memfd: the core maps it from ``/proc/pid/fd/fd``."""

    pid: int
    fd: int
    size: int  # bytes, from the file's start


class BodyFileError(OSError):
    """The core could not map a ``BodyFile``: the server sends the bytes instead."""


class Push(msgspec.Struct, tag=True, array_like=True):
    """Check and install an adapter pushed from memory as ``name``'s new version: ``weights``, a safetensors file's
    bytes (or where the server holds them), or a buffer in a client's CUDA memory (both opened by the core);
    ``config``, its adapter_config.json's object. The reply's result: its ``AdapterFacts``."""

    call_id: int
    name: str
    weights: memoryview | SharedWeights | BodyFile  # a view of the message as received: not copied under the GIL
    config: dict | None  # None: the one the safetensors bytes carry in their metadata
    server: int = 0
    version: int | None = None  # the new version's number (above the name's last), else the last plus one


def to_frames(message: ToCore, encode: Callable[[Any], bytes]) -> list:
    """``message`` as the frames of one zmq message: a Push's bytes, not encoded, as a second frame (the receiver puts
    them back in ``weights`` as a view of that frame); any other message, encoded, alone."""
    if isinstance(message, Push) and not isinstance(message.weights, (SharedWeights, BodyFile)):
        return [encode(msgspec.structs.replace(message, weights=memoryview(b""))), message.weights]
    return [encode(message)]


class Unregister(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    name: str
    server: int = 0


class CompileGrammar(msgspec.Struct, tag=True, array_like=True):
    """Compile ``spec``'s grammar for ``adapter``'s tokenizer, in ``client``'s turn: answered once it is compiled,
    or with the reason it is refused."""

    call_id: int
    spec: StructuredOutput
    adapter: AdapterRef | None = None
    client: str | None = None
    server: int = 0


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Stop: the running requests get ``seconds`` to finish; answered once the loop has drained."""

    call_id: int
    seconds: float
    server: int = 0


Call = Register | Push | Unregister | CompileGrammar | Shutdown


# ... and what the core sends.

class Step(msgspec.Struct, tag=True, array_like=True):
    """Every output of one step of the server's requests (token ids and the engine's finish, no text yet)."""

    outputs: list[RequestOutput]
    stats: EngineStats | None = None


class Reply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: Any = None
    error: tuple[str, str] | None = None  # (exception type name, message)


class AdapterFacts(msgspec.Struct, array_like=True):
    """What a server needs of a registered adapter: its version, its folder (it reads the tokenizer there itself)
    and the tokens it adds."""

    ref: AdapterRef
    path: str  # the folder's real path, as read
    added_tokens: list[int]


class Adapters(msgspec.Struct, tag=True, array_like=True):
    """To the other servers after a register or unregister: the adapter's new facts (``roots``: the folders its
    files had to lie in), or its name removed."""

    facts: AdapterFacts | None
    removed: str | None = None
    roots: list[str] | None = None


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The engine's facts the servers answer from: its vocabulary, context, KV-cache room in tokens (``kv_tokens``:
    num_blocks x block_size) and ``max_num_seqs`` (what their limits on requests in flight follow), adapters."""

    pid: int
    vocab_size: int
    max_seq_len: int
    eos_token_id: int | list[int] | None
    kv_tokens: int
    max_num_seqs: int
    adapters: list[AdapterFacts]


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The engine could not be built (instead of Ready), or it cannot step any more (then the core exits)."""

    message: str
    kind: str


class Beat(msgspec.Struct, tag=True, array_like=True):
    """The core runs (sent by a thread of its own every ``BEAT_SECONDS``)."""


ToCore = Add | Abort | Call
FromCore = Step | Reply | Adapters | Ready | Failed | Beat
ERRORS = {"AdapterError": AdapterError, "ValueError": ValueError, "TypeError": TypeError,  # raised again by kind
          "Overloaded": Overloaded, "TooManyVersions": TooManyVersions, "VersionTaken": VersionTaken,
          "BodyFileError": BodyFileError}



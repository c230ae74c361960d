"""The errors hydra-trio raises, under one root.

Every error the package raises on purpose is a :class:`HydraTrioError`, and
each class says what it is on the wire, as h11's errors carry an
``error_status_hint``: :attr:`~HydraTrioError.http_status` (the HTTP status of
the OpenAI-style error body) and :attr:`~HydraTrioError.hydra_status` (the
Hydra reply status), plus :meth:`~HydraTrioError.wire_meta` (extra keys for the
error reply) and the op-specific keys a front end adds with
:meth:`~HydraTrioError.with_meta`.  Every refusal of a request is one of them,
and each front end turns them into replies at one boundary
(:mod:`hydra_trio.http.boundary`; :meth:`hydra_trio.hydra.connection.ServerConnection.handle`),
never writing a status of its own:

====================  ====  ===============  =======================
class                 HTTP  Hydra            extra keys
====================  ====  ===============  =======================
HydraTrioError        500   ERROR
InvalidRequest        400   BAD_REQUEST
BodyError             400   BAD_REQUEST      (HTTP: the connection is closed)
BodyTooLarge          413   BAD_REQUEST
BodyTimeout           408   BAD_REQUEST
NotFound              404   NOT_FOUND
NotSupported          501   NOT_IMPLEMENTED
NoModel               501   NOT_IMPLEMENTED
Busy                  409   BUSY             ``busy_slots``
Overloaded            503   BUSY
NotReady              503   ERROR            ``stage``
Cancelled             503   ERROR
Stopping              503   ERROR
EngineFailure         500   ERROR
====================  ====  ===============  =======================

Subclasses elsewhere set their own (a state blob this node cannot take,
:class:`hydra_trio.engine.kv.state.StateError`, is HTTP 400 and Hydra ERROR).
A bare ``ValueError`` does not mean "invalid request".
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from .protocol.hydra import Status


class HydraTrioError(Exception):
    """The root of hydra-trio's errors: a server error (HTTP 500, Hydra ERROR) unless a subclass says otherwise."""

    http_status: ClassVar[int] = 500
    """The HTTP status of the reply this error becomes (OpenAI-style body, ``error.code`` the same)."""
    hydra_status: ClassVar[Status] = Status.ERROR
    """The Hydra reply status this error becomes (docs/hydra-protocol.md §2)."""

    def wire_meta(self) -> dict[str, Any]:
        """Extra keys of the error reply (Hydra meta, and HTTP's ``error`` object); none here."""
        return {}

    def with_meta(self, **meta: Any) -> Self:
        """Add keys to this error's reply (a refused CONFIGURE's ``success: false`` and ``tier``, ...), over
        :meth:`wire_meta`'s; returns ``self``, to be raised."""
        self._reply_meta = {**getattr(self, "_reply_meta", {}), **meta}
        return self

    def reply_meta(self) -> dict[str, Any]:
        """Every extra key of the error reply: :meth:`wire_meta`'s, then those :meth:`with_meta` added."""
        return {**self.wire_meta(), **getattr(self, "_reply_meta", {})}


class InvalidRequest(HydraTrioError):
    """The client's request is wrong (a field's type, range or meaning); the message names the field.
    HTTP 400, Hydra BAD_REQUEST."""

    http_status = 400
    hydra_status = Status.BAD_REQUEST


class BodyError(HydraTrioError):
    """The request's body could not be read whole: the connection ended before it did, or its length is not
    the one declared (HTTP 400; the reply closes the connection, whose bytes are out of step; Hydra
    BAD_REQUEST)."""

    http_status = 400
    hydra_status = Status.BAD_REQUEST


class BodyTooLarge(BodyError):
    """The body is over the node's limit (``--max-body``, ``--max-state-body``): HTTP 413."""

    http_status = 413


class BodyTimeout(BodyError):
    """The client stopped sending its body for longer than ``--timeout``: HTTP 408."""

    http_status = 408


class NotFound(HydraTrioError):
    """What the request names does not exist (a slot id past the node's slots): HTTP 404, Hydra NOT_FOUND."""

    http_status = 404
    hydra_status = Status.NOT_FOUND


class NotSupported(HydraTrioError):
    """The node does not offer what the request asks for (a feature off by its flags, an endpoint or opcode it
    does not implement): HTTP 501 ``not_supported_error``, as llama-server answers, Hydra NOT_IMPLEMENTED."""

    http_status = 501
    hydra_status = Status.NOT_IMPLEMENTED


class NoModel(NotSupported):
    """The node has no model (a compute-only node: it lends its ggml-RPC backend), and the request needs one."""

    def __init__(self, message: str = "this node has no model (compute-only)") -> None:
        super().__init__(message)


class Busy(HydraTrioError):
    """A slot, or the node as a whole, is processing and the request needs it idle (HTTP 409, Hydra BUSY).

    ``busy_slots``: the ids of the slots that are processing (the reply's ``busy_slots``);
    ``requests_waiting``: requests queued for a slot (in the reply when there are any).  Raised by the
    serialized control channel (a change needs every slot idle and no request waiting), by slot
    operations (STATE_GET / STATE_PUT / erase on a working slot) and by jobs
    that asked to fail rather than wait (PREFILL / DECODE on a working slot).
    """

    http_status = 409
    hydra_status = Status.BUSY

    def __init__(self, message: str, busy_slots: list[int] | tuple[int, ...] = (), requests_waiting: int = 0) -> None:
        super().__init__(message)
        self.busy_slots = list(busy_slots)
        self.requests_waiting = requests_waiting

    def wire_meta(self) -> dict[str, Any]:
        if self.requests_waiting:
            return {"busy_slots": self.busy_slots, "requests_waiting": self.requests_waiting}
        return {"busy_slots": self.busy_slots}


class Overloaded(HydraTrioError):
    """Every place the request could take is taken (every slot processing, every event subscription in use)
    and it asked not to wait: HTTP 503 ``unavailable_error``, Hydra BUSY."""

    http_status = 503
    hydra_status = Status.BUSY


class NotReady(HydraTrioError):
    """The model is not serving yet (or failed to load, or the node has none); ``stage`` says where it is
    (HTTP 503, Hydra ERROR with ``stage``)."""

    http_status = 503

    def __init__(self, message: str, stage: str = "") -> None:
        super().__init__(message)
        self.stage = stage

    def wire_meta(self) -> dict[str, Any]:
        return {"stage": self.stage}


class Cancelled(HydraTrioError):
    """The request was cancelled (its client went away, or the node is stopping): HTTP 503, Hydra ERROR."""

    http_status = 503


class Stopping(Cancelled):
    """The node is stopping and its shutdown grace (``--shutdown-grace``) is over: the request was ended
    unfinished (HTTP 503 ``unavailable_error``, in a stream an error event; Hydra ERROR, a streamed DECODE's
    rest padded with the error flag)."""


class EngineFailure(HydraTrioError):
    """The engine could not complete the request (llama.cpp failed, a COMBINED peer died, ...): HTTP 500,
    Hydra ERROR."""


class ModelLoadError(HydraTrioError, RuntimeError):
    """llama.cpp could not load the GGUF file or create its context, or the settings ask for one it would refuse
    (HTTP 500, Hydra ERROR)."""

"""The errors the Hydra protocol client raises (docs/hydra-protocol.md §2 status codes).

Two families, both under the package's root `hydra_trio.errors.HydraTrioError`:

- `HydraError`: a request went wrong. A non-OK reply status raises the
  subclass of that status (`error_for_status`; the connection is still in
  sync); a transport failure raises `HydraTimeout`, `HydraConnectionClosed`
  or `HydraProtocolError` (the connection has been closed).
- `HydraConnectError`: the TCP connection could not be opened; an OSError, no
  request was sent.

Each status subclass's ``hydra_status`` is the status it stands for (as the
node's own errors name theirs, `hydra_trio.errors`); the transport errors keep
the root's (ERROR) and HTTP 500.

Re-exported by `hydra_trio.hydra.client`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..errors import HydraTrioError
from ..protocol.hydra import Status

__all__ = [
    "HydraBadRequest",
    "HydraBusy",
    "HydraConnectError",
    "HydraConnectionClosed",
    "HydraError",
    "HydraNotFound",
    "HydraNotImplemented",
    "HydraPartial",
    "HydraProtocolError",
    "HydraServerError",
    "HydraTimeout",
    "error_for_status",
]


class HydraError(HydraTrioError):
    """Base of every error the client raises about a request.

    Attributes:
        status: the reply's `Status` (a plain int for a code newer than
            `Status`); None for transport errors (`HydraTimeout`,
            `HydraConnectionClosed`, `HydraProtocolError`).
        meta: the reply's meta JSON object (``{}`` for transport errors).
        message: ``meta["error"]`` when the server sent one, else a
            description; also ``str(exc)``.
        op: the request's opcode, when known.
        trace_id: the request's trace id, when known.
    """

    transport_name: ClassVar[str] = "ERROR"
    """What `status_name` says when ``status`` is None."""

    def __init__(
        self,
        message: str,
        *,
        status: Status | int | None = None,
        meta: dict[str, Any] | None = None,
        op: int | None = None,
        trace_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message: str = message
        self.status: Status | int | None = status
        self.meta: dict[str, Any] = {} if meta is None else meta
        self.op: int | None = op
        self.trace_id: str | None = trace_id

    @property
    def status_name(self) -> str:
        """``"BUSY"``, ``"NOT_FOUND"``, ...; ``"STATUS_0x..`` for unknown
        codes; the class's `transport_name` (``"TIMEOUT"``, ...) when status
        is None."""
        if isinstance(self.status, Status):
            return self.status.name
        if self.status is not None:
            return f"STATUS_0x{self.status:02x}"
        return self.transport_name


class HydraNotFound(HydraError):
    """Status NOT_FOUND (0x01): e.g. slot id out of range."""

    hydra_status = Status.NOT_FOUND


class HydraServerError(HydraError):
    """Status ERROR (0x02): the engine failed (e.g. STATE_PUT of a blob from
    another model: meta has ``expected_hash`` / ``got_hash``)."""

    hydra_status = Status.ERROR


class HydraPartial(HydraError):
    """Status PARTIAL (0x03)."""

    hydra_status = Status.PARTIAL


class HydraBusy(HydraError):
    """Status BUSY (0x04): e.g. SET_EXPERT_MODE while slots are processing;
    meta has ``busy_slots`` (list of slot ids)."""

    hydra_status = Status.BUSY


class HydraBadRequest(HydraError):
    """Status BAD_REQUEST (0x05): malformed key or payload, payload over the
    server's cap (the server then closes the connection)."""

    hydra_status = Status.BAD_REQUEST


class HydraNotImplemented(HydraError):
    """Status NOT_IMPLEMENTED (0x06): unknown or unsupported opcode."""

    hydra_status = Status.NOT_IMPLEMENTED


class HydraTimeout(HydraError):
    """No progress for ``timeout`` seconds while connecting, sending or
    receiving. The connection has been closed (it is out of sync)."""

    transport_name = "TIMEOUT"


class HydraConnectionClosed(HydraError):
    """The server closed the connection (or it was closed earlier after an
    error, or by `HydraClient.aclose`)."""

    transport_name = "CONNECTION_CLOSED"


class HydraProtocolError(HydraError):
    """The server's reply broke the framing (bad meta JSON, a DECODE payload
    that is not whole 9-byte frames, ...). For framing errors the connection
    has been closed."""

    transport_name = "PROTOCOL_ERROR"


class HydraConnectError(ConnectionError, HydraTrioError):
    """The TCP connection could not be opened (refused, unreachable, name
    resolution failed). An OSError (and a `HydraTrioError`), not a
    `HydraError`: no request was sent. ``host`` and ``port`` say where;
    ``reason`` is the underlying cause in words (e.g.
    ``"Connection refused"``)."""

    def __init__(self, host: str, port: int, reason: str) -> None:
        super().__init__(f"cannot connect to {host}:{port}: {reason}")
        self.host = host
        self.port = port
        self.reason = reason


_STATUS_ERRORS: dict[int, type[HydraError]] = {
    cls.hydra_status: cls
    for cls in (HydraNotFound, HydraServerError, HydraPartial, HydraBusy, HydraBadRequest, HydraNotImplemented)
}
"""A reply status -> the error of that status (each class's
:attr:`~hydra_trio.errors.HydraTrioError.hydra_status`, the one the node's own errors use)."""


def error_for_status(
    status: int,
    meta: dict[str, Any],
    *,
    op: int | None = None,
    trace_id: str | None = None,
) -> HydraError:
    """The exception for a non-OK reply: the subclass mapped to ``status``
    (`HydraError` itself for codes outside `Status`), message from
    ``meta["error"]`` (else the status name)."""
    st: Status | int
    try:
        st = Status(status)
        name = st.name
    except ValueError:
        st, name = status, f"status 0x{status:02x}"
    err = meta.get("error")
    message = err if isinstance(err, str) and err else name
    cls = _STATUS_ERRORS.get(status, HydraError)
    return cls(message, status=st, meta=meta, op=op, trace_id=trace_id)

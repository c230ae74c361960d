"""The errors hydra-trio raises, under one root.

Every error the package raises on purpose is a :class:`HydraTrioError`.  The
front ends map them to the wire: :class:`InvalidRequest` is HTTP 400 and the
Hydra status BAD_REQUEST, :class:`Busy` is HTTP 409 and BUSY (0x04),
:class:`NotReady` is HTTP 503 and ERROR with the stage, anything else is a
server error.  A bare ``ValueError`` no longer means "invalid request".
"""

from __future__ import annotations


class HydraTrioError(Exception):
    """The root of hydra-trio's errors."""


class InvalidRequest(HydraTrioError):
    """The client's request is wrong (a field's type, range or meaning); the message names the field."""


class Busy(HydraTrioError):
    """A slot, or the node as a whole, is processing and the request needs it idle.

    ``busy_slots``: the ids of the slots that are processing.  Raised by the
    serialized control channel (a change needs every slot idle), by slot
    operations (STATE_GET / STATE_PUT / erase on a working slot) and by jobs
    that asked to fail rather than wait (PREFILL / DECODE on a working slot).
    """

    def __init__(self, message: str, busy_slots: list[int] | tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.busy_slots = list(busy_slots)


class NotReady(HydraTrioError):
    """The model is not serving yet (or failed to load, or the node has none); ``stage`` says where it is."""

    def __init__(self, message: str, stage: str = "") -> None:
        super().__init__(message)
        self.stage = stage


class Cancelled(HydraTrioError):
    """The request was cancelled (its client went away, or the node is stopping)."""


class EngineFailure(HydraTrioError):
    """The engine could not complete the request (llama.cpp failed, a COMBINED peer died, ...)."""


class ModelLoadError(HydraTrioError, RuntimeError):
    """llama.cpp could not load the GGUF file or create its context, or the settings ask for one it would refuse."""

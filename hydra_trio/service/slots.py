"""A slot's KV state, saved and restored, for every front end: Hydra STATE_GET / STATE_PUT, HTTP
``GET`` / ``PUT /slots/{id}/state``, slot files (``POST /slots/{id}?action=save|restore``, :mod:`.slot_files`)
and erase.

A blob to restore is checked before the engine thread sees it (its checksum, off the engine thread:
:func:`~hydra_trio.engine.kv.state.verify_checksum_off_engine`), then applied on the engine thread all or
nothing; its buffer goes back to the transfer pool once the engine is done with it (a restore cancelled
meanwhile drops it instead: the engine may still read it).
"""

from __future__ import annotations

from typing import Any, TypeAlias

import attrs

from ..engine import (
    TRANSFER_POOL,
    BlobBuffer,
    BlobPool,
    Engine,
    EraseSlot,
    RestoreSlot,
    RunningChecksum,
    SaveSlot,
    verify_checksum_off_engine,
)
from ..errors import HydraTrioError

Blob: TypeAlias = bytearray | BlobBuffer
"""A state blob as received: one buffer of the transfer pool (a large upload), else a bytearray."""


@attrs.frozen
class RestoredSlot:
    """A restore that took: ``bytes`` of blob applied, the slot's ``n_past`` (tokens) after it, whether the
    blob's model hash and KV identity matched this node's, and this node's ``identity`` keys."""

    id_slot: int
    bytes: int
    n_past: int
    model_hash_match: bool
    kv_identity_match: bool
    identity: dict[str, Any]

    def as_reply(self, slot_key: str) -> dict[str, Any]:
        """``{"restored": true, slot_key: id, "bytes", "n_past", "model_hash_match", "kv_identity_match",
        ...identity}`` (``slot_key``: the wire's name for the slot id)."""
        return {
            "restored": True,
            slot_key: self.id_slot,
            "bytes": self.bytes,
            "n_past": self.n_past,
            "model_hash_match": self.model_hash_match,
            "kv_identity_match": self.kv_identity_match,
            **self.identity,
        }


def release(blob: Blob | bytes) -> None:
    """Give a blob's buffer back to its pool (a bytearray needs nothing)."""
    if isinstance(blob, BlobBuffer):
        blob.release()


async def save(e: Engine, id_slot: int, pool: BlobPool | None = TRANSFER_POOL) -> tuple[int, Any]:
    """The idle slot's state: ``(n_past, blob)``, the blob in a buffer of ``pool`` (release it once sent:
    :func:`release`) or, with ``pool`` None, a bytearray.  Cancelled while it waits, the engine may still write
    the buffer: it is then dropped, not pooled.  Raises Busy (the slot is processing)."""
    return await e.run_task(SaveSlot(id_slot, pool=pool))


async def restore(e: Engine, id_slot: int, blob: Blob, running: RunningChecksum | None = None) -> RestoredSlot:
    """Apply a state blob to the idle slot, all or nothing, and give its buffer back (:func:`release`; not
    when cancelled: the engine may still read it).

    ``running``: the checksum hashed while the blob arrived (only its header is read now); without it, a small
    blob is checked on the event loop, a large one in a worker thread.

    Raises:
        StateError: a blob this node cannot take (damaged, another model's, other KV cache types, more tokens
            than a slot holds; its meta says which); nothing was applied.
        Busy: the slot is processing a request.
    """
    size = len(blob)  # restoring consumes the blob (frames it in place)
    try:
        await verify_checksum_off_engine(blob, running)  # integrity first, never on the engine thread
        done = await e.run_task(RestoreSlot(id_slot, blob, checksum_verified=True))
    except HydraTrioError:  # the worker thread and the engine are done with it
        release(blob)
        raise
    release(blob)  # cancelled, the engine may still read it: it is then dropped, never pooled
    assert e.identity is not None
    return RestoredSlot(id_slot, size, done.n_past, done.model_hash_match, done.kv_identity_match, e.identity.as_meta())


async def erase(e: Engine, id_slot: int) -> int:
    """Empty the idle slot's KV cache; the tokens it held.  Raises Busy (the slot is processing)."""
    return await e.run_task(EraseSlot(id_slot))

"""Slot KV state blobs: save and restore one slot's KV cache (llama.cpp's per-sequence state API).

Blob format, version 3 (all integers little-endian; documented in
``docs/protocol-notes.md``)::

    offset  size        field
    0       4           magic  b"HYKV"
    4       2           format version (3; version 2 blobs are still read)
    6       2           kv_format: 1 = one KV stream (portable across n_parallel),
                        0 = llama.cpp's raw sequence state (same n_parallel only)
    8       4           n_tokens: tokens in the slot's KV cache (= n_past)
    12      32          model hash: raw SHA-256 of the GGUF file
    44      8           kv_len: bytes of llama.cpp sequence state that follow the tokens
    52      8           checksum: XXH3-64 of bytes 0..51 and of every byte after 60
    60      32          KV identity hash: raw SHA-256 of the identity JSON     (version 3)
    92      4           ident_len: bytes of the identity JSON                   (version 3)
    96      ident_len   the KV identity, canonical JSON (engine/kv/kv_identity.py) (version 3)
    ...     4*n_tokens  the slot's tokens (u32 each)
    ...     kv_len      llama_state_seq_get_data() output for the slot's sequence
    ...     4           extra_len: bytes of the drafters' state that follow     (version 4)
    ...     extra_len   the slot's speculative-decoding state (``draft-mtp``'s MTP sequence;
                        :meth:`~hydra_trio.engine.speculative.base.Drafter.get_state`)  (version 4)

A node writes version 4 only when its drafters keep state for the slot (``--spec-type draft-mtp``,
``draft-simple``), else version 3, so a node without them reads what it is sent; a node that does not
speculate restores a version 4 blob's KV and ignores the drafters' part.

Version 2 has no identity (its tokens start at 60): such a blob restores
only on a node whose model file has the same hash.  A version 3 blob from
another file restores when both files have the same KV identity and the node
allows cross-model KV (``--allow-cross-model-kv``); a different identity is
always refused, naming the first fact that differs.  A blob whose KV cache
types (``-ctk`` / ``-ctv``, the identity's ``type_k`` / ``type_v``) differ
from this node's is refused first, even from the same file, as a bad request
(:class:`KvTypesDiffer`: HTTP 400, Hydra BAD_REQUEST) naming both pairs.

The checksum covers the whole blob but itself, so a flipped bit anywhere (KV
bytes, token ids, lengths, the model hash) is refused before the slot is
touched (:func:`verify_checksum`).  A blob with ``n_tokens`` 0 is an empty
slot's state: restoring it empties the slot.

llama.cpp's sequence state (this version, non-unified KV cache) is
``[u32 0xaf143cd8][i32 seq_id][u32 n_stream]`` then, per stream,
``[u32 cell_count]`` and that stream's cells; a sequence's cells all sit in
one stream.  Restoring needs the
target context's own ``n_stream`` (= its ``n_parallel``), so the blob keeps
only the one stream (``kv_format`` 1) and the restore frames it again for
the target.  That is what lets a slot move between nodes with different slot
counts.

A blob is checked whole (magic, version, lengths, model hash, token count
against the slot's context) *before* anything touches the slot, and the
restore is all or nothing: when llama.cpp rejects the KV bytes, the slot's
previous state is put back.
"""

from __future__ import annotations

import array
import ctypes
import json
import logging
import struct
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import llama_cpp
import trio
import xxhash

from ...errors import HydraTrioError, InvalidRequest
from ..settings import kv_type_name
from .blobbuf import TAIL_ROOM, BlobBuffer, BlobPool
from .kv_identity import canonical, first_difference, identity_hash, kv_identity

if TYPE_CHECKING:
    from ..batching.slots import Slot
    from ..llama.model import LoadedModel

BLOB_MAGIC = b"HYKV"
BLOB_VERSION = 3
BLOB_VERSION_EXTRA = 4  # version 3 and the drafters' state after the KV bytes
READ_VERSIONS = (2, 3, 4)
_EXTRA_LEN = struct.Struct("<I")
MAX_EXTRA = 1 << 31  # bytes of drafters' state a blob may carry
_HEADER = struct.Struct("<4sHHI32sQQ")
HEADER_SIZE = _HEADER.size  # 60 bytes: the part every version has
_IDENT = struct.Struct("<32sI")  # version 3: identity hash, identity JSON length
MAX_IDENTITY_JSON = 1 << 16  # bytes
_CHECKSUM_AT = 52  # the u64 checksum: bytes 52..59

log = logging.getLogger("hydra_trio.engine")


class StateError(HydraTrioError):
    """A blob that cannot be applied; ``meta`` holds extra keys for the error reply.

    HTTP 400, as llama-server answers a slot file it cannot restore ("Unable to restore slot",
    ``ERROR_TYPE_INVALID_REQUEST``, tools/server/server-context.cpp); Hydra ERROR, as docs/hydra-protocol.md §3
    has STATE_PUT refuse another model's blob (with ``expected_hash`` / ``got_hash``)."""

    http_status = 400

    def __init__(self, message: str, **meta: object) -> None:
        super().__init__(message)
        self.meta = meta

    def wire_meta(self) -> dict[str, object]:
        return dict(self.meta)


class KvTypesDiffer(StateError, InvalidRequest):
    """A blob of a node with other KV cache types: ``"KV cache types differ: blob K q8_0 / V q8_0, this
    node K f16 / V f16"`` (HTTP 400, Hydra BAD_REQUEST; meta ``kv_identity_match`` false)."""

    http_status = 400
    hydra_status = InvalidRequest.hydra_status


def check_kv_types(identity: dict, blob_identity: dict) -> None:
    """Raise :class:`KvTypesDiffer` when the blob's KV identity has other K/V cache types than ``identity``."""
    ours = (identity.get("type_k"), identity.get("type_v"))
    theirs = (blob_identity.get("type_k"), blob_identity.get("type_v"))
    if ours != theirs:

        def name(t: object) -> str:
            return kv_type_name(t) if isinstance(t, int) else repr(t)

        raise KvTypesDiffer(
            f"KV cache types differ: blob K {name(theirs[0])} / V {name(theirs[1])}, "
            f"this node K {name(ours[0])} / V {name(ours[1])}",
            kv_identity_match=False,
            kv_cache_types={
                "blob": {"type_k": name(theirs[0]), "type_v": name(theirs[1])},
                "node": {"type_k": name(ours[0]), "type_v": name(ours[1])},
            },
        )


@attrs.frozen
class BlobHeader:
    """The fixed part of a blob (see the module docstring)."""

    n_tokens: int
    model_hash: str  # 64 hex digits
    kv_len: int
    kv_format: int = 1
    checksum: int = 0
    version: int = BLOB_VERSION
    kv_identity_hash: str | None = None  # 64 hex digits; None in a version 2 blob
    kv_identity: dict | None = None
    tokens_at: int = HEADER_SIZE  # where the token list starts
    extra_len: int = 0  # version 4: bytes of the drafters' state after the KV bytes

    @property
    def kv_end(self) -> int:
        """Where the KV bytes end (a version 4 blob's drafters' part follows)."""
        return self.tokens_at + 4 * self.n_tokens + self.kv_len

    @property
    def total_size(self) -> int:
        return self.kv_end + (_EXTRA_LEN.size + self.extra_len if self.version >= BLOB_VERSION_EXTRA else 0)


@attrs.frozen
class Restored:
    """What a restore did: the slot's ``n_past`` and whether the blob came from this very file
    (``model_hash_match``) and from a file with this KV layout (``kv_identity_match``)."""

    n_past: int
    model_hash_match: bool
    kv_identity_match: bool
    extra: bytes | None = None
    """A version 4 blob's drafters' state (None: none came with it)."""


KV_RAW = 0
KV_ONE_STREAM = 1


_SEQ_PREFIX = struct.Struct("<IiI")  # io magic, source seq_id, n_stream (llama-context.cpp)
_IO_MAGIC = 0xAF143CD8


def _one_stream(raw: memoryview) -> memoryview | None:
    """The single stream of a sequence state (see the module docstring), or None.

    None when the layout is not the expected one (then the raw state is kept).
    """
    if len(raw) < _SEQ_PREFIX.size:
        return None
    magic, _seq, n_stream = _SEQ_PREFIX.unpack_from(raw, 0)
    if magic != _IO_MAGIC:
        return None
    pos = _SEQ_PREFIX.size
    for s in range(n_stream):
        if pos + 4 > len(raw):
            return None
        (cells,) = struct.unpack_from("<I", raw, pos)
        if cells:
            end = len(raw) - 4 * (n_stream - s - 1)
            if end < pos or any(raw[end:]):
                return None
            return raw[pos:end]
        pos += 4
    return raw[pos - 4 : pos] if n_stream else None  # every stream empty: one "0 cells" stream


Blob = bytes | bytearray | memoryview | BlobBuffer
"""A blob's bytes: in memory, or in a :class:`~hydra_trio.engine.kv.blobbuf.BlobBuffer` (what :func:`save_slot`
returns and the transfer paths receive into)."""


def _bytes(blob: Blob) -> memoryview:
    return blob.view() if isinstance(blob, BlobBuffer) else memoryview(blob).cast("B")


def parse_header(data: Blob) -> BlobHeader:
    """Parse and check the blob's fixed header.

    Raises:
        StateError: too short, wrong magic or an unknown version.
    """
    data = _bytes(data)
    if len(data) < HEADER_SIZE:
        raise StateError(f"state blob too short: {len(data)} bytes, the header alone is {HEADER_SIZE}")
    magic, version, kv_format, n_tokens, digest, kv_len, checksum = _HEADER.unpack_from(data)
    if magic != BLOB_MAGIC:
        # none of its bytes in the message: the blob may be any file (a slot file) that is not one
        raise StateError(f"not a hydra-trio state blob (it does not start with {BLOB_MAGIC!r})")
    if version not in READ_VERSIONS:
        raise StateError(
            f"state blob format version {version} is not supported (this node reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}, whose blobs carry a checksum): fetch the state again "
            "from a node of this version"
        )
    if kv_format not in (KV_RAW, KV_ONE_STREAM):
        raise StateError(f"state blob KV format {kv_format} is not supported")
    header = BlobHeader(
        n_tokens=n_tokens,
        model_hash=digest.hex(),
        kv_len=kv_len,
        kv_format=kv_format,
        checksum=checksum,
        version=version,
    )
    if version == 2:
        return header
    end = HEADER_SIZE + _IDENT.size
    if len(data) < end:
        raise StateError(f"state blob too short: {len(data)} bytes, a version 3 header is at least {end}")
    ident_digest, ident_len = _IDENT.unpack_from(data, HEADER_SIZE)
    if ident_len > MAX_IDENTITY_JSON or len(data) < end + ident_len:
        raise StateError(
            f"state blob's KV identity is {ident_len} bytes: longer than the blob or than {MAX_IDENTITY_JSON}"
        )
    try:
        identity = json.loads(bytes(data[end : end + ident_len]))
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        identity = None
    if not isinstance(identity, dict):
        raise StateError("state blob's KV identity is not a JSON object")
    header = attrs.evolve(header, kv_identity_hash=ident_digest.hex(), kv_identity=identity, tokens_at=end + ident_len)
    if version >= BLOB_VERSION_EXTRA:
        at = header.kv_end
        if len(data) < at + _EXTRA_LEN.size:
            raise StateError(
                f"state blob too short: {len(data)} bytes, its KV bytes end at {at} and the "
                "drafters' state length follows"
            )
        (extra_len,) = _EXTRA_LEN.unpack_from(data, at)
        if extra_len > MAX_EXTRA:
            raise StateError(f"state blob's drafters' state is {extra_len} bytes: more than {MAX_EXTRA}")
        header = attrs.evolve(header, extra_len=extra_len)
    return header


def blob_extra(header: BlobHeader, blob: Blob) -> bytes | None:
    """A checked blob's drafters' state (version 4), copied out; None for an earlier version."""
    if header.version < BLOB_VERSION_EXTRA:
        return None
    at = header.kv_end + _EXTRA_LEN.size
    return bytes(_bytes(blob)[at : at + header.extra_len])


def _check_length(header: BlobHeader, blob: Blob) -> None:
    if header.total_size != len(blob):
        raise StateError(
            f"state blob length {len(blob)} does not match its header ({header.total_size} bytes: "
            f"{header.n_tokens} tokens, {header.kv_len} KV bytes)"
        )


def blob_checksum(blob: Blob) -> int:
    """XXH3-64 of a blob without its checksum field (bytes 0..51 and 60..end).

    xxhash's C code (it releases the GIL), about 10 GB/s from memory, more on bytes still in cache.
    """
    view = _bytes(blob)
    h = xxhash.xxh3_64(view[:_CHECKSUM_AT])
    h.update(view[HEADER_SIZE:])
    return h.intdigest()


class RunningChecksum:
    """:func:`blob_checksum` taken as a blob's bytes arrive, in order (:meth:`update` with each next
    piece), so that a receiver hashes each piece while it is still in cache instead of reading the
    whole blob again afterwards; :attr:`digest` once all ``size`` bytes went through."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()
        self.seen = 0  # bytes fed so far

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        view = memoryview(piece).cast("B")
        start, end = self.seen, self.seen + len(view)
        if start < _CHECKSUM_AT:
            self._h.update(view[: max(0, min(end, _CHECKSUM_AT) - start)])
        if end > HEADER_SIZE:
            self._h.update(view[max(0, HEADER_SIZE - start) :])
        self.seen = end

    @property
    def digest(self) -> int:
        return self._h.intdigest()


def verify_checksum(blob: Blob, running: RunningChecksum | None = None) -> BlobHeader:
    """Check the blob's header and its checksum over every other byte; returns the header.

    Pure CPU work on the bytes (about 10 GB/s): callers run it in a worker
    thread for large blobs, before the engine sees them.  ``running``: the
    checksum already taken as these very bytes arrived (all of them, in
    order); then only the header is read here.

    Raises:
        StateError: a bad header (see :func:`parse_header`), a length that
            does not match the header (a truncated or padded upload) or a
            checksum mismatch (a corrupt or altered blob).
    """
    header = parse_header(blob)
    _check_length(header, blob)
    got = running.digest if running is not None and running.seen == len(blob) else blob_checksum(blob)
    if got != header.checksum:
        raise StateError(
            f"the state blob is corrupt: checksum {got:016x} does not match the header's {header.checksum:016x}",
            expected_checksum=f"{header.checksum:016x}",
            got_checksum=f"{got:016x}",
        )
    return header


INLINE_CHECK = 1 << 20
"""Bytes of a blob to restore not hashed on arrival that are still hashed on the event loop (about 0.1 ms):
a worker thread's round trip costs more than that on a loaded machine."""


async def verify_checksum_off_engine(blob: Blob, running: RunningChecksum | None = None) -> None:
    """:func:`verify_checksum` of a blob to restore (Hydra STATE_PUT, HTTP ``PUT /slots/{id}/state``), from
    the event loop, before the engine thread sees it: on the event loop when ``running`` already hashed all
    of it (only the header is read) or it is at most :data:`INLINE_CHECK` bytes, else in a worker thread.
    Raises StateError."""
    if (running is not None and running.seen == len(blob)) or len(blob) <= INLINE_CHECK:
        verify_checksum(blob, running)
        await trio.lowlevel.checkpoint()
    else:
        await trio.to_thread.run_sync(verify_checksum, blob, running)


def blob_size(m: LoadedModel, slot: Slot) -> int:
    """Bytes a STATE_GET of the slot returns now (header + identity + tokens + one KV stream)."""
    raw = llama_cpp.llama_state_seq_get_size(m.ctx, slot.id)
    one_stream = raw - _SEQ_PREFIX.size - 4 * (m.n_stream - 1)
    return HEADER_SIZE + _IDENT.size + len(canonical(kv_identity(m))) + 4 * slot.n_past + one_stream


def slot_meta(m: LoadedModel, slot: Slot) -> dict[str, object]:
    """Engine thread: STATE_META's keys for a slot (docs/hydra-protocol.md §3), without model identity."""
    return {
        "slot_id": slot.id,
        "n_past": slot.n_past,
        "state_size": blob_size(m, slot),
        "is_processing": slot.is_processing,
    }


def save_slot(
    m: LoadedModel, slot: Slot, model_hash: str, *, pool: BlobPool | None = None, extra: bytes | None = None
) -> tuple[int, BlobBuffer]:
    """Engine thread: the slot's state as one blob.  Returns ``(n_past, blob)``.  ``extra``: the drafters'
    state of the slot (a version 4 blob carries it after the KV bytes).

    llama.cpp writes the sequence state straight into the blob's buffer, placed
    so that the slot's stream lands where the blob's KV bytes go: its 12-byte
    prefix and the other streams' empty counts fall on the token list, which is
    written afterwards.  The KV bytes are copied once (by llama.cpp, which must
    write them somewhere: the C API has no streaming form) and the checksum is
    taken while they are hot.  Peak memory: the blob.  An unexpected layout
    (the cells in another stream than llama.cpp's ``seq_to_stream`` puts them)
    takes a slower path with one more copy.

    ``pool``: where the buffer comes from (a transfer gives it back when sent,
    :meth:`BlobBuffer.release`); None: a buffer of its own.
    """
    tokens = slot.cache_tokens
    id_slot = slot.id
    kv_size = llama_cpp.llama_state_seq_get_size(m.ctx, id_slot)
    identity = kv_identity(m)
    ident = canonical(identity)
    tokens_at = HEADER_SIZE + _IDENT.size + len(ident)
    head = tokens_at + 4 * len(tokens)
    stream = id_slot if m.n_stream > 1 else 0  # llama.cpp keeps sequence i in stream i (non-unified KV)
    lead = _SEQ_PREFIX.size + 4 * stream  # the bytes before that stream's cell count
    at = max(head - lead, 0)
    tail = _EXTRA_LEN.size + len(extra) if extra else 0  # a version 4 blob's drafters' part
    size = at + kv_size + tail
    blob = pool.take(size, populate=True) if pool is not None else BlobBuffer(size, populate=True)
    whole = blob.whole()
    raw = (ctypes.c_uint8 * kv_size).from_buffer(whole, at)
    try:
        written = llama_cpp.llama_state_seq_get_data(m.ctx, raw, kv_size, id_slot)
    finally:
        del raw
    body = _stream_at(whole[at : at + written], stream, m.n_stream) if at == head - lead else None
    if body is not None:
        kv_format = KV_ONE_STREAM
        blob.size = head + body
    else:  # another layout: the raw state (or the stream _one_stream finds) moves to its place at ``head``
        state_bytes = bytes(whole[at : at + written])
        one = _one_stream(memoryview(state_bytes))
        kv_format = KV_ONE_STREAM if one is not None else KV_RAW
        kv = one if one is not None else memoryview(state_bytes)
        if head + len(kv) + tail + TAIL_ROOM > blob.capacity:
            blob.release()
            blob = pool.take(head + len(kv) + tail) if pool is not None else BlobBuffer(head + len(kv) + tail)
            whole = blob.whole()
        whole[head : head + len(kv)] = kv
        blob.size = head + len(kv)
    kv_len = blob.size - head
    if extra:
        whole = blob.whole()
        _EXTRA_LEN.pack_into(whole, blob.size, len(extra))
        whole[blob.size + _EXTRA_LEN.size : blob.size + tail] = extra
        blob.size += tail
    view = blob.view()
    _HEADER.pack_into(
        view,
        0,
        BLOB_MAGIC,
        BLOB_VERSION_EXTRA if extra else BLOB_VERSION,
        kv_format,
        len(tokens),
        bytes.fromhex(model_hash),
        kv_len,
        0,
    )
    _IDENT.pack_into(view, HEADER_SIZE, bytes.fromhex(identity_hash(identity)), len(ident))
    view[HEADER_SIZE + _IDENT.size : tokens_at] = ident
    view[tokens_at:head] = (
        array.array("I", tokens).tobytes() if sys.byteorder == "little" else struct.pack(f"<{len(tokens)}I", *tokens)
    )
    struct.pack_into("<Q", view, _CHECKSUM_AT, blob_checksum(view))
    return len(tokens), blob


def _stream_at(raw: memoryview, stream: int, n_stream: int) -> int | None:
    """Bytes of the one stream ``stream`` of a sequence state (its count and cells), when every other
    stream is empty and the prefix is llama.cpp's; None otherwise (see the module docstring)."""
    lead, tail = _SEQ_PREFIX.size + 4 * stream, 4 * (n_stream - stream - 1)
    if len(raw) < lead + 4 + tail:
        return None
    magic, _seq, n = _SEQ_PREFIX.unpack_from(raw, 0)
    if magic != _IO_MAGIC or n != n_stream or any(raw[_SEQ_PREFIX.size : lead]):
        return None
    (cells,) = struct.unpack_from("<I", raw, lead)
    if cells == 0:  # an empty slot: every stream must say "no cells"; it keeps one such count
        return 4 if len(raw) == _SEQ_PREFIX.size + 4 * n_stream and not any(raw[lead:]) else None
    if tail and any(raw[len(raw) - tail :]):
        return None
    return len(raw) - lead - tail


def check_blob(
    blob: Blob,
    model_hash: str,
    n_ctx_slot: int,
    *,
    identity: dict | None = None,
    allow_cross_model_kv: bool = False,
    checksum_verified: bool = False,
) -> BlobHeader:
    """Check a whole blob against this node before applying it: its model (``model_hash``, and
    ``identity``, this model's KV identity), slots of ``n_ctx_slot`` tokens.

    ``checksum_verified``: the caller already ran :func:`verify_checksum` on
    these very bytes (off the engine thread); otherwise it runs here.

    Raises:
        StateError: a bad header, a checksum mismatch, a length mismatch
            (truncated or padded upload), more tokens than a slot's context
            holds, or a blob of another file (meta ``expected_hash`` /
            ``got_hash``, ``kv_identity_match``): refused when the node does
            not allow cross-model KV, when the blob carries no KV identity
            (version 2) and always when the identities differ (the message
            names the first fact that differs); :class:`KvTypesDiffer`
            (also an InvalidRequest) for other KV cache types, checked first.
    """
    header = parse_header(blob) if checksum_verified else verify_checksum(blob)
    if header.kv_identity is not None and identity is not None:
        check_kv_types(identity, header.kv_identity)
    if header.model_hash != model_hash:
        hashes = {"expected_hash": model_hash, "got_hash": header.model_hash}
        if header.kv_identity is None or identity is None:
            raise StateError(
                "the state blob was made by another model (and carries no KV identity: a version 2 blob)",
                **hashes,
                kv_identity_match=False,
            )
        diff = first_difference(identity, header.kv_identity)
        if diff is not None or header.kv_identity_hash != identity_hash(identity):
            raise StateError(
                f"the state blob was made by a model with another KV layout ({diff or 'hash'})",
                **hashes,
                kv_identity_match=False,
            )
        if not allow_cross_model_kv:
            raise StateError(
                "the state blob was made by another model file with the same KV identity; this "
                "node does not take KV from other files (--allow-cross-model-kv, or CONFIGURE "
                "allow_cross_model_kv)",
                **hashes,
                kv_identity_match=True,
            )
    _check_length(header, blob)
    if header.n_tokens >= n_ctx_slot:
        raise StateError(f"the blob holds {header.n_tokens} tokens; a slot's context holds {n_ctx_slot}")
    return header


def restore_slot(
    m: LoadedModel,
    slot: Slot,
    blob: bytearray | BlobBuffer,
    model_hash: str,
    *,
    allow_cross_model_kv: bool = False,
    checksum_verified: bool = False,
    make_room: Callable[[], bool] | None = None,
) -> Restored:
    """Engine thread: apply a checked blob to an idle slot, all or nothing.

    Memory: the blob (a bytearray, or a :class:`BlobBuffer` with its tail
    room) is framed for llama.cpp in place (it is consumed: its bytes are
    changed), so the restore holds the blob plus, when the slot already held
    tokens, a backup of its old state.  An empty slot's blob
    (``n_tokens`` 0) empties the slot.

    ``make_room``: called when llama.cpp finds no room for the blob's cells (a unified KV cache that
    other slots fill); True when it freed some, and the restore is tried again.

    Raises:
        StateError: the blob is invalid or of a model it may not restore on
            (see :func:`check_blob`) or llama.cpp rejected its KV bytes; in
            every case the slot is as it was.
    """
    identity = kv_identity(m)
    header = check_blob(
        blob,
        model_hash,
        slot.n_ctx,
        identity=identity,
        allow_cross_model_kv=allow_cross_model_kv,
        checksum_verified=checksum_verified,
    )
    same_file = header.model_hash == model_hash
    same_layout = same_file or header.kv_identity_hash == identity_hash(identity)
    id_slot = slot.id
    view = _bytes(blob)
    tokens = array.array("I")
    tokens.frombytes(view[header.tokens_at : header.tokens_at + 4 * header.n_tokens])
    if sys.byteorder != "little":
        tokens.byteswap()
    bad = max(tokens, default=-1)
    if bad >= m.n_vocab:
        raise StateError(f"the blob holds token id {bad}, outside the vocabulary (0..{m.n_vocab - 1})")
    extra = blob_extra(header, blob)  # before the KV bytes are framed in place, which writes past them
    if not tokens:  # an empty slot's state: "this slot is now empty"
        _check_empty_kv(header, view[header.tokens_at : header.kv_end])
        llama_cpp.llama_memory_seq_rm(m.memory, id_slot, -1, -1)
        slot.cache_tokens.clear()
        return Restored(0, same_file, same_layout, extra)
    backup = save_slot(m, slot, model_hash)[1] if slot.n_past else None  # an empty slot needs no backup
    del view
    applied = _apply_kv(m, id_slot, header, blob)
    while not applied and make_room is not None and make_room():
        applied = _apply_kv(m, id_slot, header, blob)  # framing the blob again writes the same bytes
    if not applied:
        # llama.cpp cleared the sequence on failure: put the old state back, and check that it went back
        llama_cpp.llama_memory_seq_rm(m.memory, id_slot, -1, -1)
        if backup is None or put_back(m, id_slot, backup):
            raise StateError(
                "llama.cpp rejected the KV state (see the node's log); the slot is unchanged", slot_cleared=False
            )
        # even the put-back failed: the slot must claim no token its KV cache does not hold
        lost = len(slot.cache_tokens)
        llama_cpp.llama_memory_seq_rm(m.memory, id_slot, -1, -1)
        slot.cache_tokens.clear()
        log.error(
            "slot %d: llama.cpp rejected a restored KV state and then the slot's own backup; the slot "
            "is cleared (%d tokens dropped)",
            id_slot,
            lost,
        )
        raise StateError(
            f"llama.cpp rejected the KV state (see the node's log), and putting the slot's previous state back "
            f"failed too: the slot is now empty ({lost} tokens dropped)",
            slot_cleared=True,
            n_past=0,
        )
    slot.cache_tokens[:] = tokens.tolist()
    return Restored(len(tokens), same_file, same_layout, extra)


def put_back(m: LoadedModel, id_slot: int, backup: bytearray | BlobBuffer) -> bool:
    """Engine thread: restore a slot's own backup (:func:`save_slot` output) after a failed restore;
    True when the KV cache holds the backup's tokens again (the backup is consumed)."""
    return _apply_kv(m, id_slot, parse_header(backup), backup)


def _check_empty_kv(header: BlobHeader, kv: memoryview) -> None:
    """An empty slot's KV bytes must say "no cells" in every stream; StateError otherwise."""
    counts = kv
    if header.kv_format == KV_RAW:
        if len(kv) < _SEQ_PREFIX.size or _SEQ_PREFIX.unpack_from(kv, 0)[0] != _IO_MAGIC:
            raise StateError("the blob has no tokens but its KV state is not llama.cpp's sequence state")
        counts = kv[_SEQ_PREFIX.size :]
    if len(counts) < 4 or len(counts) % 4 or any(counts):
        raise StateError("the blob has no tokens but its KV state holds cells")


def _apply_kv(m: LoadedModel, id_slot: int, header: BlobHeader, blob: bytearray | BlobBuffer) -> bool:
    """Hand the blob's KV bytes to llama.cpp; True when the slot now holds exactly the blob's tokens.

    A one-stream blob is framed in place: the 12-byte sequence-state prefix
    overwrites the end of the (already parsed) token list and the empty
    streams' counts follow the KV bytes as zeros (appended to a bytearray,
    written into a BlobBuffer's tail room), so no second copy of the KV bytes is made.
    """
    start = header.tokens_at + 4 * header.n_tokens
    end = start + header.kv_len
    pad = 4 * (m.n_stream - 1) if header.kv_format == KV_ONE_STREAM else 0
    begin = start - _SEQ_PREFIX.size if header.kv_format == KV_ONE_STREAM else start  # the header alone is 60 bytes
    if isinstance(blob, BlobBuffer):
        target = blob.whole()
        if end + pad > len(target):
            raise StateError(f"the state blob's buffer has no room for {m.n_stream} KV streams")
        target[end : end + pad] = bytes(pad)
    else:
        del blob[end:]
        blob.extend(bytes(pad))
        target = memoryview(blob)
    if header.kv_format == KV_ONE_STREAM:
        _SEQ_PREFIX.pack_into(target, begin, _IO_MAGIC, id_slot, m.n_stream)
    size = end + pad - begin
    buf = (ctypes.c_uint8 * size).from_buffer(target, begin)
    read = llama_cpp.llama_state_seq_set_data(m.ctx, buf, size, id_slot)
    del buf, target
    # the KV must hold exactly positions 0..n_tokens-1 for the token list to be true
    pos_max = llama_cpp.llama_memory_seq_pos_max(m.memory, id_slot)
    return read == size and pos_max == header.n_tokens - 1

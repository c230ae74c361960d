"""Async Hydra protocol client: the engine opcodes of docs/hydra-protocol.md §3
over one persistent trio TCP connection.

Usage::

    async with HydraClient("127.0.0.1", 8080, timeout=30.0) as c:
        info = await c.info()
        meta = await c.state_get_to_file(0, "slot0.kv")
        await c.state_put_from_file(1, "slot0.kv")
        tokens = await c.decode(1, {"n_predict": 16})

    client = HydraClient.from_address("10.0.0.5:8080")   # same thing

The package is split by concern; this module re-exports every public name so
that ``from hydra_trio.hydra.client import ...`` keeps working:

- `hydra_trio.hydra.client_connection`: the connection and its rules (one
  request at a time, every reply read to its end, timeouts, what closes
  it), the generic requests, `CHUNK_SIZE`, `new_trace_id`.
- `hydra_trio.hydra.streams`: `ResponseStream`, `DecodeStream`,
  `HydraReply`, `DecodeFrame`.
- `hydra_trio.hydra.errors`: `HydraError` and its subclasses,
  `HydraConnectError`, `error_for_status`.

All sizes are in bytes, all times in seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import struct
from collections.abc import Mapping
from typing import Any

import trio

from ..protocol.hydra import Op
from .client_connection import CHUNK_SIZE, HydraConnection, Payload, new_trace_id
from .errors import (
    HydraBadRequest,
    HydraBusy,
    HydraConnectError,
    HydraConnectionClosed,
    HydraError,
    HydraNotFound,
    HydraNotImplemented,
    HydraPartial,
    HydraProtocolError,
    HydraServerError,
    HydraTimeout,
    error_for_status,
)
from .streams import DecodeFrame, DecodeStream, HydraReply, ResponseStream

__all__ = [
    "CHUNK_SIZE",
    "DecodeFrame",
    "DecodeStream",
    # HydraError and its subclasses, HydraConnectError, error_for_status (all of .errors)
    "HydraBadRequest",
    "HydraBusy",
    "HydraClient",
    "HydraConnectError",
    "HydraConnection",
    "HydraConnectionClosed",
    "HydraError",
    "HydraNotFound",
    "HydraNotImplemented",
    "HydraPartial",
    "HydraProtocolError",
    "HydraReply",
    "HydraServerError",
    "HydraTimeout",
    "ResponseStream",
    "error_for_status",
    "new_trace_id",
]


def _json_bytes(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _slot_key(slot: int) -> str:
    if not isinstance(slot, int) or isinstance(slot, bool):
        raise TypeError(f"slot must be an int, got {type(slot).__name__}")
    return str(slot)


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class HydraClient(HydraConnection):
    """A Hydra engine client over one persistent TCP connection.

    Constructor, `from_address`, `connect` / `aclose` / ``async with``, the
    connection rules and the generic requests (`open_request`,
    `open_request_from_file`, `exchange`, `request`) come from
    `HydraConnection`: ``HydraClient(host, port, *, timeout=30.0,
    reconnect=False, max_meta=None, token=None)`` (``token``: the node's
    ``--hydra-token``, presented on every new connection). This class adds one method per
    engine opcode (docs/hydra-protocol.md §3).

    Every request method takes ``trace_id`` (str; default: a fresh
    `new_trace_id`), sent in the request frame for log correlation
    (docs/hydra-protocol.md §2). Slot methods send the slot id in decimal as the
    key; engine-wide methods send key ``""``.

    Every request method can raise: the `HydraError` subclass of a non-OK
    status (connection still usable), `HydraTimeout`,
    `HydraConnectionClosed`, `HydraProtocolError` (connection closed),
    `HydraConnectError` (an OSError) when (re)connecting fails, ValueError /
    TypeError for arguments that cannot be encoded.
    """

    async def _meta(
        self, op: int, key: str = "", payload: Payload = b"", trace_id: str | None = None
    ) -> dict[str, Any]:
        meta, _ = await self.request(op, key, payload, trace_id)
        return meta

    # -- typed opcodes (docs/hydra-protocol.md §3) -----------------------------------

    async def info(self, *, trace_id: str | None = None) -> dict[str, Any]:
        """INFO (0x41): the engine description (``engine``, ``version``,
        ``capabilities``, ``mode``, ``peer_addr``, ... see §3)."""
        return await self._meta(Op.INFO, "", b"", trace_id)

    async def state_meta(self, slot: int, *, trace_id: str | None = None) -> dict[str, Any]:
        """STATE_META (0x32): ``slot_id``, ``n_past`` (tokens),
        ``state_size`` (bytes), ``is_processing``, model identity. Raises
        `HydraNotFound` for a slot out of range."""
        return await self._meta(Op.STATE_META, _slot_key(slot), b"", trace_id)

    def state_get(self, slot: int, *, trace_id: str | None = None) -> ResponseStream:
        """STATE_GET (0x30), streamed::

            async with client.state_get(0) as r:
                r.meta          # n_past, state_size, model identity
                r.payload_len   # bytes of KV state
                async for chunk in r: ...

        A non-OK status raises on entry (e.g. `HydraNotFound`)."""
        return self.open_request(Op.STATE_GET, _slot_key(slot), b"", trace_id)

    async def state_get_to_file(
        self,
        slot: int,
        path: str | os.PathLike[str],
        *,
        trace_id: str | None = None,
        fsync: bool = False,
    ) -> dict[str, Any]:
        """STATE_GET (0x30) streamed into the file at ``path``; returns the
        meta. Chunks are written as they arrive (memory stays about
        `CHUNK_SIZE`) to a temporary file in the same directory, renamed to
        ``path`` once the whole payload is in (``fsync``: flush it to disk
        first). On any error the temporary file is removed and ``path`` is
        left untouched. Raises what the request raises, and OSError for
        file errors."""
        target = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(target))  # noqa: ASYNC240  (no I/O but getcwd)
        tmp = os.path.join(directory, f".{os.path.basename(target)}.{secrets.token_hex(4)}.part")
        try:
            async with (
                self.state_get(slot, trace_id=trace_id) as rs,
                await trio.open_file(tmp, "wb") as f,
            ):
                async for chunk in rs:
                    await f.write(chunk)
                if fsync:
                    await f.flush()
                    await trio.to_thread.run_sync(os.fsync, f.fileno())  # blocking file I/O: off the loop
            await trio.to_thread.run_sync(os.replace, tmp, target)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_unlink_quiet, tmp)
            raise
        return rs.meta

    async def state_get_into(
        self, slot: int, buffer: bytearray | memoryview | None = None, *, trace_id: str | None = None
    ) -> tuple[dict[str, Any], memoryview]:
        """STATE_GET (0x30) into one buffer: ``(meta, blob)``, ``blob`` a view of the state's bytes at
        the start of ``buffer`` (None: a bytearray of the state's size is made).  On a plain TCP
        connection the socket writes straight into the buffer (`ResponseStream.receive_into`): the
        fastest way to read a large state into memory.  Raises ValueError when ``buffer`` is read-only
        or smaller than the state (the payload is drained first: the connection stays usable)."""
        async with self.state_get(slot, trace_id=trace_id) as rs:
            if buffer is None:
                buffer = bytearray(rs.payload_len)
            view = memoryview(buffer).cast("B")
            if view.readonly or len(view) < rs.payload_len:
                await rs.drain()
                raise ValueError(
                    f"STATE_GET of slot {slot}: the buffer must be writable and hold "
                    f"{rs.payload_len} bytes ({'read-only' if view.readonly else f'{len(view)} bytes'})"
                )
            n = await rs.receive_into(view)
        return rs.meta, view[:n]

    async def state_get_bytes(self, slot: int, *, trace_id: str | None = None) -> tuple[dict[str, Any], bytes]:
        """STATE_GET (0x30) into memory: ``(meta, state_blob)``. Only for
        small states; use `state_get_to_file` for real ones."""
        return await self.request(Op.STATE_GET, _slot_key(slot), b"", trace_id)

    async def state_put(
        self, slot: int, data: bytes | bytearray | memoryview, *, trace_id: str | None = None
    ) -> dict[str, Any]:
        """STATE_PUT (0x31) of an in-memory blob (sent in `CHUNK_SIZE`
        pieces). Returns meta (``restored``, ``bytes``, ``n_past``, model
        identity). A blob from another model raises `HydraServerError` with
        ``expected_hash`` / ``got_hash`` in meta."""
        return await self._meta(Op.STATE_PUT, _slot_key(slot), data, trace_id)

    async def state_put_from_file(
        self, slot: int, path: str | os.PathLike[str], *, trace_id: str | None = None
    ) -> dict[str, Any]:
        """STATE_PUT (0x31) streamed from the file at ``path`` (its size is
        the payload_len; read and sent in `CHUNK_SIZE` pieces). Returns
        meta as `state_put`. Raises OSError for file errors (before anything
        is sent when the file cannot be opened)."""
        async with self.open_request_from_file(Op.STATE_PUT, _slot_key(slot), path, trace_id) as rs:
            await rs.drain()
        return rs.meta

    async def configure(self, params: Mapping[str, Any], *, trace_id: str | None = None) -> dict[str, Any]:
        """CONFIGURE (0x40) with a JSON object of engine/sampling params.
        Returns meta: ``success``, ``tier``, ``params_applied``,
        ``deferred_keys``, ``unrecognized_keys``, ``state_chunk_size_applied``
        (bytes) when that key was sent."""
        return await self._meta(Op.CONFIGURE, "", _json_bytes(params), trace_id)

    async def prefill(
        self, slot: int, body: Mapping[str, Any], *, trace_id: str | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """PREFILL (0x42) with an OpenAI chat-completions body (``messages``
        required). Returns ``(meta, kv_state_blob)``; meta has ``n_past``,
        ``tokens_processed``, ``prefill_ms`` (milliseconds), model identity,
        ``model_fallback``."""
        return await self.request(Op.PREFILL, _slot_key(slot), _json_bytes(body), trace_id)

    def decode_stream(self, slot: int, body: Mapping[str, Any], *, trace_id: str | None = None) -> DecodeStream:
        """DECODE (0x43), tokens as they arrive: see `DecodeStream` (its
        `~DecodeStream.stop_reason` says why generation stopped). ``body``
        is ``{"n_predict": N, "messages": [...]}`` or a full chat body."""
        return DecodeStream(self.open_request(Op.DECODE, _slot_key(slot), _json_bytes(body), trace_id))

    async def decode(self, slot: int, body: Mapping[str, Any], *, trace_id: str | None = None) -> list[DecodeFrame]:
        """DECODE (0x43) to completion: the real token frames
        ``[(token_id, logprob, flags), ...]``, the last with
        `DECODE_FLAG_FINAL` when the engine marked one; padding dropped."""
        async with self.decode_stream(slot, body, trace_id=trace_id) as s:
            async for _ in s:
                pass
        return s.tokens

    async def set_expert_mode(
        self, mode: str, peer: str | None = None, *, trace_id: str | None = None
    ) -> dict[str, Any]:
        """SET_EXPERT_MODE (0x44): ``mode`` is ``"solo"`` or ``"combined"``
        (sent raw when ``peer`` is None, else as JSON ``{"mode", "peer"}``,
        peer ``"host:port"``). Returns meta ``success``, ``mode`` (the mode
        in effect: ``"solo"`` plus ``fallback_reason`` when combined had no
        usable peer), ``peer``. Raises `HydraBusy` (meta ``busy_slots``)
        while slots are processing, `HydraBadRequest` for a bad mode/peer."""
        payload = mode.encode("utf-8") if peer is None else _json_bytes({"mode": mode, "peer": peer})
        return await self._meta(Op.SET_EXPERT_MODE, "", payload, trace_id)

    async def swap_quant(self, quant_key: str, tensor_pattern: str, *, trace_id: str | None = None) -> dict[str, Any]:
        """SWAP_QUANT (0x45), payload ``[u16 LE len][quant_key][tensor_pattern]``.
        Returns meta ``swapped``, ``bytes``, ``swap_ms``, ``kv_preserved``;
        may raise `HydraNotImplemented`. ValueError when quant_key is over
        65535 UTF-8 bytes."""
        qk = quant_key.encode("utf-8")
        if len(qk) > 0xFFFF:
            raise ValueError(f"quant_key is {len(qk)} bytes, at most 65535 fit")
        payload = struct.pack("<H", len(qk)) + qk + tensor_pattern.encode("utf-8")
        return await self._meta(Op.SWAP_QUANT, "", payload, trace_id)

    async def pipeline_attach(self, peer: str, ot_split: str, *, trace_id: str | None = None) -> dict[str, Any]:
        """PIPELINE_ATTACH (0x46) with JSON ``{"peer": "host:port",
        "ot_split": "<regex>"}``. May raise `HydraNotImplemented`."""
        return await self._meta(Op.PIPELINE_ATTACH, "", _json_bytes({"peer": peer, "ot_split": ot_split}), trace_id)

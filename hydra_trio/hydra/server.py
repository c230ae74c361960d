"""The Hydra binary protocol, server side: one persistent connection, one request at a time.

Framing rules (hydra-protocol.md §2, the **[fix]** rows included): every
request gets exactly one well-formed reply, non-OK replies carry
``{"error": ...}``; a payload is always consumed before the next header
(over its cap: reply BAD_REQUEST, then close); bad magic closes without a
reply; unknown and Store opcodes answer NOT_IMPLEMENTED and the connection
stays usable.  Opcodes: hydra-protocol.md §3.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import trio

from .. import __version__
from ..control import Busy, Change, ControlChannel
from ..engine.engine import Engine, EngineNotReady
from ..engine.combined import DEFAULT_PATTERN
from ..engine.slots import CompletionJob, Failed, Finished, SlotAssigned, TextDelta
from ..engine.state import StateError, restore_slot, save_slot, slot_meta, verify_checksum
from ..api.schemas import ChatCompletionRequest, CompletionRequest, RequestError, structure_body
from ..api.jobs import job_continue, job_from_chat
from ..models.presets import PRESETS
from ..protocol import messages as msg
from ..ggml_rpc.backend import RpcBackend
from ..protocol.hydra import (
    BadMagic,
    DecodeFramer,
    FrameTooLarge,
    Op,
    PayloadChunk,
    ProtocolError,
    RequestDecoder,
    RequestEnded,
    RequestStarted,
    Status,
    encode_response,
    encode_response_header,
    is_store_op,
)

log = logging.getLogger("hydra_trio.hydra")
T = TypeVar("T")

_SLOT_ID = re.compile(r"0|-?[1-9][0-9]{0,8}", re.ASCII)  # plain ASCII decimal: no "+", spaces, padding or "_"


@attrs.frozen
class HydraSettings:
    """Limits of the Hydra protocol (bytes and seconds), hydra-protocol.md §2.

    Attributes:
        max_json_payload: cap on JSON payloads (64 MiB).
        max_state_payload: cap on STATE_PUT payloads (4 GiB).
        idle_timeout: seconds a connection may sit between requests.
        request_timeout: seconds of no progress inside a request before closing.
        chunk_size: bytes per send when streaming a state blob (256 KiB).
        decode_default: DECODE frame budget when the body gives none.
        decode_cap: the most frames one DECODE may announce.
    """

    max_json_payload: int = 64 * 1024 * 1024
    max_state_payload: int = 4 * 1024 * 1024 * 1024
    idle_timeout: float = 120.0
    request_timeout: float = 30.0
    chunk_size: int = 256 * 1024
    decode_default: int = 128
    decode_cap: int = 8192


class Reply(Exception):
    """Raised by an op handler to send a non-OK reply: ``status`` and ``meta`` (with ``error``)."""

    def __init__(self, status: Status, error: str, **meta: Any) -> None:
        super().__init__(error)
        self.status = status
        self.meta = {"error": error, **meta}


@attrs.define
class _Request:
    op: int
    key: str
    trace_id: str
    flags: int
    payload_len: int
    key_error: str | None
    payload: bytearray = attrs.field(factory=bytearray)


class NodeState:
    """Per-node protocol settings that CONFIGURE changes (the engine holds the rest)."""

    def __init__(self) -> None:
        self.state_chunk_size = 256 * 1024


class HydraHandler:
    """Serves Hydra connections for one engine (``None``: a node without a model)."""

    def __init__(
        self,
        engine: Engine | None,
        control: ControlChannel | None,
        settings: HydraSettings = HydraSettings(),
        node: NodeState | None = None,
        rpc: RpcBackend | None = None,
    ) -> None:
        self.engine = engine
        self.rpc = rpc
        self.control = control
        self.settings = settings
        self.node = node or NodeState()
        self.requests = 0
        self.draining = False
        self._idle_scopes: set[trio.CancelScope] = set()
        self._ops: dict[int, Callable[[_Request, trio.SocketStream], Awaitable[None]]] = {
            Op.STATE_GET: self._state_get,
            Op.STATE_PUT: self._state_put,
            Op.STATE_META: self._state_meta,
            Op.CONFIGURE: self._configure,
            Op.INFO: self._info,
            Op.PREFILL: self._prefill,
            Op.DECODE: self._decode,
            Op.SET_EXPERT_MODE: self._set_expert_mode,
            Op.SWAP_QUANT: self._swap_quant,
            Op.PIPELINE_ATTACH: self._pipeline_attach,
        }

    def _max_payload(self, op: int) -> int:
        return self.settings.max_state_payload if op == Op.STATE_PUT else self.settings.max_json_payload

    # --------------------------------------------------------------- framing
    async def __call__(self, stream: trio.SocketStream) -> None:
        """Serve requests on ``stream`` until the peer closes, a timeout, or a framing error."""
        dec = RequestDecoder(max_payload=self.settings.max_json_payload, max_payload_for=self._max_payload)
        req: _Request | None = None
        header_deadline = math.inf
        while True:
            if req is None and dec.idle:
                deadline = trio.current_time() + self.settings.idle_timeout
                header_deadline = math.inf
            elif req is None:
                # a header (16 bytes + key + trace_id) must arrive whole within the
                # request timeout: one byte every few seconds does not hold a connection
                if header_deadline == math.inf:
                    header_deadline = trio.current_time() + self.settings.request_timeout
                deadline = header_deadline
            else:  # payload: the timeout is per receive (no progress)
                deadline = trio.current_time() + self.settings.request_timeout
            idle = req is None and dec.idle
            if idle and self.draining:
                log.info("hydra: the node is shutting down; closing an idle connection")
                return
            with trio.move_on_at(deadline) as scope:
                if idle:  # between requests: drain() may close it now
                    self._idle_scopes.add(scope)
                try:
                    data = await stream.receive_some(self.settings.chunk_size)
                finally:
                    self._idle_scopes.discard(scope)
            if scope.cancelled_caught:
                if idle and self.draining:
                    log.info("hydra: the node is shutting down; closing an idle connection")
                else:
                    log.info("hydra: connection %s; closed", "idle" if idle else "stalled mid-request")
                return
            if not data:
                if req is not None:
                    log.info("[%s] hydra: peer closed mid-request (op 0x%02x); nothing applied", req.trace_id, req.op)
                return
            error: ProtocolError | None = None
            try:
                events = dec.feed(data)
            except ProtocolError as exc:
                events, error = list(exc.events or []), exc  # requests completed before the bad bytes
            req = await self._handle_events(events, req, stream)
            if error is not None:
                if isinstance(error, FrameTooLarge):
                    h = error.header
                    log.warning("hydra: %s; replying BAD_REQUEST and closing", error)
                    await stream.send_all(
                        encode_response(Status.BAD_REQUEST, {"error": str(error), "op": h.op if h else None})
                    )
                elif isinstance(error, BadMagic):
                    log.warning("hydra: %s; closing without a reply", error)
                else:
                    log.warning("hydra: protocol error: %s; closing", error)
                return
            if req is None and dec.idle:
                header_deadline = math.inf

    def drain(self) -> None:
        """Graceful shutdown: connections close between requests (idle ones now); requests in flight finish."""
        self.draining = True
        for scope in list(self._idle_scopes):
            scope.cancel()

    async def _handle_events(self, events: list[Any], req: _Request | None, stream: trio.SocketStream) -> _Request | None:
        """Feed decoder events into the request in progress; dispatch each completed request."""
        for ev in events:
            if isinstance(ev, RequestStarted):
                h = ev.header
                req = _Request(h.op, ev.key, ev.trace_id, h.flags, h.payload_len, ev.key_error)
            elif isinstance(ev, PayloadChunk):
                assert req is not None
                if _wants_payload(req):
                    req.payload += ev.data
            elif isinstance(ev, RequestEnded):
                assert req is not None
                await self._dispatch(req, stream)
                req = None
        return req

    async def _dispatch(self, req: _Request, stream: trio.SocketStream) -> None:
        self.requests += 1
        t0 = time.perf_counter()
        name = Op(req.op).name if req.op in Op._value2member_map_ else f"0x{req.op:02x}"
        status = Status.OK
        try:
            if req.key_error:
                raise Reply(Status.BAD_REQUEST, req.key_error)
            if req.flags:
                raise Reply(Status.BAD_REQUEST, f"flags 0x{req.flags:02x} are not implemented (compression is not supported)")
            handler = self._ops.get(req.op)
            if handler is None:
                what = "a Store service opcode" if is_store_op(req.op) else "an unknown opcode"
                raise Reply(Status.NOT_IMPLEMENTED, f"opcode 0x{req.op:02x} is {what}; this is an engine node")
            await handler(req, stream)
        except Reply as r:
            status = r.status
            await stream.send_all(encode_response(r.status, r.meta))
        except EngineNotReady as exc:
            status = Status.ERROR
            await stream.send_all(encode_response(Status.ERROR, {"error": str(exc)}))
        finally:
            log.info(
                "[%s] hydra %s key=%r %d bytes -> %s in %.1f ms",
                req.trace_id, name, req.key, req.payload_len, Status(status).name, (time.perf_counter() - t0) * 1e3,
            )

    # ------------------------------------------------------------- helpers
    def _engine(self) -> Engine:
        e = self.engine
        if e is None:
            raise Reply(Status.ERROR, "this node has no model (compute-only): the op needs one")
        if not e.ready:
            raise Reply(Status.ERROR, f"model not ready (stage: {e.stage})", stage=e.stage)
        return e

    def _slot(self, req: _Request) -> tuple[Engine, int]:
        if not _SLOT_ID.fullmatch(req.key):
            raise Reply(Status.BAD_REQUEST, f"key {req.key!r} is not a slot id (a decimal integer)")
        id_slot = int(req.key)
        e = self._engine()
        if not 0 <= id_slot < len(e.slots):
            raise Reply(Status.NOT_FOUND, f"slot {id_slot} not found (this node has slots 0..{len(e.slots) - 1})")
        return e, id_slot

    def _identity(self, e: Engine) -> dict[str, Any]:
        assert e.identity is not None
        return e.identity.as_meta()

    @staticmethod
    def _busy_check(e: Engine, id_slot: int) -> None:
        """Engine thread: NOT_FOUND if the slot is gone (slot count changed), BUSY if it works."""
        if id_slot >= len(e.slots):
            raise Reply(Status.NOT_FOUND, f"slot {id_slot} not found (this node has slots 0..{len(e.slots) - 1})")
        if e.slots[id_slot].is_processing:
            raise Reply(Status.BUSY, f"slot {id_slot} is processing a request", busy_slots=[id_slot])

    async def _send_blob(self, stream: trio.SocketStream, meta: dict[str, Any], blob: bytearray) -> None:
        await stream.send_all(encode_response_header(Status.OK, meta, len(blob)))
        view = memoryview(blob)
        step = self.node.state_chunk_size
        for i in range(0, len(view), step):
            await stream.send_all(view[i : i + step])

    # ------------------------------------------------------------- slot ops
    async def _state_get(self, req: _Request, stream: trio.SocketStream) -> None:
        e, id_slot = self._slot(req)

        def get(engine: Engine) -> tuple[int, bytearray]:
            self._busy_check(engine, id_slot)
            return save_slot(engine, id_slot)

        n_past, blob = await e.call(get)
        meta = {"slot_id": id_slot, "n_past": n_past, "state_size": len(blob), **self._identity(e)}
        await self._send_blob(stream, meta, blob)

    async def _state_put(self, req: _Request, stream: trio.SocketStream) -> None:
        e, id_slot = self._slot(req)
        blob = req.payload
        size = len(blob)  # restore_slot consumes the blob (frames it in place)

        def put(engine: Engine) -> int:
            self._busy_check(engine, id_slot)
            return restore_slot(engine, id_slot, blob, checksum_verified=True)

        try:
            # integrity first, in a worker thread: the engine thread never hashes a multi-GB blob
            await trio.to_thread.run_sync(verify_checksum, blob)
            n_past = await e.call(put)
        except StateError as exc:
            raise Reply(Status.ERROR, str(exc), **exc.meta) from None
        meta = {"restored": True, "slot_id": id_slot, "bytes": size, "n_past": n_past, **self._identity(e)}
        await stream.send_all(encode_response(Status.OK, meta))

    async def _state_meta(self, req: _Request, stream: trio.SocketStream) -> None:
        e, id_slot = self._slot(req)

        body = await e.call(lambda engine: slot_meta(engine, id_slot))
        await stream.send_all(encode_response(Status.OK, {**body, **self._identity(e)}))

    async def _chat_job(
        self, e: Engine, id_slot: int, raw: dict[str, Any], n_predict: int
    ) -> tuple[CompletionJob, bool]:
        """A job for PREFILL / DECODE from an OpenAI chat body; returns (job, model_fallback).

        Templating and tokenization run in a worker thread (they only read the vocabulary).
        """
        body = dict(raw)
        for k in ("n_predict", "max_tokens", "max_completion_tokens", "stream", "id_slot"):
            body.pop(k, None)
        try:
            chat = structure_body(body, ChatCompletionRequest)
            job = await trio.to_thread.run_sync(
                lambda: job_from_chat(e, chat, n_predict=n_predict, id_slot=id_slot)
            )
        except (RequestError, ValueError) as exc:
            raise Reply(Status.BAD_REQUEST, str(exc)) from None
        assert e.identity is not None
        wanted = raw.get("model")
        fallback = isinstance(wanted, str) and wanted not in ("", e.identity.model_alias)
        return job, fallback

    async def _continue_job(
        self, e: Engine, id_slot: int, raw: dict[str, Any], n_predict: int
    ) -> tuple[CompletionJob, bool]:
        """A DECODE job that continues from the slot's KV cache; the body gives only sampling fields."""
        body = {k: v for k, v in raw.items()
                if k not in ("messages", "n_predict", "max_tokens", "max_completion_tokens", "stream", "id_slot")}
        try:
            completion = structure_body(body, CompletionRequest)
            job = job_continue(e, completion, n_predict=n_predict, id_slot=id_slot)
        except (RequestError, ValueError) as exc:
            raise Reply(Status.BAD_REQUEST, str(exc)) from None
        assert e.identity is not None
        wanted = raw.get("model")
        return job, isinstance(wanted, str) and wanted not in ("", e.identity.model_alias)

    async def _run_job(self, e: Engine, job: CompletionJob, on_tokens: Callable[[TextDelta], Awaitable[None]] | None = None) -> Finished:
        try:
            handle = e.submit(job)
        except ValueError as exc:
            raise Reply(Status.BAD_REQUEST, str(exc)) from None
        try:
            async for ev in handle.events:
                if isinstance(ev, TextDelta) and on_tokens is not None:
                    await on_tokens(ev)
                elif isinstance(ev, Finished):
                    return ev
                elif isinstance(ev, Failed):
                    raise _failed_reply(ev, job.id_slot)
        finally:
            e.cancel(handle)
        raise Reply(Status.ERROR, "the request ended without a result")

    async def _prefill(self, req: _Request, stream: trio.SocketStream) -> None:
        e, id_slot = self._slot(req)
        parsed = _parse(req, msg.PrefillRequest)
        job, fallback = await self._chat_job(e, id_slot, parsed.raw, n_predict=0)
        # BUSY if the slot works when the job's turn comes; the blob is saved on
        # the engine thread as the prefill ends, before anything else can use the slot
        job = attrs.evolve(job, fail_if_busy=True, snapshot=True, request_id=req.trace_id)
        t0 = time.perf_counter()
        done = await self._run_job(e, job)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        assert done.state is not None
        n_past, blob = done.state
        meta = {
            "slot_id": id_slot,
            "n_past": n_past,
            "tokens_processed": done.prompt_n,
            "cache_n": done.cache_n,
            "prefill_ms": round(prefill_ms, 3),
            "state_size": len(blob),
            "model_fallback": fallback,
            **self._identity(e),
        }
        await self._send_blob(stream, meta, blob)

    async def _decode(self, req: _Request, stream: trio.SocketStream) -> None:
        """DECODE: generate on a slot, one 9-byte frame per token (hydra-protocol.md §3).

        ``messages`` renders a conversation (reusing the slot's cached prefix);
        ``messages: null`` (or absent) continues from what the slot holds.
        Streamed (the default): the header goes out when the slot starts, with
        ``n_past`` = the tokens in the KV cache when generation begins, and
        ``9 × budget`` bytes follow as tokens come (FINAL, then PAD frames; the
        stop reason rides in the flags of the frame that ends it).
        ``"stream": false``: the reply is sent once generation ends, its meta
        has ``tokens_generated``, ``n_past`` (after) and ``stop_reason``, and its
        payload is exactly the generated frames.
        """
        e, id_slot = self._slot(req)
        parsed = _parse(req, msg.DecodeRequest)
        for name in ("n_predict", "max_tokens"):
            value = getattr(parsed, name)
            if value is not None and value < -1:
                raise Reply(Status.BAD_REQUEST, f"{name}: must be >= -1 (-1: the default budget), got {value}")
        budget = parsed.frame_budget(self.settings.decode_default, self.settings.decode_cap)
        if budget == 0:
            raise Reply(Status.BAD_REQUEST, "n_predict: DECODE generates at least one token (PREFILL processes a prompt only)")
        if parsed.messages is None:
            job, fallback = await self._continue_job(e, id_slot, parsed.raw, n_predict=budget)
        elif not parsed.messages:
            raise Reply(Status.BAD_REQUEST, "messages: empty (send the conversation, or null to continue the slot's KV cache)")
        else:
            job, fallback = await self._chat_job(e, id_slot, parsed.raw, n_predict=budget)
        job = attrs.evolve(job, logprobs=True, fail_if_busy=True, request_id=req.trace_id)
        try:
            handle = e.submit(job)
        except ValueError as exc:
            raise Reply(Status.BAD_REQUEST, str(exc)) from None
        framer = DecodeFramer(budget)
        meta: dict[str, Any] = {
            "slot_id": id_slot, "n_predict": budget, "frame_size": 9, "stream": parsed.stream is not False,
            "model_fallback": fallback, **self._identity(e),
        }
        try:
            # wait for the slot before the reply header: BUSY must be a status, not padding
            first = await handle.events.receive()
            if isinstance(first, Failed):
                raise _failed_reply(first, id_slot)
            assert isinstance(first, SlotAssigned)
            if parsed.stream is False:
                frames, end = await self._decode_frames(handle, framer, None)
                if isinstance(end, Failed):
                    raise _failed_reply(end, id_slot)
                body = frames + framer.finish(end.stop_reason, pad=False)
                meta.update(tokens_generated=framer.tokens_generated, n_past=end.n_past, stop_reason=end.stop_reason)
                await stream.send_all(encode_response_header(Status.OK, meta, len(body)) + body)
                return
            meta["n_past"] = first.n_prompt
            await stream.send_all(encode_response_header(Status.OK, meta, 9 * budget))
            _, end = await self._decode_frames(handle, framer, stream)
        finally:
            e.cancel(handle)
        if isinstance(end, Failed):
            log.warning("[%s] DECODE on slot %d failed: %s (padding the rest)", req.trace_id, id_slot, end.message)
        await stream.send_all(framer.finish(end.stop_reason if isinstance(end, Finished) else "error"))

    @staticmethod
    async def _decode_frames(
        handle: Any, framer: DecodeFramer, stream: trio.SocketStream | None
    ) -> tuple[bytes, Finished | Failed]:
        """Frame the tokens of a running DECODE: sent as they come on ``stream``, else gathered and returned."""
        gathered = bytearray()
        async for ev in handle.events:
            if isinstance(ev, TextDelta):
                out = framer.push(ev.tokens, ev.logprobs or (0.0,) * len(ev.tokens))
                if out and stream is not None:
                    await stream.send_all(out)
                else:
                    gathered += out
            elif isinstance(ev, (Finished, Failed)):
                return bytes(gathered), ev
        return bytes(gathered), Failed("the request ended without a result")

    # ---------------------------------------------------------- engine-wide
    async def _info(self, req: _Request, stream: trio.SocketStream) -> None:
        await stream.send_all(encode_response(Status.OK, self.info()))

    def info(self) -> dict[str, Any]:
        """INFO meta (hydra-protocol.md §3): Core's keys, then hydra-trio's own."""
        e = self.engine
        n = self.node
        meta: dict[str, Any] = {
            "engine": "hydra-trio",
            "version": __version__,
            # the C++ engine's names where they mean the same, then hydra-trio's finer ones
            "capabilities": [
                "state_transfer", "expert_mode", "preset", "model_hash",
                "state_get", "state_put", "state_meta", "configure", "info",
                "prefill", "decode", "set_expert_mode", "openai_http", "kv_checksum",
            ],
            "preset_aliases": sorted(PRESETS),
            "solo_active": e is not None and e.ready,
            "rpc_backend_active": self.rpc is not None and self.rpc.active,
            "mode": e.mode if e is not None else "solo",
            "peer_addr": (e.peer or "") if e is not None else "",
            "peer_reachable": e.peer_reachable if e is not None else False,
            "layer_split": e.combined_pattern if e is not None else DEFAULT_PATTERN,
            "combined_head_attached": e is not None and e.combined_model is not None,
            "fallback_reason": e.fallback_reason if e is not None else None,
            "peer_attach": e.peer_attach if e is not None else "none",
            "pipeline_capable": False,
            "protocols": ["http", "hydra"] + (["ggml_rpc"] if self.rpc is not None else []),
            "state_chunk_size": n.state_chunk_size,
        }
        if self.rpc is not None:
            meta["rpc_backend"] = {
                "devices": list(self.rpc.settings.devices),
                "connections": self.rpc.connections,
                "bytes_in": self.rpc.bytes_in,
                "bytes_out": self.rpc.bytes_out,
                "restarts": self.rpc.restarts,
                "pid": self.rpc.pid,
                **self.rpc.stats(),  # waiting, serving, crashes, closed by reason, invalid_messages by check, ...
            }
        if e is None:
            meta["stage"] = "ready"
            meta["solo_active"] = False
            meta["model"] = None
        else:
            meta["stage"] = e.stage
            if e.ready:
                meta.update(
                    n_slots=len(e.slots),
                    n_ctx=e.model.n_ctx if e.model else 0,
                    n_ctx_slot=e.n_ctx_slot,
                    slots_processing=[s.id for s in e.slots if s.is_processing],
                    sampling_defaults=attrs.asdict(e.defaults),
                    **self._identity(e),
                )
        return meta

    async def _configure(self, req: _Request, stream: trio.SocketStream) -> None:
        e = self._engine()
        try:
            params = msg.parse_configure(req.payload).params
            t1, t2, t3, unknown = msg.classify_configure_keys(params)
        except msg.MessageError as exc:
            raise Reply(Status.BAD_REQUEST, str(exc)) from None
        applied: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        if "state_chunk_size" in t1:
            size = msg.clamp_state_chunk_size(t1.pop("state_chunk_size"))
            self.node.state_chunk_size = size
            meta["state_chunk_size_applied"] = size
            applied["state_chunk_size"] = size
        if t1:
            try:
                e.set_defaults(**t1)
            except ValueError as exc:
                raise Reply(Status.BAD_REQUEST, str(exc)) from None
            applied.update(t1)
        deferred = sorted([*t2, *t3])
        tier = 3 if t3 else 2 if t2 else 1
        if t2 or t3:
            assert self.control is not None
            try:
                result = await self.control.submit(
                    Change("configure " + ",".join(deferred), lambda eng: eng.reconfigure(**t2, **t3), req.trace_id)
                )
            except Busy as b:
                raise Reply(
                    Status.BUSY, str(b), success=False, busy_slots=b.busy_slots, params_applied=applied, tier=tier
                ) from None
            except ValueError as exc:
                raise Reply(Status.BAD_REQUEST, str(exc), success=False, params_applied=applied, tier=tier) from None
            applied.update(result)
            deferred = []
        meta.update(success=True, tier=tier, params_applied=applied, deferred_keys=deferred, unrecognized_keys=unknown)
        await stream.send_all(encode_response(Status.OK, meta))

    async def _set_expert_mode(self, req: _Request, stream: trio.SocketStream) -> None:
        e = self._engine()
        try:
            want = msg.parse_set_expert_mode(req.payload)
        except msg.MessageError as exc:
            raise Reply(Status.BAD_REQUEST, str(exc), success=False) from None
        assert self.control is not None
        change = Change(
            f"set_expert_mode {want.mode}" + (f" peer={want.peer}" if want.peer else ""),
            lambda engine: engine.set_expert_mode(want.mode, want.peer),
            req.trace_id,
        )
        try:
            meta = await self.control.submit(change)
        except Busy as b:
            raise Reply(
                Status.BUSY, str(b), success=False, busy_slots=b.busy_slots, mode=e.mode, peer=e.peer
            ) from None
        await stream.send_all(encode_response(Status.OK, meta))

    async def _swap_quant(self, req: _Request, stream: trio.SocketStream) -> None:
        raise Reply(
            Status.NOT_IMPLEMENTED,
            "SWAP_QUANT is not implemented: hydra-trio reloads whole models (CONFIGURE model_path), "
            "not single tensors",
        )

    async def _pipeline_attach(self, req: _Request, stream: trio.SocketStream) -> None:
        raise Reply(
            Status.NOT_IMPLEMENTED,
            "PIPELINE_ATTACH is not implemented (as in the C++ engine): use SET_EXPERT_MODE combined with a peer",
        )


def _parse(req: _Request, cls: type[T]) -> T:
    """The request's JSON payload as ``cls``; BAD_REQUEST naming the field otherwise."""
    try:
        return msg.structure_json(req.payload, cls)
    except msg.MessageError as exc:
        raise Reply(Status.BAD_REQUEST, str(exc)) from None


def _failed_reply(ev: Failed, id_slot: int) -> Reply:
    if ev.code == "busy":
        return Reply(Status.BUSY, ev.message, busy_slots=[id_slot])
    if ev.code == "invalid_request":
        return Reply(Status.BAD_REQUEST, ev.message)
    return Reply(Status.ERROR, ev.message)


def _wants_payload(req: _Request) -> bool:
    """Which ops keep their payload (the others consume and drop it)."""
    return req.op in (Op.STATE_PUT, Op.CONFIGURE, Op.PREFILL, Op.DECODE, Op.SET_EXPERT_MODE, Op.PIPELINE_ATTACH)


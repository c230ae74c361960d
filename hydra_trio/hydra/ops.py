"""The Hydra operations: a table from opcode to a function of a small context (docs/hydra-protocol.md §3).

Each operation is ``async def op(ctx: OpContext) -> None`` and sends exactly
one reply through the context; to refuse, it raises a typed error
(:mod:`hydra_trio.errors`, op-specific reply keys added with
:meth:`~hydra_trio.errors.HydraTrioError.with_meta`), which the connection's
boundary (:meth:`hydra_trio.hydra.connection.ServerConnection.handle`) turns into
the status its class names (:attr:`~hydra_trio.errors.HydraTrioError.hydra_status`:
InvalidRequest → BAD_REQUEST, NotFound → NOT_FOUND, NotSupported and NoModel →
NOT_IMPLEMENTED, Busy → BUSY with ``busy_slots``, NotReady → ERROR with ``stage``,
a state blob's StateError → ERROR with its meta, anything else → ERROR).
Every non-OK reply carries ``{"error": ...}``.  The work itself is the service's
(:mod:`hydra_trio.service`), shared with HTTP; this module decodes payloads and
encodes replies.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from .._version import __version__
from ..engine import TRANSFER_POOL, BlobBuffer, Engine, PipelineAttach, Reconfigure, SetExpertMode, SwapQuant
from ..engine.settings import DEFAULT_PATTERN
from ..errors import Busy, HydraTrioError, InvalidRequest, NotSupported
from ..models.presets import PRESETS, resolve_model
from ..openai.reasoning import ChatReplyText
from ..openai.schemas import ChatCompletionRequest, CompletionRequest
from ..openai.tools import ChatTools, parse_reply
from ..protocol.hydra import DecodeFramer, Op, Status, encode_response, encode_response_header
from ..rpc_backend.backend import RpcBackend
from ..service import completions, node, slots
from ..service.completions import PreparedCompletion
from ..transport.tls_bulk import send_bulk
from . import messages as msg
from .session import HydraRequest, HydraSettings

log = logging.getLogger("hydra_trio.hydra")
_SLOT_ID = re.compile(r"0|-?[1-9][0-9]{0,8}", re.ASCII)  # plain ASCII decimal: no "+", spaces, padding or "_"

CAPABILITIES = [
    # the names Core knows from the cluster's llama-server fork where they mean the same, then hydra-trio's finer ones
    "state_transfer",
    "expert_mode",
    "preset",
    "model_hash",
    "state_get",
    "state_put",
    "state_meta",
    "configure",
    "info",
    "prefill",
    "decode",
    "set_expert_mode",
    "openai_http",
    "kv_checksum",
    "quant_swap",
    "kv_identity",
    "cross_model_kv",
    "pipeline_attach",
]


@attrs.define
class OpTarget:
    """What the operations act on: the engine (None on a compute-only node; its inbox is the serialized
    control channel), the ggml-RPC backend, the protocol settings, and the settings CONFIGURE changes here."""

    engine: Engine | None
    rpc: RpcBackend | None
    settings: HydraSettings
    state_chunk_size: int = 256 * 1024


@attrs.define
class OpContext:
    """One request being answered: what it acts on, the request and its connection."""

    target: OpTarget
    req: HydraRequest
    stream: trio.abc.Stream  # the front door's SocketStream or TlsStream
    blob_bytes_sent: int = 0  # KV-state payload bytes written by send_blob (``/metrics``)

    async def reply(self, meta: dict[str, Any], status: Status = Status.OK) -> None:
        """Send a reply without payload."""
        await self.stream.send_all(encode_response(status, meta))

    async def send_blob(self, meta: dict[str, Any], blob: bytearray | bytes | BlobBuffer) -> None:
        """Send an OK reply whose payload is ``blob``, in ``state_chunk_size`` pieces (docs/hydra-protocol.md §2)
        taken straight from the blob's one buffer, never copied (:func:`~hydra_trio.transport.tls_bulk.send_bulk`:
        on a plain TCP stream each write at most ``state_chunk_size`` bytes, over TLS from a worker thread).

        Raises:
            trio.BrokenResourceError: the connection broke, or the client took no byte of the reply for
                ``settings.request_timeout`` seconds (the connection is then closed)."""
        header = encode_response_header(Status.OK, meta, len(blob))
        view = blob.view() if isinstance(blob, BlobBuffer) else memoryview(blob)
        step = self.target.state_chunk_size
        wait = (
            self.target.settings.request_timeout
        )  # a client that reads none of it holds no buffer (or thread) for ever
        try:  # on plain TCP the header rides in the first write
            await send_bulk(self.stream, view, step, wait, head=header, sent=self._count_sent)
        except trio.TooSlowError:
            log.info("[%s] hydra: the client read none of the reply for %g s; closed", self.req.trace_id, wait)
            raise trio.BrokenResourceError("the client stopped reading the reply") from None

    def _count_sent(self, n: int) -> None:
        self.blob_bytes_sent += n

    def engine(self) -> Engine:
        """The serving engine (:func:`hydra_trio.service.node.serving`): NoModel (NOT_IMPLEMENTED) on a node
        without one, NotReady (ERROR) while it loads."""
        return node.serving(self.target.engine)

    def slot(self) -> tuple[Engine, int]:
        """The engine and the slot the key names (docs/hydra-protocol.md §2 Keys): InvalidRequest (BAD_REQUEST)
        for a key that is not a slot id, NotFound for a slot the node does not have."""
        key = self.req.key
        if not _SLOT_ID.fullmatch(key):
            raise InvalidRequest(f"key {key!r} is not a slot id (a decimal integer)")
        id_slot = int(key)
        return node.slot(self.target.engine, id_slot), id_slot

    def parse(self, parser: Callable[[bytes | bytearray], Any], **meta: Any) -> Any:
        """The payload through ``parser``; MessageError (BAD_REQUEST) naming the field otherwise, with
        ``meta`` in its reply."""
        try:
            return parser(self.req.payload)
        except msg.MessageError as exc:
            raise exc.with_meta(**meta) from None


# ----------------------------------------------------------------------------- slot ops


async def state_get(ctx: OpContext) -> None:
    """STATE_GET: llama.cpp writes the slot's state into a buffer of the transfer pool, the reply is sent
    from it (:meth:`OpContext.send_blob`), and the buffer goes back to the pool."""
    e, id_slot = ctx.slot()
    with _state_event(e, "state.get", ctx.req.trace_id, id_slot) as event:
        n_past, blob = await slots.save(e, id_slot)
        try:
            event.update(bytes=len(blob), n_past=n_past)
            await ctx.send_blob(
                {"slot_id": id_slot, "n_past": n_past, "state_size": len(blob), **node.identity(e)}, blob
            )
        finally:
            slots.release(blob)


def payload_buffer(op: int, payload_len: int) -> BlobBuffer | None:
    """Where a kept payload is received (:func:`~hydra_trio.hydra.session.serve_connection`): a STATE_PUT
    of at least :data:`BUFFERED_PAYLOAD` bytes goes into a buffer of the transfer pool; others into a
    bytearray (so does a STATE_PUT whose mapping the kernel refuses: it then grows as its bytes come)."""
    if op != Op.STATE_PUT or payload_len < BUFFERED_PAYLOAD:
        return None
    try:
        return TRANSFER_POOL.take(payload_len)
    except OSError as exc:  # ENOMEM: too many large uploads announced at once
        log.warning("STATE_PUT of %d bytes: no buffer mapping (%s); receiving into a bytearray", payload_len, exc)
        return None


BUFFERED_PAYLOAD = 64 * 1024  # bytes


async def state_put(ctx: OpContext) -> None:
    """STATE_PUT: the blob (received into one buffer, :func:`payload_buffer`, and hashed as it arrived) is
    restored as every blob is (:func:`hydra_trio.service.slots.restore`: checked off the engine thread,
    applied on it, its buffer back to the pool)."""
    e, id_slot = ctx.slot()
    blob = ctx.req.payload
    with _state_event(e, "state.put", ctx.req.trace_id, id_slot, bytes=len(blob)) as event:
        done = await slots.restore(e, id_slot, blob, ctx.req.checksum)
        event["n_past"] = done.n_past
        await ctx.reply(done.as_reply("slot_id"))


@contextmanager
def _state_event(e: Engine, type_: str, trace_id: str, id_slot: int, **fields: Any) -> Iterator[dict[str, Any]]:
    """Publish ``state.get`` / ``state.put`` when the block ends: ``slot``, ``bytes``, ``ms`` and ``result``
    (``"ok"``, or the error that ended it; the block fills in what it learns in the yielded dict)."""
    t0 = time.perf_counter()
    event: dict[str, Any] = {"slot": id_slot, "bytes": 0, **fields}
    result = "ok"
    try:
        yield event
    except BaseException as exc:
        result = getattr(exc, "error", None) or str(exc) or type(exc).__name__
        raise
    finally:
        e.events.publish(type_, trace_id, **event, ms=round((time.perf_counter() - t0) * 1e3, 3), result=result)


async def state_meta(ctx: OpContext) -> None:
    e, id_slot = ctx.slot()
    await ctx.reply(node.slot_meta(e, id_slot))  # the engine's published snapshot: never waits behind a prefill


def _model_fallback(e: Engine, body: ChatCompletionRequest | CompletionRequest) -> bool:
    """The body names a model other than the one loaded (served anyway; docs/hydra-protocol.md §3 PREFILL)."""
    assert e.identity is not None
    return isinstance(body.model, str) and body.model not in ("", e.identity.model_alias)


async def _prepare(
    ctx: OpContext,
    e: Engine,
    id_slot: int,
    body: ChatCompletionRequest | CompletionRequest,
    n_predict: int,
    **changes: Any,
) -> PreparedCompletion:
    """PREFILL's / DECODE's completion: a chat's prepared in a worker thread that stops when the peer leaves
    (:func:`hydra_trio.service.completions.prepare`), a continuation at once; it fails BUSY rather than wait
    when the slot works."""
    changes.update(fail_if_busy=True, request_id=ctx.req.trace_id)
    if isinstance(body, ChatCompletionRequest):
        return await completions.prepare(
            lambda: completions.prepare_chat(e, body, n_predict=n_predict, id_slot=id_slot), **changes
        )
    return completions.prepare_continue(e, body, n_predict=n_predict, id_slot=id_slot).changed(**changes)


async def prefill(ctx: OpContext) -> None:
    e, id_slot = ctx.slot()
    body = ctx.parse(msg.parse_prefill)
    # the blob is saved on the engine thread as the prefill ends, before anything else can use the slot
    prepared = await _prepare(ctx, e, id_slot, body, 0, save_state=True, prompt_only=True)
    t0 = time.perf_counter()
    async with completions.run(e, prepared) as run:
        done = await run.result()
    assert done.state is not None
    n_past, blob = done.state
    await ctx.send_blob(
        {
            "slot_id": id_slot,
            "n_past": n_past,
            "tokens_processed": done.prompt_n,
            "cache_n": done.cache_n,
            "prefill_ms": round((time.perf_counter() - t0) * 1e3, 3),
            "state_size": len(blob),
            "model_fallback": _model_fallback(e, body),
            **node.identity(e),
        },
        blob,
    )


async def decode(ctx: OpContext) -> None:
    """DECODE: generate on a slot, one 9-byte frame per token (docs/hydra-protocol.md §3, docs/protocol-notes.md).

    ``messages`` renders a conversation (reusing the slot's cached prefix);
    ``messages: null`` (or absent) continues from what the slot holds.
    Streamed (the default): the header goes out when the slot starts, with
    ``n_past`` = the tokens in the KV cache when generation begins, and
    ``9 × budget`` bytes follow as tokens come (FINAL, then PAD frames; the
    stop reason rides in the flags of the frame that ends it).
    ``"stream": false``: the reply is sent once generation ends, its meta has
    ``tokens_generated``, ``reasoning_tokens`` (those of the thinking block, split
    by the body's ``reasoning_format`` as a chat reply is: :mod:`hydra_trio.openai.reasoning`),
    ``n_past`` (after) and ``stop_reason``, with ``tools`` in the body also ``tool_calls``
    (the HTTP reply's ``message.tool_calls``: :func:`_tool_calls`), and its payload is exactly the
    generated frames.  A streamed DECODE's meta leaves before the reply exists: its client reads the
    calls from the text of the frames' tokens.
    """
    e, id_slot = ctx.slot()
    parsed = ctx.parse(msg.parse_decode)
    budget_field = parsed.budget_field()  # the one read, as llama-server (n_predict, max_completion_tokens, max_tokens)
    if budget_field is not None and budget_field[1] < -1:
        name, value = budget_field
        raise InvalidRequest(f"{name}: must be >= -1 (-1: the default budget), got {value}")
    settings = ctx.target.settings
    budget = parsed.frame_budget(settings.decode_default, settings.decode_cap)
    if budget == 0:
        raise InvalidRequest("n_predict: DECODE generates at least one token (PREFILL processes a prompt only)")
    # the frames carry each token's own logprob, never alternatives (a body's logprobs / n_probs ask for none here)
    prepared = await _prepare(ctx, e, id_slot, parsed.body, budget, logprobs=True, n_probs=0)
    framer = DecodeFramer(budget)
    streamed = parsed.stream is not False
    meta: dict[str, Any] = {
        "slot_id": id_slot,
        "n_predict": budget,
        "frame_size": 9,
        "stream": streamed,
        "model_fallback": _model_fallback(e, parsed.body),
        **node.identity(e),
    }
    async with completions.run(e, prepared) as run:
        # wait for the slot before the reply header: BUSY must be a status, not padding
        assigned = await run.started()
        if not streamed:
            frames = bytearray()
            reply = ChatReplyText(prepared.plan.thinking)
            async for delta in run:
                if delta.eog:  # no frame for the end-of-generation token
                    continue
                frames += framer.push(delta.tokens, delta.logprobs)
                reply.add(delta.text, len(delta.tokens))
            end = run.finished
            assert end is not None
            frames += framer.finish(end.stop_reason, pad=False)
            meta.update(
                tokens_generated=framer.tokens_generated,
                reasoning_tokens=reply.reasoning_tokens,
                n_past=end.n_past,
                stop_reason=end.stop_reason,
                **_tool_calls(reply, prepared.plan.tools),
            )
            await ctx.stream.send_all(encode_response_header(Status.OK, meta, len(frames)) + frames)
            return
        meta["n_past"] = assigned.n_prompt
        await ctx.stream.send_all(encode_response_header(Status.OK, meta, 9 * budget))
        stop_reason = "error"
        try:
            async for delta in run:
                if delta.eog:
                    continue
                if out := framer.push(delta.tokens, delta.logprobs):
                    await ctx.stream.send_all(out)
            assert run.finished is not None
            stop_reason = run.finished.stop_reason
        except HydraTrioError as exc:  # the header is out: the rest of the budget is padding
            log.warning("[%s] DECODE on slot %d failed: %s (padding the rest)", ctx.req.trace_id, id_slot, exc)
        await ctx.stream.send_all(framer.finish(stop_reason))


def _tool_calls(reply: ChatReplyText, tools: ChatTools | None) -> dict[str, Any]:
    """A non-streamed DECODE's tool calls, when the body offered tools: ``{"tool_calls": [{"id", "type",
    "function": {"name", "arguments"}}]}`` (the HTTP reply's ``message.tool_calls``; ``[]``: none), parsed from
    the reply's content (its thinking split off) by the template's format (:mod:`hydra_trio.openai.tools`)."""
    if tools is None:
        return {}
    reply.finish()
    _, calls = parse_reply(tools.format, reply.content)
    return {"tool_calls": [c.as_openai() for c in calls]}


# ----------------------------------------------------------------------------- engine-wide ops


async def info(ctx: OpContext) -> None:
    await ctx.reply(info_meta(ctx.target))


def info_meta(target: OpTarget) -> dict[str, Any]:
    """INFO meta (docs/hydra-protocol.md §3): Core's keys, then hydra-trio's own (the node's facts that ``/props``
    reports too come from :mod:`hydra_trio.service.node`)."""
    e, rpc = target.engine, target.rpc
    experts = (
        e.experts.info()
        if e is not None
        else {
            "mode": "solo",
            "peer_addr": "",
            "peer_reachable": False,
            "layer_split": DEFAULT_PATTERN,
            "combined_head_attached": False,
            "fallback_reason": None,
            "peer_attach": "none",
        }
    )
    meta: dict[str, Any] = {
        "engine": "hydra-trio",
        "version": __version__,
        "capabilities": CAPABILITIES,
        **node.hardware(),
        "preset_aliases": sorted(PRESETS),
        "solo_active": e is not None and e.ready,
        "rpc_backend_active": rpc is not None and rpc.active,
        **experts,
        "pipeline_capable": e is not None,
        **(e.quants.info() if e is not None else {"quants": [], "quant": None}),
        "quant_swap": {
            "whole_model": True,
            "tensor_subsets": False,
            "peak_memory": "the old model + the new one + one KV blob per slot holding tokens",
        },
        "protocols": ["http", "hydra"] + (["ggml_rpc"] if rpc is not None else []),
        "state_chunk_size": target.state_chunk_size,
    }
    if rpc is not None:
        meta["rpc_backend"] = {
            "devices": list(rpc.settings.devices),
            "connections": rpc.connections,
            "bytes_in": rpc.bytes_in,
            "bytes_out": rpc.bytes_out,
            "restarts": rpc.restarts,
            "pid": rpc.pid,
            **rpc.stats(),  # waiting, serving, crashes, closed by reason, invalid_messages by check, ...
        }
    if e is None:
        meta.update(stage="ready", model=None)
    else:
        meta["stage"] = str(e.stage)
        meta["modalities"] = node.modalities(e)  # /props' (vision, video, audio)
        if e.ready:
            assert e.identity is not None
            snap = e.snapshot  # the engine's published slots: never waits behind a prefill
            meta.update(
                n_slots=len(snap.slots),
                n_ctx=snap.n_ctx,
                n_ctx_slot=e.n_ctx_slot,
                slots_processing=snap.slots_processing,
                sampling_defaults=attrs.asdict(e.defaults),
                **node.model_use(e),  # kv_cache {"type_k", "type_v", "flash_attn"}, memory {device: bytes}, as /props
                **e.identity.as_meta(),
            )
    return meta


async def configure(ctx: OpContext) -> None:
    """CONFIGURE (docs/hydra-protocol.md §3), whole or nothing: every key is checked first (types, tier-1
    bounds, tier-2/3 keys this node supports, the model named); tiers 2 / 3 then go through the
    control channel (every slot idle), and tier 1 applies only once they have.  A refused request
    (BAD_REQUEST, BUSY, ERROR: ``success`` false, ``params_applied`` empty) changes nothing."""
    e = ctx.engine()
    params = ctx.parse(msg.parse_configure).params
    t1, t2, t3, unknown = msg.classify_configure_keys(params)
    tier = 3 if t3 else 2 if t2 else 1
    deferred = sorted([*t2, *t3])
    chunk = msg.clamp_state_chunk_size(t1.pop("state_chunk_size")) if "state_chunk_size" in t1 else None
    cross_model_kv = t1.pop("allow_cross_model_kv", None)
    changes: dict[str, Any] = {k: t2[k] for k in ("n_ctx", "n_parallel") if k in t2}
    # 1. check everything, change nothing
    try:
        if t1:
            e.request_defaults.evolve(**t1)  # what set_defaults would apply, changing nothing
        unsupported = sorted((set(t2) | set(t3)) - {"n_ctx", "n_parallel", "model_path", "model"})
        if unsupported:
            raise InvalidRequest(f"{', '.join(unsupported)}: not supported by this node (CPU only, default KV types)")
        target = t3.get("model_path") or t3.get("model")
        if target is not None:  # the engine gets a resolved path (a file, or a preset's file)
            changes["model_path"], changes["model_alias"] = resolve_model(str(target))
    except HydraTrioError as exc:
        raise exc.with_meta(success=False, params_applied={}, tier=tier) from None
    # 2. tiers 2 / 3, which can still be refused (BUSY: a slot works; llama.cpp refusing the settings)
    result: dict[str, Any] = {}
    if t2 or t3:
        try:
            result = await e.run_task(Reconfigure(**changes, trace_id=ctx.req.trace_id))
        except HydraTrioError as exc:
            raise exc.with_meta(success=False, params_applied={}, tier=tier) from None
        deferred = []
    # 3. tier 1: checked above (a field's bounds do not depend on the others), so it cannot fail now
    applied: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    if chunk is not None:
        ctx.target.state_chunk_size = meta["state_chunk_size_applied"] = applied["state_chunk_size"] = chunk
    if cross_model_kv is not None:  # one bool, read once per STATE_PUT on the engine thread
        e.allow_cross_model_kv = applied["allow_cross_model_kv"] = cross_model_kv
    if t1:  # one new immutable RequestDefaults, swapped in whole: job-building threads see all or none of it
        e.set_defaults(**t1)
        applied.update(t1)
    applied.update(result)
    meta.update(success=True, tier=tier, params_applied=applied, deferred_keys=deferred, unrecognized_keys=unknown)
    await ctx.reply(meta)


async def set_expert_mode(ctx: OpContext) -> None:
    e = ctx.engine()
    want = ctx.parse(msg.parse_set_expert_mode, success=False)
    try:
        meta = await e.run_task(SetExpertMode(want.mode, want.peer, trace_id=ctx.req.trace_id))
    except Busy as exc:
        raise exc.with_meta(success=False, mode=str(e.experts.mode), peer=e.experts.peer) from None
    await ctx.reply(meta)


async def swap_quant(ctx: OpContext) -> None:
    """SWAP_QUANT: the whole model to another of the node's quants, through the control channel
    (an exclusive engine task, :mod:`hydra_trio.engine.quants`); a pattern that leaves some tensors out is
    NOT_IMPLEMENTED."""
    e = ctx.engine()
    want = ctx.parse(msg.parse_swap_quant, swapped=False)
    target = e.quants.paths.get(want.quant_key)
    experts_only = False
    if want.tensor_pattern and target is not None:
        try:
            msg.check_tensor_regex(want.tensor_pattern)
        except msg.MessageError as exc:
            raise InvalidRequest(f"tensor_pattern: {exc}").with_meta(swapped=False) from None
        try:  # the file is parsed and the regex run in a worker thread: never on the event loop
            names, picked, on_peer = await trio.to_thread.run_sync(
                _pattern_scope, target[0], want.tensor_pattern, e.experts.pattern, abandon_on_cancel=True
            )
        except (OSError, ValueError) as exc:
            raise HydraTrioError(f"quant {want.quant_key!r}: cannot read {target[0]}: {exc}").with_meta(
                swapped=False
            ) from None
        if picked != names:  # not the whole model: only the peer's tensors on a COMBINED head
            experts_only = e.experts.combined is not None and picked == on_peer
            if not experts_only:
                raise NotSupported(
                    f"tensor_pattern picks {len(picked)} of {len(names)} tensors: a swap takes the "
                    "whole model (an empty pattern), or on a COMBINED head exactly the tensors on "
                    f"its peer ({e.experts.pattern!r})"
                ).with_meta(swapped=False)
    try:
        meta = await e.run_task(SwapQuant(want.quant_key, experts_only=experts_only, trace_id=ctx.req.trace_id))
    except HydraTrioError as exc:
        raise exc.with_meta(swapped=False, quant=e.quants.active) from None
    await ctx.reply(meta)


def _pattern_scope(path: Path, pattern: str, peer_pattern: str) -> tuple[set[str], set[str], set[str]]:
    """The GGUF's tensor names, those ``pattern`` picks, and those on a COMBINED peer (worker thread).

    Raises OSError (no file) or ValueError (not a GGUF)."""
    import gguf

    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    rx, peer = re.compile(pattern), re.compile(peer_pattern)
    return names, {n for n in names if rx.search(n)}, {n for n in names if peer.search(n)}


async def pipeline_attach(ctx: OpContext) -> None:
    """PIPELINE_ATTACH: the tensors matching ``ot_split`` on the peer, an exclusive engine task
    (slots idle, else BUSY); ``{"peer": ""}`` detaches."""
    e = ctx.engine()
    want = ctx.parse(lambda p: msg.structure_json(p, msg.PipelineAttachRequest), success=False)
    try:
        meta = await e.run_task(PipelineAttach(want.peer, want.ot_split, trace_id=ctx.req.trace_id))
    except HydraTrioError as exc:
        raise exc.with_meta(success=False, mode=str(e.experts.mode), peer=e.experts.peer) from None
    await ctx.reply(meta)


@attrs.frozen
class OpSpec:
    """One table entry: the function, and whether the op keeps its payload (others consume and drop it)."""

    run: Callable[[OpContext], Awaitable[None]]
    keeps_payload: bool = False


OPS: dict[int, OpSpec] = {
    Op.STATE_GET: OpSpec(state_get),
    Op.STATE_PUT: OpSpec(state_put, keeps_payload=True),
    Op.STATE_META: OpSpec(state_meta),
    Op.CONFIGURE: OpSpec(configure, keeps_payload=True),
    Op.INFO: OpSpec(info),
    Op.PREFILL: OpSpec(prefill, keeps_payload=True),
    Op.DECODE: OpSpec(decode, keeps_payload=True),
    Op.SET_EXPERT_MODE: OpSpec(set_expert_mode, keeps_payload=True),
    Op.SWAP_QUANT: OpSpec(swap_quant, keeps_payload=True),
    Op.PIPELINE_ATTACH: OpSpec(pipeline_attach, keeps_payload=True),
}
"""Opcode → operation (docs/hydra-protocol.md §3)."""

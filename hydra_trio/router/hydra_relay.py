"""The Hydra protocol on the router's port (docs/router.md "Hydra and ggml-RPC"): INFO answered by the router, every
other op relayed to the child node of the model it addresses.

**Addressing.** An op names its model (a name or an alias) by a ``model`` key in its JSON object payload
(PREFILL, DECODE, CONFIGURE, PIPELINE_ATTACH, SET_EXPERT_MODE's JSON form) or by its key's suffix ``@MODEL``
(``"0@smollm2-135m"``: slot 0 of that model; every op, the only way for those without JSON: STATE_GET,
STATE_PUT, STATE_META, SWAP_QUANT).  The router takes both out before the child sees the request.  Naming none
addresses the one model running (loading or loaded), or the router's only model when none runs.  Refusals:

======================================================  ===========  ===============================
case                                                    status       error
======================================================  ===========  ===============================
no model named, several running (or none, several)      BAD_REQUEST  ``model name is missing ...``
a name that is no model                                 NOT_FOUND    ``model 'X' not found``
the key and the JSON name two models                    BAD_REQUEST
CONFIGURE ``model_path`` (a reload behind the router)   BAD_REQUEST
not running, ``--no-models-autoload``                   BAD_REQUEST  ``model is not loaded``
not running, autoload: its load starts                  BUSY         ``model X is loading ...``
loading (or being stopped)                              BUSY         ``model X is loading ...``
its last load (started here) failed: told once          ERROR        ``model name=X failed to load``
its child cannot be reached / exits before replying     ERROR        ``proxy error: ...``
======================================================  ===========  ===============================

BAD_REQUEST and NOT_FOUND are the codec's statuses for "as sent, this will not be done" and "no such thing"
(an unknown model, as an unknown slot); BUSY is the control channel's "try again".  Each refusal carries
``{"error": ...}`` and, once a model is known, ``model``.

**Relaying.** A request is received whole (its model must be known before it goes on; the child receives it
whole too), then sent on a Hydra connection to the model's child, opened once per client connection and
model and reused; the reply goes back as it arrives (a DECODE's frames as the child writes them, a state blob
chunk by chunk), nothing but its header held back.  A client that closes its connection closes its
connections to the children (a PREFILL or DECODE in flight there stops); a child that exits before its reply
began is an ERROR reply; one that exits during a DECODE's frames ends them with the error flag and padding
(as a node whose generation fails); during another payload the client's connection is closed (a blob cannot
be finished honestly).  A KV blob reaches only the child its request addresses, whose identity checks refuse a
blob of another model.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import attrs
import trio

from ..errors import Busy, HydraTrioError, InvalidRequest, ModelLoadError, NotFound, NotSupported
from ..hydra.gate import ConnectionTrust, Gate
from ..hydra.ops import OpTarget, info_meta
from ..hydra.session import Drain, HydraRequest, HydraSettings, serve_connection
from ..protocol.hydra import (
    DECODE_FRAME_SIZE,
    NEED_DATA,
    DecodeFramer,
    Op,
    ProtocolError,
    ResponseDecoder,
    ResponseEnded,
    ResponseStarted,
    Status,
    encode_request_header,
    encode_response,
    is_store_op,
    op_name,
)
from ..rpc_backend.backend import RpcBackend
from ..transport.access import AccessSettings, Refusals
from ..transport.frontdoor import AcceptedStream
from ..transport.net import wait_peer_closed
from ..transport.tls import peer_of
from ..validation import strict
from ..validation.strict import MessageError
from .errors import ModelUnavailable
from .models import CHILD_HOST, LOADED, LOADING, ModelInstance, ModelRouter
from .swap import swap_quant_key

log = logging.getLogger("hydra_trio.router")

JSON_OPS = frozenset({Op.PREFILL, Op.DECODE, Op.CONFIGURE, Op.PIPELINE_ATTACH, Op.SET_EXPERT_MODE})
"""Ops whose payload is a JSON object that may carry ``model`` (SET_EXPERT_MODE only in its JSON form)."""

RELAY_CHUNK = 256 * 1024
"""Bytes read from a child per receive."""

OPS = frozenset(int(op) for op in Op)
"""Every engine opcode (the rest: Store and unknown opcodes, NOT_IMPLEMENTED as on a node)."""

ROUTER_KEYS = ("protocols", "rpc_backend_active", "rpc_backend")
"""INFO keys that describe the port, so the router's win over a child's."""


OPS_STATUS = frozenset(int(s) for s in Status)


class ChildGone(Exception):
    """The child's connection closed (or broke) before its reply was whole."""


@attrs.define
class Upstream:
    """One Hydra connection to a child: its stream, and which child (port and process) it reaches, so that a
    model loaded again gets a new connection."""

    stream: trio.SocketStream
    port: int
    process: object
    fresh: bool = True
    """Opened for the request being relayed (not reused): a break on it is no stale connection."""

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(self.stream)


class RouterHydra:
    """The router's Hydra handler (a :class:`~hydra_trio.transport.frontdoor.ConnectionHandler`): the access
    rules of the router's port (``--control-allow``, ``--hydra-token``, as a node's), the connection loop of a
    node (:func:`~hydra_trio.hydra.session.serve_connection`), one :class:`RouterConnection` per connection.
    Run :meth:`run` first: it hosts the loads that Hydra requests start (autoload)."""

    def __init__(
        self,
        router: ModelRouter,
        settings: HydraSettings,
        access: AccessSettings,
        refused: Refusals,
        rpc: RpcBackend | None = None,
    ) -> None:
        self.router = router
        self.settings = settings
        self.rpc = rpc
        self.gate = Gate(access.control_allow, access.hydra_token, refused)
        self.target = OpTarget(None, rpc, settings)
        self.loads: set[str] = set()
        """Models whose load a Hydra request started and that do not serve yet."""
        self.failures: dict[str, str] = {}
        """Models whose load started here failed, to be told to the next request for it."""
        self._drain = Drain()
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the autoloads until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def __call__(self, stream: AcceptedStream) -> None:
        """Serve one client connection until it closes, a timeout, a framing error or a drain; its
        connections to the children close with it."""
        conn = RouterConnection(self, stream, self.gate.connection(peer_of(stream)))
        try:
            await serve_connection(stream, self.settings, conn, self._drain)
        finally:
            await conn.aclose()

    def drain(self) -> None:
        """Close idle connections now, busy ones after their reply."""
        self._drain.start()

    # ------------------------------------------------------------------------------------------ models
    def pick(self, name: str) -> ModelInstance:
        """The model ``name`` names, or with ``""`` the one running (or the only one); raises as the module
        docstring says."""
        if name:
            m = self.router.find(name)
            if m is None:
                raise NotFound(f"model '{name}' not found")
            return m
        models = list(self.router.models.values())
        running = [m for m in models if m.running]
        if len(running) == 1:
            return running[0]
        if not running and len(models) == 1:
            return models[0]
        why = (
            f"{len(running)} models are running ({', '.join(m.name for m in running)})"
            if running
            else "no model is running"
        )
        raise InvalidRequest(
            f'model name is missing from the request: {why}; name one with the payload\'s "model" '
            'or the key\'s suffix "@MODEL"'
        )

    def check_ready(self, m: ModelInstance) -> None:
        """Return when ``m`` serves; else raise BUSY (loading, or its load starts now under autoload), ERROR
        (its load started here failed: told once) or BAD_REQUEST (not running, autoload off)."""
        failure = self.failures.pop(m.name, None)
        if failure is not None and not m.running:
            raise ModelLoadError(failure).with_meta(model=m.name, exit_code=m.exit_code)
        if m.status == LOADED and not m.stopping:
            return
        if m.status != LOADING:
            if not self.router.settings.models_autoload:
                raise InvalidRequest("model is not loaded").with_meta(model=m.name)
            self._autoload(m)
        raise Busy(f"model {m.name} is loading; try again").with_meta(model=m.name, status=LOADING)

    def _autoload(self, m: ModelInstance) -> None:
        if m.name in self.loads or self._nursery is None:
            return
        self.loads.add(m.name)
        self._nursery.start_soon(self._load, m)

    async def _load(self, m: ModelInstance) -> None:
        try:
            await self.router.ensure_ready(m)
        except ModelLoadError as exc:
            self.failures[m.name] = str(exc)
        except HydraTrioError as exc:
            log.info("hydra: loading %s for a request: %s", m.name, exc)
        finally:
            self.loads.discard(m.name)

    def models_meta(self) -> list[dict[str, Any]]:
        """INFO's ``models``: ``[{"id", "aliases", "status", "port"(, "failed": true, "exit_code")}]``."""
        out = []
        for m in self.router.models.values():
            entry: dict[str, Any] = {"id": m.name, "aliases": m.aliases, "status": m.status}
            if m.running:
                entry["port"] = m.port
            if m.failed:
                entry.update(failed=True, exit_code=m.exit_code)
            out.append(entry)
        return out


def _split_key(key: str) -> tuple[str, str]:
    """``"KEY@MODEL"`` -> ``("KEY", "MODEL")`` (the first ``@``); a key without one names no model."""
    base, _, name = key.partition("@")
    return base, name


def _take_model(op: int, payload: bytearray) -> tuple[str, bytearray]:
    """The JSON payload's ``model`` (``""``: none, or null) and the payload without it (unchanged when it has
    none, or is no JSON object: the child refuses that as it would).

    Raises:
        InvalidRequest: ``model`` is no string; a CONFIGURE has ``model_path`` (a reload behind the router).
    """
    if op not in JSON_OPS or not payload.lstrip().startswith(b"{"):
        return "", payload
    try:
        params = strict.load_json_object(payload)
    except MessageError:
        return "", payload
    if op == Op.CONFIGURE and "model_path" in params:
        raise InvalidRequest(
            "model_path: a router loads models by name (POST /models/load, or a request that names one); "
            "a child's model is not replaced behind it"
        )
    if "model" not in params:
        return "", payload
    name = params.pop("model")
    if name is None:
        name = ""  # null: no model named
    if not isinstance(name, str):
        raise InvalidRequest(f"model: must be a string (a model's name or alias), got {type(name).__name__}")
    return name, bytearray(json.dumps(params).encode())


class RouterConnection:
    """One client's Hydra connection to the router (a :class:`~hydra_trio.hydra.session.ConnectionProtocol`):
    the gate's trust, INFO, and the relay of every other op (the module docstring)."""

    def __init__(self, hub: RouterHydra, stream: trio.abc.Stream, trust: ConnectionTrust) -> None:
        self.hub = hub
        self.stream = stream
        self.trust = trust
        self.upstreams: dict[str, Upstream] = {}

    async def aclose(self) -> None:
        """Close every connection to a child."""
        for up in self.upstreams.values():
            await up.aclose()
        self.upstreams.clear()

    # ------------------------------------------------------------------ payload policy (as a node's)
    def max_payload(self, op: int) -> int:
        s = self.hub.settings
        return s.max_state_payload if op == Op.STATE_PUT else s.max_json_payload

    def keeps_payload(self, op: int) -> bool:
        return op in OPS and self.trust.keeps_payload(op)

    def payload_buffer(self, op: int, payload_len: int) -> None:
        return None

    # ------------------------------------------------------------------ dispatch
    async def handle(self, req: HydraRequest) -> None:
        """Answer one request: the gate first (as a node), then INFO or the relay; a refusal is the reply its
        error class names, ``{"error": ...}``; one log line."""
        t0 = time.perf_counter()
        outcome = "NO_REPLY"
        model = ""
        try:
            assert isinstance(req.payload, bytearray)
            payload, answer = self.trust.check(req.op, req.payload)
            if answer is not None:
                await self.stream.send_all(encode_response(Status.OK, answer))
                outcome = "OK"
                return
            if req.key_error:
                raise InvalidRequest(req.key_error)
            if req.flags:
                raise InvalidRequest(f"flags 0x{req.flags:02x} are not implemented (compression is not supported)")
            if req.op not in OPS:
                what = "a Store service opcode" if is_store_op(req.op) else "an unknown opcode"
                raise NotSupported(f"opcode 0x{req.op:02x} is {what}; this is an engine node (a router)")
            key, by_key = _split_key(req.key)
            by_json, payload = _take_model(req.op, payload)
            if by_key and by_json and self.hub.router.find(by_key) is not self.hub.router.find(by_json):
                raise InvalidRequest(f"the key names model '{by_key}' and the payload's \"model\" '{by_json}'")
            if req.op == Op.INFO and not (by_key or by_json):
                await self.stream.send_all(encode_response(Status.OK, await self._info(req)))
                outcome = "OK"
                return
            m = self.hub.pick(by_key or by_json)
            model = m.name
            try:
                if req.op == Op.SWAP_QUANT and swap_quant_key(payload) in m.quants:  # the router's own switch
                    raise InvalidRequest(
                        f"quant '{swap_quant_key(payload)}' is a model of this router: load it by name "
                        "(POST /models/load, or a request that names it), which switches in place"
                    )
                self.hub.check_ready(m)
                status = await self._relay(m, req, key, payload)
            except HydraTrioError as exc:
                raise exc.with_meta(model=m.name) from None
            outcome = "NO_REPLY" if status is None else Status(status).name if status in OPS_STATUS else str(status)
        except HydraTrioError as exc:
            outcome = exc.hydra_status.name
            await self.stream.send_all(encode_response(exc.hydra_status, {"error": str(exc), **exc.reply_meta()}))
        finally:
            log.info(
                "[%s] hydra %s key=%r model=%s %d bytes -> %s in %.1f ms",
                req.trace_id,
                op_name(req.op),
                req.key,
                model or "-",
                req.payload_len,
                outcome,
                (time.perf_counter() - t0) * 1e3,
            )

    async def _info(self, req: HydraRequest) -> dict[str, Any]:
        """INFO of the router's port: a compute-only node's (:func:`~hydra_trio.hydra.ops.info_meta`), or with
        exactly one model loaded that model's own, with ``role: "router"`` and ``models``."""
        own = info_meta(self.hub.target)
        loaded = [m for m in self.hub.router.models.values() if m.status == LOADED and not m.stopping]
        meta = own
        if len(loaded) == 1:
            try:
                status, child = await self._call(loaded[0], req)
            except (ModelUnavailable, ChildGone, ProtocolError) as exc:
                log.info("hydra: INFO of %s: %s; the router's own", loaded[0].name, exc)
            else:
                if status == Status.OK:
                    meta = {**child, **{k: own[k] for k in ROUTER_KEYS if k in own}}
                    if "rpc_backend" not in own:
                        meta.pop("rpc_backend", None)
        return {**meta, "role": "router", "models": self.hub.models_meta()}

    # ------------------------------------------------------------------ relay
    async def _upstream(self, m: ModelInstance) -> tuple[Upstream, bool]:
        """This connection's Hydra connection to ``m``'s child, and whether it was opened now (a connection to
        an earlier child of the model is closed first)."""
        up = self.upstreams.get(m.name)
        if up is not None and up.port == m.port and up.process is m.process:
            return up, False
        if up is not None:
            await self._drop(m.name)
        try:
            stream = await trio.open_tcp_stream(CHILD_HOST, m.port)
        except OSError as exc:
            raise ModelUnavailable(f"proxy error: model {m.name} cannot be reached: {exc}") from None
        up = self.upstreams[m.name] = Upstream(stream, m.port, m.process)
        return up, True

    async def _drop(self, name: str) -> None:
        up = self.upstreams.pop(name, None)
        if up is not None:
            await up.aclose()

    async def _send(self, m: ModelInstance, req: HydraRequest, key: str, payload: bytearray) -> Upstream:
        """Open (or reuse) the connection to ``m``'s child and send it the request with ``key`` and ``payload``.

        Raises:
            ModelUnavailable: the child cannot be reached.
            ChildGone: the connection broke while sending (a new one may work: the child closed an idle one).
        """
        up, fresh = await self._upstream(m)
        up.fresh = fresh
        head = encode_request_header(req.op, key, req.trace_id, len(payload))
        try:
            await up.stream.send_all(head + payload if len(payload) < RELAY_CHUNK else head)
            if len(payload) >= RELAY_CHUNK:
                await up.stream.send_all(memoryview(payload))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ChildGone(f"the connection broke while sending ({exc})") from None
        return up

    async def _call(self, m: ModelInstance, req: HydraRequest) -> tuple[int, dict[str, Any]]:
        """Send ``req`` (no payload) to ``m`` and read its reply whole: (status, meta); for INFO.  A reused
        connection the child closed meanwhile is replaced once.

        Raises:
            ModelUnavailable, ChildGone, ProtocolError: no reply came (the connection is closed).
        """
        for attempt in (1, 2):
            up = None
            try:
                up = await self._send(m, req, _split_key(req.key)[0], bytearray())
                return await _read_reply(up.stream)
            except ChildGone:
                await self._drop(m.name)
                if attempt == 2 or up is None or up.fresh:
                    raise
            except BaseException:
                await self._drop(m.name)
                raise
        raise AssertionError("unreachable")

    async def _relay(self, m: ModelInstance, req: HydraRequest, key: str, payload: bytearray) -> int | None:
        """Relay one request to ``m``'s child and its reply back, while the client stays; the reply's status,
        or None when the client left (its connection to the child is closed: the child's work stops)."""
        release = self.hub.router.acquire(m, used=True)
        relay = ReplyRelay(self.stream, req.op)
        try:
            try:
                up = await self._send(m, req, key, payload)
                stayed = await relay.run_unless_client_leaves(up.stream)
            except ChildGone:
                if relay.started or m.name not in self.upstreams or self.upstreams[m.name].fresh:
                    raise
                # the child closed a connection left idle (its idle timeout) without reading the request: anew
                await self._drop(m.name)
                relay = ReplyRelay(self.stream, req.op)
                up = await self._send(m, req, key, payload)
                stayed = await relay.run_unless_client_leaves(up.stream)
            if not stayed:
                log.info(
                    "[%s] hydra: the client left during %s; its connection to %s closed",
                    req.trace_id,
                    op_name(req.op),
                    m.name,
                )
                await self._drop(m.name)
                return None
            return relay.status
        except ChildGone as exc:
            await self._drop(m.name)
            if not relay.started:
                raise ModelUnavailable(f"proxy error: model {m.name}: {exc} before its reply") from None
            if padding := relay.pad_decode():
                await self.stream.send_all(padding)
                log.warning(
                    "[%s] hydra: model %s went away during DECODE; its frames end with the error flag",
                    req.trace_id,
                    m.name,
                )
                return relay.status
            raise trio.BrokenResourceError(f"model {m.name} went away in the middle of its reply") from None
        except ProtocolError as exc:
            await self._drop(m.name)
            if not relay.started:
                raise ModelUnavailable(f"proxy error: model {m.name} answered no valid reply: {exc}") from None
            raise trio.BrokenResourceError(f"model {m.name} broke its reply's framing: {exc}") from None
        finally:
            release()


class ReplyRelay:
    """Copies one reply frame from a child's connection to the client's as it arrives: the header and meta
    once whole (so a child that goes before it leaves nothing half-sent), then every payload byte, a DECODE's
    in whole 9-byte frames (so that its end can be padded, :meth:`pad_decode`).

    Raises :class:`ChildGone` when the child's connection ends first, ProtocolError for a reply that breaks
    the framing."""

    def __init__(self, client: trio.abc.Stream, op: int) -> None:
        self.client = client
        self.op = op
        self.dec = ResponseDecoder()
        self.status: int | None = None
        self.started = False
        self.payload_len = 0
        self.payload_sent = 0
        self._pending = bytearray()

    async def run_unless_client_leaves(self, upstream: trio.abc.Stream) -> bool:
        """:meth:`run`, cancelled once the client closes its connection
        (:func:`~hydra_trio.transport.net.wait_peer_closed`); False when it was."""
        done = False
        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    await wait_peer_closed(self.client)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                try:
                    await self.run(upstream)
                    done = True
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # the watcher never fails: the relay's own error
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        return done

    async def run(self, upstream: trio.abc.Stream) -> None:
        """Copy the reply from ``upstream`` until it is whole."""
        seen = 0  # payload bytes decoded
        while True:
            data = await _receive(upstream)
            self.dec.receive_data(data)
            ended = False
            while (ev := self.dec.next_event()) is not NEED_DATA:
                if isinstance(ev, ResponseStarted):
                    self.status, self.payload_len, self.started = ev.header.status, ev.header.payload_len, True
                elif isinstance(ev, ResponseEnded):
                    ended = True
                    break
                else:
                    seen += len(ev.data)
            if ended and self.dec.unread:
                raise ProtocolError(f"{self.dec.unread} bytes after the reply")
            self._pending += data
            if not self.started:
                continue
            hold = seen % DECODE_FRAME_SIZE if self.op == Op.DECODE and not ended else 0
            out = self._pending[: len(self._pending) - hold]
            self._pending = self._pending[len(out) :]
            self.payload_sent = seen - hold
            if out:
                await self.client.send_all(out)
            if ended:
                return

    def pad_decode(self) -> bytes:
        """For a DECODE whose frames had begun: the rest of its payload as frames with the error flag, then
        padding (as a node whose generation fails); else ``b""``."""
        left = self.payload_len - self.payload_sent
        if self.op != Op.DECODE or self.status != Status.OK or left <= 0 or left % DECODE_FRAME_SIZE:
            return b""
        return DecodeFramer(left // DECODE_FRAME_SIZE).finish("error")


async def _receive(upstream: trio.abc.Stream) -> bytes:
    """The child's next bytes; raises :class:`ChildGone` when its connection closed or broke."""
    try:
        data = await upstream.receive_some(RELAY_CHUNK)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise ChildGone(f"the connection broke ({exc})") from None
    if not data:
        raise ChildGone("the connection closed")
    return bytes(data)


async def _read_reply(upstream: trio.abc.Stream) -> tuple[int, dict[str, Any]]:
    """(status, meta) of the next reply on ``upstream``, which has no payload (INFO's).

    Raises:
        ChildGone: the connection ended first.
        ProtocolError: the reply breaks the framing, or has a payload.
    """
    dec = ResponseDecoder(max_payload=0)
    status: int = Status.ERROR
    meta: dict[str, Any] = {}
    while True:
        dec.receive_data(await _receive(upstream))
        while (ev := dec.next_event()) is not NEED_DATA:
            if isinstance(ev, ResponseStarted):
                status, meta = ev.header.status, ev.meta
            elif isinstance(ev, ResponseEnded):
                return status, meta

"""The Hydra binary protocol, server side: connections (:mod:`.session`) and operations (:mod:`.ops`).

Framing rules (hydra-protocol.md §2, the **[fix]** rows included): every
request gets exactly one well-formed reply, non-OK replies carry
``{"error": ...}``; a payload is always consumed before the next header
(over its cap: reply BAD_REQUEST, then close); bad magic closes without a
reply; unknown and Store opcodes answer NOT_IMPLEMENTED and the connection
stays usable.  Opcodes: hydra-protocol.md §3.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from ..control import ControlChannel
from ..engine.engine import Engine
from ..errors import HydraTrioError
from ..access import AccessSettings, Refusals, new_refusals
from ..tls import peer_of
from ..ggml_rpc.backend import RpcBackend
from ..http.metrics import NodeMetrics
from ..protocol.hydra import Op, Status, encode_response, is_store_op
from .gate import ConnectionTrust, Gate
from .ops import OPS, Node, OpContext, Reply, info_meta, payload_buffer, reply_for
from .session import Drain, HydraRequest, HydraSettings, serve_connection

log = logging.getLogger("hydra_trio.hydra")

__all__ = ["HydraHandler", "HydraSettings"]


class HydraHandler:
    """Serves Hydra connections for one node (``engine`` None: a node without a model).

    ``access`` (``control_allow``, ``hydra_token``) decides which connections
    may run the ops that change the node (:mod:`hydra_trio.hydra.gate`);
    refusals are counted in ``refused`` at ``("hydra", reason)``.
    """

    def __init__(
        self,
        engine: Engine | None,
        control: ControlChannel | None,
        settings: HydraSettings = HydraSettings(),
        rpc: RpcBackend | None = None,
        metrics: NodeMetrics | None = None,
        access: AccessSettings = AccessSettings(),
        refused: Refusals | None = None,
    ) -> None:
        self.node = Node(engine, control, rpc, settings)
        self.settings = settings
        self.requests = 0
        self.metrics = metrics or NodeMetrics(engine)  # counted once per request in _dispatch
        self._drain = Drain()
        self.gate = Gate(access.control_allow, access.hydra_token, refused if refused is not None else new_refusals())

    async def __call__(self, stream: trio.SocketStream) -> None:
        """Serve requests on ``stream`` until the peer closes, a timeout, a framing error or a drain."""
        trust = self.gate.connection(peer_of(stream))

        async def dispatch(req: HydraRequest, stream: trio.SocketStream) -> None:
            await self._dispatch(req, stream, trust)

        await serve_connection(
            stream, self.settings, dispatch,
            keeps_payload=lambda op: op in OPS and OPS[op].keeps_payload and trust.keeps_payload(op),
            max_payload_for=self._max_payload, drain=self._drain, buffer_for=payload_buffer,
        )

    def drain(self) -> None:
        """Graceful shutdown: connections close between requests (idle ones now); requests in flight finish."""
        self._drain.start()

    @property
    def draining(self) -> bool:
        return self._drain.draining

    def info(self) -> dict[str, Any]:
        """INFO meta (see :func:`hydra_trio.hydra.ops.info_meta`)."""
        return info_meta(self.node)

    def _max_payload(self, op: int) -> int:
        s = self.settings
        return s.max_state_payload if op == Op.STATE_PUT else s.max_json_payload

    async def _dispatch(self, req: HydraRequest, stream: trio.SocketStream, trust: ConnectionTrust) -> None:
        """Answer one whole request: the op's reply, or the reply its refusal maps to; one log line, one count."""
        self.requests += 1
        t0 = time.perf_counter()
        name = Op(req.op).name if req.op in Op._value2member_map_ else f"0x{req.op:02x}"
        status: Status | None = Status.OK
        ctx: OpContext | None = None
        try:
            try:
                # the access rules first: a refused op is refused whatever else is wrong with it
                req.payload, answer = trust.check(req.op, req.payload)
                if answer is not None:
                    await stream.send_all(encode_response(Status.OK, answer))
                    return
                if req.key_error:
                    raise Reply(Status.BAD_REQUEST, req.key_error)
                if req.flags:
                    raise Reply(Status.BAD_REQUEST,
                                f"flags 0x{req.flags:02x} are not implemented (compression is not supported)")
                spec = OPS.get(req.op)
                if spec is None:
                    what = "a Store service opcode" if is_store_op(req.op) else "an unknown opcode"
                    raise Reply(Status.NOT_IMPLEMENTED, f"opcode 0x{req.op:02x} is {what}; this is an engine node")
                ctx = OpContext(self.node, req, stream)
                await spec.run(ctx)
            except HydraTrioError as exc:
                raise reply_for(exc) from None
        except Reply as r:
            status = r.status
            await stream.send_all(encode_response(r.status, r.meta))
        except BaseException:
            status = None  # the connection broke or the node stopped: no reply (or part of one) went out
            raise
        finally:
            seconds, outcome = time.perf_counter() - t0, Status(status).name if status is not None else "NO_REPLY"
            self.metrics.hydra_request(
                name if req.op in OPS else "unknown", outcome, seconds,
                state_in=req.payload_len if req.op == Op.STATE_PUT and status == Status.OK else 0,
                state_out=ctx.blob_bytes_sent if ctx is not None else 0,
            )
            log.info(
                "[%s] hydra %s key=%r %d bytes -> %s in %.1f ms",
                req.trace_id, name, req.key, req.payload_len, outcome, seconds * 1e3,
                extra={"trace_id": req.trace_id, "op": name, "ms": round(seconds * 1e3, 3),
                       **({"slot": int(req.key)} if req.key.isascii() and req.key.isdigit() and len(req.key) < 10 else {})},
            )

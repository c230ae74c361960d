"""One Hydra connection, server side: its trust, its payload policy and its dispatch, in one protocol object.

The connection loop (:func:`hydra_trio.hydra.session.serve_connection`, the
transport) reads and decodes bytes and hands each whole request to one
:class:`ServerConnection`, as hypercorn's ``TCPServer`` hands its events to
one protocol object (``H11Protocol``).  The object owns what belongs to this
connection alone:

- its **trust** (:class:`~hydra_trio.hydra.gate.ConnectionTrust`): which ops
  this peer may run under the node's ``--control-allow`` / ``--hydra-token``
  (the policy: :mod:`hydra_trio.hydra.gate`); a token presented on it trusts
  this connection only, until it closes;
- its **payload policy**: the cap per op (``max_state_payload`` for
  STATE_PUT, ``max_json_payload`` for the rest, docs/hydra-protocol.md §2) and
  whether a payload is kept (only ops that read it, and never a control op's
  this connection may not run, CONFIGURE excepted: it may carry the token),
  and where (a large STATE_PUT straight into a buffer of the KV transfer pool);
- its **dispatch**: the access rules first, then the op from
  :data:`hydra_trio.hydra.ops.OPS`; every request gets one reply, one log
  line and one count in ``/metrics``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from ..engine import BlobBuffer
from ..errors import HydraTrioError, InvalidRequest, NotSupported
from ..protocol.hydra import Op, Status, encode_response, is_store_op, op_name
from ..service.metrics import NodeMetrics
from ..transport.net import wait_peer_closed
from .gate import ConnectionTrust
from .ops import OPS, OpContext, OpTarget, payload_buffer
from .session import HydraRequest

log = logging.getLogger("hydra_trio.hydra")

__all__ = ["WATCHED_OPS", "ServerConnection"]

WATCHED_OPS = frozenset({Op.PREFILL, Op.DECODE})
"""Ops that work long on the engine before (or while) they reply: a peer that closes the connection meanwhile
cancels them (:func:`_unless_peer_leaves`), freeing the slot, instead of their running to the end."""


async def _unless_peer_leaves(stream: trio.abc.Stream, run: Any, ctx: OpContext) -> bool:
    """``await run(ctx)``, cancelled once the peer closes the connection
    (:func:`~hydra_trio.transport.net.wait_peer_closed`); False when it was.  The op's own errors are
    raised as they are."""
    gone = False
    try:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal gone
                await wait_peer_closed(stream)
                gone = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await run(ctx)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the watcher never fails: the op's own error
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return not gone


class ServerConnection:
    """The protocol object of one Hydra connection (a :class:`hydra_trio.hydra.session.ConnectionProtocol`).

    Args:
        target: what the operations act on (shared by every connection of the node).
        stream: the connection; replies are written to it.
        trust: this connection's standing with the node's gate.
        metrics: where each answered request is counted (``hydra_trio:hydra_requests``).
    """

    def __init__(self, target: OpTarget, stream: trio.abc.Stream, trust: ConnectionTrust, metrics: NodeMetrics) -> None:
        self.target = target
        self.stream = stream
        self.trust = trust
        self.metrics = metrics
        self.requests = 0

    # ------------------------------------------------------------------ payload policy
    def max_payload(self, op: int) -> int:
        """Payload cap in bytes: ``max_state_payload`` for STATE_PUT, ``max_json_payload`` for every other op."""
        s = self.target.settings
        return s.max_state_payload if op == Op.STATE_PUT else s.max_json_payload

    def keeps_payload(self, op: int) -> bool:
        """Whether ``op``'s payload is collected: the op reads it, and this connection may run the op (or it is
        CONFIGURE, whose payload may carry the token).  A refused STATE_PUT's payload is dropped as it arrives."""
        return op in OPS and OPS[op].keeps_payload and self.trust.keeps_payload(op)

    def payload_buffer(self, op: int, payload_len: int) -> BlobBuffer | None:
        """Where a kept payload of ``payload_len`` bytes is received: a transfer-pool buffer for a large
        STATE_PUT, None (a growing bytearray) for the rest (:func:`hydra_trio.hydra.ops.payload_buffer`)."""
        return payload_buffer(op, payload_len)

    # ------------------------------------------------------------------ dispatch
    async def handle(self, req: HydraRequest) -> None:
        """Answer one whole request: the op's reply, or the reply its refusal or error maps to.

        Order of checks: the access rules (a refused op is refused whatever else
        is wrong with it; an auth-only CONFIGURE is answered here), then the
        key's UTF-8, the flags (none is implemented), the opcode (Store and
        unknown opcodes: NOT_IMPLEMENTED), then the op.  This is the Hydra front
        end's error boundary: every refusal is a typed error
        (:mod:`hydra_trio.errors`), and becomes here the reply its
        ``hydra_status`` names, ``{"error": message}`` with its
        :meth:`~hydra_trio.errors.HydraTrioError.reply_meta` keys; the
        connection stays usable.  Logs one line and counts one request, also when no reply
        could be written (outcome ``NO_REPLY``; the exception propagates).
        """
        self.requests += 1
        t0 = time.perf_counter()
        name = op_name(req.op)
        status: Status | None = Status.OK
        ctx: OpContext | None = None
        try:
            # the access rules first: a refused op is refused whatever else is wrong with it
            req.payload, answer = self.trust.check(req.op, req.payload)
            if answer is not None:
                await self.stream.send_all(encode_response(Status.OK, answer))
                return
            if req.key_error:
                raise InvalidRequest(req.key_error)
            if req.flags:
                raise InvalidRequest(f"flags 0x{req.flags:02x} are not implemented (compression is not supported)")
            spec = OPS.get(req.op)
            if spec is None:
                what = "a Store service opcode" if is_store_op(req.op) else "an unknown opcode"
                raise NotSupported(f"opcode 0x{req.op:02x} is {what}; this is an engine node")
            ctx = OpContext(self.target, req, self.stream)
            if req.op not in WATCHED_OPS:
                await spec.run(ctx)
            elif not await _unless_peer_leaves(self.stream, spec.run, ctx):
                log.info("[%s] hydra: the peer closed the connection during %s; its work stopped", req.trace_id, name)
                status = None  # no reply: nobody is there to read it
        except HydraTrioError as exc:
            status = exc.hydra_status
            await self.stream.send_all(encode_response(status, {"error": str(exc), **exc.reply_meta()}))
        except BaseException:
            status = None  # the connection broke or the node stopped: no reply (or part of one) went out
            raise
        finally:
            self._record(req, name, status, ctx, time.perf_counter() - t0)

    def _record(
        self, req: HydraRequest, name: str, status: Status | None, ctx: OpContext | None, seconds: float
    ) -> None:
        """One count in ``/metrics`` and one log line for an answered (or broken-off) request."""
        outcome = Status(status).name if status is not None else "NO_REPLY"
        self.metrics.hydra_request(
            name if req.op in OPS else "unknown",
            outcome,
            seconds,
            state_in=req.payload_len if req.op == Op.STATE_PUT and status == Status.OK else 0,
            state_out=ctx.blob_bytes_sent if ctx is not None else 0,
        )
        log.info(
            "[%s] hydra %s key=%r %d bytes -> %s in %.1f ms",
            req.trace_id,
            name,
            req.key,
            req.payload_len,
            outcome,
            seconds * 1e3,
            extra={
                "trace_id": req.trace_id,
                "op": name,
                "ms": round(seconds * 1e3, 3),
                **({"slot": int(req.key)} if req.key.isascii() and req.key.isdigit() and len(req.key) < 10 else {}),
            },
        )

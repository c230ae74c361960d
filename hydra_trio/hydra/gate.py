"""Who may run the Hydra ops that change the node; the policy is in docs/protocol-notes.md.

- **Control ops** (:data:`CONTROL_OPS`: CONFIGURE, SET_EXPERT_MODE, STATE_PUT,
  SWAP_QUANT, PIPELINE_ATTACH) need a *trusted* connection when the node has
  ``--control-allow`` or ``--hydra-token``: a peer in the allow-list (or with
  an allowed verified identity, the TLS hook of :class:`hydra_trio.transport.access.Peer`),
  or a connection that presented the token.  Without either flag every
  connection is trusted, as the orchestrator expects.
- **Read-only and inference ops** (INFO, STATE_META, STATE_GET, PREFILL,
  DECODE) stay open: they change no setting of the node (PREFILL and DECODE
  use a slot as an HTTP completion does, and HTTP is guarded by API keys, not
  by this list).
- **The token** travels as the key ``auth`` of a CONFIGURE payload
  (``{"auth": "TOKEN"}``); a right one marks the *connection* trusted until it
  closes, a wrong one is refused (counted ``invalid_token``) and applies
  nothing.  A CONFIGURE that carries only ``auth`` changes nothing, so it is
  answered by the gate itself, on any node: meta ``success``, ``trusted``.
  Other keys in the same CONFIGURE are applied as usual once trusted.
- **A refusal** is a BAD_REQUEST reply (the protocol's one status for "the
  request as sent will not be done; do not retry it as it is", the
  4xx of docs/hydra-protocol.md §2) with ``{"error", "refused": "not_allowed" |
  "invalid_token", "op"}``; the payload of a refused STATE_PUT is read and
  dropped, never kept; the connection stays usable.  Each refusal is counted
  at ``("hydra", reason)``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..errors import InvalidRequest
from ..protocol.hydra import Op, op_name
from ..transport.access import AllowList, Peer, Refusals, Secrets, allowed
from ..validation import strict
from ..validation.strict import MessageError

log = logging.getLogger("hydra_trio.hydra")

CONTROL_OPS = frozenset({Op.CONFIGURE, Op.SET_EXPERT_MODE, Op.STATE_PUT, Op.SWAP_QUANT, Op.PIPELINE_ATTACH})
"""The ops that change the node: they need a trusted connection when access rules are set."""

AUTH_KEY = "auth"
"""The CONFIGURE key that carries the ``--hydra-token``."""


class Gate:
    """The access rules of one node's Hydra connections.

    Args:
        control_allow: peers trusted for control ops; None with no token: everyone.
        token: the ``--hydra-token`` (None: no token is accepted).
        refused: counter bumped at ``("hydra", reason)`` for each refusal.
    """

    def __init__(self, control_allow: AllowList | None, token: str | None, refused: Refusals) -> None:
        self.control_allow = control_allow
        self.tokens = Secrets([token] if token else [])
        self.refused = refused
        self.open = control_allow is None and not self.tokens

    def connection(self, peer: Peer) -> ConnectionTrust:
        """The trust of a new connection from ``peer`` (trusted at once when its address/identity is allowed)."""
        if self.open:
            return ConnectionTrust(self, peer, True)
        return ConnectionTrust(self, peer, self.control_allow is not None and allowed(self.control_allow, peer))


class ConnectionTrust:
    """One connection's standing with the :class:`Gate`; :attr:`trusted` may turn True once (the token)."""

    def __init__(self, gate: Gate, peer: Peer, trusted: bool) -> None:
        self.gate = gate
        self.peer = peer
        self.trusted = trusted

    def keeps_payload(self, op: int) -> bool:
        """False for a control op this connection may not run, *except* CONFIGURE (its payload may hold
        the token): the payload of a refused STATE_PUT is dropped as it arrives, never held."""
        return self.trusted or op not in CONTROL_OPS or op == Op.CONFIGURE

    def check(self, op: int, payload: bytearray) -> tuple[bytearray, dict[str, Any] | None]:
        """Pass or refuse one whole request.

        Returns ``(payload, answer)``: the payload to run the op with (a
        CONFIGURE's ``auth`` key removed), and an OK meta when the gate has
        answered the request itself (a CONFIGURE with only ``auth``), else None.

        Raises:
            InvalidRequest: BAD_REQUEST with ``refused`` in its meta, for a wrong token or a
                control op on an untrusted connection.
        """
        name = op_name(op)
        if op == Op.CONFIGURE:
            payload, answer = self._configure_auth(payload, name)
            if answer is not None:
                return payload, answer
        if op in CONTROL_OPS and not self.trusted:
            why = (
                f"peer {self.peer} is not in {self.gate.control_allow.flag or '--control-allow'} "
                f"({self.gate.control_allow})"
                if self.gate.control_allow is not None
                else "this node requires --hydra-token for control ops"
            )
            raise self._refuse(
                "not_allowed",
                f"{name} refused: {why}; send the node's token (hydra-trio commands: --token or "
                f"$HYDRA_TRIO_TOKEN; HydraClient(token=...)) as CONFIGURE "
                f'{{"{AUTH_KEY}": ...}} first, or connect from an allowed address',
                name,
            )
        return payload, None

    def _configure_auth(self, payload: bytearray, name: str) -> tuple[bytearray, dict[str, Any] | None]:
        """Take ``auth`` out of a CONFIGURE object; check it; answer an auth-only CONFIGURE here."""
        try:
            params = strict.load_json_object(payload)
        except MessageError:  # invalid JSON, NaN, too deeply nested, not an object, not UTF-8
            return payload, None  # the op answers BAD_REQUEST for it (or the gate refuses it first)
        if AUTH_KEY not in params:
            return payload, None
        token = params.pop(AUTH_KEY)
        if self.gate.tokens:
            if not isinstance(token, str) or not self.gate.tokens.matches(token):
                raise self._refuse("invalid_token", f"{name} refused: wrong {AUTH_KEY} token", name)
            if not self.trusted:
                log.info("hydra: %s presented the token; its connection is trusted for control ops", self.peer)
            self.trusted = True
        rest = bytearray(json.dumps(params).encode()) if params else bytearray()
        if params:
            return rest, None
        return rest, {
            "success": True,
            "trusted": self.trusted,
            "tier": 1,
            "params_applied": {},
            "deferred_keys": [],
            "unrecognized_keys": [],
        }

    def _refuse(self, reason: str, error: str, op: str) -> InvalidRequest:
        self.gate.refused["hydra", reason] += 1
        log.warning("hydra: %s: %s", self.peer, error)
        return InvalidRequest(error).with_meta(refused=reason, op=op)

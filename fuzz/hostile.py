"""Fuzzing rules for what an unattended node meets: long requests, vanished clients, hostile numbers, corrupt blobs.

:class:`HostileRules` is mixed into :class:`fuzz.wire.LiveServerMachine`; its
rules need the helpers of :mod:`fuzz.live` (imported lazily, as the two
modules refer to each other).  Each rule checks the right value, not just
"no crash": a long request answers in full, a hostile number is a 400 naming
its field (or runs, when it is inside the documented bounds), a corrupt blob
is refused and the slot keeps its tokens.
"""

from __future__ import annotations

import json
import math
import struct
import time

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from hydra_trio.engine.kv.state import HEADER_SIZE
from hydra_trio.engine.settings import INT32_MAX
from hydra_trio.protocol.hydra import Op, Status, encode_request

from . import wire
from .findings import timeouts_are_findings
from .strategies import SurrogateCase, http_surrogate_bodies, hydra_surrogate_payloads

# field -> (rule, C type, lo, hi), as llama-server reads the field (tools/server/server-schema.cpp):
#   soft: clamped into [lo, hi], always answered;  hard: a 400 outside [lo, hi] (a float field compared as a
#   32-bit float, an integer field after truncation);  any: no limits;  finite: a 400 unless finite as a
#   32-bit float (llama.cpp's common_sampler_init);  repeat_penalty: finite, > 0 and 1/value finite;
#   seed: any finite number (modulo 2**32)
RULES: dict[str, tuple[str, str, float, float]] = {
    "temperature": ("soft", "float", 0.0, math.inf),
    "top_k": ("soft", "int", 0, INT32_MAX),
    "top_p": ("soft", "float", 0.0, 1.0),
    "min_p": ("soft", "float", 0.0, 1.0),
    "mirostat": ("soft", "int", 0, 2),
    "typical_p": ("any", "float", -math.inf, math.inf),
    "seed": ("seed", "int", -math.inf, math.inf),
    "repeat_penalty": ("repeat_penalty", "float", 0.0, math.inf),
    "presence_penalty": ("finite", "float", -math.inf, math.inf),
    "frequency_penalty": ("finite", "float", -math.inf, math.inf),
    "repeat_last_n": ("hard", "int", -1, INT32_MAX),  # -1: the slot's context (earlier llama-server versions')
    "min_keep": ("hard", "int", 0, INT32_MAX),
    "adaptive_decay": ("hard", "float", 0.0, 0.99),
    "max_tokens": ("hard", "int", -1, INT32_MAX),
    "n_predict": ("hard", "int", -1, INT32_MAX),
}
BUDGETS = ("n_predict", "max_tokens")
"""Fields that are the token budget itself: sent alone, and not at all when the budget they give is unbounded."""

_huge_ints = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**63 - 1, 2**63, -(2**31), -2, -1, 0, 10**30]),
)
_nasty_floats = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-320", "true", "false"]),  # raw JSON text
)


def _json_number(v: object) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _f32(x: float) -> float:
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _read(raw: str) -> float | None:
    """The JSON number ``raw`` as llama-server's JSON library holds it (a boolean is 1 or 0), or None for text
    that is not JSON (NaN, Infinity)."""

    def not_json(name: str) -> float:
        raise ValueError(name)

    try:
        v = json.loads(raw, parse_constant=not_json)
    except ValueError:
        return None
    return int(v) if isinstance(v, bool) else v


def _accepted(field: str, raw: str) -> bool:
    """Whether ``RULES`` accepts this JSON number for ``field`` (the node answers it rather than a 400)."""
    rule, kind, lo, hi = RULES[field]
    v = _read(raw)
    if v is None:
        return False
    if rule in ("soft", "any"):
        return True
    if rule == "seed":
        return math.isfinite(v)
    if rule == "finite":
        return math.isfinite(_f32(v))
    if rule == "repeat_penalty":
        f = _f32(v)
        return math.isfinite(f) and f > 0 and math.isfinite(_f32(1.0 / f))
    if kind == "float":
        return _f32(lo) <= _f32(v) <= _f32(hi)
    if isinstance(v, float):
        if not math.isfinite(v):
            return False
        v = math.trunc(v)
    return lo <= v <= hi


class HostileRules(RuleBasedStateMachine):
    """Rules for issue "unattended for weeks" (see the module docstring)."""

    @rule(n=st.integers(16, 96))
    @timeouts_are_findings
    def long_request_outlives_timeouts(self, n: int) -> None:
        """A non-streamed request silent for longer than the server's client timeouts still answers in full."""
        wire.STATS["http"] += 1
        r = self.http.post(
            "/v1/completions",
            json={"prompt": "Once upon a time", "max_tokens": n, "ignore_eos": True, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == n
        assert r.json()["choices"][0]["finish_reason"] == "length"

    @rule(stream=st.booleans(), after=st.floats(0.0, 0.3), n=st.integers(1, 200))
    @timeouts_are_findings
    def client_vanishes(self, stream: bool, after: float, n: int) -> None:
        """A client that closes its socket before the reply: its slot and connection come back (invariants)."""
        wire.STATS["disconnects"] += 1
        body = json.dumps({"prompt": "Hello", "max_tokens": n, "ignore_eos": True, "stream": stream}).encode()
        with wire.connect() as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            time.sleep(after)

    @rule(field=st.sampled_from(sorted(RULES)), value=st.one_of(_huge_ints, _nasty_floats))
    @timeouts_are_findings
    def hostile_number(self, field: str, value: object) -> None:
        """Any number in any numeric field: a 400 naming the field where llama-server refuses it (hard limits,
        the penalties' finiteness), else a real answer (soft limits clamp, fields without limits take any
        value)."""
        raw = _json_number(value)
        accepted = _accepted(field, raw)
        if field in BUDGETS:
            v = _read(raw)
            if accepted and (v == -1 or v > 16):
                return  # a valid budget this large runs until the context is full
            content = '{"prompt": "The cat sat on the mat.", "%s": %s}' % (field, raw)
        else:
            content = '{"prompt": "The cat sat on the mat.", "n_predict": 4, "%s": %s}' % (field, raw)
        wire.STATS["http"] += 1
        r = self.http.post("/v1/completions", content=content.encode(), headers={"content-type": "application/json"})
        if accepted:
            assert r.status_code == 200, (field, raw, r.text)
        else:
            assert r.status_code == 400, (field, raw, r.text)
            message = r.json()["error"]["message"]
            assert message.startswith(field + ":") or message.startswith("invalid JSON"), (field, raw, message)

    @rule(
        slot=st.integers(0, 1),
        flips=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 7)), min_size=1, max_size=4),
    )
    @timeouts_are_findings
    def corrupt_blob(self, slot: int, flips: list[tuple[int, int]]) -> None:
        """A STATE_GET blob with flipped bits: STATE_PUT refuses it and the slot is unchanged."""
        wire.STATS["hydra"] += 1
        got = wire.hydra_exchange([encode_request(Op.STATE_GET, key=str(slot))])
        assert got is not None
        if got[0] == Status.BUSY:
            return
        status, meta, blob = got
        assert status == Status.OK, meta
        bad = bytearray(blob)
        for pos, bit in flips:
            bad[pos % len(bad)] ^= 1 << bit
        if bytes(bad) == blob:
            return  # the flips cancelled out
        put = wire.hydra_exchange([encode_request(Op.STATE_PUT, key=str(slot), payload=bytes(bad))])
        assert put is not None
        if put[0] == Status.BUSY:
            return
        assert put[0] == Status.ERROR, (flips, put[1])
        after = wire.hydra_exchange([encode_request(Op.STATE_META, key=str(slot))])
        assert after is not None and after[0] == Status.OK
        assert after[1]["n_past"] == meta["n_past"], "a refused blob changed the slot"
        n_tokens = struct.unpack_from("<I", blob, 8)[0]
        assert n_tokens == meta["n_past"] and len(blob) >= HEADER_SIZE

    @rule(case=http_surrogate_bodies())
    @timeouts_are_findings
    def http_lone_surrogate(self, case: SurrogateCase) -> None:
        """A lone surrogate in any string of any endpoint's body: 400 "not valid Unicode" (501 where the
        endpoint is off on this node), and the node's settings are as they were."""
        wire.STATS["http"] += 1
        wire.STATS["not_unicode"] = wire.STATS.get("not_unicode", 0) + 1
        before = _settings()
        r = self.http.post(str(case.target), content=case.body, headers={"content-type": "application/json"})
        if r.status_code != 501:
            assert r.status_code == 400, (case, r.status_code, r.text)
            assert "not valid Unicode" in r.json()["error"]["message"], (case, r.text)
        assert _settings() == before, (case, "a refused request changed the node")

    @rule(case=hydra_surrogate_payloads())
    @timeouts_are_findings
    def hydra_lone_surrogate(self, case: SurrogateCase) -> None:
        """A lone surrogate in any string of a Hydra op's JSON: BAD_REQUEST "not valid Unicode", one reply,
        and the node's settings are as they were."""
        wire.STATS["hydra"] += 1
        wire.STATS["not_unicode"] = wire.STATS.get("not_unicode", 0) + 1
        before = _settings()
        op, key = case.target  # type: ignore[misc]
        got = wire.hydra_exchange([encode_request(op, key=key, payload=case.body)])
        assert got is not None, (case, "the connection closed without a reply")
        assert got[0] == Status.BAD_REQUEST and "not valid Unicode" in got[1]["error"], (case, got[:2])
        assert _settings() == before, (case, "a refused request changed the node")


def _settings() -> dict[str, object]:
    """What no refused request may change: INFO's sampling defaults, chunk size, mode, peer, n_ctx, slots."""
    got = wire.hydra_exchange([encode_request(Op.INFO)])
    assert got is not None and got[0] == Status.OK
    meta = got[1]
    return {
        k: meta.get(k)
        for k in (
            "sampling_defaults",
            "state_chunk_size",
            "mode",
            "peer_addr",
            "layer_split",
            "n_ctx",
            "n_slots",
            "model_hash",
            "quant",
        )
    }


__all__ = ["RULES", "HostileRules"]

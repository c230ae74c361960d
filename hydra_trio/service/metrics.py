"""Prometheus metrics: llama-server's names (``llamacpp:`` prefix) and the node's own (``hydra_trio:``, ``hydra_rpc_``).

Every ``llamacpp:`` family llama-server writes (``server_task_result_metrics::to_metrics`` in
``tools/server/server-task.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors) is here under its
name and type; the speculative-decoding counters count drafts (``--spec-type``).

Most values are read from the counters of the engine (its exclusive tasks too),
the front door and the ggml-RPC backend at scrape time by a custom
collector, so the engine thread never calls into prometheus-client.  The
Hydra requests are counted where they are answered
(:meth:`NodeMetrics.hydra_request`, called once per request by the Hydra
dispatch); their latency goes into a prometheus-client
:class:`~prometheus_client.Histogram` held in the node's own registry.
Every family is listed, with its unit, in docs/operations.md ("Metrics").
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = ["EXPERT_MODES", "HYDRA_LATENCY_BUCKETS", "STATE_RATE_BUCKETS", "NodeMetrics"]

EXPERT_MODES = ("solo", "combined", "pipeline")
# seconds: an INFO takes well under a millisecond, a PREFILL or a multi-GB STATE_PUT tens of seconds
HYDRA_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    float("inf"),
)
# MB/s (10^6 bytes per second) of one STATE_GET / STATE_PUT: a congested link to a loopback transfer from memory
STATE_RATE_BUCKETS = (10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2000.0, 4000.0, 8000.0, 16000.0, float("inf"))
STATE_OPS = {"STATE_GET": "out", "STATE_PUT": "in"}  # the ops whose time is the transfer: op -> direction


class NodeMetrics:
    """One node's ``/metrics``: what it reads at scrape time, and the Hydra counts it keeps itself.

    Args:
        engine: the engine (None on a compute-only node: no ``llamacpp:`` families).
        connections: accepted connections by protocol name (the front door's counts).
        rpc: the ggml-RPC backend (:class:`~hydra_trio.rpc_backend.backend.RpcBackend`) or None.
        open_connections: connections open now, of every protocol.
        open_by_protocol: connections open now by protocol name.
        refused: refusals by the access rules, ``(protocol, reason) -> count``.
        events: the event bus (:class:`~hydra_trio.observability.events.EventBus`): its subscribers and drops.
        http_in_flight: the HTTP requests doing work now, by route (:meth:`hydra_trio.http.inflight.InFlight.counts`).
    """

    def __init__(
        self,
        engine: Engine | None = None,
        connections: Mapping[str, int] | None = None,
        rpc: Any = None,
        open_connections: Callable[[], int] | None = None,
        open_by_protocol: Mapping[str, int] | None = None,
        refused: Mapping[tuple[str, str], int] | None = None,
        events: Any = None,
        http_in_flight: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        self.engine = engine
        self.http_in_flight = http_in_flight
        self.connections = connections if connections is not None else {}
        self.rpc = rpc
        self.open_connections = open_connections
        self.open_by_protocol = open_by_protocol
        self.refused = refused
        self.events = events
        self.hydra_requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.state_bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.registry = CollectorRegistry(auto_describe=False)
        self.hydra_seconds = Histogram(
            "hydra_trio:hydra_request_seconds",
            "Hydra request latency, header in to reply out, by opcode.",
            ["op"],
            buckets=HYDRA_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.state_rate = Histogram(
            "hydra_trio:state_transfer_mb_per_second",
            "KV state transfer rate of one STATE_GET (out) or STATE_PUT "
            "(in, restored), blob bytes / request seconds, in MB/s.",
            ["direction"],
            buckets=STATE_RATE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_Collector(self))

    def hydra_request(self, op: str, status: str, seconds: float, *, state_in: int = 0, state_out: int = 0) -> None:
        """Count one answered Hydra request; an OK STATE_GET / STATE_PUT also observes its rate
        (``state_transfer_mb_per_second``: the blob's bytes over the request's seconds, 10^6 bytes/s).

        Args:
            op: the opcode's name (``INFO``), or ``unknown`` for an opcode the protocol does not name.
            status: the reply's status name (``OK``, ``BUSY``, ...), or ``NO_REPLY`` when the
                connection broke or the node stopped before the reply was written.
            seconds: from the whole request in to the reply out (a streamed DECODE: its whole stream).
            state_in: KV-state bytes restored from the request's payload (an OK STATE_PUT).
            state_out: KV-state bytes written in the reply's payload (STATE_GET, PREFILL).
        """
        self.hydra_requests[op, status] += 1
        self.hydra_seconds.labels(op).observe(seconds)
        if state_in:
            self.state_bytes["in", op] += state_in
        if state_out:
            self.state_bytes["out", op] += state_out
        moved = state_in if STATE_OPS.get(op) == "in" else state_out if STATE_OPS.get(op) == "out" else 0
        if moved and seconds > 0 and status == "OK":
            self.state_rate.labels(STATE_OPS[op]).observe(moved / seconds / 1e6)

    def render(self) -> tuple[bytes, str]:
        """Prometheus text exposition of the current values: ``(body, content_type)``."""
        body = generate_latest(self.registry)
        if self.engine is not None:
            body += _n_tokens_max(self.engine.stats.n_tokens_max)
        return body, CONTENT_TYPE_LATEST


def _n_tokens_max(value: int) -> bytes:
    """``llamacpp:n_tokens_max``, written as llama-server writes it: a counter whose name has no ``_total``
    (prometheus-client would add one to a counter's name, so the family is written here)."""
    name = "llamacpp:n_tokens_max"
    return (
        f"# HELP {name} Largest observed sequence length (prompt + generation)\n"
        f"# TYPE {name} counter\n{name} {float(value)!r}\n"
    ).encode()


class _Collector:
    """Reads the node's counters at scrape time (prometheus-client's custom collector)."""

    def __init__(self, node: NodeMetrics) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        conns = CounterMetricFamily(
            "hydra_trio:connections", "Accepted connections by classified protocol.", labels=["protocol"]
        )
        for proto, n in sorted(node.connections.items()):
            conns.add_metric([proto], n)
        yield conns
        if node.open_connections is not None:
            yield GaugeMetricFamily(
                "hydra_trio:connections_open",
                "Connections open now, of every protocol (--max-connections bounds it).",
                node.open_connections(),
            )
        if node.refused is not None:
            refused = CounterMetricFamily(
                "hydra_trio:refused",
                "Requests and connections refused by the access rules (API keys, "
                "--control-allow, --hydra-token, --rpc-allow).",
                labels=["protocol", "reason"],
            )
            for (proto, reason), n in sorted(node.refused.items()):
                refused.add_metric([proto, reason], n)
            yield refused
        if node.events is not None:
            yield GaugeMetricFamily(
                "hydra_trio:event_subscribers", "GET /v1/events subscribers connected now.", node.events.subscribers
            )
            yield CounterMetricFamily(
                "hydra_trio:events_dropped",
                "Events dropped for subscribers that read too slowly.",
                node.events.dropped_total,
            )
        if node.http_in_flight is not None:
            in_flight = GaugeMetricFamily(
                "hydra_trio:http_requests_in_flight",
                "HTTP requests doing work now (from their arrival to the end of their reply), by route.",
                labels=["route"],
            )
            for route, n in sorted(node.http_in_flight().items()):
                in_flight.add_metric([route], n)
            yield in_flight
        if node.open_by_protocol is not None:
            open_now = GaugeMetricFamily(
                "hydra_trio:protocol_connections_open",
                "Connections open now, by classified protocol.",
                labels=["protocol"],
            )
            for proto, n in sorted(node.open_by_protocol.items()):
                open_now.add_metric([proto], n)
            yield open_now
        yield from _hydra(node)
        if node.rpc is not None:
            rpc = node.rpc
            rpc_bytes = CounterMetricFamily(
                "hydra_trio:rpc_bytes", "Bytes passed through to the ggml-RPC backend.", labels=["direction"]
            )
            rpc_bytes.add_metric(["in"], rpc.bytes_in)
            rpc_bytes.add_metric(["out"], rpc.bytes_out)
            yield rpc_bytes
            yield GaugeMetricFamily(
                "hydra_trio:rpc_backend_active", "1 while the ggml-RPC backend serves.", int(rpc.active)
            )
            yield CounterMetricFamily("hydra_trio:rpc_backend_restarts", "ggml-RPC backend restarts.", rpc.restarts)
            yield from _rpc_front_door(rpc)
        if node.engine is not None:
            yield from _engine(node.engine)


def _hydra(node: NodeMetrics) -> Iterator[Metric]:
    """Hydra requests and KV-state bytes (counted by the dispatch), control-channel changes."""
    reqs = CounterMetricFamily(
        "hydra_trio:hydra_requests", "Hydra requests answered, by opcode and reply status.", labels=["op", "status"]
    )
    for (op, status), n in sorted(node.hydra_requests.items()):
        reqs.add_metric([op, status], n)
    yield reqs
    state = CounterMetricFamily(
        "hydra_trio:state_bytes",
        "KV-state bytes moved by Hydra: in (STATE_PUT restored), out (STATE_GET, PREFILL).",
        labels=["direction", "op"],
    )
    for (direction, op), n in sorted(node.state_bytes.items()):
        state.add_metric([direction, op], n)
    yield state
    if node.engine is not None:
        changes = CounterMetricFamily(
            "hydra_trio:control_changes",
            "Engine-wide changes (SET_EXPERT_MODE, CONFIGURE T2/T3, SWAP_QUANT, PIPELINE_ATTACH) by result.",
            labels=["result"],
        )
        for result, n in node.engine.stats.control.items():
            changes.add_metric([result], n)
        yield changes


def _engine(e: Engine) -> Iterator[Metric]:
    """llama-server's families, and the expert mode and peer."""
    s = e.stats
    yield CounterMetricFamily("llamacpp:prompt_tokens", "Number of prompt tokens processed.", s.prompt_tokens_total)
    yield CounterMetricFamily(
        "llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from the cache", s.prompt_tokens_cached_total
    )
    yield CounterMetricFamily("llamacpp:prompt_seconds", "Prompt process time.", s.prompt_seconds_total)
    yield CounterMetricFamily(
        "llamacpp:tokens_predicted", "Number of generation tokens processed.", s.tokens_predicted_total
    )
    yield CounterMetricFamily(
        "llamacpp:tokens_predicted_seconds", "Predict process time.", s.tokens_predicted_seconds_total
    )
    yield CounterMetricFamily("llamacpp:n_decode", "Number of llama_decode() calls.", s.n_decode_total)
    for name, what, value in (
        ("draft_tokens", "Total draft tokens generated", s.spec_draft_tokens),
        ("accepted_tokens", "Total draft tokens accepted by the target model", s.spec_accepted_tokens),
        ("drafts", "Total speculative decoding verification steps", s.spec_drafts),
    ):
        yield CounterMetricFamily(f"llamacpp:spec_decode_num_{name}", f"Speculative: {what}", value)
    if s.spec_accepted_per_pos:
        per_pos = CounterMetricFamily(
            "llamacpp:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position",
            labels=["position"],
        )
        for i, n in enumerate(list(s.spec_accepted_per_pos)):
            per_pos.add_metric([str(i)], n)
        yield per_pos
    yield CounterMetricFamily(
        "hydra_trio:requests_deferred", "Requests that waited in the queue for a free slot.", s.requests_deferred
    )
    tasks = CounterMetricFamily(
        "hydra_trio:engine_tasks",
        "Typed engine tasks run on the engine thread "
        "(hydra_trio.engine.tasks: save_slot, restore_slot, configure, ...), by type.",
        labels=["type"],
    )
    for kind, n in sorted(dict(s.tasks).items()):  # a copy: the engine thread may add a kind meanwhile
        tasks.add_metric([kind], n)
    yield tasks
    yield GaugeMetricFamily(
        "llamacpp:n_busy_slots_per_decode",
        "Average number of busy slots per llama_decode() call.",
        s.n_busy_slots_total / s.n_decode_total if s.n_decode_total else 0.0,
    )
    yield GaugeMetricFamily(
        "llamacpp:prompt_tokens_seconds",
        "Average prompt throughput in tokens/s.",
        s.prompt_tokens_total / s.prompt_seconds_total if s.prompt_seconds_total else 0.0,
    )
    yield GaugeMetricFamily(
        "llamacpp:predicted_tokens_seconds",
        "Average generation throughput in tokens/s.",
        s.tokens_predicted_total / s.tokens_predicted_seconds_total if s.tokens_predicted_seconds_total else 0.0,
    )
    yield GaugeMetricFamily(
        "hydra_trio:combined_mode", "1 while COMBINED serves new work.", int(e.experts.mode == "combined")
    )
    yield GaugeMetricFamily(
        "hydra_trio:pipeline_mode",
        "1 while a PIPELINE_ATTACH split serves new work.",
        int(e.experts.mode == "pipeline"),
    )
    mode = GaugeMetricFamily(
        "hydra_trio:expert_mode", "1 for the expert mode serving new work, 0 for the others.", labels=["mode"]
    )
    for name in EXPERT_MODES:
        mode.add_metric([name], int(str(e.experts.mode) == name))
    yield mode
    yield GaugeMetricFamily(
        "hydra_trio:peer_reachable",
        "1 while the ggml-RPC peer (--rpc-engine, SET_EXPERT_MODE, PIPELINE_ATTACH) answers; 0 without one.",
        int(bool(e.experts.peer) and e.experts.peer_reachable),
    )
    yield CounterMetricFamily(
        "hydra_trio:expert_mode_switches", "Switches between SOLO and COMBINED models.", s.mode_switches
    )
    yield CounterMetricFamily(
        "hydra_trio:combined_fallbacks", "COMBINED requests answered with SOLO.", s.combined_fallbacks
    )
    yield CounterMetricFamily("hydra_trio:peer_losses", "ggml-RPC peers lost mid-request.", s.peer_losses)

    kv = e.kv_cache()
    if kv:
        info = GaugeMetricFamily(
            "hydra_trio:kv_cache_info",
            "1, labelled with the KV cache types (-ctk, -ctv) and "
            "flash attention in effect (on, off; auto when llama.cpp did not say).",
            labels=["type_k", "type_v", "flash_attn"],
        )
        info.add_metric([kv["type_k"], kv["type_v"], kv["flash_attn"]], 1)
        yield info
        memory = GaugeMetricFamily(
            "hydra_trio:memory_bytes",
            "Bytes the loaded models take, by device and kind (weights, kv, compute), as llama.cpp allocated them.",
            labels=["device", "kind"],
        )
        for dev, use in sorted(e.memory_use().items()):
            for kind, n in use.items():
                memory.add_metric([dev, kind], n)
        yield memory
    yield from _prompt_cache(e.prompt_cache)
    yield GaugeMetricFamily("llamacpp:requests_processing", "Number of requests processing.", e.requests_processing)
    yield GaugeMetricFamily("llamacpp:requests_deferred", "Number of requests deferred.", e.requests_waiting)


def _prompt_cache(pc: Any) -> Iterator[Metric]:
    """The host-RAM prompt cache (:class:`~hydra_trio.engine.batching.prompt_cache.PromptCache`; plain ints)."""
    yield CounterMetricFamily(
        "hydra_trio:prompt_cache_hits", "Prompts that got a prefix restored from the host-RAM prompt cache.", pc.hits
    )
    yield CounterMetricFamily(
        "hydra_trio:prompt_cache_misses",
        "Prompts the slots left at least 32 tokens short of "
        "that no prompt-cache entry helped (failed restores included).",
        pc.misses,
    )
    yield CounterMetricFamily("hydra_trio:prompt_cache_saves", "Slot states kept in the prompt cache.", pc.saves)
    yield CounterMetricFamily(
        "hydra_trio:prompt_cache_restore_failures",
        "Prompt-cache restores llama.cpp refused (the prompt was evaluated instead).",
        pc.restore_failures,
    )
    evicted = CounterMetricFamily(
        "hydra_trio:prompt_cache_evictions", "Prompt-cache entries dropped, by reason.", labels=["reason"]
    )
    for reason, n in sorted(pc.evicted.items()):
        evicted.add_metric([reason], n)
    yield evicted
    yield GaugeMetricFamily("hydra_trio:prompt_cache_bytes", "Bytes of KV state in the prompt cache now.", pc.bytes)
    yield GaugeMetricFamily("hydra_trio:prompt_cache_entries", "Entries in the prompt cache now.", pc.n_entries)
    yield GaugeMetricFamily(
        "hydra_trio:prompt_cache_limit_bytes",
        "The prompt cache's budget (--cache-ram; -1 no limit, 0 off).",
        pc.info()["limit_bytes"],
    )


def _rpc_front_door(rpc: Any) -> Iterator[Metric]:
    """The ggml-RPC queue, crashes and refusals (ggml_rpc.backend.RpcBackend)."""
    yield GaugeMetricFamily("hydra_rpc_clients_waiting", "ggml-RPC clients waiting for the backend.", rpc.waiting)
    yield GaugeMetricFamily("hydra_rpc_clients_serving", "ggml-RPC clients being served (0 or 1).", rpc.serving)
    yield GaugeMetricFamily("hydra_rpc_clients_handshaking", "ggml-RPC clients still sending HELLO.", rpc.handshaking)
    yield CounterMetricFamily("hydra_rpc_clients_served", "ggml-RPC clients passed to the backend.", rpc.connections)
    closed = CounterMetricFamily(
        "hydra_rpc_clients_closed", "ggml-RPC clients refused or closed by the front door.", labels=["reason"]
    )
    for reason, n in sorted(rpc.closed.items()):
        closed.add_metric([reason], n)
    yield closed
    invalid = CounterMetricFamily(
        "hydra_rpc_invalid_messages", "ggml-RPC messages refused by validation, by failed check.", labels=["check"]
    )
    for check, n in sorted(rpc.invalid.items()):
        invalid.add_metric([check], n)
    yield invalid
    yield CounterMetricFamily(
        "hydra_rpc_backend_crashes", "ggml-RPC backend exits by a signal or a non-zero code.", rpc.crashes
    )

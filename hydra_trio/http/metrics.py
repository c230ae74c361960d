"""Prometheus metrics with llama-server's names (``llamacpp:`` prefix), via prometheus-client.

Values are read from the engine's counters at scrape time by a custom
collector, so the engine thread never calls into prometheus-client.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from ..engine.engine import Engine


class _Collector:
    def __init__(
        self, engine: Engine | None, connections: Mapping[str, int], rpc: Any, open_connections: int | None,
        refused: Mapping[tuple[str, str], int] | None = None,
    ) -> None:
        self.refused = refused
        self.engine = engine
        self.connections = connections
        self.rpc = rpc
        self.open_connections = open_connections

    def collect(self) -> Iterator[Metric]:
        conns = CounterMetricFamily(
            "hydra_trio:connections", "Accepted connections by classified protocol.", labels=["protocol"]
        )
        for proto, n in sorted(self.connections.items()):
            conns.add_metric([proto], n)
        yield conns
        if self.open_connections is not None:
            yield GaugeMetricFamily(
                "hydra_trio:connections_open", "Connections open now, of every protocol (--max-connections bounds it).",
                self.open_connections,
            )
        if self.refused is not None:
            refused = CounterMetricFamily(
                "hydra_trio:refused", "Requests and connections refused by the access rules (API keys, "
                "--control-allow, --hydra-token, --rpc-allow).", labels=["protocol", "reason"],
            )
            for (proto, reason), n in sorted(self.refused.items()):
                refused.add_metric([proto, reason], n)
            yield refused
        if self.rpc is not None:
            rpc_bytes = CounterMetricFamily(
                "hydra_trio:rpc_bytes", "Bytes passed through to the ggml-RPC backend.", labels=["direction"]
            )
            rpc_bytes.add_metric(["in"], self.rpc.bytes_in)
            rpc_bytes.add_metric(["out"], self.rpc.bytes_out)
            yield rpc_bytes
            yield GaugeMetricFamily("hydra_trio:rpc_backend_active", "1 while the ggml-RPC backend serves.", int(self.rpc.active))
            yield CounterMetricFamily("hydra_trio:rpc_backend_restarts", "ggml-RPC backend restarts.", self.rpc.restarts)
            yield from _rpc_front_door(self.rpc)
        e = self.engine
        if e is None:
            return
        s = e.stats
        yield CounterMetricFamily("llamacpp:prompt_tokens", "Number of prompt tokens processed.", s.prompt_tokens_total)
        yield CounterMetricFamily("llamacpp:prompt_seconds", "Prompt process time.", s.prompt_seconds_total)
        yield CounterMetricFamily("llamacpp:tokens_predicted", "Number of generation tokens processed.", s.tokens_predicted_total)
        yield CounterMetricFamily(
            "llamacpp:tokens_predicted_seconds", "Predict process time.", s.tokens_predicted_seconds_total
        )
        yield CounterMetricFamily("llamacpp:n_decode", "Number of llama_decode() calls.", s.n_decode_total)
        yield CounterMetricFamily(
            "hydra_trio:requests_deferred", "Requests that waited in the queue for a free slot.", s.requests_deferred
        )
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
        yield GaugeMetricFamily("hydra_trio:combined_mode", "1 while COMBINED serves new work.", int(e.experts.mode == "combined"))
        yield GaugeMetricFamily("hydra_trio:pipeline_mode", "1 while a PIPELINE_ATTACH split serves new work.",
                                int(e.experts.mode == "pipeline"))
        yield CounterMetricFamily("hydra_trio:expert_mode_switches", "Switches between SOLO and COMBINED models.", s.mode_switches)
        yield CounterMetricFamily("hydra_trio:combined_fallbacks", "COMBINED requests answered with SOLO.", s.combined_fallbacks)
        yield CounterMetricFamily("hydra_trio:peer_losses", "ggml-RPC peers lost mid-request.", s.peer_losses)
        yield GaugeMetricFamily("llamacpp:requests_processing", "Number of requests processing.", e.requests_processing)
        yield GaugeMetricFamily("llamacpp:requests_deferred", "Number of requests deferred.", e.requests_waiting)


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


def render(
    engine: Engine | None, connections: Mapping[str, int], rpc: Any = None, open_connections: int | None = None,
    refused: Mapping[tuple[str, str], int] | None = None,
) -> tuple[bytes, str]:
    """Prometheus text exposition of the current values: ``(body, content_type)``.

    ``refused`` (``(protocol, reason) -> count``) becomes ``hydra_trio:refused_total{protocol,reason}``.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(engine, connections, rpc, open_connections, refused))  # type: ignore[arg-type]
    return generate_latest(registry), CONTENT_TYPE_LATEST

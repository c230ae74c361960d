"""hydra-trio's own flags (connections, TLS, access, the ggml-RPC backend, COMBINED, quantizations, logs,
shutdown) and the legacy flags of the cluster's llama-server fork, which llama-server does not have."""

from __future__ import annotations

from typing import Any

import attrs

from ..engine.settings import EngineConfig
from ..http.settings import HttpSettings
from ..observability.logs import LOG_FORMATS
from ..rpc_backend.backend import RpcBackendSettings
from ..transport.frontdoor import FrontDoorSettings
from . import _types as t
from ._flags import ACCEPTED, OWN, Flag


def _default(settings: type[Any], field: str) -> Any:
    """A flag's default: the settings class's own (one place for each default)."""
    return attrs.fields_dict(settings)[field].default


def H(names: tuple[str, ...], note: str, **kw) -> Flag:  # a table row: hydra-trio's own flag
    return Flag(names, OWN, note, group="hydra", **kw)


_rpc = RpcBackendSettings

FLAGS: list[Flag] = [
    # -- models --------------------------------------------------------------------------------------
    H(
        ("--quant",),
        "a quantization SWAP_QUANT may switch to, KEY=PATH|ALIAS, repeatable (e.g. --quant "
        "q4=smollm2-135m --quant q8=smollm2-135m-q8); the -m model is the one whose file matches, else key "
        "'default'; when -a names the -m model's key, each quant's model id is its key",
        value="KEY=PATH|ALIAS",
        type=t.quant_value,
        action="append",
        default=[],
    ),
    H(
        ("--allow-cross-model-kv",),
        "STATE_PUT applies a KV blob of another model file with the same KV identity "
        "(e.g. another quantization of this model)",
        action="store_true",
    ),
    H(
        ("--max-embedding-inputs",),
        "most inputs in one embeddings request; more are a 400 naming this limit (default: 2048, OpenAI's)",
        value="N",
        type=t.int_range(1, t.INT32_MAX),
        default=_default(EngineConfig, "max_embedding_inputs"),
    ),
    H(
        ("--no-model",),
        "a compute-only node: ggml-RPC backend, Hydra INFO and HTTP /health, /version, /slots",
        action="store_true",
    ),
    H(
        ("--no-router-spare",),
        "router mode: start each model's child cold, instead of forking it from the warm interpreter the "
        "router keeps (its fork server, with its imports done: a child starts about 0.5 s sooner with it)",
        action="store_true",
    ),
    # -- connections and HTTP ------------------------------------------------------------------------
    H(
        ("--max-connections",),
        "connections served at once",
        value="N",
        type=t.int_range(1, t.INT32_MAX),
        default=_default(FrontDoorSettings, "max_connections"),
    ),
    H(
        ("--max-event-subscribers",),
        "GET /v1/events subscribers at once (503 past it; default: a quarter of --max-connections, at least 1)",
        value="N",
        type=t.int_range(1, t.INT32_MAX),
    ),
    H(
        ("--classify-timeout",),
        "seconds a new connection has to send its first byte",
        value="SECONDS",
        type=t.seconds(),
        default=_default(FrontDoorSettings, "classify_timeout"),
    ),
    H(
        ("--keep-alive-timeout",),
        "HTTP: seconds an idle connection is kept, and the time a client has to send a request's headers",
        value="SECONDS",
        type=t.seconds(),
        default=_default(HttpSettings, "keep_alive_timeout"),
    ),
    H(
        ("--cors-origin",),
        "HTTP: an origin allowed by CORS, repeatable (adds to --cors-origins)",
        value="ORIGIN",
        action="append",
    ),
    H(
        ("--shutdown-grace",),
        "on SIGTERM/Ctrl-C, let requests in flight finish for up to this long; those still "
        "running then end with an error saying so (a stream's error event, a 503) (0 = end them at once)",
        value="SECONDS",
        type=t.seconds(zero_ok=True),
        default=10.0,
    ),
    H(
        ("--log-level",),
        "log level: DEBUG, INFO, WARNING, ERROR (default: INFO)",
        value="LEVEL",
        type=t.choice("DEBUG", "INFO", "WARNING", "ERROR"),
    ),
    H(
        ("--log-format",),
        "log lines as text, or one JSON object per line with ts, level, logger, msg and, "
        "where they apply, trace_id, slot, op, ms (default: text)",
        value="{text,json}",
        type=t.choice(*LOG_FORMATS),
    ),
    # -- TLS -----------------------------------------------------------------------------------------
    H(
        ("--tls-cert",),
        "PEM certificate chain: serve TLS on the same port (first byte 0x16) for all three "
        "protocols (= --ssl-cert-file)",
        value="FILE",
        dest="tls_cert",
    ),
    H(("--tls-key",), "PEM private key of --tls-cert (= --ssl-key-file)", value="FILE", dest="tls_key"),
    H(
        ("--tls-client-ca",),
        "PEM CA bundle: TLS clients must present a certificate it signed (mutual TLS)",
        value="FILE",
    ),
    H(("--tls-required",), "only loopback peers may connect without TLS (needs --tls-cert)", action="store_true"),
    H(
        ("--rpc-tls",),
        "reach every ggml-RPC peer (--rpc-engine, SET_EXPERT_MODE, PIPELINE_ATTACH) over TLS "
        "through a local loopback tunnel per peer (presents --tls-cert/--tls-key when given)",
        action="store_true",
    ),
    H(
        ("--tls-ca",),
        "--rpc-tls: PEM CA bundle the peer's certificate must chain to (default: the system's)",
        value="FILE",
    ),
    # -- COMBINED and the ggml-RPC backend -----------------------------------------------------------
    H(
        ("--rpc-engine",),
        "COMBINED mode: once the model serves, place its MoE expert tensors on this ggml-RPC "
        "peer (another node's port or --ggml-rpc-port) and switch to COMBINED (a value that is not HOST:PORT leaves "
        "COMBINED off, said at start-up: the node runs SOLO then)",
        value="HOST:PORT",
    ),
    H(
        ("--combined-pattern",),
        "tensors that live on the peer in COMBINED mode",
        value="REGEX",
        type=t.regex,
        default=_default(EngineConfig, "combined_pattern"),
    ),
    H(("--no-rpc-backend",), "do not lend this node's compute over ggml-RPC", action="store_true"),
    H(
        ("--rpc-device",),
        "local ggml device to expose over ggml-RPC, repeatable (default: cpu)",
        value="NAME",
        action="append",
    ),
    H(
        ("--rpc-cache-dir",),
        "tensor cache of the ggml-RPC backend, so repeated uploads are skipped ('' disables it)",
        value="DIR",
        default=str(_default(_rpc, "cache_dir")),
    ),
    H(
        ("--rpc-threads",),
        "CPU threads of the ggml-RPC backend (default: all cores)",
        value="N",
        type=t.int_range(1, t.GGML_MAX_N_THREADS, "ggml's most threads"),
    ),
    H(
        ("--rpc-max-waiting",),
        "ggml-RPC clients that may wait while the backend serves another; more are closed (0 = none wait)",
        value="N",
        type=t.int_range(0, t.INT32_MAX),
        default=_default(_rpc, "max_waiting"),
    ),
    H(
        ("--rpc-wait-timeout",),
        "how long a ggml-RPC client may wait for its turn",
        value="SECONDS",
        type=t.seconds(),
        default=_default(_rpc, "wait_timeout"),
    ),
    H(
        ("--rpc-handshake-timeout",),
        "time for a ggml-RPC client's HELLO to arrive whole, and for the backend to "
        "answer it (a backend that does not is restarted)",
        value="SECONDS",
        type=t.seconds(),
        default=_default(_rpc, "handshake_timeout"),
    ),
    H(
        ("--rpc-stall-timeout",),
        "a begun ggml-RPC message may go this long without a byte (a backend stopped "
        "mid-reply is restarted); idle time between messages is unlimited",
        value="SECONDS",
        type=t.seconds(),
        default=_default(_rpc, "stall_timeout"),
    ),
    H(
        ("--rpc-restart-wait",),
        "how long a ggml-RPC client is held while the backend restarts (0 = not held)",
        value="SECONDS",
        type=t.seconds(zero_ok=True),
        default=_default(_rpc, "restart_wait"),
    ),
    H(
        ("--rpc-max-message-size",),
        "largest ggml-RPC message accepted",
        value="BYTES",
        type=t.int_range(1, 2**63 - 1),
        default=_default(_rpc, "max_message_size"),
    ),
    # -- flags of the cluster's llama-server fork-------------------------------------------------------------
    H(
        ("--rpc-port",),
        "Hydra's llama-server fork: the Hydra protocol's port; also served by this node's front door (every "
        "protocol on every port; 0 or less, or --port itself, opens nothing more)",
        value="PORT",
        type=t.engine_port,
    ),
    H(
        ("--ggml-rpc-port",),
        "Hydra's llama-server fork: the ggml-RPC port a head's --rpc-engine names; also served by this "
        "node's front door (read as C's atoi, as the fork reads it: 0 or less, or --port itself, opens nothing more)",
        value="PORT",
        type=t.c_atoi,
    ),
    H(
        ("--combined-ot-pattern",),
        "Hydra's llama-server fork: REGEX[=BUFT], override-tensor syntax: the regex before the last "
        "'=' is the pattern of the tensors COMBINED places on the --rpc-engine peer (sets --combined-pattern); the "
        "buffer type is ignored, as the fork ignores it (said at start-up)",
        value="REGEX[=BUFT]",
        type=t.combined_ot,
    ),
    Flag(
        ("--peer-only",),
        ACCEPTED,
        "this node lends its compute over ggml-RPC on every port whether or not it "
        "serves a model; --no-model makes a compute-only node",
        group="hydra",
    ),
    Flag(
        ("--combined-split-mode",),
        ACCEPTED,
        "COMBINED places the --combined-pattern tensors on the peer; no split mode applies",
        value="MODE",
        group="hydra",
    ),
    Flag(
        ("--combined-tensor-split",),
        ACCEPTED,
        "COMBINED places the --combined-pattern tensors on the peer; no tensor split applies",
        value="N0,N1,...",
        group="hydra",
    ),
    Flag(
        ("--peer-health-url",),
        ACCEPTED,
        "the head tries its --rpc-engine peer once it serves and watches "
        "the peer's ggml-RPC port from then on (SET_EXPERT_MODE tries again); no separate health probe",
        value="HOST:PORT",
        group="hydra",
    ),
    Flag(
        ("--yarn-ext-ctx",),
        ACCEPTED,
        "Hydra's llama-server fork drops it unread; YaRN follows --yarn-orig-ctx and the --yarn-* flags",
        value="N",
        group="hydra",
    ),
]

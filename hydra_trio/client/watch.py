"""``hydra-trio watch HOST:PORT``: a node's live event stream (``GET /v1/events``) in the terminal.

    hydra-trio watch 127.0.0.1:8080                  live table, refreshed in place
    hydra-trio watch 127.0.0.1:8080 --json           raw events as JSON lines, for scripts
    hydra-trio watch 127.0.0.1:8080 --types slot     only some categories (hydra_trio.observability.events.CATEGORIES)

The table (drawn with :mod:`rich` ``Live``, no hand-made escape codes) shows
the node (version, model, mode, peer, queue, tok/s, connections per
protocol) and its slots from the once-a-second ``stats`` event, and the last
:data:`RECENT` other events (time, type, trace id, a short summary).  The
client is built on trio-websocket.  Both are imported when the watch runs, not
with the module: the ``hydra-trio`` command line (a node included) adds
``watch`` to its parser, and rich with trio-websocket are some 80 modules.

Reconnects: when the connection cannot be opened or drops (the node stopped,
restarted, went away), the watch says so ("disconnected, retrying in N s")
and tries again after 0.5 s, doubling up to 5 s, and back to 0.5 s once a
connection gets its ``hello``.  It never gives up on its own.

Exit codes: 0 on Ctrl-C (SIGINT) or SIGTERM, terminal restored; 1 when the
node refuses the handshake (HTTP 401/403: no or a wrong ``--api-key``) or
its TLS certificate does not verify, as retrying cannot help; 2 bad
arguments (argparse).

Options: ``--api-key KEY`` (default ``$HYDRA_TRIO_API_KEY``) is sent as
``Authorization: Bearer KEY`` (the events endpoint sits behind the node's
``--api-key`` check like the rest of HTTP); ``--tls`` connects with
``wss://`` (``--tls-ca FILE``, ``--tls-cert``/``--tls-key`` for mutual TLS,
as the Hydra client commands).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import ssl
import sys
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import trio

if TYPE_CHECKING:
    from rich.console import JustifyMethod, RenderableType
    from rich.table import Table

from ..observability.events import CATEGORIES, parse_types
from ..transport.tls_options import add_tls_options, check_tls_options, tls_context
from ..validation.address import address_argument, parse_peer

RECENT = 10
"""Non-``stats`` events the table keeps."""

REPLAY = 200
"""Recent events the table asks the node to replay on connecting (the most ``GET /v1/events`` gives)."""

BACKOFF_FIRST = 0.5
BACKOFF_MAX = 5.0

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2


class Fatal(Exception):
    """A failure that retrying cannot mend (a refused handshake, a certificate that does not verify)."""


# --------------------------------------------------------------------------- state and rendering
class WatchState:
    """What the table shows: the node's ``hello``, its last ``stats``, the last events, the connection."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.hello: dict[str, Any] | None = None
        self.stats: dict[str, Any] | None = None
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT)
        self.connected = False
        self.status = "connecting…"
        self.retry_at: float | None = None  # trio.current_time() of the next attempt while disconnected

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "hello":  # a new connection: what it replays (``?recent=``) refills the list
            self.hello, self.stats = event, None
            self.events.clear()
        elif kind == "stats":
            self.stats = event
        else:
            self.events.append(event)


def _clock(ts: Any) -> str:
    """Unix seconds → local ``HH:MM:SS.mmm``."""
    try:
        t = float(ts)
    except (TypeError, ValueError):
        return "?"
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def summary(event: dict[str, Any], width: int = 200) -> str:
    """A one-line summary of ``event``'s fields (not ``ts``/``type``/``trace_id``), at most ``width`` characters.

    ``slot.finished`` shows its reply's timings as ``prompt N (cached C), generated G, T tok/s``."""
    fields = {k: v for k, v in event.items() if k not in ("ts", "type", "trace_id")}
    parts = []
    timings = fields.pop("timings", None)
    if fields.get("stop_reason") == fields.get("finish_reason"):
        fields.pop("stop_reason", None)
    for k, v in fields.items():
        if v is None or v == "":
            continue
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        parts.append(f"{k} {json.dumps(v, separators=(',', ':')) if isinstance(v, (dict, list)) else v}")
    if isinstance(timings, dict):
        parts.append(
            f"prompt {timings.get('prompt_n')} (cached {timings.get('cache_n')}), "
            f"generated {timings.get('predicted_n')}, {timings.get('predicted_per_second', 0):.1f} tok/s"
        )
    text = ", ".join(parts)
    return text if len(text) <= width else text[: width - 1] + "…"


def _connections(stats: dict[str, Any]) -> str:
    conns = stats.get("connections") or {}
    text = ", ".join(f"{k} {v}" for k, v in sorted(conns.items())) or "none"
    return f"{text} (open {stats.get('connections_open', '?')})"


def _add_row(table: Table, *cells: Any) -> None:
    """``table.add_row`` with every ``str`` cell as a plain :class:`rich.text.Text`: rich reads a ``str``
    cell as console markup, and these cells hold what clients chose (a Hydra trace id ``[/x]`` raised
    MarkupError and ended the watch; ``[blink]`` styled the screen).  ``Text`` also drops control codes."""
    from rich.text import Text

    table.add_row(*(Text(c) if isinstance(c, str) else c for c in cells))


def render(state: WatchState, now: float | None = None, width: int = 120) -> RenderableType:
    """The screen for ``state``: a header grid, the slots table, the recent events table.

    ``now`` (``trio.current_time()``) counts down to the next attempt while disconnected;
    ``width``: the terminal's, in columns (the events table fits it)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    hello, stats = state.hello or {}, state.stats or {}
    if state.connected:
        status = Text("connected", style="green")
    else:
        wait = f" in {max(state.retry_at - now, 0):.1f} s" if state.retry_at is not None and now is not None else ""
        status = Text(state.status.replace("{wait}", wait), style="bold red")
    _add_row(head, "node", Text.assemble(state.address, "  ", status))
    if hello:
        _add_row(
            head,
            "hydra-trio",
            f"{hello.get('version')}  model {hello.get('model') or '-'}  "
            f"slots {hello.get('n_slots')}  rpc backend {'yes' if hello.get('rpc_backend') else 'no'}",
        )
    if stats:
        peer = stats.get("peer") or "-"
        if stats.get("peer"):
            peer += " (reachable)" if stats.get("peer_reachable") else " (unreachable)"
        stage = stats.get("stage") if state.connected else "? (last seen: " + str(stats.get("stage")) + ")"
        _add_row(head, "mode", f"{stats.get('mode')}  peer {peer}  stage {stage}")
        _add_row(
            head,
            "load",
            f"queue {stats.get('queue', 0)}  processing {stats.get('processing', 0)}  "
            f"{stats.get('tok_s', 0.0):.1f} tok/s  generated {stats.get('tokens_predicted_total', 0)}",
        )
        _add_row(head, "connections", _connections(stats))
        _add_row(
            head,
            "subscribers",
            f"{stats.get('subscribers', '?')}  events dropped {stats.get('events_dropped_total', 0)}",
        )

    slots = Table(title="slots", title_justify="left", expand=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("slot", "right"),
        ("state", "left"),
        ("prompt", "right"),
        ("generated", "right"),
        ("tok/s", "right"),
        ("n_past/n_ctx", "right"),
        ("trace id", "left"),
    )
    for name, justify in columns:
        slots.add_column(name, justify=justify)
    for s in stats.get("slots") or []:
        busy = s.get("state") == "processing"
        _add_row(
            slots,
            str(s.get("id")),
            Text(str(s.get("state")), style="bold yellow" if busy else "dim"),
            str(s.get("n_prompt", 0)),
            str(s.get("n_decoded", 0)),
            f"{s.get('tok_s', 0.0):.1f}",
            f"{s.get('n_past', 0)}/{s.get('n_ctx', 0)}",
            s.get("trace_id") or "",
        )
    if not stats:
        slots.caption = "waiting for the first stats event…"

    events = Table(title=f"last {RECENT} events", title_justify="left", expand=False)
    # fixed widths: the summary gets what the terminal has left, one line per event
    events.add_column("time", no_wrap=True, width=12)
    events.add_column("type", style="cyan", no_wrap=True, overflow="ellipsis", width=19)
    events.add_column("trace id", no_wrap=True, overflow="ellipsis", width=24)
    events.add_column("summary", overflow="ellipsis", no_wrap=True, width=max(width - 12 - 19 - 24 - 13, 20))
    for e in state.events:
        _add_row(events, _clock(e.get("ts")), str(e.get("type")), str(e.get("trace_id") or ""), summary(e))
    return Group(head, Text(""), slots, Text(""), events)


# --------------------------------------------------------------------------- the connection
def _resource(types: frozenset[str] | None, recent: int = 0) -> str:
    """``/v1/events`` with its query: ``types`` (None: all) and ``recent`` events to replay first."""
    query = [f"types={quote(','.join(sorted(types)))}"] if types else []
    if recent:
        query.append(f"recent={recent}")
    return "/v1/events" + ("?" + "&".join(query) if query else "")


async def follow(
    host: str,
    port: int,
    resource: str,
    on_event: Any,
    on_state: Any,
    ssl_context: ssl.SSLContext | None = None,
    api_key: str | None = None,
) -> None:
    """Read ``ws[s]://host:port{resource}`` for ever, calling ``on_event(event, raw_text)`` per frame;
    reconnect with back-off (0.5 s doubling to 5 s) when it cannot connect or drops.

    ``on_state(connected: bool, why: str, retry_in: float | None)`` is told of each change.

    Raises:
        Fatal: the handshake was refused (HTTP 401/403) or the certificate does not verify.
    """
    from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError, open_websocket

    headers = [(b"authorization", b"Bearer " + api_key.encode())] if api_key else None
    delay = BACKOFF_FIRST
    while True:
        why = ""
        try:
            async with open_websocket(
                host,
                port,
                resource,
                use_ssl=ssl_context or False,
                extra_headers=headers,
                connect_timeout=10,
                disconnect_timeout=2,
            ) as ws:
                while True:
                    raw = await ws.get_message()
                    event = json.loads(raw)
                    if event.get("type") == "hello":
                        delay = BACKOFF_FIRST
                        on_state(True, "", None)
                    on_event(event, raw)
        except ConnectionRejected as exc:
            if exc.status_code in (401, 403):
                raise Fatal(
                    f"the node refused the connection (HTTP {exc.status_code}): "
                    "it needs an API key (--api-key or $HYDRA_TRIO_API_KEY), or another one"
                ) from None
            why = f"refused (HTTP {exc.status_code})"
        except ssl.SSLCertVerificationError as exc:
            raise Fatal(f"TLS: the node's certificate does not verify: {exc.verify_message}") from None
        except ConnectionClosed as exc:
            reason = exc.reason
            why = f"closed ({reason.code}{': ' + reason.reason if reason.reason else ''})" if reason else "closed"
        except HandshakeError as exc:
            cause = exc.__cause__ or exc.__context__
            why = str(cause or exc) or type(cause or exc).__name__
            if ssl_context is not None:  # trio-websocket reports a failed TLS handshake as a timeout: ask TLS
                await _check_certificate(host, port, ssl_context)
        except (OSError, trio.BrokenResourceError, ValueError) as exc:  # ValueError: a frame that is not JSON
            why = str(exc) or type(exc).__name__
        on_state(False, why, delay)
        await trio.sleep(delay)
        delay = min(delay * 2, BACKOFF_MAX)


async def _check_certificate(host: str, port: int, ssl_context: ssl.SSLContext) -> None:
    """Open a TLS connection to ``host:port`` and close it after the handshake.

    Raises:
        Fatal: the node's certificate does not verify against ``ssl_context`` (anything else passes:
            the caller retries)."""
    try:
        with trio.fail_after(10):
            stream = await trio.open_ssl_over_tcp_stream(host, port, ssl_context=ssl_context, https_compatible=True)
            try:
                await stream.do_handshake()
            finally:
                await trio.aclose_forcefully(stream)
    except trio.BrokenResourceError as exc:
        if isinstance(exc.__cause__, ssl.SSLCertVerificationError):
            raise Fatal(f"TLS: the node's certificate does not verify: {exc.__cause__.verify_message}") from None
    except (OSError, trio.TooSlowError):
        pass


async def _until_signal(cancel_scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            cancel_scope.cancel()
            return


async def watch(args: argparse.Namespace) -> int:
    """The ``watch`` command (run under trio); returns the exit code."""
    host, port = parse_peer(args.address, field="address")
    ctx = tls_context(args)
    types = parse_types(args.types)
    if types is not None and not args.json:
        types = types | {"stats"}  # the table is drawn from stats; the events list keeps the chosen ones
    # the table asks for the node's recent history (all it keeps) so its events list starts full
    resource = _resource(types, 0 if args.json else REPLAY)
    code = EXIT_OK
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_signal, nursery.cancel_scope)
            if args.json:
                await _json_lines(nursery, host, port, resource, ctx, args.api_key)
            else:
                await _live_table(nursery, args.address, host, port, resource, ctx, args.api_key)
    except* Fatal as group:  # raised in the nursery: it arrives in an ExceptionGroup
        print(f"hydra-trio watch: {group.exceptions[0]}", file=sys.stderr)
        code = EXIT_REFUSED
    return code


async def _json_lines(
    nursery: trio.Nursery, host: str, port: int, resource: str, ctx: ssl.SSLContext | None, api_key: str | None
) -> None:
    def on_event(event: dict[str, Any], raw: str) -> None:
        try:
            sys.stdout.write(raw + "\n")
            sys.stdout.flush()
        except BrokenPipeError:  # `| head`: the reader is done
            nursery.cancel_scope.cancel()

    def on_state(connected: bool, why: str, retry_in: float | None) -> None:
        if not connected:
            print(f"hydra-trio watch: disconnected ({why}), retrying in {retry_in:.1f} s", file=sys.stderr, flush=True)

    await follow(host, port, resource, on_event, on_state, ctx, api_key)


async def _live_table(
    nursery: trio.Nursery,
    address: str,
    host: str,
    port: int,
    resource: str,
    ctx: ssl.SSLContext | None,
    api_key: str | None,
) -> None:
    state = WatchState(address)

    def on_state(connected: bool, why: str, retry_in: float | None) -> None:
        state.connected = connected
        if not connected:
            state.status = f"disconnected ({why}), retrying{{wait}}…"
            state.retry_at = trio.current_time() + (retry_in or 0.0)

    from rich.console import Console
    from rich.live import Live

    console = Console()
    with Live(
        render(state, None, console.width),
        console=console,
        auto_refresh=False,
        redirect_stdout=False,
        redirect_stderr=False,
        vertical_overflow="crop",
    ) as live:

        async def redraw() -> None:
            while True:
                live.update(render(state, trio.current_time(), console.width), refresh=True)
                await trio.sleep(0.25)

        nursery.start_soon(redraw)
        await follow(host, port, resource, lambda e, _raw: state.on_event(e), on_state, ctx, api_key)


# --------------------------------------------------------------------------- command line
def _types(text: str) -> str:
    try:
        parse_types(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def watch_command(args: argparse.Namespace) -> int:
    """Entry point for ``hydra-trio watch`` (``args.func``)."""
    try:
        check_tls_options(args)
    except ValueError as exc:
        print(f"hydra-trio watch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return trio.run(watch, args)
    except (OSError, ValueError) as exc:  # TLS files that cannot be read
        print(f"hydra-trio watch: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:  # a Ctrl-C before the signal receiver was up
        return EXIT_OK


def add_watch_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``watch`` to the ``hydra-trio`` subparsers."""
    p = subparsers.add_parser(
        "watch",
        help="watch a node's live events: slots, mode, queue, connections (GET /v1/events)",
        description="Show a node's live state in the terminal from its event stream (GET /v1/events, a "
        "WebSocket), refreshed in place; reconnects when the node restarts; Ctrl-C to quit.",
    )
    p.add_argument("address", type=address_argument, metavar="HOST:PORT")
    p.add_argument("--json", action="store_true", help="print the raw events as JSON lines (one per line, flushed)")
    p.add_argument(
        "--types",
        type=_types,
        default=None,
        metavar="CATEGORIES",
        help=f"comma-separated event categories ({','.join(CATEGORIES)}); the table always gets stats",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("HYDRA_TRIO_API_KEY") or None,
        metavar="KEY",
        help="the node's --api-key, sent as Authorization: Bearer (default: $HYDRA_TRIO_API_KEY)",
    )
    add_tls_options(p, "connect with TLS, wss:// (the node runs with --tls-cert)")
    p.set_defaults(func=watch_command)
    return p

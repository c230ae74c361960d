"""Two nodes embedded in one trio process (the library API, docs/library.md "As a library") keep their own HTTP
limits: hypercorn's fixes (:mod:`hydra_trio.http._hyper`) are each server's, not the process's.

Real sockets and real requests to two real engines (the packaged default model) in one ``trio.run``.
"""

from __future__ import annotations

import json

import trio

from hydra_trio import EngineConfig, ServerConfig, resolve_model, serve
from hydra_trio.http.settings import HttpSettings

SMALL, LARGE = 4096, 1 << 20  # the two servers' max_body, bytes


async def _head(port: int, data: bytes) -> tuple[trio.SocketStream, bytes]:
    """Open a connection, send ``data``, and read until the end of the first response's head."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(data)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = await stream.receive_some(65536)
        assert chunk, f"closed before a response head: {got!r}"
        got += chunk
    return stream, got


async def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` (a request asking for close) and read until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        out = b""
        while chunk := await stream.receive_some(65536):
            out += chunk
        return out


def _post(
    body: bytes,
    *,
    expect: bool = False,
    path: bytes = b"/v1/completions",
    method: bytes = b"POST",
    length: int | None = None,
) -> bytes:
    head = (
        method
        + b" "
        + path
        + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
        + (b"Expect: 100-continue\r\n" if expect else b"")
        + b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length)
    )
    return head if expect else head + body


async def test_two_embedded_servers_each_enforce_their_own_body_limit() -> None:
    path, alias = resolve_model("smollm2-135m")
    # a valid completion request padded with JSON whitespace to 64 KiB: over SMALL, under LARGE
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    body += b" " * (64 * 1024 - len(body))

    def config(max_body: int) -> ServerConfig:
        return ServerConfig(
            port=0,
            rpc_backend=None,
            http=HttpSettings(max_body=max_body),
            engine=EngineConfig(path, alias, n_parallel=1, n_ctx=512),
        )

    async with trio.open_nursery() as nursery:
        # the small one first: a process-wide limit would be the last server's (LARGE) for both
        small = await nursery.start(serve, config(SMALL))
        large = await nursery.start(serve, config(LARGE))
        with trio.fail_after(300):
            await small.engine.wait_ready()
            await large.engine.wait_ready()

        # Expect: 100-continue over the small server's cap: its 413 at once, no 100
        stream, head = await _head(small.port, _post(body, expect=True))
        await stream.aclose()
        assert head.startswith(b"HTTP/1.1 413 "), head[:200]
        # the same request to the large server: the 100 comes, then the body goes through
        stream, head = await _head(large.port, _post(body, expect=True))
        async with stream:
            assert head.startswith(b"HTTP/1.1 100 "), head[:200]
            await stream.send_all(body)
            out = head.split(b"\r\n\r\n", 1)[1]
            while chunk := await stream.receive_some(65536):
                out += chunk
        assert out.startswith(b"HTTP/1.1 200 "), out[:300]
        assert json.loads(out.split(b"\r\n\r\n", 1)[1])["object"] == "text_completion"

        # without Expect, the whole body sent: the app's own limit, per server too
        small_out = await _exchange(small.port, _post(body))
        assert small_out.startswith(b"HTTP/1.1 413 "), small_out[:300]
        assert b"limit is %d" % SMALL in small_out
        large_out = await _exchange(large.port, _post(body))
        assert large_out.startswith(b"HTTP/1.1 200 "), large_out[:300]

        # over LARGE, the large server refuses too (its limit is a limit)
        stream, head = await _head(large.port, _post(b"", expect=True, length=LARGE + 1))
        await stream.aclose()
        assert head.startswith(b"HTTP/1.1 413 "), head[:200]

        # a KV state blob (PUT /slots/{id}/state) has its own, larger limit (max_state_body): the 100
        # comes for a body over max_body, as the app would read it
        stream, head = await _head(
            small.port, _post(b"", expect=True, method=b"PUT", path=b"/slots/0/state", length=64 * 1024)
        )
        await stream.aclose()
        assert head.startswith(b"HTTP/1.1 100 "), head[:200]
        nursery.cancel_scope.cancel()

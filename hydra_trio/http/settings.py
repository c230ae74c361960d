"""HTTP settings: how long the server waits for a client, and how much it reads."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio


@attrs.frozen
class HttpSettings:
    """Limits of the HTTP front end (seconds and bytes).

    The server only ever times out while it waits for the *client*: a
    request runs as long as it needs once it has arrived, however long its
    reply takes to generate or stream.

    Attributes:
        keep_alive_timeout: seconds an idle connection is kept between
            requests, and the time a client has to send a request's headers
            whole (``--keep-alive-timeout``; hypercorn's ``keep_alive_timeout``).
        body_timeout: seconds of silence allowed while a request's body is
            arriving; past it the reply is 408 and the connection closes
            (``--timeout``, llama-server's flag name; default 3600, llama-server's).
            None: no limit; 0: no waiting (:func:`waiting_for_client`).
        write_timeout: seconds a reply may wait for the client to take any
            of its bytes; past it the connection closes and the request ends
            as for a client that went away (``--timeout`` sets it with
            ``body_timeout``, as llama-server's ``-to`` is its read and write
            timeout; default 3600, llama-server's).  None: no limit; 0: no waiting.
        max_body: the largest request body in bytes (413 beyond it, at once
            when the client sent ``Expect: 100-continue``).
        max_state_body: the largest ``PUT /slots/{id}/state`` body (a KV state blob), in bytes: 4 GiB,
            the Hydra ``STATE_PUT`` payload limit.
        endpoint_props: ``POST /props`` is offered (``--props``; llama-server's ``endpoint_props``);
            otherwise it answers 501, as llama-server's.
        cors_origins: origins allowed by CORS (``--cors-origin``); ``*``, the
            default, allows any, as llama-server does.
        max_event_subscribers: ``GET /v1/events`` subscribers at once; past it a
            handshake is refused with 503 (``--max-event-subscribers``; by
            default a quarter of ``--max-connections``).  A subscriber holds its
            connection for as long as it likes, so without a cap they could take
            every connection the front door serves and lock HTTP and Hydra out.
    """

    keep_alive_timeout: float = 5.0
    body_timeout: float | None = 3600.0
    write_timeout: float | None = 3600.0
    max_body: int = 16 * 1024 * 1024
    max_state_body: int = 4 * 1024 * 1024 * 1024
    endpoint_props: bool = False
    cors_origins: tuple[str, ...] = ("*",)
    max_event_subscribers: int = 256


@asynccontextmanager
async def waiting_for_client(timeout: float | None) -> AsyncIterator[trio.CancelScope]:
    """The scope of one wait on the client (a body's next chunk, a reply's bytes taken), with llama-server's
    meaning of its read/write timeout (cpp-httplib's ``poll`` on the socket, ``tools/server/server-http.cpp``
    of the llama.cpp that llama-cpp-python 0.3.36 vendors): ``timeout`` > 0 seconds at most; None (``--timeout``
    below 0) no limit; 0 no waiting at all: what the client has already sent, or what the socket takes at
    once, goes through, and the wait ends as soon as nothing in the process can run any more (by then the
    bytes already in the socket have been read).  ``scope.cancelled_caught`` afterwards: the wait timed out.
    """
    if timeout is None:
        with trio.CancelScope() as scope:
            yield scope
    elif timeout > 0:
        with trio.move_on_after(timeout) as scope:
            yield scope
    else:
        # here: trio.testing imports importlib.metadata, which a node does not otherwise need
        from trio.testing import wait_all_tasks_blocked

        cutter = trio.CancelScope()

        async def cut_off() -> None:
            with cutter:  # trio's "every task is blocked": its I/O poll with a zero timeout found nothing to do
                await wait_all_tasks_blocked()
                scope.cancel()

        with trio.CancelScope() as scope:
            # a system task, not a nursery around the caller's code: its exceptions stay as they are
            trio.lowlevel.spawn_system_task(cut_off)
            try:
                yield scope
            finally:
                cutter.cancel()

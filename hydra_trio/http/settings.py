"""HTTP settings: how long the server waits for a client, and how much it reads."""

from __future__ import annotations

import attrs


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
            (``--timeout``, llama-server's flag name).
        write_timeout: seconds a reply may wait for the client to take any
            of its bytes; past it the connection closes and the request ends
            as for a client that went away (``--timeout`` sets it with
            ``body_timeout``, as llama-server's ``-to`` is its read and write
            timeout; default 600, llama-server's).  None: no limit.
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
    body_timeout: float = 30.0
    write_timeout: float | None = 600.0
    max_body: int = 16 * 1024 * 1024
    max_state_body: int = 4 * 1024 * 1024 * 1024
    endpoint_props: bool = False
    cors_origins: tuple[str, ...] = ("*",)
    max_event_subscribers: int = 256

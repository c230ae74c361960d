"""A blocking Hydra wire helper for tests: raw frames over a real socket, parsed with the real codec."""

from __future__ import annotations

import socket

from hydra_trio.protocol.hydra import (
    NEED_DATA,
    PayloadChunk,
    ResponseDecoder,
    ResponseEnded,
    ResponseStarted,
    encode_request,
)


class Wire:
    """One persistent connection; ``call`` sends a request and reads exactly one reply."""

    def __init__(self, port: int, timeout: float = 60.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.dec = ResponseDecoder()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def call(self, op: int, key: str = "", payload: bytes = b"", trace_id: str = "test") -> tuple[int, dict, bytes]:
        self.send(encode_request(op, key=key, payload=payload, trace_id=trace_id))
        return self.read_reply()

    def read_reply(self) -> tuple[int, dict, bytes]:
        """(status, meta, payload) of the next reply; raises ConnectionError if the server closes first."""
        status, meta, body = None, None, bytearray()
        while True:
            while (ev := self.dec.next_event()) is not NEED_DATA:
                if isinstance(ev, ResponseStarted):
                    status, meta = ev.header.status, ev.meta
                elif isinstance(ev, PayloadChunk):
                    body += ev.data
                elif isinstance(ev, ResponseEnded):
                    assert status is not None and meta is not None  # ResponseStarted came first
                    return status, meta, bytes(body)
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("server closed the connection")
            self.dec.receive_data(data)

    def closed_by_server(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

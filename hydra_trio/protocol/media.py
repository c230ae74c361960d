"""Media in prompts (images, audio, videos), as values every layer shares: the front ends read them from requests, the
engine evaluates them with the multimodal projector (``--mmproj``).

* :data:`MEDIA_MARKER`: the text that stands for one media item in a prompt (llama-server's ``get_media_marker``,
  ``tools/server/server-common.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors: ``LLAMA_MEDIA_MARKER``,
  else drawn once per process); ``mtmd``'s context is given the same marker, so the prompt's markers are where
  ``mtmd_tokenize`` puts each item's chunk.
* :class:`MediaItem`: one item's bytes (an image, audio or video file as sent), its kind and its id (the SHA-256 of the
  bytes in hex: the id ``mtmd_helper_bitmap_init_from_buf`` gives its bitmap, ``tools/mtmd/mtmd-helper.cpp``, by
  which llama-server's prompt cache tells one image from another).
* :class:`MediaPrompt`: a prompt's text with one marker per item, and its items in order: what a completion job
  carries to the engine.
* :class:`MediaSettings`: the node's multimodal settings (``--mmproj`` and the flags around it).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import attrs

MEDIA_MARKER = os.environ.get("LLAMA_MEDIA_MARKER") or f"<__media_{secrets.token_hex(16)}__>"
"""The media marker of this process: ``LLAMA_MEDIA_MARKER``, else ``<__media_`` 32 random characters ``__>``
(llama-server's)."""

IMAGE, AUDIO = "image", "audio"


def is_audio_file(data: bytes) -> bool:
    """Whether ``data`` is read as audio (``audio_helpers::is_audio_file``, ``tools/mtmd/mtmd-helper.cpp``): a
    RIFF/WAVE, an MP3 (an ``ID3`` tag or an MPEG sync word) or a FLAC file, at least 12 bytes.  mtmd decides
    by the bytes alone, whatever the request's part says."""
    if len(data) < 12:
        return False
    wav = data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    mp3 = data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)
    return wav or mp3 or data[:4] == b"fLaC"


@attrs.frozen
class MediaItem:
    """One media item of a prompt.

    Attributes:
        kind: :data:`AUDIO` when the bytes are an audio file (:func:`is_audio_file`), else :data:`IMAGE`
            (mtmd tries the image decoders, then ffmpeg for a WebP image or a video; bytes that are none of
            these fail there).
        data: the file's bytes as the client sent them (PNG, JPEG, ..., WAV, MP3, FLAC, or a video: MP4, WebM,
            ...), decoded from base64.
        id: the SHA-256 of ``data`` in lowercase hex, 64 characters: the bitmap's id (``mtmd_bitmap_set_id``),
            the key by which a cached prompt's media chunk is compared (a video's frame N: ``ID+N``).
    """

    kind: str
    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")
    id: str

    @classmethod
    def of(cls, data: bytes) -> MediaItem:
        """The item for ``data``: its kind from its bytes, its id their SHA-256."""
        return cls(AUDIO if is_audio_file(data) else IMAGE, data, hashlib.sha256(data).hexdigest())


@attrs.frozen
class MediaPrompt:
    """A prompt with media: ``text`` holds :data:`MEDIA_MARKER` once for each of ``items``, in order (at least
    one item).  The engine tokenizes it with ``mtmd_tokenize`` (special tokens parsed, BOS added as for a text
    prompt), which splits it into text chunks and one chunk per item."""

    text: str
    items: tuple[MediaItem, ...]

    @property
    def n_bytes(self) -> int:
        return sum(len(i.data) for i in self.items)


@attrs.frozen
class MediaSettings:
    """The node's multimodal settings (llama-server's flags; ``common/arg.cpp``).

    Attributes:
        mmproj: the multimodal projector GGUF (``-mm/--mmproj``, or a preset's own with ``--mmproj-auto``);
            None: the node takes no media.
        vision, audio: what the projector's encoders take (its ``clip.has_vision_encoder`` /
            ``clip.has_audio_encoder``, read when the node starts): ``/props``' ``modalities``.
        offload: the projector on the GPU (``--mmproj-offload``, default on; nothing is offloaded without one).
        device: the projector's device (``-mmdev``); None: follows ``--device``'s first, as llama-server.
        image_min_tokens, image_max_tokens: the fewest / most tokens an image may take, for vision models with
            dynamic resolution (``--image-min-tokens`` / ``--image-max-tokens``); -1: the projector's own.
        batch_max_tokens: most image tokens encoded in one batch (``--mtmd-batch-max-tokens``; llama-server's
            default 1024).
        media_path: the directory ``file://`` URLs of a request are read from (``--media-path``); None: such
            URLs are refused, as llama-server's.
        video_fps: the frames a second read from a video (``--video-fps``; llama-server's default 4.0; 0 or
            less: the video's own rate).
        video_timestamp_interval_ms: milliseconds of video between two timestamp texts (``[0m5.00s]``) in
            the prompt (``--video-timestamp-interval``; llama-server's default 5000; 0 or less: none).
        video_ffmpeg_dir: the directory holding the ``ffmpeg`` and ``ffprobe`` executables that decode videos
            (and WebP images) (``--video-ffmpeg-dir``); None: found on ``PATH``, as llama-server's.
    """

    mmproj: Path | None = None
    vision: bool = False
    audio: bool = False
    offload: bool = True
    device: str | None = None
    image_min_tokens: int = -1
    image_max_tokens: int = -1
    batch_max_tokens: int = 1024
    media_path: Path | None = None
    video_fps: float = 4.0
    video_timestamp_interval_ms: int = 5000
    video_ffmpeg_dir: str | None = None

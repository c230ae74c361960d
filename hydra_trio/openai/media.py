"""Media in requests, read as llama-server reads them (``tools/server/server-common.cpp`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors: ``oaicompat_content_load_media``, ``handle_media``, ``tokenize_input_subprompt``).

* Chat content parts: ``{"type": "image_url", "image_url": {"url"}}``, ``{"type": "input_audio",
  "input_audio": {"data", "format"}}`` (``url`` when ``data`` is absent; ``format`` is not read: the bytes say
  what they are),
  and llama-server's video parts ``{"type": "input_video", "input_video": {"data"}}`` (``url`` when ``data`` is
  absent) and ``{"type": "video_url", "video_url": {"url"}}``.  :func:`parse_content` reads a message's parts
  (sans-I/O, when the body is read): each media part becomes :data:`~hydra_trio.protocol.media.MEDIA_MARKER` in
  the message's text, joined as ``common/chat.cpp`` joins parts when a message holds media (text parts one
  line each, no newline before or after a marker), and a :class:`MediaPart` kept for :func:`load_media`.
* :func:`load_media`: the node's checks and the parts' bytes, in the parts' order: a kind the node does not take
  is llama-server's error (HTTP 500, :class:`MediaNotSupported`); then the URL: ``data:`` (base64, an
  ``image/``, ``audio/`` or ``video/`` type), bare base64, ``file://`` under ``--media-path``; remote
  ``http(s)://`` URLs are refused (400: the node fetches nothing); then the limits
  (:data:`MAX_MEDIA_ITEMS`, :data:`MAX_MEDIA_BYTES`).
* llama-server's ``/completion`` form ``{"prompt": {"prompt_string", "multimodal_data": [base64, ...]}}``:
  :class:`MultimodalPrompt`, read by :func:`load_multimodal_data`.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from ..errors import HydraTrioError, InvalidRequest
from ..protocol.hydra import Status
from ..protocol.media import MEDIA_MARKER, MediaItem, MediaSettings
from ..validation import strict as msg

MAX_MEDIA_ITEMS = 64
"""Most media items in one request (400 beyond; llama-server has no limit)."""
MAX_MEDIA_BYTES = 10 * 1024 * 1024
"""Most bytes of one media item once decoded (400 beyond): llama-server's limit on a fetched image
(``common_remote_params.max_size`` in ``handle_media``), here for every item."""

MEDIA_TYPES = {"image_url": "image", "input_audio": "audio", "input_video": "video", "video_url": "video"}
"""Content part types that carry media, and the kind the node must take for each (llama-server's)."""
_NOT_SUPPORTED = "{} input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
NO_MULTIMODAL_DATA = "Multimodal data provided, but model does not support multimodal requests."
"""llama-server's 400 for ``multimodal_data`` on a model without a projector (``tokenize_input_subprompt``)."""


class MediaNotSupported(HydraTrioError):
    """A media part of a kind the node does not take: llama-server's message (``image input is not supported -
    hint: if this is unexpected, you may need to provide the mmproj``) and its status, HTTP 500 (a
    ``runtime_error`` in ``oaicompat_content_load_media``); Hydra BAD_REQUEST."""

    hydra_status = Status.BAD_REQUEST


@attrs.frozen
class MediaPart:
    """One media content part as sent: ``type`` (a key of :data:`MEDIA_TYPES`), ``url`` (the ``image_url.url``,
    or ``input_audio.data`` / ``.url``; "" when absent), ``where`` (``messages[i].content[j]``, for errors)."""

    type: str
    url: str
    where: str = ""


def _url_of(part: dict[str, Any], kind: str, where: str) -> str:
    inner = part.get(kind)
    if inner is None:
        return ""
    if not isinstance(inner, dict):
        raise msg.TypeMismatch(f"{where}.{kind}: expected an object, got {msg.type_name(inner)}")
    keys = ("url",) if kind == "image_url" else ("data", "url")  # input_audio: data, else url (llama-server's)
    for key in keys:
        value = inner.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise msg.TypeMismatch(f"{where}.{kind}.{key}: expected a string, got {msg.type_name(value)}")
            return value
    return ""


def parse_content(parts: Sequence[Any], where: str = "content") -> tuple[str, tuple[MediaPart, ...]]:
    """A message's content parts as ``(text, media parts)``.

    Without media the text parts are joined as they are; with media each media part is
    :data:`~hydra_trio.protocol.media.MEDIA_MARKER` and the parts are joined as ``common/chat.cpp`` joins
    them (``common_chat_msg::to_json_oaicompat``): a newline between two text parts, none before or after a
    marker.  Raises TypeMismatch: a part that is not an object, an unknown ``type`` (llama-server's
    ``unsupported content[].type``), a text part without a string ``text``, a media part's URL not a string.
    """
    pieces: list[tuple[str, str]] = []
    media: list[MediaPart] = []
    for j, part in enumerate(parts):
        w = f"part {j}"  # the caller's error path names the content list
        if not isinstance(part, dict):
            raise msg.TypeMismatch(f"{w}: expected a content part object, got {msg.type_name(part)}")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise msg.TypeMismatch(f"{w}.text: expected a string")
            pieces.append(("text", part["text"]))
        elif kind in MEDIA_TYPES:
            media.append(MediaPart(kind, _url_of(part, kind, w), f"{where}[{j}]"))
            pieces.append(("media", MEDIA_MARKER))
        else:
            raise msg.TypeMismatch(f"{w}: unsupported content[].type {kind!r} (text, {', '.join(MEDIA_TYPES)})")
    if not media:
        return "".join(t for _, t in pieces), ()
    text, after_marker = "", False
    for kind, piece in pieces:
        if kind == "text" and not after_marker and text:
            text += "\n"
        after_marker = kind == "media"
        text += piece
    return text, tuple(media)


def check_accepted(parts: Sequence[MediaPart], settings: MediaSettings, video: bool = False) -> None:
    """Raise MediaNotSupported (llama-server's text) for the first part whose kind the node does not take
    (``settings.vision`` / ``.audio``; ``video``: the loaded projector's ``modalities.video``), and
    InvalidRequest beyond :data:`MAX_MEDIA_ITEMS` parts."""
    taken = {"image": settings.vision, "audio": settings.audio, "video": video}
    for p in parts:
        kind = MEDIA_TYPES[p.type]
        if not taken[kind]:
            raise MediaNotSupported(_NOT_SUPPORTED.format(kind))
    if len(parts) > MAX_MEDIA_ITEMS:
        raise InvalidRequest(f"{len(parts)} media items in one request, more than {MAX_MEDIA_ITEMS} (MAX_MEDIA_ITEMS)")


def load_media(parts: Sequence[MediaPart], settings: MediaSettings, video: bool = False) -> tuple[MediaItem, ...]:
    """The parts' items, in order (:func:`check_accepted`, then :func:`read_url` for each).
    Raises MediaNotSupported (500) or InvalidRequest (400) naming the part."""
    check_accepted(parts, settings, video)
    return tuple(MediaItem.of(read_url(p.url, settings.media_path, p.where)) for p in parts)


def _too_big(n: int, where: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: the media item is {n} bytes, more than {MAX_MEDIA_BYTES} (MAX_MEDIA_BYTES)")


def decode_base64(text: str, where: str) -> bytes:
    """Standard base64 (padding optional, as llama-server's decoder) to bytes, at most :data:`MAX_MEDIA_BYTES`.
    Raises InvalidRequest: not base64 (llama-server's ``Invalid base64 value``), empty, or too big."""
    text = text.strip()
    n = len(text.rstrip("=")) * 3 // 4  # the decoded size of valid base64, known before decoding
    if n > MAX_MEDIA_BYTES:
        raise _too_big(n, where)
    try:
        data = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"Invalid base64 value ({where})") from None
    if not data:
        raise InvalidRequest(f"Invalid base64 value ({where}: no bytes)")
    if len(data) > MAX_MEDIA_BYTES:
        raise _too_big(len(data), where)
    return data


def read_url(url: str, media_path: Path | None, where: str = "url") -> bytes:
    """A media part's bytes from its URL, as llama-server's ``handle_media``:

    * ``http...``: refused, 400 (llama-server downloads it; this node makes no network requests);
    * ``file://NAME``: the file NAME under ``media_path`` (``--media-path``; without it 400, llama-server's
      ``file:// URLs are not allowed unless --media-path is specified``); a name that is absolute, holds
      ``..`` or leads outside the directory is ``file path is not allowed``;
    * ``data:TYPE;base64,DATA``: TYPE ``image/...``, ``audio/...`` or ``video/...`` (else ``Invalid uri format``),
      one comma (else ``Invalid uri-encoded base64 value``), base64 (else ``uri must be base64 encoded``);
    * anything else: bare base64.

    Raises InvalidRequest with llama-server's message and ``where``."""
    if url.startswith("http"):
        raise InvalidRequest(
            f"remote media URLs are not fetched: this node makes no network requests; send the "
            f"file's bytes as a data: URL (base64) ({where}: {url[:100]!r})"
        )
    if url.startswith("file://"):
        return _read_file(url[len("file://") :], media_path, where)
    if url.startswith("data:"):
        parts = url.split(",")
        if len(parts) != 2:
            raise InvalidRequest(f"Invalid uri-encoded base64 value ({where})")
        head = parts[0]
        if not head.startswith(("data:image/", "data:video/", "data:audio/")):
            raise InvalidRequest(f"Invalid uri format: {head[:100]} ({where})")
        if not head.endswith("base64"):
            raise InvalidRequest(f"uri must be base64 encoded ({where})")
        return decode_base64(parts[1], where)
    return decode_base64(url, where)


def _read_file(name: str, media_path: Path | None, where: str) -> bytes:
    if media_path is None:
        raise InvalidRequest(f"file:// URLs are not allowed unless --media-path is specified ({where})")
    rel = Path(name)
    bad = (
        not name
        or rel.is_absolute()
        or any(p in ("..", ".", "") for p in name.split("/"))
        or any(ord(c) < 32 or c in "\\:" for c in name)
    )
    root = media_path.resolve()
    path = (root / rel).resolve()
    if bad or not path.is_relative_to(root):
        raise InvalidRequest(f"file path is not allowed: {name[:200]} ({where})")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MEDIA_BYTES + 1)
    except OSError:
        raise InvalidRequest(f"file does not exist or cannot be opened: {name[:200]} ({where})") from None
    if len(data) > MAX_MEDIA_BYTES:
        raise _too_big(path.stat().st_size, where)
    return data


@attrs.frozen
class MultimodalPrompt:
    """llama-server's prompt object ``{"prompt_string": ..., "multimodal_data": [base64, ...]}``: ``prompt`` a
    string (or a list of token ids and strings, without media), ``data`` the base64 strings (None: the key was
    absent, the object is a plain prompt)."""

    prompt: str | tuple[int | str, ...]
    data: tuple[str, ...] | None = None


def parse_multimodal_prompt(v: dict[str, Any]) -> MultimodalPrompt:
    """A prompt object.  Raises TypeMismatch: ``prompt_string`` missing or not a string (nor, without
    ``multimodal_data``, a list of token ids and strings), ``multimodal_data`` not a list of strings."""
    if "prompt_string" not in v:
        raise msg.TypeMismatch(
            '"prompt" elements must be a string, a list of tokens, a JSON object containing a '
            "prompt string, or a list of mixed strings & tokens."
        )
    text, data = v["prompt_string"], v.get("multimodal_data")
    if data is None:
        if (
            isinstance(text, list)
            and all(isinstance(t, str) or (isinstance(t, int) and not isinstance(t, bool)) for t in text)
            and text
        ):
            return MultimodalPrompt(tuple(text))
        if not isinstance(text, str):
            raise msg.TypeMismatch("prompt_string: expected a string or a list of token ids and strings")
        return MultimodalPrompt(text)
    if not isinstance(text, str):
        raise msg.TypeMismatch("prompt_string: expected a string (with multimodal_data)")
    if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        raise msg.TypeMismatch("multimodal_data: expected a list of base64 strings")
    return MultimodalPrompt(text, tuple(data))


def load_multimodal_data(p: MultimodalPrompt, settings: MediaSettings) -> tuple[MediaItem, ...]:
    """The items of a prompt object's ``multimodal_data``.  Raises InvalidRequest: the node has no projector
    (llama-server's :data:`NO_MULTIMODAL_DATA`), more than :data:`MAX_MEDIA_ITEMS`, an entry that is not
    base64 or too big, or a count of media markers in ``prompt_string`` that is not the entries' (llama-server's
    ``Failed to tokenize prompt``: ``mtmd_tokenize`` pairs each marker with one entry)."""
    assert p.data is not None and isinstance(p.prompt, str)
    if settings.mmproj is None:
        raise InvalidRequest(NO_MULTIMODAL_DATA)
    if len(p.data) > MAX_MEDIA_ITEMS:
        raise InvalidRequest(
            f"multimodal_data: {len(p.data)} media items, more than {MAX_MEDIA_ITEMS} (MAX_MEDIA_ITEMS)"
        )
    items = tuple(MediaItem.of(decode_base64(d, f"multimodal_data[{i}]")) for i, d in enumerate(p.data))
    check_markers(p.prompt, len(items))
    return items


def check_markers(text: str, n_items: int) -> None:
    """Raise InvalidRequest unless ``text`` holds :data:`~hydra_trio.protocol.media.MEDIA_MARKER` exactly
    ``n_items`` times (``mtmd_tokenize`` refuses other counts: llama-server's ``Failed to tokenize prompt``)."""
    n = text.count(MEDIA_MARKER)
    if n != n_items:
        raise InvalidRequest(
            f"Failed to tokenize prompt: the prompt holds the media marker {n} times for "
            f"{n_items} media items (the marker is GET /props' media_marker)"
        )

"""Images, audio and video in a prompt: the projector (``--mmproj``) through llama-cpp-python's ``mtmd`` bindings.

A prompt that holds media is its text tokens with each media chunk in place, as llama-server's
``server_tokens`` (``tools/server/server-common.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors)
holds them: a chunk of ``n_tokens`` embeddings takes ``n_tokens`` entries of the token list, here each the
chunk's *placeholder* (:func:`placeholder`, a negative id that no vocabulary token has, derived from the
chunk's id), so that every prefix comparison of token lists (a slot's cache, the host-RAM prompt cache,
prefix sharing, context checkpoints) compares media by id, as llama-server's ``get_common_prefix`` does: the
same image reaches through, another image is a miss at its first cell.

A chunk fills ``n_tokens`` KV cells but advances the position by ``n_pos``: with M-RoPE (the Qwen-VL
families) an image of ``w x h`` embeddings advances it by ``max(w, h)``, and the text after it continues
there.  :class:`MediaLayout` maps a cell count to the position that follows (llama-server's ``pos_next``)
and keeps cuts off a chunk's inside (``keep_first`` refuses to cut one in two).

A video (any file that is neither an image stb_image decodes nor an audio clip) is read as llama-server reads it
(``mtmd_helper_bitmap_init_from_buf``, ``tools/mtmd/mtmd-helper.cpp``): ``ffprobe`` and ``ffmpeg`` (on ``PATH``,
or in ``--video-ffmpeg-dir``) decode its frames at ``--video-fps`` while ``mtmd_tokenize`` runs, which gives
the text ``Video:``, one image chunk per frame (two consecutive frames in one chunk for a projector that merges
frames in time, as Qwen2-VL's), and a timestamp text (``[0m5.00s]``) every ``--video-timestamp-interval``
milliseconds; frame ``N``'s chunk has the id ``SHA256+N``.  A WebP image is decoded by ``ffmpeg`` too.

Thread use: :class:`MediaContext` is built and freed on the engine thread with the model; its
:meth:`~MediaContext.tokenize` runs on any thread (llama-server tokenizes media on its HTTP threads while
its main loop encodes), :meth:`~MediaContext.eval_chunk` on the engine thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import llama_cpp

from ...errors import InvalidRequest, ModelLoadError
from ...protocol.media import MEDIA_MARKER

if TYPE_CHECKING:  # numpy is loaded only where a drafter hears media (eval_chunk's on_batch)
    import numpy as np

log = logging.getLogger("hydra_trio.engine")


_PLACEHOLDER_SPAN = 2**31 - 3

EmbdCallback = Callable[[int, "np.ndarray", "np.ndarray"], None]
"""``on_batch(seq_id, embd, pos)`` of :meth:`MediaContext.eval_chunk`: one decoded piece of a media chunk."""

_mtmd_log = logging.getLogger("llama_cpp.mtmd")


@llama_cpp.llama_log_callback
def _log_line(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    """mtmd's and clip's log lines (one per tensor at load, several per image) go to the ``llama_cpp.mtmd``
    logger: warnings and errors at their level, the rest at DEBUG."""
    msg = text.decode("utf-8", "replace").rstrip("\n")
    if msg:
        _mtmd_log.log(logging.WARNING if level == 3 else logging.ERROR if level == 4 else logging.DEBUG, "%s", msg)


def placeholder(media_id: str, n_tokens: int) -> int:
    """The token-list entry of each cell of a media chunk: a negative 32-bit id from the chunk's id and size
    (-2 down to -(2**31 - 1); -1 is llama.cpp's ``LLAMA_TOKEN_NULL``).  Two chunks of equal id and size have
    the same placeholder, so they compare equal; any other pair differs (up to a 31-bit hash collision)."""
    digest = hashlib.sha256(f"{media_id}\0{n_tokens}".encode()).digest()
    return -2 - int.from_bytes(digest[:8], "little") % _PLACEHOLDER_SPAN


class _ChunkHandle:
    """An ``mtmd_input_chunk`` copy this process owns; freed when the last reference goes."""

    def __init__(self, ptr: Any) -> None:
        import llama_cpp.mtmd_cpp as mtmd

        self.ptr = ptr
        self._free = weakref.finalize(self, mtmd.mtmd_input_chunk_free, ptr)


@attrs.frozen
class VideoOptions:
    """How videos are read (llama-server's ``--video-fps``, ``--video-timestamp-interval``,
    ``--video-ffmpeg-dir``, with its defaults): ``fps`` frames a second (0 or less: the video's own rate),
    a timestamp text every ``timestamp_interval_ms`` milliseconds of video (0 or less: none), ``ffmpeg_dir``
    the directory of the ``ffmpeg`` and ``ffprobe`` executables (None: found on ``PATH``)."""

    fps: float = 4.0
    timestamp_interval_ms: int = 5000
    ffmpeg_dir: str | None = None


@attrs.frozen(eq=False)
class MediaChunk:
    """One image, audio clip or video frame (or two frames merged) of a prompt, tokenized: ``n_tokens`` embeddings
    (KV cells) at token index ``start`` of :attr:`MediaTokens.tokens`, advancing the position by ``n_pos``;
    ``handle`` None: a chunk known by its place only (a slot's layout restored from a state blob: its embeddings are
    in the KV cache, and a chunk that must be evaluated always comes from its own request's prompt)."""

    id: str
    """The media's id: the SHA-256 (hex) of its file's bytes, as llama.cpp's ``mtmd_helper_bitmap_init_from_buf``
    sets it, unless the caller named one; a video frame's: the video's, ``+`` and the frame's index."""
    kind: str
    """``image`` (video frames too) or ``audio``."""
    start: int
    n_tokens: int
    n_pos: int
    handle: _ChunkHandle | None = attrs.field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    @property
    def placeholder(self) -> int:
        return placeholder(self.id, self.n_tokens)


class MediaLayout:
    """Where the media chunks lie in a token list (the prompt's, hence the slot's cache, whose prefix it is),
    and what that does to positions.  Empty (:data:`NO_MEDIA`): every count is its own position."""

    def __init__(self, chunks: Sequence[MediaChunk] = ()) -> None:
        self.chunks = tuple(sorted(chunks, key=lambda c: c.start))
        self._at = {c.start: c for c in self.chunks}

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def chunk_at(self, n: int) -> MediaChunk | None:
        """The chunk that starts at token index ``n``, if one does."""
        return self._at.get(n)

    def next_start(self, n: int) -> int | None:
        """The start of the first chunk at or after index ``n`` (None: text to the end)."""
        return next((c.start for c in self.chunks if c.start >= n), None)

    def snap(self, n: int) -> int:
        """``n`` cells, or the start of the chunk ``n`` falls inside (a cut never splits a chunk)."""
        for c in self.chunks:
            if c.start < n < c.end:
                return c.start
        return n

    def pos(self, n: int) -> int:
        """The position that follows the first ``n`` cells (``n`` off any chunk's inside): ``n`` less what the
        chunks before it hold beyond the positions they advance (llama-server's ``pos_next``)."""
        return n - sum(c.n_tokens - c.n_pos for c in self.chunks if c.end <= n)

    def n_at(self, pos: int) -> int:
        """The cell count :meth:`pos` maps to ``pos`` (its inverse; a position inside a chunk's span: the chunk's
        start)."""
        n = pos
        for c in self.chunks:
            p0 = self.pos(c.start)
            if pos <= p0:
                break
            if pos < p0 + c.n_pos:
                return c.start
            n += c.n_tokens - c.n_pos
        return n

    def held(self, n_past: int) -> bool:
        """A slot holding ``n_past`` cells of this token list holds media."""
        return bool(self.chunks) and self.chunks[0].start < n_past


NO_MEDIA = MediaLayout()


@attrs.frozen(eq=False)
class MediaTokens:
    """A prompt with media, tokenized (:meth:`MediaContext.tokenize`): ``tokens`` are the text tokens with
    each chunk's ``n_tokens`` placeholders in place (``len(tokens)``: the prompt's tokens as llama-server counts
    them, ``usage.prompt_tokens``), ``chunks`` the media chunks in order."""

    tokens: tuple[int, ...]
    chunks: tuple[MediaChunk, ...]

    @property
    def n_pos(self) -> int:
        """The positions the prompt advances (``mtmd_helper_get_n_pos``)."""
        return MediaLayout(self.chunks).pos(len(self.tokens))


class MediaContext:
    """An ``mtmd`` context: the projector at ``path`` loaded for the model ``model`` (a ``llama_model``
    pointer), with llama-server's context parameters (``use_gpu``: ``--mmproj-offload``; ``n_threads``;
    ``image_min_tokens``/``image_max_tokens``: -1 for the projector's own; ``batch_max_tokens``: the most
    image tokens one encode batch holds, ``--mtmd-batch-max-tokens``; ``device``: ``-mmdev``, a ggml device
    name, "" for mtmd's own choice; the media marker :data:`MEDIA_MARKER`); ``video``: how videos are read.

    Raises:
        ModelLoadError: mtmd refused the file (not a projector, or one for a model of another width).
    """

    def __init__(
        self,
        path: str | Path,
        model: Any,
        *,
        use_gpu: bool = True,
        n_threads: int = 1,
        image_min_tokens: int = -1,
        image_max_tokens: int = -1,
        batch_max_tokens: int = 1024,
        device: str = "",
        video: VideoOptions = VideoOptions(),
    ) -> None:
        import llama_cpp.mtmd_cpp as mtmd

        self._mtmd = mtmd
        mtmd.mtmd_log_set(_log_line, None)
        mtmd.mtmd_helper_log_set(_log_line, None)
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = n_threads
        self._marker = MEDIA_MARKER.encode()  # the process's marker (the front ends write it); kept alive
        params.media_marker = self._marker
        params.image_min_tokens = image_min_tokens
        params.image_max_tokens = image_max_tokens
        params.batch_max_tokens = batch_max_tokens
        if device:  # llama-server: ggml_backend_dev_by_name, case-insensitive (checked when the node started)
            from . import ggml_backend

            dev = next(
                (d for d in ggml_backend.all_devices() if ggml_backend.device_name(d).lower() == device.lower()), None
            )
            if dev is None:
                raise ModelLoadError(f"-mmdev/--mmproj-device: no device {device!r}")
            params.device = dev
        self.path = str(path)
        self.ctx = mtmd.mtmd_init_from_file(self.path.encode(), model, params)
        if not self.ctx:
            raise ModelLoadError(f"failed to load multimodal model, '{self.path}'")  # llama-server's words
        self.vision = bool(mtmd.mtmd_support_vision(self.ctx))
        self.audio = bool(mtmd.mtmd_support_audio(self.ctx))
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(self.ctx))
        self.video = bool(mtmd.mtmd_helper_support_video(self.ctx))  # a build with video and a vision encoder
        self._ffmpeg_dir = video.ffmpeg_dir.encode() if video.ffmpeg_dir else None  # kept alive: opt points here
        self._init_opt = mtmd.mtmd_helper_init_opt_default()
        self._init_opt.video_params.fps_target = video.fps
        self._init_opt.video_params.timestamp_interval_ms = video.timestamp_interval_ms
        self._init_opt.video_params.ffmpeg_bin_dir = self._ffmpeg_dir
        log.info("loaded multimodal model, '%s' (vision %s, audio %s)", self.path, self.vision, self.audio)

    @property
    def modalities(self) -> dict[str, bool]:
        """``{"vision": bool, "video": bool, "audio": bool}`` (llama-server's ``/props`` ``modalities``; ``video``
        is ``mtmd_helper_support_video``: libmtmd built with video and a vision encoder, whether or not ffmpeg
        is installed)."""
        return {"vision": self.vision, "video": self.video, "audio": self.audio}

    def close(self) -> None:
        """Free the context (engine thread; before the model it was loaded for)."""
        if self.ctx:
            self._mtmd.mtmd_free(self.ctx)
            self.ctx = None

    def tokenize(
        self, text: str, media: Sequence[Any], *, add_special: bool = True, parse_special: bool = True
    ) -> MediaTokens:
        """``text``, whose :data:`MEDIA_MARKER` each stands for one item of ``media`` in order, as text
        tokens and media chunks (llama-server's ``process_mtmd_prompt``: special tokens parsed, BOS added
        when the vocabulary wants one).  Each item has ``data`` (the file's bytes: an image stb_image decodes,
        a WAV, MP3 or FLAC clip, a WebP image or a video ffmpeg decodes) and may have ``id`` (a non-empty one
        names the media for the cache instead of the SHA-256 of its bytes).  A video's frames are read (an
        ``ffmpeg`` process) while ``mtmd_tokenize`` runs; its reader is freed once it returns.

        Raises:
            InvalidRequest: an item is none of those, or a WebP or video that ffprobe / ffmpeg cannot read or
                cannot be run for ("Failed to load image or audio file"), or the markers and the items do not
                pair up or mtmd refused the media ("Failed to tokenize prompt"), as llama-server words them.
        """
        mtmd = self._mtmd
        bitmaps = []
        videos = []  # a video's bitmap reads its frames through its reader: alive until mtmd_tokenize returns
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            for item in media:
                data = bytes(item.data)
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                out = mtmd.mtmd_helper_bitmap_init_from_buf_wrapper(self.ctx, buf, len(data), False, self._init_opt)
                if out.video_ctx:
                    videos.append(out.video_ctx)
                if not out.bitmap:
                    raise InvalidRequest("Failed to load image or audio file")
                bitmaps.append(out.bitmap)
                if getattr(item, "id", ""):
                    mtmd.mtmd_bitmap_set_id(out.bitmap, str(item.id).encode())
            raw = text.encode("utf-8")
            inp = mtmd.mtmd_input_text(raw, len(raw), add_special, parse_special)
            arr = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            if mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps)) != 0:
                raise InvalidRequest("Failed to tokenize prompt")
            return self._collect(chunks)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for v in videos:
                mtmd.mtmd_helper_video_free(v)
            for b in bitmaps:
                mtmd.mtmd_bitmap_free(b)

    def _collect(self, chunks: Any) -> MediaTokens:
        mtmd = self._mtmd
        tokens: list[int] = []
        found: list[MediaChunk] = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                arr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                tokens.extend(arr[j] for j in range(n.value))
                continue
            copy = mtmd.mtmd_input_chunk_copy(chunk)
            if not copy:
                raise MemoryError("mtmd_input_chunk_copy failed")
            raw_id = mtmd.mtmd_input_chunk_get_id(chunk)
            media = MediaChunk(
                id=raw_id.decode("utf-8", "replace") if raw_id else "",
                kind="audio" if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO else "image",
                start=len(tokens),
                n_tokens=int(mtmd.mtmd_input_chunk_get_n_tokens(chunk)),
                n_pos=int(mtmd.mtmd_input_chunk_get_n_pos(chunk)),
                handle=_ChunkHandle(copy),
            )
            found.append(media)
            tokens.extend([media.placeholder] * media.n_tokens)
        return MediaTokens(tuple(tokens), tuple(found))

    def eval_chunk(
        self,
        lctx: Any,
        chunk: MediaChunk,
        pos: int,
        seq_id: int,
        n_batch: int,
        logits_last: bool,
        on_batch: EmbdCallback | None = None,
    ) -> int:
        """Engine thread: encode ``chunk`` and decode its embeddings into sequence ``seq_id`` of the llama
        context ``lctx`` at position ``pos``, in pieces of at most ``n_batch`` (``mtmd_helper_eval_chunk_single``;
        a non-causal projector's decode takes the whole chunk at once); ``logits_last``: the last embedding's
        logits are kept (index -1).  ``on_batch(seq_id, embd, pos)`` hears each decoded piece, as llama-server's
        ``process_mtmd_chunk`` hands it to its drafters: ``embd`` float32 ``[n, n_embd]``, ``pos`` int32
        ``[n_pos, n]`` (4 rows with M-RoPE, else 1), both copies (the same steps as
        ``mtmd_helper_eval_chunk_single``: ``mtmd_encode_chunk``, then ``mtmd_helper_decode_image_chunk`` with a
        post-decode callback).  Returns mtmd's code (0: done; -1 too for a chunk without a handle)."""
        if chunk.handle is None:  # a restored slot's chunk: no input to encode (mtmd's failure code)
            log.error("media chunk %s has no projector input (restored from a state blob)", chunk.id)
            return -1
        mtmd = self._mtmd
        new_pos = llama_cpp.llama_pos(0)
        if on_batch is None:
            return int(
                mtmd.mtmd_helper_eval_chunk_single(
                    self.ctx, lctx, chunk.handle.ptr, pos, seq_id, n_batch, logits_last, ctypes.byref(new_pos)
                )
            )
        import numpy as np

        rc = int(mtmd.mtmd_encode_chunk(self.ctx, chunk.handle.ptr))
        if rc != 0:
            return rc
        embd = mtmd.mtmd_get_output_embd(self.ctx)

        def hear(view: Any, _user: Any) -> int:
            b = view.contents
            rows = np.ctypeslib.as_array(b.embd, shape=(b.n_tokens, b.n_embd)).copy()
            where = np.ctypeslib.as_array(b.pos, shape=(b.n_pos, b.n_tokens)).copy()
            try:
                on_batch(b.seq_id, rows, where)
            except Exception:  # a drafter's failure never fails the target's chunk
                log.exception("media chunk %s: a drafter failed on its embeddings", chunk.id)
            return 0

        callback = mtmd.mtmd_helper_post_decode_callback(hear)  # alive until the call returns
        return int(
            mtmd.mtmd_helper_decode_image_chunk(
                self.ctx, lctx, chunk.handle.ptr, embd, pos, seq_id, n_batch, ctypes.byref(new_pos), callback, None
            )
        )

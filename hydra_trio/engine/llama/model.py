"""Model loading and model identity, through llama-cpp-python's low-level API.

Everything here runs on the engine thread (see :mod:`hydra_trio.engine.loop`):
llama.cpp objects are created, used and freed by that one thread only.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import llama_cpp

from ...errors import InvalidRequest, ModelLoadError
from ...observability.memory import available_memory
from ...validation.strict import TooLong
from ..bridge import thread_local_set
from ..settings import KV_CACHE_TYPES, UNQUANTIZED_KV_TYPES, LlamaOptions, kv_type_name
from . import ggml_backend, kv_overrides
from .ggml_backend import clean_build_paths
from .jinja_chat import JinjaChatFormatter, capability_variables
from .media import MediaContext, MediaTokens, VideoOptions
from .placement import Placement, PlacementError, placed_tensors
from .tokenize import SpecialTokens, tokenize_linear

log = logging.getLogger("hydra_trio.engine")

_backend_ready = False

_log_tap = threading.local()
"""``.lines``: the list llama.cpp's log lines logged on this thread go to while :func:`_tap_llama_log` runs."""


def _install_llama_log_handler() -> None:
    """Route llama.cpp's log lines to Python logging (logger ``llama_cpp``).

    llama.cpp calls the callback from whichever thread logs; logging is
    thread-safe.  Its DEBUG chatter stays at DEBUG.
    """

    # enum ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
    levels = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR, 5: logging.DEBUG}
    llog = logging.getLogger("llama_cpp")

    @llama_cpp.llama_log_callback
    def _cb(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        msg = clean_build_paths(text.decode("utf-8", "replace").rstrip("\n"))
        if msg:
            if (tap := getattr(_log_tap, "lines", None)) is not None:
                tap.append(msg)
            # llama.cpp's INFO is very chatty (one line per tensor): keep it at DEBUG.
            py_level = levels.get(level, logging.DEBUG)
            llog.log(logging.DEBUG if py_level == logging.INFO else py_level, "%s", msg)

    # keep a reference: ctypes callbacks must outlive their registration
    _install_llama_log_handler.cb = _cb  # type: ignore[attr-defined]  # a function attribute holds it
    llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))


def init_backend(numa: str | None = None) -> None:
    """Initialise llama.cpp's backends once per process (idempotent); ``numa`` (``--numa distribute|isolate|
    numactl``) is ggml's NUMA strategy, set once per process as llama-server sets it after the backends."""
    global _backend_ready, _numa_set
    if not _backend_ready:
        _install_llama_log_handler()
        llama_cpp.llama_backend_init()
        _backend_ready = True
    if numa and not _numa_set:
        llama_cpp.llama_numa_init(_NUMA[numa])
        _numa_set = True


_NUMA = {"distribute": 1, "isolate": 2, "numactl": 3}  # enum ggml_numa_strategy
_numa_set = False


def slot_context(n_ctx_seq: int, per_slot: int, n_ctx_train: int) -> int:
    """Tokens one slot may hold, as llama-server's ``n_ctx_slot()`` (``tools/server/server-context.cpp`` of
    the vendored llama.cpp): the context's ``n_ctx_seq`` (without ``-kvu`` a slot's own stream,
    ``n_ctx / n_parallel``; with ``-kvu`` the whole shared cache), capped by ``--kv-unified-per-slot``
    (``per_slot`` > 0) and by the model's training context ``n_ctx_train`` (which llama.cpp stretches
    when YaRN scales RoPE: ``n_ctx_orig_yarn / rope_freq_scale``).  Each cap that binds is logged, as
    llama-server logs it."""
    n = n_ctx_seq
    if per_slot > 0:
        if per_slot < n:
            log.info("capping per-slot context (%d) to --kv-unified-per-slot (%d)", n, per_slot)
        elif per_slot > n:
            log.warning(
                "--kv-unified-per-slot (%d) exceeds the per-slot pool capacity (%d) - cap has no effect, "
                "slots are limited to %d",
                per_slot,
                n,
                n,
            )
        n = min(n, per_slot)
    if n > n_ctx_train:
        log.warning("the slot context (%d) exceeds the training context of the model (%d) - capping", n, n_ctx_train)
        n = n_ctx_train
    return n


class LoadStopped(RuntimeError):
    """A load or hash was stopped on purpose (the node is shutting down)."""


def hash_cache_dir() -> Path:
    """Where files' SHA-256 are remembered (:func:`sha256_file`): ``$XDG_CACHE_HOME/hydra-trio/hashes``
    (``~/.cache/...`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydra-trio" / "hashes"


def file_identity(path: Path | str) -> tuple[str, int, int, int, int, int]:
    """The file at ``path`` as it is now: its real path, device, inode, size and both times in nanoseconds
    (a write, a rename over it or a ``touch`` gives another).

    Raises:
        OSError: it cannot be read."""
    st = os.stat(path)
    return os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _hash_entry(path: Path, kind: str) -> Path:
    """The cache file of ``path``'s digest ``kind`` as the file is now: named after :func:`file_identity`."""
    key = "\0".join([kind, *map(str, file_identity(path))])
    return hash_cache_dir() / hashlib.sha256(key.encode()).hexdigest()


def _read_entry(path: Path | str, kind: str) -> str | None:
    """The entry's text; None when it cannot be read or is not UTF-8 (a damaged entry is read afresh)."""
    with contextlib.suppress(OSError, UnicodeError):
        return _hash_entry(Path(path), kind).read_bytes().decode()
    return None


def _write_entry(path: Path | str, kind: str, text: str) -> None:
    with contextlib.suppress(OSError):
        entry = _hash_entry(Path(path), kind)
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, entry)


def remembered_digest(path: Path | str, kind: str) -> str | None:
    """The digest ``kind`` (``"sha256"``: the file's; others: of something read from it, e.g. its
    vocabulary) kept for ``path`` as it is now (:func:`remember_digest`), else None (also when the file or
    the cache cannot be read)."""
    known = (_read_entry(path, kind) or "").strip()
    return known if re.fullmatch(r"[0-9a-f]{64}", known) else None


def remember_digest(path: Path | str, kind: str, digest: str) -> None:
    """Keep ``digest`` for ``path`` as it is now, in :func:`hash_cache_dir` (atomically; a cache that cannot
    be written is passed over)."""
    _write_entry(path, kind, digest + "\n")


def remembered_table(path: Path | str, kind: str) -> Any:
    """The JSON value ``kind`` kept for ``path`` as it is now (:func:`remember_table`: a table read from the
    file through llama.cpp), else None (also when it cannot be read or parsed)."""
    text = _read_entry(path, kind)
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None


def remember_table(path: Path | str, kind: str, value: Any) -> None:
    """Keep the JSON value ``value`` for ``path`` as it is now, beside its digests (:func:`remember_digest`)."""
    _write_entry(path, kind, json.dumps(value, separators=(",", ":")))


def sha256_file(
    path: Path,
    chunk: int = 1 << 20,
    stop: Callable[[], bool] | None = None,
    on_block: Callable[[int], object] | None = None,
    *,
    remember: bool = True,
) -> str:
    """SHA-256 of a file as 64 lowercase hex digits, read in ``chunk``-byte blocks.

    ``on_block(n)`` is called with each block's size in bytes (progress; the whole size at once when the hash
    is remembered).  ``remember``: a hash computed is kept in :func:`hash_cache_dir` under the file's
    identity (:func:`remember_digest`), and the same file unchanged is not read again (a node's start, a
    quantization swap, a router's child: a 250 MB model's hash costs a third of a second on 2 cores).

    Raises:
        OSError: the file cannot be read.
        LoadStopped: ``stop()`` returned True between two blocks.
    """
    if remember and (known := remembered_digest(path, "sha256")) is not None:
        if on_block is not None:
            on_block(os.stat(path).st_size)
        return known
    digest = hashlib.sha256()
    buf = bytearray(chunk)  # one buffer, read into: a new block per read would leave freed megabytes in the heap
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            if on_block is not None:
                on_block(n)
            if stop is not None and stop():
                raise LoadStopped(f"hashing {path} stopped")
    hexdigest = digest.hexdigest()
    if remember:
        remember_digest(path, "sha256", hexdigest)
    return hexdigest


DEFAULT_CHAT_TEMPLATE = "chatml"
"""The template of a model whose GGUF has none (llama-server falls back to chatml too)."""


@functools.cache
def builtin_chat_templates() -> tuple[str, ...]:
    """The names of llama.cpp's built-in chat templates (``llama_chat_builtin_templates``),
    the names llama-server's ``--chat-template`` accepts: ``chatml``, ``gemma``, ``llama2``,
    ``llama3``, ``zephyr``, ``phi3``, ..."""
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return tuple(name.decode() for name in names)


def check_chat_template(value: str, *, jinja: bool = False) -> str:
    """Check a ``--chat-template`` value: a built-in name, or Jinja text that compiles
    (only the latter with ``jinja``: a template file's text).

    Returns a description for the log.  Raises ValueError naming the problem
    (a Jinja syntax error, or a word that is no built-in template's name).
    """
    if not jinja and value in builtin_chat_templates():
        return f"built-in {value!r}"
    if not jinja and "{{" not in value and "{%" not in value:
        raise ValueError(
            f"{value!r} is neither a built-in template ({', '.join(builtin_chat_templates())}) "
            "nor an existing file nor Jinja text"
        )
    ChatTemplate.jinja(value, "", "", "check")
    return f"Jinja text ({len(value)} characters)"


_SENTINEL = "\x01hydra-trio\x01"


class ChatTemplateError(InvalidRequest, ValueError):
    """The chat template refused the request's messages: a Jinja template called ``raise_exception('...')``
    (e.g. a role it does not accept) or failed on them, or llama.cpp's built-in template could not render
    them.  The client's bad request, as llama-server answers it (HTTP 400 ``invalid_request_error`` with the
    template's message, tools/server/server-context.cpp; Hydra BAD_REQUEST, the connection kept)."""


_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "eos_token",
        "bos_token",
        "raise_exception",
        "add_generation_prompt",
        "functions",
        "function_call",
        "tools",
        "tool_choice",
        "strftime_now",
    }
)
"""Variables llama-cpp-python's Jinja renderer sets itself (``Jinja2ChatFormatter.__call__``, as
:class:`.JinjaChatFormatter`)."""


class ChatTemplate:
    """Renders chat messages into a prompt: ``template(messages) -> (prompt, stop strings)``.

    Two kinds, as llama-server has them: Jinja text (a GGUF's
    ``tokenizer.chat_template`` or a template file), rendered by
    llama-cpp-python's ``Jinja2ChatFormatter`` (its copy :class:`.JinjaChatFormatter`;
    stop string: the EOS token's text), and llama.cpp's built-in templates by name, rendered by
    ``llama_chat_apply_template`` (stop string: the end-of-turn marker the
    template writes after an assistant message, e.g. ``<|im_end|>`` for chatml,
    found by rendering a sentinel turn; a model whose own end-of-turn token
    differs stops on that text).

    Attributes:
        kind: ``"jinja"`` or ``"builtin"``.
        source: the Jinja text, or the built-in template's name (``/props``'s
            ``chat_template``).
        origin: where it comes from, for the log.
    """

    def __init__(
        self,
        kind: str,
        source: str,
        origin: str,
        render: Callable[
            [list[dict], dict[str, Any] | None, list[dict] | None, int | None, bool], tuple[str, list[str]]
        ],
    ):
        self.kind = kind
        self.source = source
        self.origin = origin
        self._render = render

    @classmethod
    def jinja(
        cls, text: str, bos_token: str, eos_token: str, origin: str, kwargs: dict[str, Any] | None = None
    ) -> ChatTemplate:
        """Jinja text; ``kwargs`` are extra template variables (llama-server's ``--chat-template-kwargs``,
        e.g. ``enable_thinking``; the names the renderer sets itself are not overridden).  Raises ValueError
        when it does not compile."""
        extra = {k: v for k, v in (kwargs or {}).items() if k not in _RESERVED_TEMPLATE_VARIABLES}
        try:
            fmt = JinjaChatFormatter(
                template=text, eos_token=eos_token, bos_token=bos_token, add_generation_prompt=True
            )
        except Exception as exc:  # jinja2.TemplateSyntaxError and friends
            raise ValueError(f"the chat template does not compile: {exc}") from None

        def render(
            messages: list[dict],
            more: dict[str, Any] | None = None,
            tools: list[dict] | None = None,
            max_chars: int | None = None,
            add_generation_prompt: bool = True,
        ) -> tuple[str, list[str]]:
            variables = capability_variables(
                {**extra, **{k: v for k, v in (more or {}).items() if k not in _RESERVED_TEMPLATE_VARIABLES}}
            )
            try:
                prompt = fmt.render(
                    max_chars,
                    messages=messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    **variables,
                )
            except TooLong:
                raise
            except Exception as exc:  # raise_exception's ValueError, jinja2's TemplateError, a TypeError, ...
                raise ChatTemplateError(f"messages: the chat template failed: {exc}") from exc
            return prompt, [eos_token]

        return cls("jinja", text, origin, render)

    @classmethod
    def builtin(cls, name: str, origin: str) -> ChatTemplate:
        """llama.cpp's built-in template ``name`` (:func:`builtin_chat_templates`)."""
        tail = _apply_builtin(
            name, [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}], add_assistant=False
        )
        end = tail.split(_SENTINEL, 1)[1].strip() if _SENTINEL in tail else ""
        stop = [end] if end else []

        def render(
            messages: list[dict],
            more: dict[str, Any] | None = None,
            tools: list[dict] | None = None,
            max_chars: int | None = None,
            add_generation_prompt: bool = True,
        ) -> tuple[str, list[str]]:
            return _apply_builtin(name, messages, add_assistant=add_generation_prompt), list(stop)

        return cls("builtin", name, origin, render)

    def __call__(
        self,
        messages: list[dict],
        kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
        max_chars: int | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[str, list[str]]:
        """``(prompt, stop strings)``; ``kwargs`` are template variables over the node's (a request's
        ``chat_template_kwargs``); ``tools`` (OpenAI tool objects) reach a Jinja template as its ``tools``
        variable (a built-in template has no variables and never renders tools: callers describe them
        in a message instead, :func:`hydra_trio.openai.tools.render_messages`).  ``max_chars``: a Jinja
        template's rendering stops with :class:`~hydra_trio.validation.strict.TooLong` past that many
        characters (a built-in template writes little more than the messages themselves).
        ``add_generation_prompt`` false: the prompt ends after the last message, no assistant turn opened
        (llama-server's request field of that name; a built-in template's ``add_ass``)."""
        return self._render(messages, kwargs, tools, max_chars, add_generation_prompt)

    def describe(self) -> str:
        if self.kind == "builtin":
            return f"llama.cpp built-in {self.source!r} ({self.origin})"
        return f"Jinja, {len(self.source)} characters ({self.origin})"


def _apply_builtin(name: str, messages: list[dict], *, add_assistant: bool) -> str:
    """``llama_chat_apply_template`` with built-in template ``name``; raises ChatTemplateError when it fails."""
    keep = [(str(m.get("role", "")).encode(), str(m.get("content") or "").encode()) for m in messages]
    chat = (llama_cpp.llama_chat_message * len(keep))()
    for i, (role, content) in enumerate(keep):
        chat[i].role = role
        chat[i].content = content
    size = sum(len(r) + len(c) for r, c in keep) * 2 + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(keep), add_assistant, buf, size)
        if n < 0:
            raise ChatTemplateError(f"messages: chat template {name!r} failed on these messages")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n
    raise ValueError(f"chat template {name!r}: the prompt kept growing")


@attrs.frozen
class ModelIdentity:
    """Model identity keys of docs/hydra-protocol.md §3: alias, path, SHA-256 of the GGUF, and the
    SHA-256 of its KV identity (:mod:`hydra_trio.engine.kv.kv_identity`): files with equal
    ``kv_identity_hash`` can exchange slot KV."""

    model_alias: str
    model_path: str
    model_hash: str
    kv_identity_hash: str = ""

    def as_meta(self) -> dict[str, str]:
        return attrs.asdict(self)


class LoadedModel:
    """A GGUF model and one llama.cpp context with ``n_parallel`` sequences.

    Args:
        path: the GGUF file.
        n_ctx: total context in tokens, shared by the sequences as llama-server
            does (each slot gets ``n_ctx // n_parallel`` tokens); 0: the model's
            training context (llama-server's ``-c 0``).
        n_parallel: number of sequences (slots), one KV sequence each.
        n_batch: most tokens per ``llama_decode`` call.
        n_threads: CPU threads (None: all cores).
        progress: called with 0.0..1.0 while the weights load (llama.cpp's
            ``progress_callback``); returning False aborts the load.
        peer: ``(ggml_backend_dev_t of a ggml-RPC peer, tensor name regex, label)``:
            the tensors matching the regex go to the peer (COMBINED's experts,
            PIPELINE_ATTACH's split); the label names the rule in the log.
        chat_template: llama-server's ``--chat-template``: None for the GGUF's
            own template (llama.cpp's built-in ``chatml`` when it has none), a
            built-in name (:func:`builtin_chat_templates`) or Jinja text.
        log_chat_template: log (INFO) which chat template is in effect.
        options: llama.cpp model and context parameters from llama-server's
            flags (:class:`~hydra_trio.engine.settings.LlamaOptions`); the
            placement ones (devices, layers, tensor overrides) as
            :class:`~hydra_trio.engine.llama.placement.Placement` builds them,
            composed with ``peer``.
        chat_template_kwargs: extra variables for a Jinja chat template
            (``--chat-template-kwargs``).

    Raises:
        ModelLoadError: llama.cpp refused the file or the context, the
            Jinja chat template does not compile, or a device or buffer type
            of ``options`` does not exist here
            (:class:`~hydra_trio.engine.llama.placement.Placement`).
    """

    def __init__(
        self,
        path: Path,
        *,
        n_ctx: int,
        n_parallel: int,
        n_batch: int,
        n_threads: int | None,
        progress: Callable[[float], bool] | None = None,
        peer: tuple[int, str, str] | None = None,
        chat_template: str | None = None,
        log_chat_template: bool = False,
        options: LlamaOptions | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.options = opts = options if options is not None else LlamaOptions()
        init_backend(opts.numa)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        mparams = llama_cpp.llama_model_default_params()
        _apply_model_options(mparams, opts)
        self._kv_overrides = kv_overrides.apply(mparams, opts.kv_overrides)  # --override-kv; kept alive
        n_layer = None
        if opts.n_cpu_moe or opts.n_cpu_ffn:  # -ncmoe/-ncffn: one pattern per layer, up to the model's layers
            try:
                n_layer = ggml_backend.GgufHeader(path).block_count
            except OSError:
                pass  # llama.cpp says what is wrong with the file below
        try:
            self.placement = Placement(opts, n_layer=n_layer, peer=peer)
        except PlacementError as exc:
            raise ModelLoadError(str(exc)) from None
        self.placement.apply(
            mparams
        )  # an explicit device list: a NULL one means every registered device, ggml-RPC peers too
        if progress is not None:

            @llama_cpp.llama_progress_callback
            def _progress(value: float, _user: ctypes.c_void_p) -> bool:
                return bool(progress(float(value)))

            self._progress_cb = _progress  # keep alive during the load
            mparams.progress_callback = _progress
        self._llama_log: list[str] = []  # llama.cpp's log of this load: buffer sizes, flash attention's choice
        with _tap_llama_log(self._llama_log):
            self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        self.tensor_placement = placed_tensors(self._llama_log)
        """Tensors an override placed, by buffer type name (``{"CPU": 24}``; ``/props`` ``tensor_placement``)."""
        if not self.model:
            raise ModelLoadError(f"llama.cpp could not load {path}")
        if self.placement.overrides or self.placement.devices or opts.devices is not None:
            log.info(
                "placement of %s: %s; tensors overridden: %s",
                path.name,
                self.placement.describe(),
                ", ".join(f"{n} to {buft}" for buft, n in self.tensor_placement.items()) or "none",
            )
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.model)
        if n_ctx == 0:  # llama-server's -c 0: the model's training context
            n_ctx = self.n_ctx_train

        if n_ctx < 16 * n_parallel:
            llama_cpp.llama_model_free(self.model)
            self.model = None
            raise ModelLoadError(f"n_ctx {n_ctx} is too small: at least 16 tokens per slot ({n_parallel} slots)")
        # the KV cache's ggml types (-ctk / -ctv): the memory check counts them
        self.type_k, self.type_v = KV_CACHE_TYPES[opts.cache_type_k], KV_CACHE_TYPES[opts.cache_type_v]
        kv_bytes = n_ctx * self.kv_bytes_per_token()
        free = available_memory()
        if free is not None and kv_bytes > free:
            llama_cpp.llama_model_free(self.model)
            self.model = None
            raise ModelLoadError(
                f"n_ctx {n_ctx} needs {kv_bytes / 2**20:.0f} MiB of KV cache (K {opts.cache_type_k}, "
                f"V {opts.cache_type_v}: {kv_bytes // n_ctx} bytes per token); only {free / 2**20:.0f} MiB of "
                "memory is available"
            )
        _libc()  # large blocks from mmap from now on (see _libc)
        threads = n_threads or os.cpu_count() or 1
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(opts.n_ubatch or n_batch, n_batch)
        cparams.n_seq_max = n_parallel
        cparams.n_threads = threads
        cparams.n_threads_batch = opts.n_threads_batch or threads
        apply_context_options(cparams, opts)
        cparams.kv_unified = opts.kv_unified  # default: one KV stream per slot, like llama-server's
        cparams.no_perf = True
        self._cparams = cparams
        self.file_backed = _weights_file_backed(self._llama_log, opts)
        """Every weight is read from the file's pages (mapped, not locked, no copy in another buffer): kept
        without its context (:meth:`release_context`), the model holds little more than its vocabulary."""
        try:
            self._file_identity: tuple[str, int, int, int, int, int] | None = file_identity(path)
        except OSError:  # gone since it was read: never the same file
            self._file_identity = None
        with _tap_llama_log(self._llama_log):
            self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            self.model = None
            raise ModelLoadError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_parallel={n_parallel})")
        # read back what llama.cpp chose: it may round n_ctx up and cap n_batch at n_ctx
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)
        self.n_ctx_slot = slot_context(
            llama_cpp.llama_n_ctx_seq(self.ctx), opts.kv_unified_per_slot, llama_cpp.llama_model_n_ctx_train(self.model)
        )
        """Tokens one slot may hold (:func:`slot_context`): with ``-kvu`` the whole shared cache."""
        self.n_batch = min(n_batch, llama_cpp.llama_n_batch(self.ctx), llama_cpp.llama_n_ubatch(self.ctx))
        self.n_parallel = n_parallel
        self.n_stream = 1 if opts.kv_unified else n_parallel  # KV streams: one, or one per sequence
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.flash_attn = _flash_attn_in_effect(opts, self._llama_log)
        kv_cells = llama_cpp.llama_n_ctx_seq(self.ctx) * self.n_stream  # every stream's cells (-kvu: one stream)
        self.memory_use = _memory_use(
            self._llama_log, llama_cpp.llama_model_size(self.model), kv_cells * self.kv_bytes_per_token()
        )
        del self._llama_log
        log.info(
            "memory: %s; KV cache K %s, V %s (%d cells), flash attention %s",
            "; ".join(
                f"{dev}: " + ", ".join(f"{'KV' if k == 'kv' else k} {v / 2**20:.1f} MiB" for k, v in use.items())
                for dev, use in self.memory_use.items()
            ),
            opts.cache_type_k,
            opts.cache_type_v,
            kv_cells,
            self.flash_attn,
        )
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos_id = llama_cpp.llama_vocab_bos(self.vocab)
        self.eos_id = llama_cpp.llama_vocab_eos(self.vocab)
        try:
            self.chat_template = self._make_chat_formatter(chat_template)
        except Exception:
            self.close()
            raise
        if log_chat_template:
            log.info("chat template: %s", self.chat_template.describe())
        self.media: MediaContext | None = None
        """The projector (``--mmproj``), loaded with the model and freed with it; None: text only."""
        if opts.mmproj:
            try:
                self.media = MediaContext(
                    opts.mmproj,
                    self.model,
                    use_gpu=opts.mmproj_offload,
                    n_threads=threads,
                    image_min_tokens=opts.image_min_tokens,
                    image_max_tokens=opts.image_max_tokens,
                    batch_max_tokens=opts.mmproj_batch_max_tokens,
                    device=opts.mmproj_device,
                    video=VideoOptions(opts.video_fps, opts.video_timestamp_interval_ms, opts.video_ffmpeg_dir or None),
                )
            except Exception:
                self.close()
                raise

    # -- metadata ---------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes with this model's cache types (:attr:`type_k`, :attr:`type_v`,
        from ``-ctk`` / ``-ctv``), over all layers.

        ``n_layer × (row_size(type_k, n_head_kv × key_length) + row_size(type_v, n_head_kv × value_length))``,
        ``row_size(t, n) = n / ggml_blck_size(t) × ggml_type_size(t)`` (f16: 2 bytes an element; q8_0: 34
        bytes a block of 32); head sizes from the GGUF (``{arch}.attention.key_length`` / ``value_length``),
        else ``n_embd / n_head`` as llama.cpp assumes.
        """
        from ...protocol.ggml_rpc import GGML_TYPE_COUNT
        from .ggml_backend import type_traits

        arch = self.meta("general.architecture") or ""
        n_head = max(1, llama_cpp.llama_model_n_head(self.model))
        default = llama_cpp.llama_model_n_embd(self.model) // n_head
        k = int(self.meta(f"{arch}.attention.key_length") or default)
        v = int(self.meta(f"{arch}.attention.value_length") or default)
        n_head_kv = llama_cpp.llama_model_n_head_kv(self.model)
        traits = type_traits(GGML_TYPE_COUNT)

        def row(type_id: int, n: int) -> int:
            blck, size = traits[type_id]
            return -(-n // blck) * size

        return llama_cpp.llama_model_n_layer(self.model) * (
            row(self.type_k, n_head_kv * k) + row(self.type_v, n_head_kv * v)
        )

    def kv_cache_info(self) -> dict[str, str]:
        """``{"type_k", "type_v", "flash_attn"}``: the KV cache's types (``q8_0``) and flash attention in
        effect (``on`` / ``off``; ``auto`` when llama.cpp did not say what it chose) — ``/props``'s
        and INFO's ``kv_cache``."""
        return {"type_k": kv_type_name(self.type_k), "type_v": kv_type_name(self.type_v), "flash_attn": self.flash_attn}

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None when absent."""
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        return buf.value.decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        raw = llama_cpp.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", "replace") if raw else ""

    def _make_chat_formatter(self, chat_template: str | None) -> ChatTemplate:
        """The chat template in effect, chosen as llama-server chooses (``--chat-template``):

        ``chat_template`` None: the GGUF's own (``tokenizer.chat_template``),
        else llama.cpp's built-in ``chatml`` (llama-server's fallback for a
        model without a template; also used, with a warning, when the GGUF's
        template does not compile); a built-in name
        (:func:`builtin_chat_templates`): that template; anything else: Jinja
        template text.

        Raises ModelLoadError for Jinja text that does not compile.
        """
        bos = self.token_text(self.bos_id) if self.bos_id >= 0 else ""
        eos = self.token_text(self.eos_id) if self.eos_id >= 0 else ""
        if chat_template is None:
            raw = llama_cpp.llama_model_chat_template(self.model, None)
            if not raw:
                return ChatTemplate.builtin(DEFAULT_CHAT_TEMPLATE, "the GGUF has none: llama-server's default")
            try:
                return ChatTemplate.jinja(
                    raw.decode("utf-8", "replace"),
                    bos,
                    eos,
                    "the GGUF's tokenizer.chat_template",
                    self.chat_template_kwargs,
                )
            except ValueError as exc:
                log.warning("the GGUF's chat template is unusable (%s); using %s", exc, DEFAULT_CHAT_TEMPLATE)
                return ChatTemplate.builtin(DEFAULT_CHAT_TEMPLATE, "the GGUF's does not compile")
        if chat_template in builtin_chat_templates():
            return ChatTemplate.builtin(chat_template, "--chat-template")
        try:
            return ChatTemplate.jinja(chat_template, bos, eos, "custom Jinja template", self.chat_template_kwargs)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None

    # -- text <-> tokens --------------------------------------------------
    def tokenize(
        self, text: str, *, add_special: bool, parse_special: bool = True, limit: int | None = None
    ) -> list[int]:
        """Tokenize UTF-8 text; ``add_special`` adds BOS when the model wants one.

        Linear in the text (:mod:`hydra_trio.engine.llama.tokenize`).  ``limit``: raise
        :class:`~hydra_trio.engine.llama.tokenize.PromptTooLong` (an InvalidRequest) once the text
        has that many tokens, or before tokenizing when its length alone shows it will.
        """
        return tokenize_linear(
            self.vocab,
            self.special_tokens,
            text.encode("utf-8"),
            add_special=add_special,
            parse_special=parse_special,
            adds_suffix=self._adds_suffix,
            limit=limit,
        )

    @property
    def modalities(self) -> dict[str, bool]:
        """What the projector takes besides text: ``{"vision": bool, "video": bool, "audio": bool}`` (all False
        without one; llama-server's ``/props`` ``modalities``)."""
        return self.media.modalities if self.media is not None else {"vision": False, "video": False, "audio": False}

    def tokenize_with_media(
        self, text: str, media: Sequence[Any], *, add_special: bool = True, parse_special: bool = True
    ) -> MediaTokens:
        """``text`` with one :data:`~hydra_trio.engine.llama.media.MEDIA_MARKER` per item of ``media`` (items with
        ``data: bytes`` and ``id: str``), tokenized into text tokens and media chunks
        (:meth:`~hydra_trio.engine.llama.media.MediaContext.tokenize`; any thread).

        Raises:
            InvalidRequest: the model has no projector (llama-server's words for an image or an audio clip), or
                mtmd refused the media or the markers.
        """
        if self.media is None:
            kinds = {getattr(item, "kind", "image") for item in media} or {"image"}
            kind = "audio" if kinds == {"audio"} else "image"
            raise InvalidRequest(
                f"{kind} input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
            )
        return self.media.tokenize(text, media, add_special=add_special, parse_special=parse_special)

    @functools.cached_property
    def special_tokens(self) -> SpecialTokens:
        """The vocabulary's special tokens as llama.cpp's tokenizer partitions with them: read on the first
        request (a pass over the vocabulary: about 80 ms for 49,152 tokens on 2 cores) and remembered on
        disk beside the file's digests (:func:`remember_table`, by the file as it is now and the
        ``--override-kv`` given), so that the next node on the same file (a router's next child) reads it
        back instead."""
        kind = "special-tokens\0" + repr(self.options.kv_overrides)
        known = remembered_table(self.path, kind)
        if known is not None:
            with contextlib.suppress(KeyError, TypeError, ValueError, OverflowError):
                return SpecialTokens.from_table(known)
        table = SpecialTokens(self.vocab)
        remember_table(self.path, kind, table.as_table())
        return table

    @functools.cached_property
    def eog_tokens(self) -> list[int]:
        """The end-of-generation tokens, for ``ignore_eos`` (banned with a logit bias, as llama-server does);
        read once, on the first request that asks (a pass over the vocabulary)."""
        return [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)]

    def share_vocabulary_tables(self, other: LoadedModel) -> None:
        """Take ``other``'s :attr:`special_tokens` and :attr:`eog_tokens` that it has read, instead of reading
        them again.  Only for a model whose vocabulary is ``other``'s token for token: the caller checked
        (SWAP_QUANT between two files of the same KV identity, which hashes every token's text and
        attributes)."""
        for name in ("special_tokens", "eog_tokens"):
            if name in other.__dict__:
                self.__dict__[name] = other.__dict__[name]

    @functools.cached_property
    def _adds_suffix(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_eos(self.vocab) or llama_cpp.llama_vocab_get_add_sep(self.vocab))

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """The bytes one token renders to; special tokens (``<|im_end|>``...) render empty
        unless ``special`` (then as their text, like llama.cpp's ``common_token_to_piece``); a media
        chunk's placeholder (a negative id, :mod:`~hydra_trio.engine.llama.media`) renders empty, as llama-server's
        ``server_tokens::detokenize`` skips media."""
        if token < 0:
            return b""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: tuple[int, ...] | list[int]) -> str:
        """The text of a token sequence (special tokens render empty; invalid UTF-8 as U+FFFD)."""
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def apply_chat_template(
        self,
        messages: list[dict],
        kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
        max_chars: int | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[str, list[str]]:
        """Render chat messages (``[{"role", "content"}]``) with the template in effect
        (:attr:`chat_template`, chosen at load: :meth:`_make_chat_formatter`); ``kwargs``
        are extra template variables over the node's ``chat_template_kwargs``; ``tools`` is the
        Jinja template's ``tools`` variable.

        Returns ``(prompt, extra_stop_strings)``.  Raises :class:`ChatTemplateError` (an InvalidRequest) when the
        template rejects the messages, :class:`~hydra_trio.validation.strict.TooLong` when a Jinja template's prompt
        would pass ``max_chars`` characters.
        """
        return self.chat_template(messages, kwargs, tools, max_chars, add_generation_prompt)

    def chat_prompt_tokens(self, prompt: str, limit: int | None = None) -> list[int]:
        """Tokenize a rendered chat prompt as llama-server does: special tokens are parsed, and
        BOS is put in front when the vocabulary wants one and the template did not write it.
        ``limit``: as :meth:`tokenize`'s."""
        tokens = self.tokenize(prompt, add_special=False, parse_special=True, limit=limit)
        if self.add_bos and self.bos_id >= 0 and (not tokens or tokens[0] != self.bos_id):
            tokens.insert(0, self.bos_id)
        return tokens

    def facts(self) -> dict[str, Any]:
        """llama-server's model facts (``/v1/models``' ``meta``, ``/props``' ``model_ftype``), read from llama.cpp:
        ``{"vocab_type": int (llama_vocab_type), "n_vocab", "n_ctx_train", "n_embd" (input width), "n_params",
        "size" (bytes of weights), "ftype": str ("Q4_1", llama_ftype_name)}``."""
        ftype = llama_cpp.llama_ftype_name(llama_cpp.llama_model_ftype(self.model))
        return {
            "vocab_type": int(llama_cpp.llama_vocab_type(self.vocab)),
            "n_vocab": self.n_vocab,
            "n_ctx_train": self.n_ctx_train,
            "n_embd": int(llama_cpp.llama_model_n_embd_inp(self.model)),
            "n_params": int(llama_cpp.llama_model_n_params(self.model)),
            "size": int(llama_cpp.llama_model_size(self.model)),
            "ftype": ftype.decode("utf-8", "replace") if ftype else "",
        }

    def check_grammar(self, grammar: str) -> None:
        """Check that llama.cpp accepts the GBNF ``grammar`` over this vocabulary (any thread: it only reads
        the vocabulary; :func:`~hydra_trio.engine.batching.sampling.check_grammar`).  Raises GrammarError."""
        from ..batching.sampling import check_grammar  # the sampler chains' module: loaded with the engine

        check_grammar(self.vocab, grammar)

    def release_context(self) -> None:
        """Free the context (the KV cache and the compute buffers) and keep the model: a standby that
        :meth:`restore_context` serves again without llama.cpp's load of the file (its vocabulary: most of
        a small model's load).  Engine thread only."""
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
            self.memory = None
        release_free_memory()

    def same_file(self) -> bool:
        """The file on disk is still the one loaded (:func:`file_identity`)."""
        try:
            return file_identity(self.path) == self._file_identity
        except OSError:  # gone
            return False

    def restore_context(self) -> None:
        """A context again, as the model had (after :meth:`release_context`).

        Raises:
            ModelLoadError: llama.cpp could not create it (the model stays a standby)."""
        if self.ctx:
            return
        ctx = llama_cpp.llama_init_from_model(self.model, self._cparams)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a context again for {self.path.name}")
        self.ctx = ctx
        self.memory = llama_cpp.llama_get_memory(ctx)

    def close(self) -> None:
        """Free the projector, the context and the model (engine thread only)."""
        media = getattr(self, "media", None)
        if media is not None:
            media.close()
            self.media = None
        if getattr(self, "ctx", None):
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            llama_cpp.llama_model_free(self.model)
            self.model = None
        release_free_memory()


GGML_TYPES = KV_CACHE_TYPES
"""ggml type ids of llama-server's KV cache types (``ggml.h``; :data:`~hydra_trio.engine.settings.KV_CACHE_TYPES`)."""


@contextlib.contextmanager
def _tap_llama_log(lines: list[str]) -> Iterator[None]:
    """Append the llama.cpp log lines logged on this thread to ``lines`` while the block runs (a model load:
    its buffer sizes, flash attention's choice, where overrides placed tensors)."""
    with thread_local_set(_log_tap, "lines", lines):
        yield


_FA_CHOSEN = re.compile(r"Flash Attention (enabled|not supported, set to disabled)")


def _flash_attn_in_effect(opts: LlamaOptions, lines: list[str]) -> str:
    """``on`` / ``off`` as llama.cpp runs it: ``-fa on|off`` as given; for ``auto``, what llama.cpp chose
    (it enables flash attention for a quantized V cache, else probes the devices and logs
    ``resolve_fused_ops: Flash Attention enabled`` or ``... set to disabled``), ``auto`` when it did not say."""
    if opts.flash_attn != "auto":
        return opts.flash_attn
    if opts.cache_type_v not in UNQUANTIZED_KV_TYPES:
        return "on"
    for line in lines:
        if m := _FA_CHOSEN.search(line):
            return "on" if m.group(1) == "enabled" else "off"
    return "auto"


_BUFFER_LINE = re.compile(r"^\w+:\s+(\S+)\s+(model|KV|compute|output) buffer size =\s*([0-9.]+) MiB")
_KINDS = {"model": "weights", "KV": "kv", "compute": "compute", "output": "compute"}


def _device_of_buffer(buft: str) -> str:
    """The device a ggml buffer type lives on: ``CPU_Mapped``, ``CPU_REPACK`` -> ``CPU``; a GPU's pinned
    host buffer (``CUDA_Host``) -> ``CPU``; ``CUDA0``, ``RPC0[host:port]`` as they are."""
    if buft.endswith("_Host"):
        return "CPU"
    return re.sub(r"_(Mapped|REPACK|AARCH64|KLEIDIAI|Split)$", "", buft)


def _weights_file_backed(lines: list[str], opts: LlamaOptions) -> bool:
    """Every model buffer of llama.cpp's load log is a mapping of the file (``CPU_Mapped``: not repacked, not
    offloaded, not read into memory) and the pages are not locked (``--mlock``)."""
    buffers = [m.group(1) for line in lines if (m := _BUFFER_LINE.match(line)) and m.group(2) == "model"]
    return bool(buffers) and all(b.endswith("_Mapped") for b in buffers) and "mlock" not in opts.load_mode


def _memory_use(lines: list[str], weights: int, kv: int) -> dict[str, dict[str, int]]:
    """Bytes per device and kind, ``{"CPU": {"weights", "kv", "compute"}}``, from llama.cpp's own
    accounting: its log's ``<buffer type> model|KV|compute|output buffer size = N MiB`` lines (0.01 MiB
    precision; the logits output buffer counts as compute).  Without such lines (another llama.cpp):
    ``weights`` (``llama_model_size``) and ``kv`` (exact, from the cache types) on the CPU."""
    use: dict[str, dict[str, int]] = {}
    for line in lines:
        if m := _BUFFER_LINE.match(line):
            dev = use.setdefault(_device_of_buffer(m.group(1)), {"weights": 0, "kv": 0, "compute": 0})
            dev[_KINDS[m.group(2)]] += round(float(m.group(3)) * 2**20)
    if not use:
        return {"CPU": {"weights": weights, "kv": kv, "compute": 0}}
    for kind, exact in (("weights", weights), ("kv", kv)):  # on one device: the exact figure
        holders = [dev for dev in use.values() if dev[kind]]
        if len(holders) == 1:
            holders[0][kind] = exact
    return use


_LOAD_MODES = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 4}  # enum llama_load_mode
_ROPE_SCALING = {"none": 0, "linear": 1, "yarn": 2}  # enum llama_rope_scaling_type
FLASH_ATTN_TYPE = {
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
}
"""``-fa on|off|auto`` as llama.cpp's ``enum llama_flash_attn_type`` (``llama_context_params.flash_attn_type``)."""


def _apply_model_options(mparams: Any, opts: LlamaOptions) -> None:
    """The loading parameters of ``opts`` (the placement ones:
    :class:`~hydra_trio.engine.llama.placement.Placement`)."""
    mparams.load_mode = _LOAD_MODES[opts.load_mode]
    mparams.check_tensors = opts.check_tensors
    mparams.use_extra_bufts = opts.repack
    mparams.no_host = opts.no_host
    mparams.load_mtp = opts.load_mtp


def apply_context_options(cparams: Any, opts: LlamaOptions) -> None:
    """The context parameters of ``opts``: flash attention, KV cache types and offload, RoPE/YaRN."""
    cparams.flash_attn_type = FLASH_ATTN_TYPE[opts.flash_attn]
    cparams.type_k = GGML_TYPES[opts.cache_type_k]
    cparams.type_v = GGML_TYPES[opts.cache_type_v]
    cparams.offload_kqv = opts.kv_offload
    cparams.op_offload = opts.op_offload
    cparams.swa_full = opts.swa_full
    if opts.rope_scaling is not None:
        cparams.rope_scaling_type = _ROPE_SCALING[opts.rope_scaling]
    cparams.rope_freq_base = opts.rope_freq_base
    cparams.rope_freq_scale = opts.rope_freq_scale
    cparams.yarn_orig_ctx = opts.yarn_orig_ctx
    cparams.yarn_ext_factor = opts.yarn_ext_factor
    cparams.yarn_attn_factor = opts.yarn_attn_factor
    cparams.yarn_beta_slow = opts.yarn_beta_slow
    cparams.yarn_beta_fast = opts.yarn_beta_fast
    cparams.embeddings = opts.embeddings
    cparams.n_rs_seq = opts.n_rs_seq
    if opts.pooling is not None:  # enum llama_pooling_type (engine/llama/embedding.py's POOLING)
        cparams.pooling_type = ("none", "mean", "cls", "last", "rank").index(opts.pooling)


def release_free_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``; a no-op elsewhere).
    Returns whether glibc released any.  About 20 µs with a model loaded.

    A freed model and context leave tens of MiB free inside the heap, which
    glibc keeps; without this, swapping models back and forth grew the RSS by a
    third before it levelled off.  After a load (the GGUF parse's temporaries)
    and after requests (prompt buffers, token lists) it gives back a MiB or two.
    """
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def resident_bytes() -> int | None:
    """This process's resident set size (VmRSS) in bytes, from ``/proc/self/statm``; None without procfs."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, once: large blocks (a context's KV cache, compute buffers) always come from mmap.

    glibc otherwise raises its mmap threshold each time such a block is freed,
    after which the next one comes from the heap and stays there when freed:
    swapping models grew the anonymous RSS by a KV cache's size now and then.
    Setting the threshold fixes it at 4 MiB (smaller blocks, e.g. 1 MiB socket reads, stay on the heap).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt(_M_MMAP_THRESHOLD, 4 << 20)
        return libc
    except (OSError, AttributeError):
        return None

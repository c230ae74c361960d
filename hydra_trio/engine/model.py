"""Model loading and model identity, through llama-cpp-python's low-level API.

Everything here runs on the engine thread (see :mod:`hydra_trio.engine.batch`):
llama.cpp objects are created, used and freed by that one thread only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import attrs
import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

log = logging.getLogger("hydra_trio.engine")

_backend_ready = False


class ModelLoadError(RuntimeError):
    """llama.cpp could not load the GGUF file or create its context."""


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
        msg = text.decode("utf-8", "replace").rstrip("\n")
        if msg:
            # llama.cpp's INFO is very chatty (one line per tensor): keep it at DEBUG.
            py_level = levels.get(level, logging.DEBUG)
            llog.log(logging.DEBUG if py_level == logging.INFO else py_level, "%s", msg)

    # keep a reference: ctypes callbacks must outlive their registration
    _install_llama_log_handler.cb = _cb  # type: ignore[attr-defined]
    llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))


def init_backend() -> None:
    """Initialise llama.cpp's backends once per process (idempotent)."""
    global _backend_ready
    if not _backend_ready:
        _install_llama_log_handler()
        llama_cpp.llama_backend_init()
        _backend_ready = True


class LoadStopped(RuntimeError):
    """A load or hash was stopped on purpose (the node is shutting down)."""


def sha256_file(path: Path, chunk: int = 1 << 20, stop: Callable[[], bool] | None = None) -> str:
    """SHA-256 of a file as 64 lowercase hex digits, read in ``chunk``-byte blocks.

    Raises:
        OSError: the file cannot be read.
        LoadStopped: ``stop()`` returned True between two blocks.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
            if stop is not None and stop():
                raise LoadStopped(f"hashing {path} stopped")
    return digest.hexdigest()


def available_memory() -> int | None:
    """Bytes this process can still allocate, as far as the OS tells: the least of
    ``MemAvailable`` (/proc/meminfo), the cgroup v2 ``memory.max`` headroom and the
    ``RLIMIT_AS`` headroom.  None when none of them is known.
    """
    import resource

    limits: list[int] = []
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError):
        pass
    try:
        cg = open("/proc/self/cgroup").read().strip().split("\n")[0].split("::", 1)[1]
        base = Path("/sys/fs/cgroup") / cg.lstrip("/")
        high = (base / "memory.max").read_text().strip()
        if high != "max":
            limits.append(int(high) - int((base / "memory.current").read_text()))
    except (OSError, ValueError, IndexError):
        pass
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            vm = next(line for line in open("/proc/self/status") if line.startswith("VmSize:"))
            limits.append(soft - int(vm.split()[1]) * 1024)
        except (OSError, StopIteration, ValueError):
            pass
    return max(0, min(limits)) if limits else None


@attrs.frozen
class ModelIdentity:
    """Model identity keys of hydra-protocol.md §3: alias, path, SHA-256 of the GGUF."""

    model_alias: str
    model_path: str
    model_hash: str

    def as_meta(self) -> dict[str, str]:
        return attrs.asdict(self)


class LoadedModel:
    """A GGUF model and one llama.cpp context with ``n_parallel`` sequences.

    Args:
        path: the GGUF file.
        n_ctx: total context in tokens, shared by the sequences as llama-server
            does (each slot gets ``n_ctx // n_parallel`` tokens).
        n_parallel: number of sequences (slots), one KV sequence each.
        n_batch: most tokens per ``llama_decode`` call.
        n_threads: CPU threads (None: all cores).
        progress: called with 0.0..1.0 while the weights load (llama.cpp's
            ``progress_callback``); returning False aborts the load.
        devices: ``ggml_backend_dev_t`` handles to load onto (default: the CPU).
        overrides: ``(tensor name regex, buffer type)`` pairs (llama.cpp's
            ``tensor_buft_overrides``), e.g. the expert tensors on a peer.

    Raises:
        ModelLoadError: llama.cpp refused the file or the context.
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
        devices: list[int] | None = None,
        overrides: list[tuple[str, int]] | None = None,
    ) -> None:
        init_backend()
        from . import combined, ggml_rpc

        self.path = path
        mparams = llama_cpp.llama_model_default_params()
        # an explicit device list: NULL would mean "every registered device",
        # ggml-RPC peers included (DESIGN.md)
        devs = devices if devices is not None else [ggml_rpc.cpu_device()]
        self._devices = (ctypes.c_void_p * (len(devs) + 1))(*devs, None)
        mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        mparams.n_gpu_layers = 0  # layers (and the KV cache) stay on the host; overrides move single tensors
        if overrides:
            self._overrides = combined.tensor_overrides(overrides)
            mparams.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        if progress is not None:

            @llama_cpp.llama_progress_callback
            def _progress(value: float, _user: ctypes.c_void_p) -> bool:
                return bool(progress(float(value)))

            self._progress_cb = _progress  # keep alive during the load
            mparams.progress_callback = _progress
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise ModelLoadError(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.model)

        if not 16 * n_parallel <= n_ctx <= self.n_ctx_train * n_parallel:
            llama_cpp.llama_model_free(self.model)
            self.model = None
            raise ModelLoadError(
                f"n_ctx {n_ctx} must be between {16 * n_parallel} and {self.n_ctx_train * n_parallel} "
                f"(16 to n_ctx_train={self.n_ctx_train} tokens per slot, {n_parallel} slots)"
            )
        kv_bytes = n_ctx * self.kv_bytes_per_token()
        free = available_memory()
        if free is not None and kv_bytes > free:
            llama_cpp.llama_model_free(self.model)
            self.model = None
            raise ModelLoadError(
                f"n_ctx {n_ctx} needs {kv_bytes / 2**20:.0f} MiB of KV cache "
                f"({kv_bytes // n_ctx} bytes per token); only {free / 2**20:.0f} MiB of memory is available"
            )
        threads = n_threads or os.cpu_count() or 1
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_parallel
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = False  # one KV stream per slot, like llama-server's default
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            self.model = None
            raise ModelLoadError(
                f"llama.cpp could not create a context (n_ctx={n_ctx}, n_parallel={n_parallel})"
            )
        # read back what llama.cpp chose: it may round n_ctx up and cap n_batch at n_ctx
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)
        self.n_ctx_slot = llama_cpp.llama_n_ctx_seq(self.ctx)
        self.n_batch = min(n_batch, llama_cpp.llama_n_batch(self.ctx), llama_cpp.llama_n_ubatch(self.ctx))
        self.n_parallel = n_parallel
        self.n_stream = n_parallel  # KV streams: one per sequence (kv_unified is off)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos_id = llama_cpp.llama_vocab_bos(self.vocab)
        self.eos_id = llama_cpp.llama_vocab_eos(self.vocab)
        self.chat_formatter = self._make_chat_formatter()
        # end-of-generation tokens, for ignore_eos (banned with a logit bias, as llama-server does)
        self.eog_tokens = [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)]

    # -- metadata ---------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes with the default (F16) cache types, over all layers.

        ``n_layer × n_head_kv × (key_length + value_length) × 2``; head sizes
        from the GGUF (``{arch}.attention.key_length`` / ``value_length``),
        else ``n_embd / n_head`` as llama.cpp assumes.
        """
        arch = self.meta("general.architecture") or ""
        n_head = max(1, llama_cpp.llama_model_n_head(self.model))
        default = llama_cpp.llama_model_n_embd(self.model) // n_head
        k = int(self.meta(f"{arch}.attention.key_length") or default)
        v = int(self.meta(f"{arch}.attention.value_length") or default)
        n_head_kv = llama_cpp.llama_model_n_head_kv(self.model)
        return llama_cpp.llama_model_n_layer(self.model) * n_head_kv * (k + v) * 2


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

    def _make_chat_formatter(self) -> Jinja2ChatFormatter | None:
        raw = llama_cpp.llama_model_chat_template(self.model, None)
        if not raw:
            return None
        return Jinja2ChatFormatter(
            template=raw.decode("utf-8"),
            eos_token=self.token_text(self.eos_id) if self.eos_id >= 0 else "",
            bos_token=self.token_text(self.bos_id) if self.bos_id >= 0 else "",
            add_generation_prompt=True,
        )

    # -- text <-> tokens --------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        """Tokenize UTF-8 text; ``add_special`` adds BOS when the model wants one."""
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), buf, n_max, add_special, parse_special
            )
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token renders to (special tokens render empty)."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def detokenize(self, tokens: tuple[int, ...] | list[int]) -> str:
        """The text of a token sequence (special tokens render empty; invalid UTF-8 as U+FFFD)."""
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def apply_chat_template(self, messages: list[dict]) -> tuple[str, list[str]]:
        """Render chat messages with the GGUF's own template.

        Returns ``(prompt, extra_stop_strings)``.  Raises ValueError when the
        model has no template or the template rejects the messages.
        """
        if self.chat_formatter is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            out = self.chat_formatter(messages=messages)
        except Exception as exc:  # jinja2 raises TemplateError / TypeError / ...
            raise ValueError(f"chat template failed: {exc}") from exc
        stop = out.stop if isinstance(out.stop, list) else ([out.stop] if out.stop else [])
        return out.prompt, stop

    def close(self) -> None:
        """Free the context and the model (engine thread only)."""
        if getattr(self, "ctx", None):
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            llama_cpp.llama_model_free(self.model)
            self.model = None

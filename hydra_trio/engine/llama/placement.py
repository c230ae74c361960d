"""Where a model's tensors go: llama-server's offload and placement flags as ``llama_model_params`` fields.

``-dev``, ``-ngl``, ``-sm``, ``-ts``, ``-mg``, ``-ot``, ``-cmoe``, ``-ncmoe``, ``-ncffn`` (common/arg.cpp,
``common_model_params_to_llama`` in common/common.cpp) become the ``devices``, ``n_gpu_layers``,
``split_mode``, ``tensor_split``, ``main_gpu`` and ``tensor_buft_overrides`` of one model, composed with a
COMBINED / PIPELINE_ATTACH peer's pattern (:class:`Placement`); :func:`placed_tensors` counts where the
overrides put each tensor, from llama.cpp's log of the load.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

import llama_cpp

from ...errors import HydraTrioError
from ..settings import LlamaOptions
from . import ggml_backend


class PlacementError(HydraTrioError, ValueError):
    """A device or buffer type that does not exist here, or placement values llama.cpp cannot take (the
    message names the flag and the value); :class:`~hydra_trio.engine.llama.model.LoadedModel` raises it as
    ``ModelLoadError``."""


class _Override(ctypes.Structure):
    """``struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }``."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def tensor_overrides(pairs: list[tuple[str, int]]) -> ctypes.Array[_Override]:
    """A NULL-terminated ``llama_model_tensor_buft_override`` array (keep it alive while loading)."""
    arr = (_Override * (len(pairs) + 1))()
    for i, (pattern, buft) in enumerate(pairs):
        arr[i].pattern = pattern.encode()
        arr[i].buft = buft
    return arr


# -- placement: devices, layers, tensor overrides (llama-server's -dev, -ngl, -sm, -ts, -mg, -ot, -cmoe, ...) --

LLM_FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
"""The MoE expert tensors, as ``-cmoe`` / ``-ncmoe`` match them (``common/common.h``)."""
LLM_FFN_DENSE_REGEX = r"\.ffn_(up|down|gate)\."
"""The dense FFN tensors, as ``-ncffn`` matches them (``common/common.h``)."""

_SPLIT_MODES = {"none": 0, "layer": 1, "row": 2, "tensor": 3}  # enum llama_split_mode
_N_GPU_LAYERS = {"auto": -1, "all": -2}  # llama-server's values (common/arg.cpp); libllama: negative = all


def ffn_block_regex(layer: int, ffn_regex: str) -> str:
    """llama-server's per-layer pattern (``llm_ffn_block_regex``): ``blk\\.{layer}`` + ``ffn_regex``."""
    return f"blk\\.{layer}{ffn_regex}"


def _device_names() -> list[str]:
    return sorted(name for name, _, _ in ggml_backend.local_devices())


def offload_devices(opts: LlamaOptions) -> list[int]:
    """The local devices a model's layers may go to (``llama_model_params.devices``), as llama-server picks them.

    ``opts.devices`` None: llama.cpp's default choice (``llama_prepare_model_devices``) without ggml-RPC
    peers: every GPU, else the integrated GPUs; none on a CPU-only build.  ``("none",)``: no device
    (``-dev none``).  Names: those devices, in that order.  ggml-RPC peers are never in this list (a NULL
    list means every registered device, peers included), and the CPU is not an offload device (llama-server refuses
    ``-dev CPU`` too): every layer not offloaded stays in host memory.

    Raises:
        PlacementError: a name that is no device of this machine, or the CPU's (the message names it).
    """
    devs = [d for d in ggml_backend.all_devices() if not ggml_backend.is_rpc_device(d)]
    if opts.devices is None:
        gpus = [d for d in devs if ggml_backend.device_type(d) == ggml_backend.GGML_BACKEND_DEVICE_TYPE_GPU]
        igpus = [d for d in devs if ggml_backend.device_type(d) == ggml_backend.GGML_BACKEND_DEVICE_TYPE_IGPU]
        return gpus or igpus
    if tuple(opts.devices) == ("none",):
        return []
    by_name = {ggml_backend.device_name(d).lower(): d for d in devs}  # ggml_backend_dev_by_name: case-insensitive
    out = []
    for name in opts.devices:
        dev = by_name.get(name.lower())
        if dev is None:
            raise PlacementError(
                f"-dev/--device: no device {name!r} here (devices: {', '.join(_device_names())}; see --list-devices)"
            )
        if ggml_backend.device_type(dev) == ggml_backend.GGML_BACKEND_DEVICE_TYPE_CPU:
            raise PlacementError(
                f"-dev/--device: {name!r} is the CPU, not an offload device (llama-server refuses "
                "it too); -dev none keeps every layer in host memory"
            )
        out.append(dev)
    return out


def operator_overrides(opts: LlamaOptions) -> list[tuple[str, int, str]]:
    """``(pattern, buffer type, flag)`` of the operator's ``-ot`` entries, in their order, each buffer type
    looked up by name over every registered device's buffer type (``parse_tensor_buffer_overrides``:
    ``CPU``, ``CUDA0``, ...).

    Raises:
        PlacementError: a buffer type no device here has (the message names it and lists those that exist).
    """
    bufts = ggml_backend.buffer_types()
    out = []
    for pattern, name in opts.tensor_overrides:
        if name not in bufts:
            hint = (
                " (a ggml-RPC buffer type needs llama-server's --rpc, which this node refuses; "
                "--rpc-engine and --combined-pattern put tensors on a COMBINED peer)"
                if name.upper().startswith("RPC")
                else ""
            )
            raise PlacementError(
                f"-ot/--override-tensor {pattern}={name}: unknown buffer type {name!r} "
                f"(available: {', '.join(sorted(bufts))}){hint}"
            )
        out.append((pattern, bufts[name], "-ot"))
    return out


def host_overrides(opts: LlamaOptions, n_layer: int | None) -> list[tuple[str, int, str]]:
    """``(pattern, CPU buffer type, flag)`` of ``-cmoe``, ``-ncmoe N`` and ``-ncffn N``, with llama-server's
    patterns (``llm_ffn_exps_cpu_override``, ``llm_add_n_cpu_ffn_overrides``): one per layer for the
    first N layers (at most ``n_layer``, the model's, when known: more would match nothing)."""
    cpu = ggml_backend.libs()[0].ggml_backend_dev_buffer_type(ggml_backend.cpu_device())
    out = []
    if opts.cpu_moe:
        out.append((LLM_FFN_EXPS_REGEX, cpu, "-cmoe"))
    for n, regex, flag in (
        (opts.n_cpu_moe, LLM_FFN_EXPS_REGEX, "-ncmoe"),
        (opts.n_cpu_ffn, LLM_FFN_DENSE_REGEX, "-ncffn"),
    ):
        out += [(ffn_block_regex(i, regex), cpu, flag) for i in range(min(n, n_layer if n_layer is not None else n))]
    return out


def check_placement(opts: LlamaOptions) -> None:
    """Check the device names and ``-ot`` buffer types of ``opts`` against this machine, without loading.

    Raises PlacementError naming the first unknown one (``hydra-trio run`` exits 2 with its message).
    """
    offload_devices(opts)
    operator_overrides(opts)


class Placement:
    """The placement fields of ``llama_model_params`` for one model, and the ctypes arrays they point at.

    Built from llama-server's flags (:class:`~hydra_trio.engine.settings.LlamaOptions`) as
    ``common_model_params_to_llama`` builds them: ``n_gpu_layers`` (``auto`` -1, ``all`` -2, both "every
    layer" in libllama: the memory fitting of llama-server's ``-fit`` is libcommon's and not done here),
    ``split_mode``, ``main_gpu``, ``tensor_split`` (``llama_max_devices()`` floats), ``devices``
    (:func:`offload_devices`, always an explicit list) and ``tensor_buft_overrides``.

    The overrides, in the order llama.cpp tries them (``llama_model_loader``: the first pattern that
    matches a tensor's name, ``std::regex_search``, decides its buffer type):

    1. the operator's ``-ot`` entries, in their order: an explicit ``-ot`` wins over everything else;
    2. ``peer``'s pattern on the peer's buffer type (COMBINED's experts, PIPELINE_ATTACH's ``ot_split``);
    3. ``-cmoe``, then ``-ncmoe``, then ``-ncffn`` (host memory): in COMBINED the experts go to the peer.

    llama-server keeps its command line's order among ``-ot``, ``-cmoe`` and ``-ncmoe``; this node puts
    ``-ot`` first, which differs only when an ``-ot`` pattern and ``-cmoe``/``-ncmoe`` match the same
    tensor and ``-cmoe``/``-ncmoe`` came first on llama-server's command line.

    With a peer, the peer's device joins the list and gets no layer of its own (only the tensors its
    pattern matches): without local offload devices (or ``-ngl 0``) the list is the peer alone with no layer
    offloaded, as llama-server's ``--rpc HOST:PORT -ngl 0`` builds it (listing the CPU device too gives the
    context a second CPU backend: COMBINED decode on the test MoE ran at 19.3 instead of 24.4 tok/s); with
    local GPUs the peer comes last with a ``tensor_split`` share of 0, and ``-sm none`` keeps only the
    ``-mg`` GPU next to it.

    Raises:
        PlacementError: an unknown device or buffer type, ``-mg`` beyond the devices, more ``-ts`` values
            than llama.cpp's device limit, or ``-sm tensor`` with a peer.
    """

    def __init__(
        self, opts: LlamaOptions, *, n_layer: int | None = None, peer: tuple[int, str, str] | None = None
    ) -> None:
        local = offload_devices(opts)
        ops = operator_overrides(opts)
        max_devices = llama_cpp.llama_max_devices()
        self.n_gpu_layers = (
            _N_GPU_LAYERS[opts.n_gpu_layers] if isinstance(opts.n_gpu_layers, str) else int(opts.n_gpu_layers)
        )
        self.split_mode = _SPLIT_MODES[opts.split_mode]
        self.main_gpu = opts.main_gpu
        split = list(opts.tensor_split)
        if len(split) >= max_devices:
            raise PlacementError(
                f"-ts/--tensor-split: {len(split)} values, but llama.cpp takes at most {max_devices - 1}"
            )
        if opts.split_mode == "none" and local and opts.main_gpu >= len(local):
            raise PlacementError(f"-mg/--main-gpu {opts.main_gpu}: there are {len(local)} offload devices")
        peer_entry: list[tuple[str, int, str]] = []
        if peer is None:
            devices = local
        else:
            peer_dev, pattern, label = peer
            peer_entry = [(pattern, ggml_backend.libs()[0].ggml_backend_dev_buffer_type(peer_dev), label)]
            if not local or self.n_gpu_layers == 0:
                devices = [peer_dev]
                self.n_gpu_layers, self.split_mode, split = 0, _SPLIT_MODES["layer"], []
            elif opts.split_mode == "tensor":
                raise PlacementError(
                    "-sm tensor with a ggml-RPC peer (COMBINED, PIPELINE_ATTACH) is not supported: "
                    "llama.cpp would split every weight over the peer too"
                )
            else:
                if opts.split_mode == "none":
                    local, self.main_gpu, self.split_mode = [local[opts.main_gpu]], 0, _SPLIT_MODES["layer"]
                shares = (split + [0.0] * len(local))[: len(local)]
                if not any(shares):  # llama.cpp's default: by free memory
                    shares = [float(ggml_backend.device_memory(d)[0]) or 1.0 for d in local]
                devices, split = [*local, peer_dev], [*shares, 0.0]
        self.overrides = ops + peer_entry + host_overrides(opts, n_layer)
        """``(pattern, buffer type, source)`` in llama.cpp's order; source: ``-ot``, ``-cmoe``, ``-ncmoe``,
        ``-ncffn`` or the peer's label."""
        self.devices = devices
        self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
        self._split = (ctypes.c_float * max_devices)(*split) if any(split) else None
        self._overrides = tensor_overrides([(p, b) for p, b, _ in self.overrides]) if self.overrides else None

    def apply(self, mparams: Any) -> None:
        """Set the placement fields of ``mparams`` (a ``llama_model_params``); keep this object alive while
        the model loads."""
        mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        mparams.n_gpu_layers = self.n_gpu_layers
        mparams.split_mode = self.split_mode
        mparams.main_gpu = self.main_gpu
        if self._split is not None:
            mparams.tensor_split = ctypes.cast(self._split, ctypes.POINTER(ctypes.c_float))
        if self._overrides is not None:
            mparams.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)

    def describe(self) -> str:
        """One line for the log: the devices and the override rules by source."""
        names = ", ".join(ggml_backend.device_name(d) for d in self.devices) or "none (every layer in host memory)"
        rules: dict[str, int] = {}
        for _, _, source in self.overrides:
            rules[source] = rules.get(source, 0) + 1
        return f"devices {names}; n_gpu_layers {self.n_gpu_layers}; overrides " + (
            ", ".join(f"{src} x{n}" for src, n in rules.items()) or "none"
        )


_OVERRIDDEN = re.compile(r"^tensor (\S+) \(.*\) buffer type overridden to (\S+)")
"""llama.cpp's line for each tensor an override placed (``llama_model_loader``, DEBUG level)."""


def placed_tensors(log_lines: list[str]) -> dict[str, int]:
    """How many tensors an override placed, by buffer type name (``{"CPU": 24}``), from llama.cpp's log lines
    of one model load (``llama_model_loader``'s "buffer type overridden to BUFT" line per tensor): distinct
    names, so a tied output weight that reuses ``token_embd.weight`` counts once."""
    names: dict[str, set[str]] = {}
    for line in log_lines:
        if m := _OVERRIDDEN.match(line):
            names.setdefault(m[2], set()).add(m[1])
    return {buft: len(n) for buft, n in sorted(names.items())}

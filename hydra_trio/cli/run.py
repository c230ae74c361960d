"""``hydra-trio run``: from parsed flags to a serving node (configs, logs, process settings, signals)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import ssl
import sys
from pathlib import Path
from typing import Any

import attrs
import trio

from ..engine.settings import EngineConfig, GenerationDefaults, LlamaOptions
from ..http.settings import HttpSettings
from ..models.presets import DEFAULT_ALIAS, PRESETS, PresetError, resolve_model
from ..models.projector import ProjectorError, projector_modalities
from ..observability.logs import configure_logging
from ..protocol.media import MediaSettings
from ..rpc_backend.backend import RpcBackendSettings
from ..transport.access import AccessSettings
from ..transport.frontdoor import FrontDoorSettings
from ..transport.tls import TlsSettings, client_context, server_context
from . import _types
from ._flags import accepted_notes, given_environment
from .access import access_settings
from .flags import RUN_FLAGS

log = logging.getLogger("hydra_trio")

NICE = {-1: 5, 0: 0, 1: -5, 2: -10, 3: -20}
"""``--prio`` -> nice value, as llama.cpp's ``set_process_priority`` (common/common.cpp, POSIX)."""

_VERBOSITY = {0: "ERROR", 1: "ERROR", 2: "WARNING", 3: "INFO"}  # llama-server's -lv thresholds; 4+: DEBUG


def log_level(args: argparse.Namespace) -> str:
    """``--log-level`` if given, else ``-v`` / ``-lv N`` as llama-server's thresholds, else INFO."""
    if args.log_level is not None:
        return args.log_level
    if args.verbose:
        return "DEBUG"
    if args.log_verbosity is not None:  # below 0 llama-server logs nothing: fatal errors only here
        return "CRITICAL" if args.log_verbosity < 0 else _VERBOSITY.get(args.log_verbosity, "DEBUG")
    return "INFO"


def llama_options(args: argparse.Namespace) -> LlamaOptions:
    """The :class:`LlamaOptions` of parsed ``run`` flags."""
    freq_scale = args.rope_freq_scale
    if freq_scale is None and args.rope_scale is not None and args.rope_scale > 0:
        freq_scale = 1.0 / args.rope_scale  # llama-server: --rope-scale N sets rope_freq_scale = 1/N
    opts = {
        # -tb 0: every core, as llama-server (not "as --threads", which is what leaving it out means)
        "n_threads_batch": (args.threads_batch or os.cpu_count() or 1) if args.threads_batch is not None else None,
        "n_ubatch": args.ubatch_size,
        "swa_full": args.swa_full,
        "flash_attn": args.flash_attn,
        "kv_offload": args.kv_offload,
        "op_offload": args.op_offload,
        "repack": args.repack,
        "no_host": args.no_host,
        "check_tensors": args.check_tensors,
        "load_mode": args.load_mode,
        "cache_type_k": args.cache_type_k,
        "cache_type_v": args.cache_type_v,
        "numa": (args.numa or "distribute") if args.numa is not None else None,  # llama-server: '' = distribute
        "kv_unified": args.kv_unified or args.parallel == -1,  # -np -1, llama-server's auto: unified KV
        "kv_unified_per_slot": args.kv_unified_per_slot,
        "rope_scaling": args.rope_scaling,
        "rope_freq_base": args.rope_freq_base,
        "rope_freq_scale": freq_scale,
        "yarn_orig_ctx": args.yarn_orig_ctx,
        "yarn_ext_factor": args.yarn_ext_factor,
        "yarn_attn_factor": args.yarn_attn_factor,
        "yarn_beta_slow": args.yarn_beta_slow,
        "yarn_beta_fast": args.yarn_beta_fast,
        "n_gpu_layers": args.gpu_layers,
        "split_mode": args.split_mode,
        "tensor_split": args.tensor_split,
        "main_gpu": args.main_gpu,
        "devices": args.device,
        "tensor_overrides": tuple(p for group in args.override_tensor or [] for p in group),
        "cpu_moe": args.cpu_moe,
        "n_cpu_moe": args.n_cpu_moe,
        "n_cpu_ffn": args.n_cpu_ffn,
        "embeddings": args.embedding,
        "pooling": args.pooling,
        "kv_overrides": tuple(kv for group in args.override_kv or [] for kv in group) or None,
    }
    return LlamaOptions(**{k: v for k, v in opts.items() if v is not None})


def template_kwargs(args: argparse.Namespace) -> dict:
    """``--chat-template-kwargs`` plus ``--reasoning on|off`` (``enable_thinking``), ``--reasoning-effort``
    (``reasoning_effort``; ``default`` leaves it out) and ``--[no-]reasoning-preserve``
    (``preserve_reasoning``), as llama-server (``common/arg.cpp``)."""
    kwargs = dict(args.chat_template_kwargs or {})
    if args.reasoning in ("on", "off"):
        kwargs["enable_thinking"] = args.reasoning == "on"
    if args.reasoning_effort is not None and args.reasoning_effort != "default":
        kwargs["reasoning_effort"] = args.reasoning_effort
    if args.reasoning_preserve is not None:  # not given: the renderer's default, llama-server's (true)
        kwargs["preserve_reasoning"] = args.reasoning_preserve
    return kwargs


def extra_ports(args: argparse.Namespace) -> tuple[int, ...]:
    """``--rpc-port`` and ``--ggml-rpc-port``: more ports for the same front door (0 or less, above 65535
    (:func:`combined_target`'s notes say so) and --port itself: none)."""
    ports = []
    for p in (args.rpc_port, args.ggml_rpc_port):
        if p is not None and 0 < p <= 65535 and p != args.port and p not in ports:
            ports.append(p)
    return tuple(ports)


def generation_defaults(args: argparse.Namespace) -> GenerationDefaults:
    """The :class:`GenerationDefaults` of parsed ``run`` flags: ``--samplers``/``--sampler-seq``,
    ``--ignore-eos``, ``-l``, ``--grammar``/``-j``, ``--adaptive-*``, ``-r`` (escapes processed unless
    ``--no-escape``, as llama-server) and ``--cache-prompt``."""
    stop = tuple(_types.escapes(r) if args.escape else r for r in args.reverse_prompt or ())
    return GenerationDefaults(
        samplers=args.samplers[0] if args.samplers is not None else None,
        ignore_eos=args.ignore_eos,
        logit_bias=tuple(args.logit_bias or ()),
        grammar=args.grammar,
        adaptive_target=min(args.adaptive_target, 1.0) if args.adaptive_target is not None else -1.0,
        adaptive_decay=min(max(args.adaptive_decay, 0.0), 0.99) if args.adaptive_decay is not None else 0.9,
        stop=stop,
        cache_prompt=args.cache_prompt,
        special=args.special,
    )


def combined_target(args: argparse.Namespace) -> tuple[str | None, str, list[str]]:
    """COMBINED's peer and expert pattern from ``--rpc-engine``, ``--combined-ot-pattern`` (else
    ``--combined-pattern``), and the start-up lines about them: ``(peer or None, pattern, warnings)``.

    The cluster's llama-server fork starts with any value of these flags, and runs SOLO when one leaves
    COMBINED nothing to do; so does the node: a peer that is not ``HOST:PORT``, or a pattern that is empty or not a
    regular expression, leaves the peer None (SOLO) with a warning.  The buffer type after the pattern's last
    ``=`` is ignored, as the fork ignores it (one line says so).
    """
    from ..validation.address import parse_peer
    from ..validation.strict import MessageError

    notes: list[str] = []
    peer = args.rpc_engine
    if peer is not None:
        try:
            parse_peer(peer, field="--rpc-engine")
        except MessageError as exc:
            notes.append(f"{exc}: COMBINED is off, the node serves SOLO")
            peer = None
    pattern = args.combined_pattern
    if args.combined_ot_pattern is not None:
        pattern, buft = args.combined_ot_pattern
        problem = "is empty" if not pattern else None
        if problem is None:
            try:
                re.compile(pattern)
            except re.error as exc:
                problem = f"is not a regular expression ({exc})"
        if problem is not None:
            notes.append(
                f"--combined-ot-pattern: the pattern before the last '=' {problem}: COMBINED is off, the "
                "node serves SOLO"
            )
            peer, pattern = None, args.combined_pattern
        elif buft is not None:
            notes.append(
                f"--combined-ot-pattern: the buffer type {buft} after the last '=' is ignored; COMBINED "
                f"places the tensors matching {pattern} on the --rpc-engine peer"
            )
    for flag, port in (("--rpc-port", args.rpc_port), ("--ggml-rpc-port", args.ggml_rpc_port)):
        if port is not None and port > 65535:
            notes.append(f"{flag} {port}: not a TCP port; no port opened for it")
    return peer, pattern, notes


def _process_settings(args: argparse.Namespace) -> None:
    """``--prio`` (nice value) and ``-C``/``-Cr`` (CPU affinity), for the whole process."""
    if args.prio:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, NICE[args.prio])
        except OSError as exc:  # raising priority needs CAP_SYS_NICE: llama-server warns and goes on too
            log.warning("--prio %d: could not set the process priority (nice %d): %s", args.prio, NICE[args.prio], exc)
    mask = args.cpu_mask if args.cpu_mask is not None else args.cpu_range
    if mask is not None:
        cpus = {i for i in range(mask.bit_length()) if mask >> i & 1}
        try:
            os.sched_setaffinity(0, cpus)
        except (OSError, ValueError) as exc:
            log.warning("CPU affinity %s: not applied: %s", sorted(cpus), exc)


def _notes(args: argparse.Namespace, opts: LlamaOptions) -> None:
    """One line for each flag whose effect an operator could miss."""
    for env in given_environment(RUN_FLAGS):
        log.info("environment: %s is set (an explicit flag wins over it)", env)
    for note in accepted_notes(RUN_FLAGS, args):
        log.warning("%s", note)
    gpu = [
        name
        for name, given in (
            ("-ngl", args.gpu_layers),
            ("-sm", args.split_mode),
            ("-ts", args.tensor_split),
            ("-mg", args.main_gpu),
            ("-cmoe", args.cpu_moe or None),
            ("-ncmoe", args.n_cpu_moe),
            ("-ncffn", args.n_cpu_ffn),
        )
        if given is not None
    ]
    if gpu and not _has_gpu():
        log.warning(
            "%s: no usable GPU in this build; every tensor stays in host memory (llama-server warns the same way)",
            ", ".join(gpu),
        )
    for note in combined_target(args)[2]:
        log.warning("%s", note)
    if args.samplers is not None and args.samplers[1]:  # llama-server warns and leaves them out too
        log.warning("--samplers/--sampler-seq: unknown samplers left out: %s", ", ".join(map(repr, args.samplers[1])))


def _has_gpu() -> bool:
    """A device layers can be offloaded to (llama-server's ``llama_supports_gpu_offload``, without ggml-RPC)."""
    from ..engine.llama.ggml_backend import (
        GGML_BACKEND_DEVICE_TYPE_ACCEL,
        GGML_BACKEND_DEVICE_TYPE_CPU,
        all_devices,
        device_type,
        is_rpc_device,
    )

    return any(
        device_type(d) not in (GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_ACCEL) and not is_rpc_device(d)
        for d in all_devices()
    )


def _check_devices(opts: LlamaOptions) -> str | None:
    """A -dev name or an -ot buffer type this machine does not have: the message (exit 2), else None.

    The engine's own check (:func:`hydra_trio.engine.llama.placement.check_placement`), which a model load repeats."""
    from ..engine import PlacementError, check_placement

    try:
        check_placement(opts)
    except PlacementError as exc:
        return str(exc)
    return None


def _log_devices() -> None:
    """The start-up log's device lines: the build's backends, each device with its free/total memory."""
    from ..engine.llama.ggml_backend import build_backends, local_devices

    log.info("backends: %s", ", ".join(build_backends()))
    for name, free, total in local_devices():
        log.info("device %s: %d MiB free of %d MiB", name, free // 2**20, total // 2**20)


def _list_devices() -> int:
    from ..engine.llama.ggml_backend import local_devices

    print("Available devices:")
    for name, free, total in local_devices():
        print(f"  {name}: {total // 2**20} MiB ({free // 2**20} MiB free)")
    return 0


def _tls_contexts(args: argparse.Namespace) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """The server context (``--tls-cert``/``--tls-key``/``--tls-client-ca``) and the ``--rpc-tls`` client context.

    Raises:
        ValueError: flags that do not go together.
        OSError, ssl.SSLError: a file that cannot be read or is not valid PEM.
    """
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key (--ssl-cert-file and --ssl-key-file) go together")
    if args.tls_cert is None and (args.tls_client_ca or args.tls_required):
        raise ValueError("--tls-client-ca and --tls-required need --tls-cert/--tls-key")
    if args.rpc_tls and args.no_model:
        raise ValueError("--rpc-tls is for a head (a node with a model) that dials peers; --no-model dials none")
    if args.tls_ca and not args.rpc_tls:
        raise ValueError("--tls-ca is for --rpc-tls")
    server = None
    if args.tls_cert is not None:
        settings = TlsSettings(
            Path(args.tls_cert),
            Path(args.tls_key),
            Path(args.tls_client_ca) if args.tls_client_ca else None,
            args.tls_required,
        )
        server = server_context(settings)
    client = client_context(args.tls_ca, args.tls_cert, args.tls_key) if args.rpc_tls else None
    return server, client


def run_node(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; the exit code (2: a setting refused before anything bound or loaded)."""
    if args.list_devices:
        return _list_devices()
    if args.cache_list:
        from .models import print_cache_list

        return print_cache_list()
    if args.completion_bash:
        from .models import print_completion_bash

        return print_completion_bash([n for f in RUN_FLAGS if f.kind != "refused" for n in f.all_names])
    configure_logging(
        "CRITICAL" if args.log_disable else log_level(args),
        args.log_format or ("json" if args.log_jsonl else "text"),
        sys.stderr,
        file=args.log_file,
        timestamps=args.log_timestamps,
        disabled=args.log_disable,
    )
    try:
        return trio.run(_run, args)
    except Exception as exc:  # e.g. ModelLoadError: say it plainly, exit non-zero
        err: BaseException = exc
        while isinstance(err, BaseExceptionGroup) and len(err.exceptions) == 1:
            err = err.exceptions[0]
        log.error("fatal: %s", err)
        return 1


def rpc_backend_settings(args: argparse.Namespace, access: AccessSettings) -> RpcBackendSettings | None:
    """The ggml-RPC backend this node (or router) lends on its port, from the ``--rpc-*`` flags and
    ``--rpc-allow``; None with ``--no-rpc-backend``."""
    if args.no_rpc_backend:
        return None
    return RpcBackendSettings(
        devices=tuple(args.rpc_device or ["cpu"]),
        cache_dir=Path(args.rpc_cache_dir) if args.rpc_cache_dir else None,
        threads=args.rpc_threads,
        max_waiting=args.rpc_max_waiting,
        wait_timeout=args.rpc_wait_timeout,
        handshake_timeout=args.rpc_handshake_timeout,
        stall_timeout=args.rpc_stall_timeout,
        restart_wait=args.rpc_restart_wait,
        max_message_size=args.rpc_max_message_size,
        allow=access.rpc_allow,
    )


def media_settings(args: argparse.Namespace, model: str) -> MediaSettings:
    """The node's :class:`~hydra_trio.protocol.media.MediaSettings`: ``-mm FILE``, else with ``--mmproj-auto``
    (the default) the projector of the ``-m`` preset when it has one (``tiny-vision``), as llama-server takes
    the one it finds with ``-hf``; a ``-m FILE`` has none unless ``-mm`` names it.

    Raises ProjectorError: the projector is no ``clip`` GGUF with an encoder, or ``-mmdev`` names a device
    this machine does not have (llama-server's ``invalid device``)."""
    path = Path(args.mmproj) if args.mmproj else None
    preset = PRESETS.get(model)
    if path is None and args.mmproj_auto and preset is not None and preset.projector is not None:
        path = preset.projector()
    device = args.mmproj_device
    if device not in (None, "none"):
        from ..engine.llama.ggml_backend import local_devices

        names = [name for name, _free, _total in local_devices()]
        if device.lower() not in {n.lower() for n in names}:  # ggml_backend_dev_by_name: case-insensitive
            raise ProjectorError(
                f"-mmdev/--mmproj-device: invalid device: {device} (this machine has: {', '.join(names)})"
            )
    vision, audio = projector_modalities(path) if path is not None else (False, False)
    given = {
        "image_min_tokens": args.image_min_tokens,
        "image_max_tokens": args.image_max_tokens,
        "batch_max_tokens": args.mtmd_batch_max_tokens,
        "video_fps": args.video_fps,
        "video_timestamp_interval_ms": args.video_timestamp_interval,
        "video_ffmpeg_dir": args.video_ffmpeg_dir or None,
    }
    return MediaSettings(
        mmproj=path,
        vision=vision,
        audio=audio,
        offload=args.mmproj_offload and device != "none",
        device=None if device == "none" else device,
        media_path=args.media_path,
        **{k: v for k, v in given.items() if v is not None},
    )


def engine_config(args: argparse.Namespace, opts: LlamaOptions) -> EngineConfig:
    """The :class:`EngineConfig` of parsed ``run`` flags.  With a projector (:func:`media_settings`), context
    shift and cache reuse are off, as llama-server turns them off for a multimodal model (with a warning).

    Raises:
        PresetError: ``-m``, a ``--quant`` or ``-md`` names neither a file nor an installed preset.
        ProjectorError: the projector's settings (:func:`media_settings`).
    """
    path, alias = resolve_model(args.model or DEFAULT_ALIAS)
    quants = tuple((key, *resolve_model(model)) for key, model in args.quant)
    speculative = args.speculative
    if speculative.draft_model:  # a file or a preset, as -m
        try:
            draft, _alias = resolve_model(speculative.draft_model)
        except PresetError as exc:
            raise PresetError(f"--spec-draft-model/-md/--model-draft: {exc}") from exc
        speculative = attrs.evolve(speculative, draft_model=str(draft))
    template, _origin = args.chat_template or args.chat_template_file or (None, "")
    peer, pattern, _notes = combined_target(args)
    n_parallel = 4 if args.parallel == -1 else args.parallel  # llama-server's auto: 4 slots
    n_ctx = args.ctx_size
    if n_ctx is None and args.kv_unified_per_slot is not None and args.kv_unified_per_slot > 0:
        n_ctx = n_parallel * args.kv_unified_per_slot  # llama-server sizes the pool so when -c is not given
    given = {  # a flag not given (None) leaves EngineConfig's own default, which is llama-server's
        "n_ctx": n_ctx,
        "n_predict": args.n_predict,
        "n_keep": args.n_keep,
        "n_cache_reuse": args.n_cache_reuse,
        "slot_prompt_similarity": args.slot_prompt_similarity,
        "embd_normalize": args.embd_normalize,
        "n_ctx_checkpoints": args.n_ctx_checkpoints,
        "checkpoint_min_step": args.checkpoint_min_step,
        "cache_ram_mib": args.cache_ram_mib,
        "cache_idle_slots": args.cache_idle_slots,
        "max_embedding_inputs": args.max_embedding_inputs,
        "reasoning_format": args.reasoning_format,
        "reasoning_budget": args.reasoning_budget,
        "reasoning_budget_message": args.reasoning_budget_message,
    }
    media = media_settings(args, args.model or DEFAULT_ALIAS)
    context_shift = args.context_shift
    if media.mmproj is not None:
        log.info("multimodal projector %s (vision %s, audio %s)", media.mmproj, media.vision, media.audio)
        if context_shift:
            log.warning("ctx_shift is not supported by multimodal, it will be disabled")
            context_shift = False
        if given["n_cache_reuse"]:
            log.warning("cache_reuse is not supported by multimodal, it will be disabled")
            given["n_cache_reuse"] = 0
    return EngineConfig(
        model_path=path,
        model_alias=args.alias or alias,
        n_parallel=n_parallel,
        n_batch=args.batch_size,
        n_threads=args.threads or None,  # -t 0: every core
        peer=peer,
        combined_pattern=pattern,
        chat_template=template,
        allow_cross_model_kv=args.allow_cross_model_kv,
        quants=quants,
        llama=opts,
        chat_template_kwargs=template_kwargs(args),
        sampling=args.sampling,
        context_shift=context_shift,
        slot_save_path=args.slot_save_path,
        generation=generation_defaults(args),
        skip_chat_parsing=args.skip_chat_parsing,
        prefill_assistant=args.prefill_assistant,
        speculative=speculative,
        media=media,
        **{k: v for k, v in given.items() if v is not None},
    )


async def _run(args: argparse.Namespace) -> int:
    from ..node.server import Server, ServerConfig, serve  # loads llama.cpp: only for `run`

    try:
        access = access_settings(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    opts = llama_options(args)
    problem = _check_devices(opts)
    if problem:
        log.error("%s", problem)
        return 2
    _notes(args, opts)
    _log_devices()
    _process_settings(args)
    engine = None
    if not args.no_model:
        try:
            engine = engine_config(args, opts)
        except (PresetError, ProjectorError) as exc:
            log.error("%s", exc)
            return 2
        if args.chat_template or args.chat_template_file:
            log.info("chat template: %s", (args.chat_template or args.chat_template_file)[1])
        log.info(
            "model %s (%s), %d slots, n_ctx %s",
            engine.model_alias,
            engine.model_path,
            engine.n_parallel,
            engine.n_ctx or "the model's training context",
        )
        if engine.embeddings:
            log.info(
                "embeddings only (--embedding): pooling %s, normalization %d; completions are refused",
                engine.pooling or "the model's",
                engine.embd_normalize,
            )
    else:
        log.info("compute-only node: no model")
    rpc = rpc_backend_settings(args, access)
    if rpc is None and args.no_model:
        log.error("--no-model with --no-rpc-backend leaves nothing to serve")
        return 2
    try:
        tls, rpc_tls = _tls_contexts(args)
    except (OSError, ValueError) as exc:
        log.error("TLS: %s", exc)
        return 2
    cors = tuple(args.cors_origins or ()) + tuple(args.cors_origin or ())
    http_kw: dict[str, Any] = {}  # -to not given: HttpSettings' defaults (llama-server's)
    if args.timeout is not None:  # below 0: no limit (None); 0: no waiting
        http_kw = dict.fromkeys(("body_timeout", "write_timeout"), None if args.timeout < 0 else args.timeout)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        extra_ports=extra_ports(args),
        engine=engine,
        frontdoor=FrontDoorSettings(
            max_connections=args.max_connections,
            classify_timeout=args.classify_timeout,
            tls=tls,
            tls_required=args.tls_required,
        ),
        rpc_tls=rpc_tls,
        http=HttpSettings(
            keep_alive_timeout=args.keep_alive_timeout,
            cors_origins=cors or ("*",),
            max_event_subscribers=args.max_event_subscribers or max(1, args.max_connections // 4),
            endpoint_props=bool(args.endpoint_props),
            **http_kw,
        ),
        rpc_backend=rpc,
        access=access,
        reuse_port=args.reuse_port,
    )
    async with trio.open_nursery() as nursery:
        server: Server | None = None

        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                first = True
                async for signum in signals:
                    if server is not None:
                        server.begin_stop()  # before anything awaits: the ggml-RPC child may have got it too
                    if first and server is not None:  # a grace of 0: the requests in flight are ended at once
                        log.info(
                            "%s received: no new connections; requests in flight get %g s to finish "
                            "(send it again to stop at once)",
                            signal.Signals(signum).name,
                            args.shutdown_grace,
                        )
                        first = False
                        nursery.start_soon(server.shutdown, args.shutdown_grace)
                        continue
                    log.info("%s received: shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(stop_on_signal)
        try:
            server = await nursery.start(serve, config)
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
            nursery.cancel_scope.cancel()
            return 1
        await server.stopped.wait()
        nursery.cancel_scope.cancel()
    return 0

"""Router mode from the command line: ``hydra-trio --models-preset FILE`` or ``--models-dir DIR`` without
``-m``, as llama-server starts its router (docs/router.md).

The models are read and checked before anything listens or loads: each model's flags are parsed by the
node's own parser, one key at a time and then whole, so that a key the node does not know, or a value it
refuses, exits 2 naming the preset, the key and the reason.  Then the router serves
(:class:`~hydra_trio.router.server.RouterServer`) until SIGINT/SIGTERM (once: stop every child within its
``stop-timeout``, twice: at once).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from ..config import ServerConfig
from ..http.settings import HttpSettings
from ..models.presets import PRESETS, PresetError, resolve_model
from ..models.projector import ProjectorError, projector_modalities
from ..observability.logs import configure_logging
from ..router.child_process import ForkServer
from ..router.models import ModelInstance, ModelRouter, RouterSettings
from ..router.presets import (
    DEFAULT_STOP_TIMEOUT,
    FALSEY,
    LOAD_ON_STARTUP,
    RESERVED,
    ROUTER_ONLY,
    STOP_TIMEOUT,
    TRUTHY,
    ModelPreset,
    ModelsConfigError,
    Option,
    OptionSpec,
    OptionTable,
    child_environment,
    read_preset_file,
    scan_models_dir,
)
from ..router.swap import quant_siblings
from ..transport.frontdoor import FrontDoorSettings
from ..transport.tls import TlsSettings, server_context
from .access import access_settings
from .flags import RUN_FLAGS
from .fork_server import Node, start_here
from .router_memory import check_router_memory
from .run import log_level, rpc_backend_settings

log = logging.getLogger("hydra_trio")


def option_table() -> OptionTable:
    """Every flag of ``run`` as preset keys (:class:`~hydra_trio.router.presets.OptionTable`)."""
    return OptionTable(
        OptionSpec(f.names, f.neg, f.value is not None, f.env) for f in RUN_FLAGS if f.action not in ("help", "version")
    )


Parse = Callable[[list[str], dict[str, str]], argparse.Namespace]
"""The command line's parser (:func:`hydra_trio.cli.parse_args`)."""


def _parse_error(parse: Parse, argv: list[str], environ: dict[str, str]) -> str | None:
    """The node parser's refusal of ``argv`` (its message, without the usage), else None."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse(["run", *argv], environ)
    except SystemExit as exc:
        if exc.code in (0, None):
            return "the flags print something and exit (no server would run)"
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit {exc.code}"
        return last.split(": error: ", 1)[-1]
    return None


def _check(parse: Parse, preset: ModelPreset, environ: dict[str, str]) -> None:
    """Refuse (ModelsConfigError) a model whose flags the node refuses, naming the key; see the module docstring."""
    for option in preset.options.values():
        spec = option.spec
        if spec.preset_only:
            _check_preset_only(preset.name, option)
            continue
        single = ModelPreset(preset.name, preset.source, {spec.names[0]: option}).argv() or [spec.name]
        if (problem := _parse_error(parse, single, {})) is not None:
            raise ModelsConfigError(f"preset '{preset.name}': key '{option.key}' (from {_where(option)}): {problem}")
    model = preset.get("--model")
    if model is None:
        raise ModelsConfigError(
            f"preset '{preset.name}': no model: set 'model' to a GGUF file or a model name ({', '.join(PRESETS)})"
        )
    if not Path(model).expanduser().is_file() and model not in PRESETS:
        raise ModelsConfigError(f"preset '{preset.name}': key 'model': no such file, and no model name: {model}")
    if (problem := _parse_error(parse, preset.argv(), environ)) is not None:
        raise ModelsConfigError(f"preset '{preset.name}': {problem}")


def _check_preset_only(name: str, option: Option) -> None:
    key = option.spec.names[0]
    if key == LOAD_ON_STARTUP and option.value not in TRUTHY + FALSEY:
        raise ModelsConfigError(
            f"preset '{name}': key '{option.key}': '{option.value}' is no boolean (one of {', '.join(TRUTHY + FALSEY)})"
        )
    if key == STOP_TIMEOUT and not (option.value.isdigit() and int(option.value) <= 86400):
        raise ModelsConfigError(
            f"preset '{name}': key '{option.key}': '{option.value}' is no number of seconds from 0 to 86400"
        )


def _where(option: Option) -> str:
    return option.origin if option.origin == "the command line" else f"[{option.origin}]"


def _modalities(preset: ModelPreset) -> tuple[str, ...]:
    mmproj = preset.get("--mmproj")
    if mmproj is None or preset.get("--no-mmproj") is not None:
        return ("text",)
    try:
        vision, audio = projector_modalities(Path(mmproj))
    except (ProjectorError, OSError, ValueError):
        return ("text",)
    return ("text", *(["image"] if vision else []), *(["audio"] if audio else []))


def build_models(
    args: argparse.Namespace, argv: list[str], parse: Parse, environ: dict[str, str] | None = None
) -> tuple[list[ModelInstance], list[ModelInstance]]:
    """The router's models and those to load at start (``load-on-startup``), from ``--models-dir``, then
    ``--models-preset`` (a section over the directory's model of the same name), each over ``[*]`` and under the
    router's command line ``argv``, as llama-server's ``load_models``; presets that differ only in their
    quantization know each other (:func:`~hydra_trio.router.swap.quant_siblings`).

    Raises:
        ModelsConfigError: a preset the node refuses (see :func:`_check`), two models or aliases of one name, or more
            ``load-on-startup`` models than ``--models-max``.
    """
    environ = dict(os.environ if environ is None else environ)
    table = option_table()
    top = {k: o for k, o in table.from_argv(argv).items() if o.spec.name not in RESERVED + ROUTER_ONLY}
    glob: dict[str, Option] = {}
    found: dict[str, ModelPreset] = {}
    if args.models_dir:
        for p in scan_models_dir(Path(args.models_dir), table):
            found[p.name] = p
    if args.models_preset:
        glob, presets = read_preset_file(Path(args.models_preset), table)
        for p in presets:
            found[p.name] = p.over(found[p.name].options) if p.name in found else p
    models: list[ModelInstance] = []
    startup: list[ModelInstance] = []
    names: dict[str, str] = {}
    launcher = RouterSettings().launcher
    for p in found.values():
        p = p.over(glob).under(top).without(RESERVED)
        _check(parse, p, environ)
        stop = p.get(STOP_TIMEOUT)
        m = ModelInstance(p, table, launcher, float(stop) if stop is not None else DEFAULT_STOP_TIMEOUT, _modalities(p))
        for n in (m.name, *m.aliases):
            if n in names:
                raise ModelsConfigError(
                    f"model name or alias '{n}' of model '{m.name}' conflicts with model '{names[n]}'"
                )
            names[n] = m.name
        models.append(m)
        if (p.get(LOAD_ON_STARTUP) or "false") in TRUTHY:
            startup.append(m)
    siblings = quant_siblings([m.preset for m in models])
    for m in models:
        m.quants = siblings.get(m.name, {})
    if 0 < args.models_max < len(startup):
        raise ModelsConfigError(
            f"number of models to load on startup ({len(startup)}) exceeds models_max ({args.models_max})"
        )
    return models, startup


def model_factory(
    args: argparse.Namespace, argv: list[str], parse: Parse, environ: dict[str, str] | None = None
) -> Callable[[str], ModelInstance]:
    """``POST /models``'s models: ``name`` is a model on this machine (one of the project's installed models or
    a GGUF file), listed as ``source: "cache"`` with the preset's ``[*]`` under the router's command line, as
    :func:`build_models` builds the others.  The callable raises ModelsConfigError for a model that is not
    here (it would need a download) or that the node refuses."""
    environ = dict(os.environ if environ is None else environ)
    table = option_table()
    top = {k: o for k, o in table.from_argv(argv).items() if o.spec.name not in RESERVED + ROUTER_ONLY}
    glob = read_preset_file(Path(args.models_preset), table)[0] if args.models_preset else {}

    def make(name: str) -> ModelInstance:
        try:
            resolve_model(name)
        except PresetError as exc:
            raise ModelsConfigError(str(exc)) from exc
        model = table.option("model", name, name)
        p = ModelPreset(name, "cache", {model.spec.names[0]: model}).over(glob).under(top).without(RESERVED)
        _check(parse, p, environ)
        stop = p.get(STOP_TIMEOUT)
        launcher = RouterSettings().launcher
        return ModelInstance(p, table, launcher, float(stop) if stop else DEFAULT_STOP_TIMEOUT, _modalities(p))

    return make


def run_router(args: argparse.Namespace, parse: Parse, node: Node) -> int:
    """Serve in router mode until SIGINT/SIGTERM; 2 when a preset or flag is refused before anything starts.
    ``parse`` checks each model's flags (:func:`hydra_trio.cli.parse_args`).

    First of all, before it starts a thread, the process forks itself into the children's fork server
    (:mod:`hydra_trio.cli.fork_server`; not with ``--no-router-spare``), warm at once; a child forked there
    runs ``node`` (:func:`hydra_trio.cli.main`), then ends with its status."""
    fork_server: ForkServer | None = None
    fork_error: BaseException | None = None
    if not args.no_router_spare and ForkServer.supported():
        try:
            fork_server = ForkServer(*start_here(child_environment(), node))
        except (OSError, RuntimeError) as exc:
            fork_error = exc
    try:
        return _run_router(args, parse, fork_server, fork_error)
    finally:
        if fork_server is not None:
            fork_server.close()


def _run_router(
    args: argparse.Namespace, parse: Parse, fork_server: ForkServer | None, fork_error: BaseException | None
) -> int:
    configure_logging(
        "CRITICAL" if args.log_disable else log_level(args),
        args.log_format or ("json" if args.log_jsonl else "text"),
        sys.stderr,
        file=args.log_file,
        timestamps=args.log_timestamps,
        disabled=args.log_disable,
    )
    try:
        models, startup = build_models(args, list(getattr(args, "argv", [])), parse)
        check_router_memory(models, args.models_max, parse)
        factory = model_factory(args, list(getattr(args, "argv", [])), parse)
        access = access_settings(args)
        tls = None
        if args.tls_cert is not None or args.tls_key is not None:
            if args.tls_cert is None or args.tls_key is None:
                raise ValueError("--tls-cert and --tls-key (--ssl-cert-file and --ssl-key-file) go together")
            tls = server_context(
                TlsSettings(
                    Path(args.tls_cert),
                    Path(args.tls_key),
                    Path(args.tls_client_ca) if args.tls_client_ca else None,
                    args.tls_required,
                )
            )
    except (ModelsConfigError, ValueError, OSError) as exc:
        log.error("%s", exc)
        return 2
    if fork_error is not None:
        log.warning("no fork server for the children (the router starts another when idle): %s", fork_error)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        engine=None,
        rpc_backend=rpc_backend_settings(args, access),
        access=access,
        reuse_port=args.reuse_port,
        frontdoor=FrontDoorSettings(
            max_connections=args.max_connections,
            classify_timeout=args.classify_timeout,
            tls=tls,
            tls_required=args.tls_required,
        ),
        http=HttpSettings(
            keep_alive_timeout=args.keep_alive_timeout,
            cors_origins=tuple(args.cors_origins or ()) + tuple(args.cors_origin or ()) or ("*",),
        ),
    )
    if args.timeout is not None:  # below 0: no limit (None); 0: no waiting
        limit = None if args.timeout < 0 else args.timeout
        config = attrs.evolve(config, http=attrs.evolve(config.http, body_timeout=limit, write_timeout=limit))
    router = ModelRouter(
        models,
        RouterSettings(
            models_max=args.models_max,
            models_autoload=args.models_autoload,
            spare=not args.no_router_spare,
            relay_timeout=3600.0 if args.timeout is None else (args.timeout if args.timeout > 0 else None),
        ),
        factory=factory,
        fork_server=fork_server,
    )
    log.info(
        "starting server in router mode: %d models, at most %s loaded, autoload %s",
        len(models),
        args.models_max or "any number",
        "on" if args.models_autoload else "off",
    )
    try:
        return trio.run(_serve, config, router, startup, args.shutdown_grace)
    except Exception as exc:
        error: BaseException = exc
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        log.error("fatal: %s", error)
        return 1


async def _serve(config: ServerConfig, router: ModelRouter, startup: list[ModelInstance], grace: float) -> int:
    from ..router.server import RouterServer

    server = RouterServer(config, router, startup)
    async with trio.open_nursery() as nursery:

        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                first = True
                async for signum in signals:
                    if first:
                        log.info(
                            "%s received: stopping every model (send it again to stop at once)",
                            signal.Signals(signum).name,
                        )
                        first = False
                        nursery.start_soon(server.shutdown, grace)
                        continue
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(stop_on_signal)
        try:
            await nursery.start(server.run)
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
            nursery.cancel_scope.cancel()
            return 1
        await server.stopped.wait()
        nursery.cancel_scope.cancel()
    return 0

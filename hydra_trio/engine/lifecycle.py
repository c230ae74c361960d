"""The model's life on the engine thread: load, hash and warm up; reconfigure; swap quantizations.

:class:`ModelLifecycle` owns what a model change replaces — the configuration, the models
(:class:`~hydra_trio.engine.experts.combined.ExpertModes`), the model's identity, the scheduler over its
slots and the host-RAM prompt cache — and the stages ``/health`` reports while the first model loads
(:class:`Stage`).  Every method runs on the engine thread; CONFIGURE and SWAP_QUANT run only while every
slot is idle (exclusive tasks, :mod:`~hydra_trio.engine.tasks`).  A model change builds the new model
before it frees the old one, so a failure leaves the node serving as before.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import llama_cpp

from ..errors import Cancelled, EngineFailure, InvalidRequest, ModelLoadError
from ..observability import progress
from ..observability.events import EventBus
from .batching.prompt_cache import PromptCache
from .batching.scheduler import Scheduler
from .experts.combined import ExpertModes, PeerError
from .kv.kv_identity import identity_hash, kv_identity
from .kv.state import StateError, restore_slot, save_slot
from .llama.model import LoadedModel, ModelIdentity, release_free_memory, resident_bytes, sha256_file
from .quants import QuantSet, cache_dir, merge_tensors
from .requests import StepHandOff
from .settings import INT32_MAX, EngineConfig, check_n_parallel
from .speculative.build import build_speculative, target_options
from .stats import EngineStats

log = logging.getLogger("hydra_trio.engine")


class Stage(enum.StrEnum):
    """Where the engine is in its life (``/health``'s ``stage``)."""

    STARTING = "starting"
    LOADING_MODEL = "loading_model"
    HASHING_MODEL = "hashing_model"
    WARMUP = "warmup"
    READY = "ready"
    ERROR = "error"
    STOPPED = "stopped"


def trim_heap(when: str) -> None:
    """:func:`~hydra_trio.engine.llama.model.release_free_memory` (glibc ``malloc_trim``, about 20 µs), logged at
    DEBUG with the resident set size: after the load and each time the last busy slot goes idle, never
    between two decode steps of a request."""
    if not log.isEnabledFor(logging.DEBUG):
        release_free_memory()
        return
    before = resident_bytes()
    released = release_free_memory()
    after = resident_bytes()
    if before is not None and after is not None:
        log.debug(
            "heap trimmed %s: resident %.1f MiB (%+.1f MiB)%s",
            when,
            after / 2**20,
            (after - before) / 2**20,
            "" if released else ", nothing to release",
        )


def warm_up(m: LoadedModel) -> None:
    """One tiny decode so the first request does not pay for lazy init, of llama-server's tokens
    (``common_init_from_params`` in ``common/common.cpp``: BOS and EOS, those the vocabulary has, else token 0;
    a batch of two runs the kernels a prompt runs), then :func:`trim_heap`: the load's temporaries go back to
    the system."""
    ids = [t for t in (m.bos_id, m.eos_id) if t >= 0] or [0]
    tokens = (llama_cpp.llama_token * len(ids))(*ids)  # alive while the batch points at it
    llama_cpp.llama_decode(m.ctx, llama_cpp.llama_batch_get_one(tokens, len(ids)))
    llama_cpp.llama_memory_clear(m.memory, True)
    trim_heap("after loading")


def model_kwargs(config: EngineConfig) -> dict[str, Any]:
    """The :class:`LoadedModel` keyword arguments every model of this engine is built with (SOLO at start
    and on reload, COMBINED, PIPELINE) besides its path, context and slots; ``config.media``'s projector is
    loaded with each (its ``mmproj``, ``offload``, ``device``, ``image_min_tokens``, ``image_max_tokens``,
    ``batch_max_tokens``, the ``video_*`` settings)."""
    options, media = config.llama, config.media
    if media.mmproj is not None:
        options = attrs.evolve(
            options,
            mmproj=str(media.mmproj),
            mmproj_offload=media.offload,
            image_min_tokens=media.image_min_tokens,
            image_max_tokens=media.image_max_tokens,
            mmproj_batch_max_tokens=media.batch_max_tokens,
            mmproj_device=media.device or "",
            video_fps=media.video_fps,
            video_timestamp_interval_ms=media.video_timestamp_interval_ms,
            video_ffmpeg_dir=media.video_ffmpeg_dir or "",
        )
    return {
        "n_batch": config.n_batch,
        "n_threads": config.n_threads,
        "chat_template": config.chat_template,
        "options": target_options(config.speculative, options),
        "chat_template_kwargs": config.chat_template_kwargs,
    }


class ModelLifecycle:
    """The served model and what hangs off it, from the first load to the last close (engine thread).

    Args:
        config: the engine's configuration (a model change evolves it: :attr:`config`).
        events: where ``load.*`` (and, through the scheduler and the expert modes, ``slot.*``, ``mode.*``,
            ``peer.*``) events go.
        stats: the engine's counters (:class:`~hydra_trio.engine.stats.EngineStats`).
        hand_off: the scheduler's step hand-over of token events to trio.
    """

    def __init__(self, config: EngineConfig, events: EventBus, stats: EngineStats, hand_off: StepHandOff) -> None:
        self.config = config
        self.events, self.stats, self.hand_off = events, stats, hand_off
        self.stage = Stage.STARTING
        self.progress = 0.0
        """The fraction of the weights loaded (0..1) while :attr:`stage` is ``loading_model``."""
        self.error: str | None = None
        self.stage_times: dict[str, float] = {}
        self.identity: ModelIdentity | None = None
        self.quants = QuantSet(config.quants, config.model_path, config.model_alias)
        self.standby: LoadedModel | None = None
        """The quantization served before the last SWAP_QUANT, kept without its context when its weights are
        the file's own pages (:attr:`LoadedModel.file_backed`): a swap back to it loads no file."""
        """The node's quantizations by key (``--quant KEY=PATH_OR_ALIAS``) and the active one."""
        self.experts = ExpertModes(config.peer, config.combined_pattern, stats, model_kwargs(config), events=events)
        self.scheduler: Scheduler | None = None
        self.prompt_cache = PromptCache(config.cache_ram_mib, config.cache_idle_slots, events)
        """Slots' KV states kept in host RAM (``--cache-ram``); emptied whenever a new model or context serves."""
        self.publish: Callable[[], None] = lambda: None
        """What each new scheduler calls to publish the engine's snapshot (:attr:`Scheduler.publish`)."""

    @property
    def model(self) -> LoadedModel | None:
        """The model that serves new work (SOLO or COMBINED)."""
        return self.experts.active

    @property
    def slots(self) -> list[Any]:
        """The slots of the scheduler (none before the model serves)."""
        return self.scheduler.slots if self.scheduler is not None else []

    def set_stage(self, stage: Stage) -> None:
        """Enter ``stage``: logged with the time the previous one took, and published as ``load.stage``."""
        now = time.monotonic()
        previous: dict[str, Any] = {}
        if self.stage_times:
            prev, t0 = self.stage, self.stage_times[self.stage]
            log.info("stage %s done in %.2f s", prev, now - t0)
            previous = {"previous": str(prev), "previous_s": round(now - t0, 3)}
        self.stage = stage
        self.stage_times[stage] = now
        log.info("stage %s", stage)
        self.events.publish("load.stage", stage=str(stage), **previous, **({"error": self.error} if self.error else {}))

    def load(self, stopping: Callable[[], bool]) -> bool:
        """Load the configured model, hash its file, build its scheduler and warm it up, moving
        :attr:`stage` through ``loading_model`` (with :attr:`progress`), ``hashing_model`` and ``warmup``.
        ``stopping`` says the node is shutting down: the load stops and :attr:`stage` becomes ``stopped``.
        Returns False when the load stopped that way (the models are closed then), else True.

        Raises:
            Exception: what loading raised (:attr:`stage` is ``error`` then, :attr:`error` says why).
        """
        cfg = self.config
        try:
            self.set_stage(Stage.LOADING_MODEL)
            size = cfg.model_path.stat().st_size
            with progress.step("loading model", total=size, unit="B") as bar:

                def on_load(p: float) -> bool:  # llama.cpp's fraction of the weights loaded
                    self.progress = p
                    bar.update(p * size)
                    return not stopping()  # False aborts the load (shutdown during load)

                model = LoadedModel(
                    cfg.model_path,
                    n_ctx=cfg.n_ctx,
                    n_parallel=cfg.n_parallel,
                    progress=on_load,
                    log_chat_template=True,
                    **self.experts.model_kwargs,
                )
            self.experts.set_solo(model)
            self.progress = 1.0
            self.set_stage(Stage.HASHING_MODEL)
            with progress.step("hashing model", total=size, unit="B") as bar:
                model_hash = sha256_file(cfg.model_path, stop=stopping, on_block=bar.advance)
            self.quants.remember_hash(cfg.model_path, model_hash)
            self.identity = ModelIdentity(
                model_alias=cfg.model_alias,
                model_path=str(cfg.model_path),
                model_hash=model_hash,
                kv_identity_hash=identity_hash(kv_identity(model)),
            )
            self.scheduler = self.new_scheduler(model, self.identity.model_hash)
            self.set_stage(Stage.WARMUP)
            with progress.step("warm-up"):
                warm_up(model)
            self.quants.hash_in_background()
        except Exception as exc:
            self.experts.close()
            if stopping():  # the node is stopping: the load was aborted on purpose, not a failure
                self.set_stage(Stage.STOPPED)
                log.info("model load stopped: the node is shutting down")
                return False
            self.error = str(exc)
            self.set_stage(Stage.ERROR)
            log.error("model load failed: %s", exc)
            raise
        return True

    def new_scheduler(self, model: LoadedModel, model_hash: str) -> Scheduler:
        """The scheduler over ``model``'s slots, with the configuration's slot and cache settings and the
        prompt cache; each step's token events reach trio in one hand-over.

        As llama-server, ``context_shift`` and ``n_cache_reuse`` are dropped with a
        warning when the model's memory cannot shift positions (recurrent or hybrid) or a projector is loaded
        (``--mmproj``); speculative decoding stays with a projector, on slots with media too (the drafters hear
        the media's embeddings: :meth:`~hydra_trio.engine.speculative.base.Drafter.process_media`).
        """
        cfg = self.config
        context_shift, n_cache_reuse = cfg.context_shift, cfg.n_cache_reuse
        if not llama_cpp.llama_memory_can_shift(model.memory):
            if context_shift:
                log.warning("context shift is not supported by this model's memory; it is disabled")
                context_shift = False
            if n_cache_reuse:
                log.warning("cache reuse is not supported by this model's memory; it is disabled")
                n_cache_reuse = 0
        if model.media is not None:  # an image's cells cannot be shifted or moved (positions != cells with M-RoPE)
            if context_shift:
                log.warning("ctx_shift is not supported by multimodal, it will be disabled")  # llama-server's line
                context_shift = False
            if n_cache_reuse:
                log.warning("cache_reuse is not supported by multimodal, it will be disabled")
                n_cache_reuse = 0
        log.info(
            "initializing, n_slots = %d, n_ctx_slot = %d, kv_unified = '%s'",
            model.n_parallel,
            model.n_ctx_slot,
            "true" if model.options.kv_unified else "false",
        )  # llama-server's line
        spec, spec_cap = build_speculative(cfg.speculative, model, model.n_parallel)
        sched = Scheduler(
            self.experts,
            model.n_parallel,
            model.n_ctx_slot,
            model.n_batch,
            self.stats,
            model_hash,
            events=self.events,
            spec=spec,
            spec_cap=spec_cap,
            context_shift=context_shift,
            n_keep=cfg.n_keep,
            n_cache_reuse=n_cache_reuse,
            slot_prompt_similarity=cfg.slot_prompt_similarity,
            n_ctx_checkpoints=cfg.n_ctx_checkpoints,
            checkpoint_min_step=cfg.checkpoint_min_step,
            prompt_cache=self.prompt_cache,
            hand_off=self.hand_off,
        )
        sched.publish = self.publish
        return sched

    def at_idle(self) -> None:
        """Every slot idle after a request: :func:`trim_heap`, and a COMBINED peer's worker frees its OpenMP
        team (:meth:`ExpertModes.rest`: a peer lost before the next request then leaves no second team behind)."""
        trim_heap("idle")
        self.experts.rest()

    def close(self) -> None:
        """The node stops: fail what the scheduler still holds and free the models."""
        if self.scheduler is not None:
            self.scheduler.close(Cancelled("the server is shutting down"))
        self.drop_standby()
        self.experts.close()

    def drop_standby(self) -> None:
        """Free the :attr:`standby` model, if any."""
        standby, self.standby = self.standby, None
        if standby is not None:
            standby.close()

    def install_model(self, new: LoadedModel, identity: ModelIdentity, *, keep_old: bool = False) -> None:
        """Every slot idle: ``new`` serves from now on and the old model is freed, or with ``keep_old``
        (a SWAP_QUANT) kept as the :attr:`standby` when its weights are its file's pages and it has no
        projector (any earlier standby is freed).

        The slots start empty (their KV belonged to the old context), and so does the prompt cache;
        requests waiting in the queue would stay (the control channel runs a change only when none waits:
        :meth:`~hydra_trio.engine.tasks.EngineTask.perform`).  Used by :meth:`reconfigure` and :meth:`swap_quant`.
        """
        assert self.scheduler is not None and self.experts.solo is not None
        old = self.experts.solo
        pending, self.scheduler.pending = self.scheduler.pending, collections.deque()
        self.scheduler.close(Cancelled("the engine is being reconfigured"))  # no slot is busy: frees the batch
        self.experts.set_solo(new)
        self.drop_standby()
        if keep_old and old.file_backed and old.media is None:  # a projector is memory of its own
            old.release_context()
            self.standby = old
            log.info("%s kept without its context: a swap back to it loads no file", old.path.name)
        else:
            old.close()
        self.identity = identity
        self.prompt_cache.clear("reload")
        self.scheduler = self.new_scheduler(new, identity.model_hash)
        self.scheduler.pending = pending
        self.config = attrs.evolve(self.config, model_path=new.path, model_alias=identity.model_alias)
        self.quants.loaded(new.path)

    def reconfigure(
        self,
        *,
        n_ctx: int | None = None,
        n_parallel: int | None = None,
        model_path: Path | None = None,
        model_alias: str | None = None,
    ) -> dict[str, Any]:
        """Every slot idle (an exclusive task: :class:`~hydra_trio.engine.tasks.Reconfigure`): CONFIGURE
        tiers 2 and 3.

        ``n_ctx`` / ``n_parallel`` rebuild the context; ``model_path`` (already
        resolved from a path or preset alias by the caller) reloads the model.
        The new context or model is built before the old one is freed, so a
        failure leaves the engine as it was.  Slots' KV caches are dropped
        (they belong to the old context); no request waits (:meth:`~hydra_trio.engine.tasks.EngineTask.perform`).
        Returns the applied values.

        Raises:
            InvalidRequest: a value out of range, or llama.cpp refused the new settings.
        """
        old = self.experts.solo
        assert old is not None and self.scheduler is not None
        n_ctx = old.n_ctx if n_ctx is None else n_ctx
        n_parallel = old.n_parallel if n_parallel is None else n_parallel
        check_n_parallel(n_parallel)  # the bound -np has too
        if not 16 * n_parallel <= n_ctx <= INT32_MAX:  # a slot's cap (the training context) is the model's, as at start
            raise InvalidRequest(
                f"n_ctx: {n_ctx} is out of range ({16 * n_parallel}..{INT32_MAX} for {n_parallel} slots)"
            )
        path = model_path or old.path
        alias = model_alias or self.config.model_alias
        try:
            new = LoadedModel(
                path, n_ctx=n_ctx, n_parallel=n_parallel, log_chat_template=True, **self.experts.model_kwargs
            )
        except Exception as exc:
            raise InvalidRequest(f"llama.cpp refused the new settings: {exc}") from None
        identity = self.identity
        assert identity is not None
        if path != old.path:
            identity = ModelIdentity(
                model_alias=alias,
                model_path=str(path),
                model_hash=sha256_file(path),
                kv_identity_hash=identity_hash(kv_identity(new)),
            )
        self.install_model(new, identity)
        self.config = attrs.evolve(self.config, n_ctx=n_ctx, n_parallel=n_parallel)
        log.info("reconfigured: model %s, n_ctx %d, %d slots", path.name, new.n_ctx, n_parallel)
        return {"n_ctx": new.n_ctx, "n_parallel": n_parallel, "model_path": str(path)}

    def swap_quant(self, key: str) -> dict[str, Any]:
        """Every slot idle (an exclusive task: :class:`~hydra_trio.engine.tasks.SwapQuant`): make quant ``key``
        the served model, its slots' KV caches moved into it when both files have the same KV identity; returns
        SWAP_QUANT's meta (:mod:`~hydra_trio.engine.quants`).

        Meta: ``swapped`` (False when ``key`` is already active), ``quant``,
        ``bytes`` (the size of the file loaded), ``swap_ms``, ``kv_preserved``
        (every slot kept its KV cache: same KV identity), ``slots_preserved``, and
        the new model's identity keys.

        Raises:
            InvalidRequest: an unknown key, or a COMBINED head (switch to SOLO first).
            EngineFailure: the file did not load; the old model still serves.
        """
        qs = self.quants
        if key not in qs.paths:
            known = ", ".join(qs.keys) or "none: start the node with --quant KEY=PATH_OR_ALIAS"
            raise InvalidRequest(f"quant {key!r} is not one of this node's quants ({known})")
        if str(self.experts.mode) != "solo":
            raise InvalidRequest(
                f"SWAP_QUANT of the whole model while {str(self.experts.mode).upper()} serves: "
                "switch to SOLO first (the attached model is then freed by the swap)"
            )
        old = self.experts.solo
        old_identity = self.identity
        assert old is not None and old_identity is not None
        if key == qs.active:
            return {
                "swapped": False,
                "quant": key,
                "bytes": 0,
                "swap_ms": 0.0,
                "kv_preserved": True,
                "slots_preserved": sum(1 for s in self.slots if s.n_past),
                **old_identity.as_meta(),
            }
        path, alias = qs.paths[key]
        t0 = time.perf_counter()
        new = self._from_standby(path)
        from_standby = new is not None
        try:
            if new is None:
                new = LoadedModel(
                    path,
                    n_ctx=old.n_ctx,
                    n_parallel=old.n_parallel,
                    n_batch=old.n_batch,
                    n_threads=self.config.n_threads,
                    chat_template=self.config.chat_template,
                    options=old.options,
                    chat_template_kwargs=old.chat_template_kwargs,
                )
        except Exception as exc:
            raise EngineFailure(
                f"quant {key!r} ({path}) did not load: {exc}; the node still serves {qs.active or old.path.name}"
            ) from None
        t_load = time.perf_counter()
        try:
            identity = ModelIdentity(
                model_alias=alias or path.stem,
                model_path=str(path),
                model_hash=qs.file_hash(path),
                kv_identity_hash=identity_hash(kv_identity(new)),
            )
            kv_preserved = identity.kv_identity_hash == old_identity.kv_identity_hash
            if kv_preserved:  # the same vocabulary
                new.share_vocabulary_tables(old)
            blobs = (
                [(s.id, save_slot(old, s, old_identity.model_hash)[1]) for s in self.slots if s.n_past]
                if kv_preserved
                else []
            )  # a slot holding media too: its blob carries its media layout
        except Exception:
            new.close()
            raise
        t_identity = time.perf_counter()
        self.install_model(new, identity, keep_old=True)
        qs.loaded(path, key)
        t_install = time.perf_counter()
        preserved = 0
        for id_slot, blob in blobs:
            try:
                restore_slot(new, self.slots[id_slot], blob, identity.model_hash, allow_cross_model_kv=True)
                preserved += 1
            except StateError as exc:  # the slot stays empty
                log.warning("SWAP_QUANT: slot %d's KV cache did not move to %s: %s", id_slot, key, exc)
                kv_preserved = False
        ms = (time.perf_counter() - t0) * 1e3
        log.info(
            "SWAP_QUANT to %s (%s) in %.0f ms (%s %.0f, identity and KV saved %.0f, install %.0f, KV restored "
            "%.0f); %d slot(s) kept their KV cache",
            key,
            path.name,
            ms,
            "a new context for the standby" if from_standby else "load",
            (t_load - t0) * 1e3,
            (t_identity - t_load) * 1e3,
            (t_install - t_identity) * 1e3,
            (time.perf_counter() - t_install) * 1e3,
            preserved,
        )
        return {
            "swapped": True,
            "quant": key,
            "bytes": path.stat().st_size,
            "swap_ms": round(ms, 3),
            "kv_preserved": kv_preserved,
            "slots_preserved": preserved,
            **identity.as_meta(),
        }

    def _from_standby(self, path: Path) -> LoadedModel | None:
        """The :attr:`standby` model when it is ``path``'s, unchanged on disk, with its context again;
        else None (a standby of another file stays; one whose file changed, or that cannot have a context
        again, is freed)."""
        standby = self.standby
        if standby is None or standby.path.resolve() != path.resolve():
            return None
        self.standby = None
        if standby.same_file():
            try:
                standby.restore_context()
                return standby
            except ModelLoadError as exc:
                log.warning("the standby %s could not serve again (%s): loading the file", path.name, exc)
        standby.close()
        return None

    def swap_peer_tensors(self, key: str) -> dict[str, Any]:
        """Every slot idle, a COMBINED head: the tensors on the peer (the experts) from
        quant ``key``, the head's own tensors as they are; returns SWAP_QUANT's meta (``bytes``: what was
        uploaded to the peer; ``kv_preserved`` false: the COMBINED model's KV cache starts empty).

        Raises:
            InvalidRequest: an unknown key, no COMBINED model, or a quant file without those tensors.
            EngineFailure: the new COMBINED model did not build (the node is back in SOLO, saying why).
        """
        qs, experts = self.quants, self.experts
        if key not in qs.paths:
            raise InvalidRequest(f"quant {key!r} is not one of this node's quants ({', '.join(qs.keys)})")
        if experts.combined is None:
            raise InvalidRequest(
                "a tensor_pattern swaps the tensors on the COMBINED peer; no COMBINED model is attached"
            )
        assert experts.solo is not None  # a COMBINED model is built next to the SOLO one
        base, other = experts.solo.path, qs.paths[key][0]
        tag = hashlib.sha256(f"{base}|{other}|{experts.pattern}".encode()).hexdigest()[:12]
        dst = cache_dir() / f"{base.stem}+{key}-peer-tensors-{tag}.gguf"
        try:
            if not dst.is_file():
                merge_tensors(base, other, experts.pattern, dst)
        except ValueError as exc:
            raise InvalidRequest(f"quant {key!r}: {exc}") from None
        try:
            meta = experts.replace_peer_tensors(dst, key)
        except PeerError as exc:
            raise EngineFailure(str(exc)) from None
        log.info(
            "SWAP_QUANT: the tensors on peer %s now come from %s (%s), in %.0f ms",
            experts.peer,
            key,
            other.name,
            meta["swap_ms"],
        )
        return meta

"""SWAP_QUANT: a node's quantizations of its model, and swapping the whole model between them.

A node knows its quantizations by key (``--quant KEY=PATH_OR_ALIAS``,
repeatable; the model loaded at start is the one whose path matches, else
key ``default``).  A swap loads the other file, moves every slot's KV cache
into it when both files have the same KV identity
(:mod:`hydra_trio.engine.kv.kv_identity`: e.g. Q4_1 and Q8_0 of one model), and
frees the old model.  It is whole or nothing: when the new file does not
load, the old model keeps serving.  Peak memory during a swap: the old model,
the new one and one KV blob per slot that holds tokens.

On a COMBINED head, a ``tensor_pattern`` that picks exactly the tensors on
the peer swaps only those (:func:`swap_peer_tensors`): llama.cpp loads a
model from one file, so a file is made with the head's own tensors from the
current model and the peer's from the other quant
(:func:`~hydra_trio.models.quant.merge_tensors`, cached), and the COMBINED
model is rebuilt from it; the SOLO model stays.  Any other subset answers
NOT_IMPLEMENTED.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from ..errors import EngineFailure, InvalidRequest
from .experts.combined import PeerError
from .kv.kv_identity import identity_hash, kv_identity
from .llama.model import LoadedModel, ModelIdentity, sha256_file
from .kv.state import StateError, restore_slot, save_slot

log = logging.getLogger("hydra_trio.engine")


def cache_dir() -> Path:
    """Where made models live: ``$XDG_CACHE_HOME/hydra-trio/models`` (``~/.cache/...`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydra-trio" / "models"


class QuantSet:
    """The quantizations a node may swap between: ``key -> (path, alias)``, and the active key.

    Args:
        quants: ``(key, path, alias)`` of each (``--quant``).
        loaded: the GGUF file loaded at start (its key is the matching
            entry's, else ``default`` is added for it).
    """

    def __init__(self, quants: tuple[tuple[str, Path, str], ...], loaded: Path, loaded_alias: str = "") -> None:
        self.paths: dict[str, tuple[Path, str]] = {key: (Path(path).resolve(), alias) for key, path, alias in quants}
        self._hashes: dict[tuple[Path, int, int], str] = {}  # SHA-256 by (file, mtime, size)
        self.active: str | None = None
        loaded = Path(loaded).resolve()
        if self.paths and not any(p == loaded for p, _ in self.paths.values()):
            self.paths.setdefault("default", (loaded, loaded_alias))
        self.loaded(loaded)
        if self.active is not None and loaded_alias:  # -a/--alias names the model loaded at start
            self.paths[self.active] = (loaded, loaded_alias)

    @property
    def keys(self) -> list[str]:
        return list(self.paths)

    def loaded(self, path: Path, key: str | None = None) -> None:
        """The model in ``path`` serves now: ``key``, else the first key of that file (None for a
        file outside the set), is the active one."""
        path = Path(path).resolve()
        if key is not None and self.paths.get(key, (None,))[0] == path:
            self.active = key
        elif self.active is None or self.paths.get(self.active, (None,))[0] != path:
            self.active = next((k for k, (p, _) in self.paths.items() if p == path), None)

    def file_hash(self, path: Path) -> str:
        """The file's SHA-256, hashed again whenever its size or modification time changed."""
        st = path.stat()
        key = (path, st.st_mtime_ns, st.st_size)
        if key not in self._hashes:
            self._hashes[key] = sha256_file(path)
        return self._hashes[key]

    def snapshot(self) -> dict[str, Any]:
        """INFO's keys: ``quants`` (the keys) and ``quant`` (the active key, or None)."""
        return {"quants": self.keys, "quant": self.active}


def swap_quant(engine: Any, key: str) -> dict[str, Any]:
    """Engine thread, every slot idle: make quant ``key`` the served model of ``engine`` (an
    :class:`~hydra_trio.engine.engine.Engine`); returns SWAP_QUANT's meta.

    Meta: ``swapped`` (False when ``key`` is already active), ``quant``,
    ``bytes`` (the size of the file loaded), ``swap_ms``, ``kv_preserved``
    (every slot kept its KV cache: same KV identity), ``slots_preserved``, and
    the new model's identity keys.

    Raises:
        InvalidRequest: an unknown key, or a COMBINED head (switch to SOLO first).
        EngineFailure: the file did not load; the old model still serves.
    """
    qs = engine.quants
    if key not in qs.paths:
        known = ", ".join(qs.keys) or "none: start the node with --quant KEY=PATH_OR_ALIAS"
        raise InvalidRequest(f"quant {key!r} is not one of this node's quants ({known})")
    if str(engine.experts.mode) != "solo":
        raise InvalidRequest(f"SWAP_QUANT of the whole model while {str(engine.experts.mode).upper()} serves: switch "
                             "to SOLO first (the attached model is then freed by the swap)")
    old = engine.experts.solo
    old_identity = engine.identity
    assert old is not None and old_identity is not None
    if key == qs.active:
        return {"swapped": False, "quant": key, "bytes": 0, "swap_ms": 0.0, "kv_preserved": True,
                "slots_preserved": sum(1 for s in engine.slots if s.n_past), **old_identity.as_meta()}
    path, alias = qs.paths[key]
    t0 = time.perf_counter()
    try:
        new = LoadedModel(path, n_ctx=old.n_ctx, n_parallel=old.n_parallel, n_batch=old.n_batch,
                          n_threads=engine.config.n_threads, chat_template=engine.config.chat_template,
                          options=old.options, chat_template_kwargs=old.chat_template_kwargs)
    except Exception as exc:
        raise EngineFailure(f"quant {key!r} ({path}) did not load: {exc}; the node still serves "
                            f"{qs.active or old.path.name}") from None
    try:
        identity = ModelIdentity(model_alias=alias or path.stem, model_path=str(path), model_hash=qs.file_hash(path),
                                 kv_identity_hash=identity_hash(kv_identity(new)))
        kv_preserved = identity.kv_identity_hash == old_identity.kv_identity_hash
        blobs = ([(s.id, save_slot(old, s, old_identity.model_hash)[1]) for s in engine.slots if s.n_past]
                 if kv_preserved else [])
    except Exception:
        new.close()
        raise
    engine.install_model(new, identity)
    qs.loaded(path, key)
    preserved = 0
    for id_slot, blob in blobs:
        try:
            restore_slot(new, engine.slots[id_slot], blob, identity.model_hash, allow_cross_model_kv=True)
            preserved += 1
        except StateError as exc:  # the slot stays empty
            log.warning("SWAP_QUANT: slot %d's KV cache did not move to %s: %s", id_slot, key, exc)
            kv_preserved = False
    ms = (time.perf_counter() - t0) * 1e3
    log.info("SWAP_QUANT to %s (%s) in %.0f ms; %d slot(s) kept their KV cache", key, path.name, ms, preserved)
    return {"swapped": True, "quant": key, "bytes": path.stat().st_size, "swap_ms": round(ms, 3),
            "kv_preserved": kv_preserved, "slots_preserved": preserved, **identity.as_meta()}


def swap_peer_tensors(engine: Any, key: str) -> dict[str, Any]:
    """Engine thread, every slot idle, a COMBINED head: the tensors on the peer (the experts) from
    quant ``key``, the head's own tensors as they are; returns SWAP_QUANT's meta (``bytes``: what was
    uploaded to the peer; ``kv_preserved`` false: the COMBINED model's KV cache starts empty).

    Raises:
        InvalidRequest: an unknown key, no COMBINED model, or a quant file without those tensors.
        EngineFailure: the new COMBINED model did not build (the node is back in SOLO, saying why).
    """
    import hashlib

    qs, experts = engine.quants, engine.experts
    if key not in qs.paths:
        raise InvalidRequest(f"quant {key!r} is not one of this node's quants ({', '.join(qs.keys)})")
    if experts.combined is None:
        raise InvalidRequest("a tensor_pattern swaps the tensors on the COMBINED peer; no COMBINED model is attached")
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
    log.info("SWAP_QUANT: the tensors on peer %s now come from %s (%s), in %.0f ms", experts.peer, key,
             other.name, meta["swap_ms"])
    return meta


def merge_tensors(base: Path, other: Path, pattern: str, dst: Path) -> Path:
    """Write ``base`` with the tensors whose names match ``pattern`` (``re.search``) taken from
    ``other`` instead: e.g. a MoE head's own tensors in Q4_1 with the experts of its Q8_0 file.

    Both files must hold the matching tensors with the same names and shapes.
    Written to a temporary name and renamed.

    Raises:
        ValueError: no tensor matches, or ``other`` lacks one or holds it in another shape.
    """
    import re

    import gguf

    rx = re.compile(pattern)
    rb, ro = gguf.GGUFReader(str(base)), gguf.GGUFReader(str(other))
    theirs = {t.name: t for t in ro.tensors}
    picked = [t.name for t in rb.tensors if rx.search(t.name)]
    if not picked:
        raise ValueError(f"no tensor of {base.name} matches {pattern!r}")
    for name in picked:
        mine = next(t for t in rb.tensors if t.name == name)
        if name not in theirs or list(theirs[name].shape) != list(mine.shape):
            raise ValueError(f"{other.name} has no tensor {name} of shape {list(mine.shape)}")
    arch = str(rb.fields["general.architecture"].contents())
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in rb.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    chosen = set(picked)
    for t in rb.tensors:
        src = theirs[t.name] if t.name in chosen else t
        writer.add_tensor(t.name, src.data, raw_dtype=src.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    log.info("wrote %s: %s with %d tensors from %s", dst.name, base.name, len(picked), other.name)
    return dst

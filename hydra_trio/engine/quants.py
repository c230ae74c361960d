"""SWAP_QUANT: a node's quantizations of its model (:class:`QuantSet`), and the rules of swapping between them.

A node knows its quantizations by key (``--quant KEY=PATH_OR_ALIAS``,
repeatable; the model loaded at start is the one whose path matches, else
key ``default``).  A swap loads the other file, moves every slot's KV cache
into it when both files have the same KV identity
(:mod:`hydra_trio.engine.kv.kv_identity`: e.g. Q4_1 and Q8_0 of one model), and
frees the old model's context (:meth:`~hydra_trio.engine.lifecycle.ModelLifecycle.swap_quant`), keeping the
model itself as the standby a swap back serves without loading the file when its weights are the file's mapped
pages (else it is freed).  It is whole or nothing: when the new file does not load, the old model keeps
serving.  Peak memory during a swap: the old model, the new one and one KV blob per slot that holds tokens.

On a COMBINED head, a ``tensor_pattern`` that picks exactly the tensors on
the peer swaps only those (:meth:`~hydra_trio.engine.lifecycle.ModelLifecycle.swap_peer_tensors`): llama.cpp loads a
model from one file, so a file is made with the head's own tensors from the
current model and the peer's from the other quant
(:func:`~hydra_trio.models.quant.merge_tensors`, cached), and the COMBINED
model is rebuilt from it; the SOLO model stays.  Any other subset answers
NOT_IMPLEMENTED.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from .llama.model import sha256_file

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
        loaded_alias: ``-a/--alias``: the name of the model loaded at start; when it is that model's key,
            every quant is named by its key (the model id the node answers with after a swap: a router
            starts its children so, each quant keyed by the router's name of it).
    """

    def __init__(self, quants: tuple[tuple[str, Path, str], ...], loaded: Path, loaded_alias: str = "") -> None:
        self.paths: dict[str, tuple[Path, str]] = {key: (Path(path).resolve(), alias) for key, path, alias in quants}
        self._hashes: dict[tuple[Path, int, int], str] = {}  # SHA-256 by (file, mtime, size)
        self.active: str | None = None
        loaded = Path(loaded).resolve()
        if self.paths and not any(p == loaded for p, _ in self.paths.values()):
            self.paths.setdefault("default", (loaded, loaded_alias))
        self.loaded(loaded)
        if self.active is not None and loaded_alias == self.active:  # each quant is named by its key
            self.paths = {k: (p, k) for k, (p, _) in self.paths.items()}
        elif self.active is not None and loaded_alias:  # -a/--alias names the model loaded at start
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

    def hash_in_background(self) -> threading.Thread | None:
        """Hash every quant's file not hashed yet on a daemon thread (once the node serves), so that a swap
        does not (a SHA-256 of the whole file: about 0.2 s for SmolLM2's Q8_0 here).  None without quants.
        A file that cannot be read is left for the swap to report."""
        files = [p for p, _ in self.paths.values()]
        if len(files) < 2:
            return None

        def run() -> None:
            for path in files:
                try:
                    self.file_hash(path)
                except OSError:
                    pass

        thread = threading.Thread(target=run, name="quant-hash", daemon=True)
        thread.start()
        return thread

    def remember_hash(self, path: Path, digest: str) -> None:
        """``digest`` is the SHA-256 of ``path`` as it is now (the load at start hashed it): a swap back to
        it does not hash it again."""
        path = Path(path).resolve()
        st = path.stat()
        self._hashes[(path, st.st_mtime_ns, st.st_size)] = digest

    def info(self) -> dict[str, Any]:
        """INFO's keys: ``quants`` (the keys) and ``quant`` (the active key, or None)."""
        return {"quants": self.keys, "quant": self.active}


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

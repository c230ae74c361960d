"""Whether two GGUF files are quantizations of one model: the same tensors (names and shapes), the same
hyperparameters (every ``{architecture}.*`` key) and the same tokenizer (every ``tokenizer.*`` key); only the
tensors' types and the file's description (``general.*``: name, file type, ...; ``quantize.*``: how it was
quantized) may differ, which is what llama.cpp's quantizer changes.  Two such files have the same KV
identity (:mod:`hydra_trio.engine.kv.kv_identity`) for the same KV cache types, and a node swaps one for
the other with SWAP_QUANT keeping its slots' KV caches.

A model made from another (the test MoE made from SmolLM2: the same attention, so the same KV identity, but
other feed-forward tensors) is another model: its layout differs.

The header is walked here rather than with ``gguf.GGUFReader``, which decodes every token of the vocabulary
into its own array (two seconds for SmolLM2's 49,152 tokens; this walk hashes their bytes as they lie).
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from pathlib import Path

_SKIPPED = (b"general.", b"quantize.", b"split.")
"""Keys that describe the file rather than the model (llama.cpp's quantizer rewrites ``general.file_type`` and
``general.quantization_version`` and adds ``quantize.*``); ``general.architecture`` is hashed apart."""

_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Bytes of each fixed-size GGUF value type (``gguf_type`` of ``ggml/include/gguf.h``); 8 is a string
(u64 length, bytes), 9 an array (u32 type, u64 count, items)."""

_known: dict[tuple[Path, int, int], str] = {}


class _Walk:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.at = 0

    def u32(self) -> int:
        (v,) = struct.unpack_from("<I", self.data, self.at)
        self.at += 4
        return int(v)

    def u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self.data, self.at)
        self.at += 8
        return int(v)

    def string(self) -> bytes:
        n = self.u64()
        self.at += n
        if self.at > len(self.data):
            raise ValueError("a string runs past the end of the file")
        return bytes(self.data[self.at - n : self.at])

    def skip_value(self, vtype: int) -> None:
        if vtype in _FIXED:
            self.at += _FIXED[vtype]
        elif vtype == 8:
            n = self.u64()  # read before ``self.at`` is (``self.at += self.u64()`` would add to the old value)
            self.at += n
        elif vtype == 9:
            item, count = self.u32(), self.u64()
            if item in _FIXED:
                self.at += _FIXED[item] * count
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")
        if self.at > len(self.data):
            raise ValueError("a value runs past the end of the file")


def weights_layout(path: Path) -> str:
    """SHA-256 (hex) of what every quantization of the model in ``path`` shares (the module docstring):
    ``general.architecture``; every other key but the file's description, with its type and value bytes;
    every tensor's name and shape.  Read from the file's header (memory-mapped, no tensor data); cached by
    the file's path, size and modification time.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is no GGUF file (version 2 or 3), or its header is cut short.
    """
    path = Path(path).resolve()
    st = path.stat()
    key = (path, st.st_mtime_ns, st.st_size)
    if key in _known:
        return _known[key]
    h = hashlib.sha256()
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is no GGUF file")
        w = _Walk(data)
        w.at = 4
        if w.u32() not in (2, 3):
            raise ValueError(f"{path}: GGUF version other than 2 or 3")
        n_tensors, n_kv = w.u64(), w.u64()
        keys: list[tuple[bytes, int, int, int]] = []  # name, type, start, end: in name order (files differ)
        tensors: list[tuple[bytes, list[int]]] = []
        try:
            for _ in range(n_kv):
                name = w.string()
                vtype = w.u32()
                start = w.at
                w.skip_value(vtype)
                if name == b"general.architecture" or not name.startswith(_SKIPPED):
                    keys.append((name, vtype, start, w.at))
            for _ in range(n_tensors):
                name = w.string()
                dims = [w.u64() for _ in range(w.u32())]
                w.at += 12  # its type (u32) and offset (u64) are the file's, not the model's
                tensors.append((name, dims))
        except struct.error as exc:
            raise ValueError(f"{path}: the GGUF header is cut short") from exc
        for name, vtype, start, end in sorted(keys):
            h.update(b"%s\0%d\0%d\0" % (name, vtype, end - start) + data[start:end])
        for name, dims in sorted(tensors):
            h.update(b"tensor\0%s\0%s\0" % (name, repr(dims).encode()))
    _known[key] = digest = h.hexdigest()
    return digest

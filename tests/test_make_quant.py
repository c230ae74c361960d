"""models/quant.make_quant on a warm cache too: llama.cpp's quantizer run on the small generated hybrid
(seconds), not only when the packaged model's Q8_0 file is first made."""

from __future__ import annotations

from pathlib import Path

import gguf
import llama_cpp
import pytest

from hydra_trio.models.quant import ensure_quant, make_quant, quant_path


def tensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    return {t.name: (t.tensor_type.name, [int(n) for n in t.shape]) for t in gguf.GGUFReader(str(path)).tensors}


def test_make_quant_writes_a_loadable_q8_0_file_with_the_same_tensors(hybrid_model: Path, tmp_path: Path) -> None:
    dst = tmp_path / "sub" / "hybrid-q8_0.gguf"  # a folder that does not exist yet
    assert make_quant(hybrid_model, dst, "Q8_0", threads=1) == dst
    assert sorted(p.name for p in dst.parent.iterdir()) == [dst.name]  # no temporary file left behind
    before, after = tensors(hybrid_model), tensors(dst)
    assert after.keys() == before.keys()
    assert all(after[name][1] == shape for name, (_, shape) in before.items())  # same shapes
    # the 2-D weights whose rows Q8_0 can hold (a multiple of 32 values) are Q8_0 now; norms stay F32
    assert after["blk.0.ffn_gate.weight"][0] == "Q8_0" and before["blk.0.ffn_gate.weight"][0] == "F32"
    assert after["token_embd_norm.weight"][0] == "F32"
    assert dst.stat().st_size < hybrid_model.stat().st_size
    reader = gguf.GGUFReader(str(dst))
    assert reader.fields["general.architecture"].contents() == "lfm2"
    assert reader.fields["general.file_type"].contents() == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    # llama.cpp loads it, with the source's vocabulary
    model = llama_cpp.Llama(str(dst), n_ctx=64, verbose=False)
    try:
        assert model.n_vocab() == 49152
        assert model.tokenize(b"Hello world") == llama_cpp.Llama(
            str(hybrid_model), n_ctx=64, verbose=False, vocab_only=True
        ).tokenize(b"Hello world")
    finally:
        model.close()


def test_make_quant_refuses_an_unknown_type_and_a_file_that_is_no_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown quantization 'Q3_X'"):
        make_quant(tmp_path / "x.gguf", tmp_path / "y.gguf", "Q3_X")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 64)
    dst = tmp_path / "out" / "junk-q8_0.gguf"
    with pytest.raises(RuntimeError, match="failed with code"):
        make_quant(junk, dst, "Q8_0", threads=1)
    assert list(dst.parent.iterdir()) == []  # neither the file nor its temporary


def test_ensure_quant_makes_the_file_once_in_the_cache(
    hybrid_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    dst = quant_path("hybrid", "F16")
    assert dst == tmp_path / "hydra-trio" / "models" / "hybrid-f16.gguf"
    assert ensure_quant(hybrid_model, "hybrid", "F16") == dst
    made = dst.stat().st_mtime_ns
    assert tensors(dst)["blk.0.ffn_gate.weight"][0] == "F16"
    assert ensure_quant(hybrid_model, "hybrid", "F16") == dst
    assert dst.stat().st_mtime_ns == made  # the cached file, not made again

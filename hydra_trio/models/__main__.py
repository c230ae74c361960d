"""``python -m hydra_trio.models NAME OUT_DIR``: write a generated model's files into a folder.

``tiny-vision`` (:mod:`hydra_trio.models.tiny_vision`) and ``tiny-audio`` (:mod:`hydra_trio.models.tiny_audio`)
are two files each, the language model and its projector, for ``-m MODEL --mmproj MMPROJ``; they are written with
the names they have in the cache and the same bytes (a fixed seed), and their paths printed one a line.  Exit status
2 on a wrong command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

NAMES = ("tiny-vision", "tiny-audio")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in NAMES:
        print(f"usage: python -m hydra_trio.models {{{','.join(NAMES)}}} OUT_DIR", file=sys.stderr)
        return 2
    from . import tiny_audio, tiny_vision
    from .presets import smollm2_path

    out = Path(argv[1])
    if argv[0] == "tiny-vision":
        model, mmproj = (out / p.name for p in tiny_vision.default_paths())
        tiny_vision.make_tiny_vision(smollm2_path(), model, mmproj)
    else:
        model, mmproj = (out / p.name for p in tiny_audio.default_paths())
        tiny_audio.make_tiny_audio(smollm2_path(), model, mmproj)
    print(model)
    print(mmproj)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``python -m hydra_trio.models tiny-vision OUT_DIR``: write a generated model's files into a folder.

``tiny-vision`` (:mod:`hydra_trio.models.tiny_vision`) is two files, the language model and its projector, for
``-m MODEL --mmproj MMPROJ``; they are written with the names they have in the cache and the same bytes (a fixed
seed), and their paths printed one a line.  Exit status 2 on a wrong command line.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "tiny-vision":
        print("usage: python -m hydra_trio.models tiny-vision OUT_DIR", file=sys.stderr)
        return 2
    from .presets import smollm2_path
    from .tiny_vision import default_paths, make_tiny_vision

    out = Path(argv[1])
    model, mmproj = (out / p.name for p in default_paths())
    make_tiny_vision(smollm2_path(), model, mmproj)
    print(model)
    print(mmproj)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

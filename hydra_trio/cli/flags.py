"""Every flag of ``hydra-trio run`` in one list, in llama-server's argument groups (see :mod:`._flags`)."""

from __future__ import annotations

from . import access, common, own, sampling, server, speculative
from ._flags import KINDS, Flag, check_unique

RUN_FLAGS: list[Flag] = [
    *common.FLAGS,
    *sampling.FLAGS,
    *server.FLAGS,
    *speculative.FLAGS,
    *own.FLAGS,
    *speculative.OWN_FLAGS,
    *access.FLAGS,
]
"""Every flag of ``hydra-trio run``, llama-server's and the node's own (the flag table of docs/cli.md)."""
check_unique(RUN_FLAGS)
assert all(f.kind in KINDS for f in RUN_FLAGS)

GROUPS = {
    "common": "common params (llama-server's)",
    "sampling": "sampling params: the defaults of every request that does not set them (llama-server's)",
    "server": "server params (llama-server's)",
    "speculative": "speculative decoding (llama-server's)",
    "hydra": "hydra-trio's own params and those of the cluster's llama-server fork",
}

"""Why a speculative decoding type of llama-server is not served: the texts to refuse it with at parse time.

llama-server's ``draft-eagle3``, ``draft-dflash`` and ``draft-dspark`` (``common/speculative.cpp`` of the
llama.cpp that llama-cpp-python 0.3.36 vendors) feed a draft model the target's hidden states at the
input of the layers the draft names: the target context turns on their extraction with
``llama_set_embeddings_layer_inp``, reads them with ``llama_get_embeddings_layer_inp``, and the layers come
from ``llama_model_target_layer_ids`` / ``llama_model_target_layer_ids_n`` of the draft model (DFlash 2
also reads ``llama_model_dflash_selector_top_k``).  Those are llama.cpp's staging API (``src/llama-ext.h``):
llama-cpp-python 0.3.36 binds only its NextN calls (``llama_cpp.llama_cpp_ext``: what ``draft-mtp`` uses),
not these, so none of the three can be built on the bindings.  ``draft-mtp`` and ``draft-simple`` need
nothing beyond them (:mod:`.mtp`, :mod:`.draft_model`).
"""

from __future__ import annotations

_LAYER_INPUTS = (
    "llama-cpp-python 0.3.36 does not bind llama.cpp's layer-input extraction "
    "(llama_set_embeddings_layer_inp, llama_get_embeddings_layer_inp) nor "
    "llama_model_target_layer_ids, which feed the draft the target's hidden states"
)

DRAFT_EAGLE3 = f"--spec-type draft-eagle3 is not supported: {_LAYER_INPUTS} (EAGLE-3 reads three target layers)"
DRAFT_DFLASH = (
    f"--spec-type draft-dflash is not supported: {_LAYER_INPUTS} (DFlash's block draft is conditioned on them)"
)
DRAFT_DSPARK = (
    f"--spec-type draft-dspark is not supported: {_LAYER_INPUTS} (DSpark is DFlash's block draft with a Markov head)"
)

UNSUPPORTED: dict[str, str] = {
    "draft-eagle3": DRAFT_EAGLE3,
    "draft-dflash": DRAFT_DFLASH,
    "draft-dspark": DRAFT_DSPARK,
}
"""``--spec-type`` names refused at parse time, with the reason to give."""

"""The node's drafters for its model: what ``--spec-type`` asks for, built beside the target model.

As llama-server's ``common_speculative_init`` does when a server context starts (``common/speculative.cpp``
and ``tools/server/server-context.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors): the
model-free types from their settings, ``draft-mtp`` on an MTP context of the target's own model,
``draft-simple`` on ``--model-draft`` with its own context.  Engine thread only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import llama_cpp

from ...errors import ModelLoadError
from ..settings import LlamaOptions
from .settings import SpecSettings

if TYPE_CHECKING:  # the drafters load numpy: only a node that speculates imports them (build_speculative)
    from .budget import DraftBudget
    from .combine import Speculative

log = logging.getLogger("hydra_trio.engine")

RS_SEQ_MAX = 16
"""The most recurrent-state copies a slot keeps for the model-free types on a recurrent or hybrid model
(each is a copy of the slot's recurrent state): their drafts are cut to this many tokens there."""


def target_options(settings: SpecSettings, options: LlamaOptions) -> LlamaOptions:
    """The target model's options for ``settings``: ``draft-mtp`` loads the MTP layers, and a recurrent or
    hybrid model keeps per-token copies of its recurrent state so a rejected draft can be removed
    (``n_rs_seq``: ``--spec-draft-n-max`` for ``draft-mtp``, as llama-server's ``need_n_rs_seq``; the other
    types, which llama-server rolls back with checkpoints, up to :data:`RS_SEQ_MAX`)."""
    enabled = settings.enabled
    if not enabled:
        return options
    mtp = "draft-mtp" in enabled
    n_rs = settings.draft_n_max if mtp else min(settings.n_max(), RS_SEQ_MAX)
    return attrs.evolve(options, load_mtp=options.load_mtp or mtp, n_rs_seq=max(options.n_rs_seq, n_rs))


def draft_options(settings: SpecSettings, options: LlamaOptions) -> LlamaOptions:
    """``--model-draft``'s options: the target's, with the draft's KV cache types (``-ctkd``/``-ctvd``) and
    without the target's tensor overrides, MTP, recurrent-state copies or projector."""
    return attrs.evolve(
        options,
        cache_type_k=settings.draft_cache_type_k,
        cache_type_v=settings.draft_cache_type_v,
        tensor_overrides=(),
        load_mtp=False,
        n_rs_seq=0,
        mmproj="",
    )


def _local_gpu() -> bool:
    """This machine has a GPU (or integrated GPU) device for layers (``llama_supports_gpu_offload`` is also
    true for a build with ggml-RPC alone, which offloads nothing by itself)."""
    from ..llama import ggml_backend as g

    kinds = (g.GGML_BACKEND_DEVICE_TYPE_GPU, g.GGML_BACKEND_DEVICE_TYPE_IGPU)
    return any(g.device_type(d) in kinds for d in g.all_devices() if not g.is_rpc_device(d))


def draft_budget(settings: SpecSettings, options: LlamaOptions, flash_attn: str = "on") -> DraftBudget | None:
    """The node's :class:`~.budget.DraftBudget` (``--spec-budget-row-cost``; ``auto``: the CPU's ratio, growing
    with the slot's context, when the model's ``options`` offload no layer to a GPU; ``flash_attn``: whether
    the target's context runs with flash attention, ``on`` or ``off``, as
    :attr:`~hydra_trio.engine.llama.model.LoadedModel.flash_attn` says), None when every draft is verified
    whole (a ratio of 0)."""
    from .budget import CPU_NO_FA, CPU_ROW_COST, CPU_ROW_COST_PER_KTOKEN, DraftBudget

    if settings.budget_row_cost >= 0:
        return DraftBudget(settings.budget_row_cost) if settings.budget_row_cost > 0 else None
    if _local_gpu() and options.n_gpu_layers not in (0, "0"):
        return None
    if flash_attn == "off":
        return DraftBudget(*CPU_NO_FA)
    return DraftBudget(CPU_ROW_COST, CPU_ROW_COST_PER_KTOKEN)


def build_speculative(settings: SpecSettings, model: object, n_parallel: int) -> tuple[Speculative | None, int]:
    """The drafters for ``model`` (a :class:`~hydra_trio.engine.llama.model.LoadedModel`, built with
    :func:`target_options`) and the most tokens one draft may hold on it (a recurrent or hybrid model:
    its ``n_rs_seq``).  ``(None, 0)`` when no type is enabled, and when one cannot be set up
    (``draft-mtp`` without MTP layers, ``draft-simple`` without a draft model or with one whose vocabulary
    differs, a draft file that does not load, a recurrent model without recurrent-state copies): as llama-server, the
    node then logs ``failed to initialize speculative decoding context`` with the reason and serves
    without speculative decoding.
    """
    from ..llama.model import LoadedModel

    assert isinstance(model, LoadedModel)
    if not settings.enabled:
        return None, 0
    from .combine import make_speculative  # the drafters load numpy: only a node that speculates
    from .drafting import DraftParams

    params = DraftParams(n_max=settings.draft_n_max, n_min=settings.draft_n_min, p_min=settings.draft_p_min)

    def mtp(s: SpecSettings, n: int):  # a factory of make_speculative
        from .mtp import DraftMtp, create_mtp_context

        return DraftMtp(model.ctx, create_mtp_context(model.model, model.ctx, model.options), n, params)

    def simple(s: SpecSettings, n: int):
        from .draft_model import DraftSimple, load_draft_model

        if not s.draft_model:
            raise ValueError("draft-simple requires a draft context (--model-draft)")
        draft = load_draft_model(Path(s.draft_model), model, draft_options(s, model.options), n_threads=s.draft_threads)
        return DraftSimple(model.model, draft, n, params)

    cap = 1 << 30
    try:
        if llama_cpp.llama_model_is_recurrent(model.model) or llama_cpp.llama_model_is_hybrid(model.model):
            cap = int(llama_cpp.llama_n_rs_seq(model.ctx))
            if cap < 1:
                raise ValueError(
                    "a recurrent or hybrid model needs recurrent-state copies (n_rs_seq), which "
                    "this context has none of"
                )
        spec = make_speculative(settings, n_parallel, {"draft-mtp": mtp, "draft-simple": simple})
    except (ValueError, RuntimeError, OSError, ModelLoadError) as exc:
        log.error(
            "failed to initialize speculative decoding context (%s): %s; serving without speculative decoding",
            ",".join(settings.enabled),
            exc,
        )
        return None, 0
    if spec is not None:
        spec.budget = draft_budget(settings, model.options, model.flash_attn)
        log.info(
            "speculative decoding: %s, at most %d tokens a draft%s",
            spec.name,
            spec.n_max,
            f" (recurrent memory: {cap})" if cap < spec.n_max else "",
        )
    return spec, cap

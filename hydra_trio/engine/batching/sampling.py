"""llama.cpp sampler chains and token probabilities (engine thread only).

A request's sampler is one ``llama_sampler`` chain built as llama-server
builds it (``common/sampling.cpp``, ``common_sampler_init``): logit bias,
grammar, then the ``samplers`` list in the request's order (a name may
repeat; a name left out is not run; ``adaptive_p`` replaces ``dist`` at the
end), by default

* Mirostat off: repetition penalties, DRY, top-n-sigma, top-k, typical,
  top-p, min-p, XTC, temperature (dynamic with ``dynatemp_range > 0``) and a
  seeded ``dist``;
* ``mirostat`` 1 or 2: temperature and Mirostat (1.0 or 2.0) only, as in
  llama-server, where Mirostat replaces the whole list (penalties and DRY
  included); greedy with ``temperature <= 0``;
* ``temperature <= 0`` without Mirostat: the same list up to XTC, then
  greedy (argmax) instead of temperature and ``dist``; top-n-sigma, top-k,
  top-p and min-p are left out, as they never drop the most likely token.
  llama-server runs the whole list with a zero temperature, which keeps
  only the most likely token left: the same choice.

Penalties, DRY, top-n-sigma, typical, XTC and dynamic temperature at their
neutral values are left out of the chain (llama.cpp would run them as no-ops).
Every value reaching llama.cpp here has been checked against the bounds of
:mod:`hydra_trio.engine.settings`.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import attrs
import llama_cpp

from ...errors import InvalidRequest
from ..settings import SAMPLER_ORDER, SamplingParams
from .gbnf_depth import depths

MAX_GRAMMAR_BYTES = 256 * 1024
MAX_GRAMMAR_DEPTH = 128
MAX_GRAMMAR_REPETITION = 2000
"""Largest ``{m,n}`` count: llama.cpp's parser (``MAX_REPETITION_THRESHOLD``) refuses a larger minimum and
silently makes a larger maximum unbounded, so both are refused here."""
MAX_GRAMMAR_STACK_DEPTH = 1024
"""Longest chain of references llama.cpp's grammar engine stacks up (:func:`.gbnf_depth.stack_depth`): its
time and memory grow with the square of it (10,000: 2.5 s and 630 MiB before the first token); the
node's JSON schemas at their own depth limit need 130."""
MAX_GRAMMAR_REF_CHAIN = 8192
"""Longest chain of rule references (:func:`.gbnf_depth.depths`): llama.cpp's check for left recursion
follows one with a C call per link, about 140 bytes of the thread's stack each (18,000 overflowed 2 MiB);
the node's JSON schemas make chains of about 2,100 at most (2,000 optional properties)."""
MAX_GRAMMAR_EXPANSION = 500_000
"""Most grammar elements llama.cpp's parser may create expanding ``{m,n}``, ``*``, ``+`` and ``?``
(estimated as count x the repeated item's text length, summed over the grammar)."""


class GrammarError(InvalidRequest, ValueError):
    """A grammar llama.cpp cannot use (it fails to parse, or is too large or too deep to parse safely)."""


@attrs.frozen
class SamplerSpec:
    """Everything a request asks of its sampler.

    Attributes:
        params: the numeric sampler settings.
        logit_bias: ``(token id, bias)`` pairs added to the logits (OpenAI's ``logit_bias``).
        banned: tokens that may never be sampled (llama-server's ``ignore_eos`` bans end-of-generation).
        grammar: GBNF text constraining the output (llama.cpp's grammar sampler), root rule ``root``.
        order: the chain's stages in this order, llama-server's canonical names (``samplers``; a
            name may repeat, one left out is not run); None: :data:`~hydra_trio.engine.settings.SAMPLER_ORDER`.
        adaptive_target, adaptive_decay: the ``adaptive_p`` sampler's settings; it replaces ``dist``
            at the end of the chain when ``order`` names it (llama-server's rule).
        lazy_triggers: None for a grammar that applies from the first token; else the grammar
            waits for one of these ECMAScript regexes to match the generated text and applies from
            the match (or its first non-empty group) on (``llama_sampler_init_grammar_lazy_patterns``).
    """

    params: SamplingParams = SamplingParams()
    logit_bias: tuple[tuple[int, float], ...] = ()
    banned: tuple[int, ...] = ()
    grammar: str | None = None
    order: tuple[str, ...] | None = None
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    lazy_triggers: tuple[str, ...] | None = None


def check_grammar(vocab: Any, grammar: str) -> None:
    """Check that llama.cpp accepts ``grammar`` (any thread: it only reads the vocabulary).

    llama.cpp's GBNF parser recurses once per nesting level, and copies the
    repeated item once per ``{m,n}`` count, so text larger than 256 KiB,
    nested deeper than 128 groups, with a count over 2000 or expanding to more
    than 500,000 elements is refused before it is parsed (one linear scan);
    so is a grammar whose stacks would grow deeper than :data:`MAX_GRAMMAR_STACK_DEPTH`, or
    with a chain of references longer than :data:`MAX_GRAMMAR_REF_CHAIN`.

    Raises:
        GrammarError: too large, too deep, or llama.cpp's parser refused it.
    """
    data = grammar.encode("utf-8")
    if len(data) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the grammar is {len(data)} bytes; the limit is {MAX_GRAMMAR_BYTES} (MAX_GRAMMAR_BYTES)")
    depth, expansion = _scan(grammar)
    if depth > MAX_GRAMMAR_DEPTH:
        raise GrammarError(f"the grammar nests groups deeper than {MAX_GRAMMAR_DEPTH} levels (MAX_GRAMMAR_DEPTH)")
    if expansion > MAX_GRAMMAR_EXPANSION:
        raise GrammarError(
            f"the grammar's repetitions expand to about {expansion} elements; the limit is "
            f"{MAX_GRAMMAR_EXPANSION} (MAX_GRAMMAR_EXPANSION)"
        )
    nesting, chain = depths(grammar)
    if nesting > MAX_GRAMMAR_STACK_DEPTH:
        raise GrammarError(
            f"the grammar's rules nest {nesting} deep (a chain of references each followed by more "
            f"of its alternative); the limit is {MAX_GRAMMAR_STACK_DEPTH} (MAX_GRAMMAR_STACK_DEPTH)"
        )
    if chain > MAX_GRAMMAR_REF_CHAIN:
        raise GrammarError(
            f"the grammar has a chain of {chain} rule references; the limit is {MAX_GRAMMAR_REF_CHAIN} "
            "(MAX_GRAMMAR_REF_CHAIN)"
        )
    smpl = llama_cpp.llama_sampler_init_grammar(vocab, data, b"root")
    if not smpl:
        raise GrammarError("llama.cpp could not parse the grammar (GBNF, with a 'root' rule)")
    llama_cpp.llama_sampler_free(smpl)


def _scan(grammar: str) -> tuple[int, int]:
    """``(deepest nesting of ( ) groups, estimated elements the repetitions expand to)``, outside string
    literals, character classes and comments.  Raises GrammarError for a ``{m,n}`` count over
    :data:`MAX_GRAMMAR_REPETITION`."""
    depth = deepest = expansion = 0
    last = 1  # text length of the item a quantifier repeats (a rule name or a group: one reference)
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c in '"[':
            start = i
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and grammar[i] != close:
                i += 2 if grammar[i] == "\\" else 1
            last = i - start + 1
        elif c == "#":
            while i < n and grammar[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
            last = 1
        elif c in "*+?":
            expansion += 2 * last
        elif c == "{":
            end = grammar.find("}", i)
            if end < 0:
                break  # llama.cpp's parser says what is wrong
            counts = [p.strip() for p in grammar[i + 1 : end].split(",")]
            for p in counts:
                if p.isdigit() and (len(p) > 9 or int(p) > MAX_GRAMMAR_REPETITION):
                    raise GrammarError(
                        f"the repetition {{{grammar[i + 1 : end][:40]}}} is over the limit of "
                        f"{MAX_GRAMMAR_REPETITION} (MAX_GRAMMAR_REPETITION)"
                    )
            expansion += max([int(p) for p in counts if p.isdigit()] + [1]) * last
            i = end
        elif c.isalnum() or c in "-_.":
            last = 1
        i += 1
    return deepest, expansion


def build_sampler(spec: SamplerSpec, vocab: Any, n_vocab: int, n_ctx_slot: int, prompt: Sequence[int]) -> Any:
    """A llama.cpp sampler chain for one request (free it with ``llama_sampler_free``).

    The order and what each setting does: this module's docstring.
    ``temperature <= 0`` gives greedy sampling (argmax), as in llama-server.
    The penalty and DRY windows are at most ``n_ctx_slot`` tokens and look
    back over the prompt too (as llama-server); ``top_k`` is at most ``n_vocab``.

    Raises:
        GrammarError: the grammar failed to parse (callers check it first
            with :func:`check_grammar`).
    """
    p = spec.params
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = llama_cpp.llama_sampler_chain_add
    bias = [(t, -math.inf) for t in spec.banned] + list(spec.logit_bias)
    if bias:
        arr = (llama_cpp.llama_logit_bias * len(bias))(*(llama_cpp.llama_logit_bias(token=t, bias=b) for t, b in bias))
        add(chain, llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(bias), arr))
    if spec.grammar:
        if spec.lazy_triggers is not None:
            patterns = [p.encode("utf-8") for p in spec.lazy_triggers]
            triggers = (ctypes.c_char_p * max(1, len(patterns)))(*patterns)
            grammar = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
                vocab, spec.grammar.encode("utf-8"), b"root", triggers, len(patterns), None, 0
            )
        else:
            grammar = llama_cpp.llama_sampler_init_grammar(vocab, spec.grammar.encode("utf-8"), b"root")
        if not grammar:
            llama_cpp.llama_sampler_free(chain)
            raise GrammarError("llama.cpp could not parse the grammar")
        add(chain, grammar)
    if p.mirostat:  # llama-server: temperature and Mirostat replace the whole list, penalties and DRY included
        if p.temperature <= 0:
            add(chain, llama_cpp.llama_sampler_init_greedy())
        elif p.mirostat == 1:
            add(chain, llama_cpp.llama_sampler_init_temp(p.temperature))
            add(
                chain, llama_cpp.llama_sampler_init_mirostat(n_vocab, p.seed_u32(), p.mirostat_tau, p.mirostat_eta, 100)
            )
        else:
            add(chain, llama_cpp.llama_sampler_init_temp(p.temperature))
            add(chain, llama_cpp.llama_sampler_init_mirostat_v2(p.seed_u32(), p.mirostat_tau, p.mirostat_eta))
        return chain
    greedy = p.temperature <= 0
    use_adaptive = False
    for name in spec.order if spec.order is not None else SAMPLER_ORDER:
        if name == "adaptive_p":
            use_adaptive = True  # llama-server: it picks the token, so it goes last, in place of dist
            continue
        smpl = _stage(name, spec, vocab, n_vocab, n_ctx_slot, prompt, greedy)
        if smpl is not None:
            add(chain, smpl)
    if greedy:
        add(chain, llama_cpp.llama_sampler_init_greedy())
    elif use_adaptive:
        add(chain, llama_cpp.llama_sampler_init_adaptive_p(spec.adaptive_target, spec.adaptive_decay, p.seed_u32()))
    else:
        add(chain, llama_cpp.llama_sampler_init_dist(p.seed_u32()))
    return chain


def sample_next(chain: Any, ctx: Any, idx: int, n_vocab: int, *, constrained: bool) -> int:
    """The token ``chain`` picks from the logits at batch row ``idx``, accepted into the chain (penalties,
    DRY and the grammar see it): llama.cpp's ``llama_sampler_sample``.

    With a grammar (``constrained``) the pick is checked before it is accepted.  Settings that llama-server
    accepts can drive logits to infinity and the chain's arithmetic to NaN (a negative ``typical_p``, a huge
    negative ``frequency_penalty`` or ``dry_multiplier``, a vanishing ``temperature`` or ``repeat_penalty``);
    llama.cpp's ``dist`` then takes the last candidate, which may be a token the grammar refused, and
    accepting it throws inside llama.cpp and aborts the process.  Such a pick is replaced by the most likely
    token the grammar allows (the largest raw logit among them).  numpy is imported by the first request
    with a grammar.
    """
    if not constrained:
        return int(llama_cpp.llama_sampler_sample(chain, ctx, idx))
    import numpy as np

    logits = np.ctypeslib.as_array(
        ctypes.cast(llama_cpp.llama_get_logits_ith(ctx, idx), ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)
    )
    cur = _candidates(logits)
    arr = llama_cpp.llama_token_data_array(
        data=cur.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=n_vocab, selected=-1, sorted=False
    )
    llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
    token = int(cur["id"][arr.selected]) if 0 <= arr.selected < arr.size else -1
    if token < 0 or not grammar_allows(chain, token):
        token = _best_allowed(chain, logits)
    llama_cpp.llama_sampler_accept(chain, token)
    return token


def _candidates(logits: Any) -> Any:
    """llama.cpp's ``llama_token_data`` array (``id``, ``logit``, ``p``) of every token, as a numpy array."""
    import numpy as np

    cur = np.empty(len(logits), dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    cur["id"] = np.arange(len(logits), dtype=np.int32)
    cur["logit"] = logits
    cur["p"] = 0.0
    return cur


def _best_allowed(chain: Any, logits: Any) -> int:
    """The token with the largest raw logit among those the chain's grammar allows next."""
    import numpy as np

    cur = _candidates(logits)
    for i in range(llama_cpp.llama_sampler_chain_n(chain)):
        smpl = llama_cpp.llama_sampler_chain_get(chain, i)
        if llama_cpp.llama_sampler_name(smpl) == b"grammar":
            arr = llama_cpp.llama_token_data_array(
                data=cur.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
                size=len(cur),
                selected=-1,
                sorted=False,
            )
            llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
            break
    allowed = np.where(np.isfinite(cur["logit"]), cur["logit"], -np.inf)
    return int(cur["id"][int(np.argmax(allowed))])


def grammar_allows(chain: Any, token: int) -> bool:
    """Whether the chain's grammar sampler (if it has one; a lazy one not yet triggered allows all) lets
    ``token`` come next: llama.cpp's grammar ``apply`` on that one candidate.  Accepting a token the
    grammar refuses would abort the process (llama.cpp throws), so a forced token is checked first."""
    for i in range(llama_cpp.llama_sampler_chain_n(chain)):
        smpl = llama_cpp.llama_sampler_chain_get(chain, i)
        if llama_cpp.llama_sampler_name(smpl) == b"grammar":
            data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(id=token, logit=0.0, p=0.0))
            arr = llama_cpp.llama_token_data_array(data=data, size=1, selected=-1, sorted=False)
            llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
            return data[0].logit != -math.inf
    return True


def _stage(
    name: str, spec: SamplerSpec, vocab: Any, n_vocab: int, n_ctx_slot: int, prompt: Sequence[int], greedy: bool
) -> Any:
    """One stage of the chain by llama-server's sampler name, or None where it would be a no-op
    (a neutral value; with greedy sampling, the stages that never drop the most likely token and
    the temperature)."""
    p = spec.params
    if name == "penalties":
        window = p.penalty_window(n_ctx_slot)
        if window <= 0 or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
            return None
        penalties = llama_cpp.llama_sampler_init_penalties(
            n_vocab, window, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
        )
        # the penalties remember the prompt; the grammar must not see it, so only this sampler does
        for tok in prompt[-window:]:
            llama_cpp.llama_sampler_accept(penalties, tok)
        return penalties
    if name == "dry":
        dry_window = p.dry_window(n_ctx_slot)
        return _dry(p, vocab, dry_window, prompt) if p.dry_enabled and dry_window > 0 else None
    if name == "top_n_sigma":
        return llama_cpp.llama_sampler_init_top_n_sigma(p.top_n_sigma) if not greedy and p.top_n_sigma > 0 else None
    if name == "top_k":
        return llama_cpp.llama_sampler_init_top_k(min(p.top_k, n_vocab)) if not greedy and p.top_k > 0 else None
    if name == "typ_p":
        return llama_cpp.llama_sampler_init_typical(p.typical_p, p.min_keep) if p.typical_p < 1.0 else None
    if name == "top_p":
        return None if greedy else llama_cpp.llama_sampler_init_top_p(p.top_p, p.min_keep)
    if name == "min_p":
        return None if greedy else llama_cpp.llama_sampler_init_min_p(p.min_p, p.min_keep)
    if name == "xtc":
        if p.xtc_probability > 0 and p.xtc_threshold <= 0.5:
            return llama_cpp.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, p.min_keep, p.seed_u32())
        return None
    if name == "temperature":
        if greedy:
            return None
        if p.dynatemp_range > 0:
            return llama_cpp.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent)
        return llama_cpp.llama_sampler_init_temp(p.temperature)
    if name == "infill":
        return llama_cpp.llama_sampler_init_infill(vocab)
    raise ValueError(f"unknown sampler {name!r}")  # names are checked when the request is parsed


def _dry(p: SamplingParams, vocab: Any, window: int, prompt: Sequence[int]) -> Any:
    """llama.cpp's DRY sampler over ``window`` tokens, having seen the prompt's last ``window`` tokens
    (llama-server feeds every prompt token to its whole chain)."""
    breakers = [b.encode("utf-8") for b in p.dry_sequence_breakers]
    arr = (ctypes.c_char_p * max(1, len(breakers)))(*breakers)
    dry = llama_cpp.llama_sampler_init_dry(
        vocab, p.dry_multiplier, p.dry_base, p.dry_allowed_length, window, arr, len(breakers)
    )
    for tok in prompt[-window:]:
        llama_cpp.llama_sampler_accept(dry, tok)
    return dry


@attrs.frozen
class TokenProbs:
    """One sampled token's log-probability and the most likely alternatives (natural log, raw logits).

    ``top``: up to N ``(token, logprob)`` pairs, most likely first.
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_probs(ctx: Any, idx: int, n_vocab: int, token: int, n_top: int) -> TokenProbs:
    """Log-softmax of the raw logits at batch row ``idx``: the sampled ``token``'s value and the top ``n_top``.

    This is the distribution before any sampler (llama-server's default,
    ``post_sampling_probs`` off).  Values are <= 0.  numpy is imported here, by the first request that asks
    for log-probabilities, not with the node (about 15 MiB of resident memory).
    """
    import numpy as np

    ptr = llama_cpp.llama_get_logits_ith(ctx, idx)
    logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
    peak = float(logits.max())
    lse = peak + float(np.log(np.exp(logits - peak).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        k = min(n_top, n_vocab)
        ids = np.argpartition(-logits, k - 1)[:k]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        top = tuple((int(t), min(0.0, float(logits[t]) - lse)) for t in ids)
    return TokenProbs(min(0.0, float(logits[token]) - lse), top)

"""One completion, as every front end runs it: prepare the engine's job and the plan of its reply, start it,
then stream or collect its reply.

* **Prepare** (:func:`prepare` with :func:`prepare_chat`, :func:`prepare_text` or :func:`prepare_continue`):
  the body's prompt rendered and tokenized, its fields checked, in a worker thread that stops with its
  request (:func:`in_worker`).  The result is the engine's :class:`~hydra_trio.engine.requests.CompletionJob` and a
  :class:`ReplyPlan`: how the reply's text is split into thinking and content and how its tool calls are read.
  The plan stays with the caller; the engine sees the job alone (llama-server likewise keeps a chat's parser
  state beside the HTTP task, not in its slot).
* **Start** (:func:`start`, or ``async with`` :func:`run`): the job goes to the engine's inbox.
* **Reply** (:func:`stream`, :func:`collect`): the engine's deltas through a reply object
  (:class:`~hydra_trio.openai.replies.CompletionReply`); the engine's request is cancelled on every way
  out, so a client that leaves frees its slot.

Every refusal is a typed error (:mod:`hydra_trio.errors`), raised to the front end's boundary.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import attrs
import trio

from ..engine import CompletionJob, Engine, JobRun, stop_when
from ..openai.reasoning import ThinkingSetup
from ..openai.replies import CompletionReply
from ..openai.schemas import ChatCompletionRequest, CompletionRequest
from ..openai.tools import ChatTools
from . import jobs

T = TypeVar("T")


@attrs.frozen
class ReplyPlan:
    """How the engine's text becomes a reply, kept by the front end: ``thinking``, the split of a chat
    reply's text into thinking and content (None: a text completion's reply is all content); ``tools``,
    how its tool calls are read (None: the request offered none)."""

    thinking: ThinkingSetup | None = None
    tools: ChatTools | None = None


@attrs.frozen
class PreparedCompletion:
    """A completion ready to start: the engine's ``job`` and the ``plan`` of its reply."""

    job: CompletionJob
    plan: ReplyPlan = ReplyPlan()

    def changed(self, **changes: Any) -> PreparedCompletion:
        """This completion with ``changes`` to its job (``request_id``, a front end's ``fail_if_busy`` ...)."""
        return attrs.evolve(self, job=attrs.evolve(self.job, **changes)) if changes else self


def prepare_chat(
    e: Engine, body: ChatCompletionRequest, *, n_predict: int | None = None, id_slot: int | None = None
) -> PreparedCompletion:
    """A chat's job (:func:`~.jobs.chat_job`: the template in effect, tokenized) and its reply's plan.
    ``n_predict`` / ``id_slot`` override the body's.  Worker thread (:func:`in_worker`).

    Raises ChatTemplateError (the template failed), MessageError (a field), PromptTooLong."""
    job, thinking, tools = jobs.chat_job(e, body, n_predict=n_predict, id_slot=id_slot)
    return PreparedCompletion(job, ReplyPlan(thinking, tools))


def prepare_text(e: Engine, body: CompletionRequest) -> PreparedCompletion:
    """A text completion's job (:func:`~.jobs.job_from_completion`); its reply is the text as generated.
    Worker thread.  Raises MessageError (a field, a token id outside the vocabulary), PromptTooLong."""
    return PreparedCompletion(jobs.job_from_completion(e, body))


def prepare_continue(e: Engine, body: CompletionRequest, *, n_predict: int, id_slot: int) -> PreparedCompletion:
    """Generation on from what slot ``id_slot`` holds (Hydra DECODE without messages,
    :func:`~.jobs.job_continue`), its text split by the body's ``reasoning_format`` (else the node's) on the
    node's template, as a chat reply's would be.  Cheap (nothing is tokenized): on the event loop."""
    m = e.model_view
    assert m is not None
    fmt = body.raw.get("reasoning_format") or e.config.reasoning_format  # checked when the payload was read
    return PreparedCompletion(
        jobs.job_continue(e, body, n_predict=n_predict, id_slot=id_slot),
        ReplyPlan(ThinkingSetup.for_prompt(fmt, m.chat_template.source, "")),
    )


def chat_prompt(e: Engine, body: ChatCompletionRequest) -> str:
    """The chat rendered by the template in effect, as a chat completion would render it (generation prompt
    included): ``POST /apply-template``.  Worker thread.  Raises ChatTemplateError."""
    return jobs.chat_prompt(e, body)[0]


async def in_worker(work: Callable[[], T], stop: threading.Event | None = None) -> T:
    """``work()`` (rendering, tokenizing: work that only reads the vocabulary) in a trio worker thread,
    never on the event loop or the engine thread.

    It stops with its request: once ``stop`` is set (an HTTP request's, set when its client leaves), or
    once the caller is cancelled (a Hydra peer that left), tokenizing in the thread raises Cancelled at its
    next chunk (:func:`~hydra_trio.engine.llama.tokenize.stop_when`, as do loops that call
    :func:`~hydra_trio.engine.llama.tokenize.raise_if_stopped`), and a cancelled caller stops waiting at once."""
    stop = stop if stop is not None else threading.Event()

    def run() -> T:
        with stop_when(stop):
            return work()

    try:
        return await trio.to_thread.run_sync(run, abandon_on_cancel=True)
    except trio.Cancelled:
        stop.set()
        raise


async def prepare(
    work: Callable[[], PreparedCompletion], *, stop: threading.Event | None = None, **changes: Any
) -> PreparedCompletion:
    """Prepare a completion in a worker thread (:func:`in_worker`, stopped by ``stop``), with ``changes`` to
    its job (``request_id``, a front end's ``fail_if_busy`` ...).  Raises what ``work`` raises."""
    return (await in_worker(work, stop)).changed(**changes)


def run(e: Engine, prepared: PreparedCompletion) -> JobRun:
    """The prepared job's run, not yet submitted: ``async with`` it (submits on entry, cancels the engine's
    request on exit), or :func:`start` it."""
    return JobRun(e, prepared.job)


def start(e: Engine, prepared: PreparedCompletion) -> JobRun:
    """Submit the prepared job to the engine's inbox; the caller closes the run (:func:`stream` and
    :func:`collect` do).  Raises the engine's refusals (NotReady, InvalidRequest)."""
    return run(e, prepared).submit()


async def collect(run: JobRun, reply: CompletionReply) -> Any:
    """The whole reply: every delta into ``reply``, then :meth:`~hydra_trio.openai.replies.CompletionReply.whole`.
    The engine's request is cancelled on every way out (a caller cancelled because its client left).
    Raises the engine's errors (EngineFailure, Stopping, ...)."""
    try:
        async for delta in run:
            reply.add(delta, run.assigned)
    finally:
        run.close()
    assert run.finished is not None
    return reply.whole(run.finished)


async def stream(run: JobRun, reply: CompletionReply) -> AsyncIterator[str]:
    """The reply's server-sent events; the deltas that arrived together (one engine step's, or more when
    the client reads slower than the engine writes) go out in one piece, as does the stream's end.  The
    engine's request is cancelled on every way out; its errors are raised (the front end puts them in the
    stream)."""
    try:
        if head := reply.stream_head():
            yield head
        async for delta in run:
            out = reply.stream_delta(delta, run.assigned)
            for more in run.ready():
                out += reply.stream_delta(more, run.assigned)
            if out:
                yield out
        assert run.finished is not None
        yield reply.stream_tail(run.finished)
    finally:
        run.close()

"""The HTTP slot routes, llama-server's and the node's:

* ``GET /slots``: one object per slot (:meth:`~hydra_trio.engine.snapshot.SlotSnapshot.info`, its
  ``params`` :func:`~hydra_trio.openai.native.task_params`); with ``?fail_on_no_slot=<anything but empty>``
  and every slot processing, 503 ``no slot available``, as llama-server answers.  ``[]`` on a node without
  a model.
* ``POST /slots/{id}?action=erase|save|restore``: llama-server's replies, erase ``{"id_slot", "n_erased"}``;
  save and restore take ``{"filename"}`` (:mod:`hydra_trio.service.slot_files`) and answer 501 without
  ``--slot-save-path`` (erase always works); 400 for another action, a bad or missing filename, or a file this
  node cannot restore; 409 while the slot processes a request; 500 when the file cannot be written.
* ``GET /slots/{id}/state/meta``: the slot's state meta (Hydra STATE_META's).
* ``GET /slots/{id}/state``: the idle slot's KV state blob (``application/octet-stream``, the bytes Hydra
  ``STATE_GET`` sends; headers ``X-Slot-Id``, ``X-N-Past``, ``X-Model-Hash``).
* ``PUT /slots/{id}/state``: restore one, all or nothing (:func:`hydra_trio.service.slots.restore`: checksum,
  model / KV identity, tokens that fit) -> ``{"restored": true, "id_slot", "bytes", "n_past",
  "model_hash_match", "kv_identity_match", ...identity}``.  A blob that cannot be applied is 400 (with
  STATE_PUT's error keys).

Every route with a slot id answers 404 for a slot the node does not have and 400 for a path that names none;
501 on a node without a model, 503 while the model loads.  Typed errors go to the boundary (:mod:`.errors`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine import BlobBuffer, Engine
from ..errors import InvalidRequest, NotSupported, Overloaded
from ..openai.native import task_params
from ..openai.schemas import SlotFileRequest
from ..service import node, slot_files, slots
from .bodies import STATE_CHUNK, RequestReader, slot_in_path

STATE_TYPE = "application/octet-stream"


class SlotRoutes:
    """The slot handlers over one engine (None: a node without a model) and a body reader."""

    def __init__(self, engine: Engine | None, reader: RequestReader) -> None:
        self.engine = engine
        self.reader = reader

    def _slot(self, request: Request) -> tuple[Engine, int]:
        """The serving engine and the path's slot, which it has."""
        e = node.serving(self.engine)
        id_slot = slot_in_path(request)
        node.check_slot(e, id_slot)
        return e, id_slot

    async def list(self, request: Request) -> Response:
        if self.engine is None:
            return JSONResponse([])
        e = node.serving(self.engine)
        n_keep, fmt, spec = e.config.n_keep, e.config.reasoning_format, ",".join(e.config.speculative.types)
        info = e.slots_info(lambda job: task_params(job, n_keep=n_keep, reasoning_format=fmt, spec_types=spec))
        if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in info):
            raise Overloaded("no slot available")
        return JSONResponse(info)

    async def state_meta(self, request: Request) -> Response:
        e, id_slot = self._slot(request)
        return JSONResponse(node.slot_meta(e, id_slot))

    async def action(self, request: Request) -> Response:
        e, id_slot = self._slot(request)
        action = request.query_params.get("action")
        if action == "erase":
            return JSONResponse({"id_slot": id_slot, "n_erased": await slots.erase(e, id_slot)})
        if action not in ("save", "restore"):
            raise InvalidRequest(f"action: {action!r} is not supported (supported: erase, save, restore)")
        directory = e.config.slot_save_path
        if directory is None:
            raise NotSupported("This server does not support slots action. Start it with `--slot-save-path`")
        body = await self.reader.read(request, SlotFileRequest)
        run = slot_files.save if action == "save" else slot_files.restore
        return JSONResponse(await run(e, id_slot, Path(directory), body.filename))

    async def get_state(self, request: Request) -> Response:
        """The blob is saved into a buffer of the transfer pool (:func:`hydra_trio.service.slots.save`) and
        streamed from it in :data:`~.bodies.STATE_CHUNK` slices (the server copies each as it frames it), with
        its ``Content-Length``; the buffer goes back to the pool when the body is sent or the client left."""
        e, id_slot = self._slot(request)
        n_past, blob = await slots.save(e, id_slot)
        return StreamingResponse(
            _slices(blob),
            media_type=STATE_TYPE,
            headers={
                "Content-Length": str(len(blob)),
                "X-Slot-Id": str(id_slot),
                "X-N-Past": str(n_past),
                "X-Model-Hash": node.identity(e)["model_hash"],
            },
        )

    async def put_state(self, request: Request) -> Response:
        """The body goes into one buffer, hashed as it arrives (:meth:`~.bodies.RequestReader.read_blob`), and
        is restored as Hydra STATE_PUT restores (:func:`hydra_trio.service.slots.restore`)."""
        e, id_slot = self._slot(request)
        blob, running = await self.reader.read_blob(request)
        done = await slots.restore(e, id_slot, blob, running)
        return JSONResponse(done.as_reply("id_slot"))


async def _slices(blob: BlobBuffer) -> AsyncIterator[memoryview]:
    """The blob in :data:`~.bodies.STATE_CHUNK` slices; the buffer goes back to its pool at the end (the ASGI
    server has copied each slice before it asks for the next)."""
    try:
        view = blob.view()
        for i in range(0, len(view), STATE_CHUNK):
            yield view[i : i + STATE_CHUNK]
        del view
    finally:
        slots.release(blob)

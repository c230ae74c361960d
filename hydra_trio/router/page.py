"""The router's status page, ``GET /``: every model with its status, redrawn live from ``GET /models/sse``
(``static/router.html`` and ``static/router.js`` beside the node's page, with its stylesheet).  Plain files,
nothing fetched from elsewhere; open without an API key as the node's page is (its data is not: a key given in
the page's fragment, ``/#key=KEY``, goes to each request as ``Authorization``)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent.parent / "http" / "static"
"""The node's static files, where the router's page lives too."""

_NO_CACHE = {"Cache-Control": "no-cache"}  # a router upgraded in place serves its new page at once


async def router_page(request: Request) -> Response:
    """``GET /``: ``static/router.html``."""
    return FileResponse(STATIC_DIR / "router.html", media_type="text/html; charset=utf-8", headers=_NO_CACHE)


async def _to_the_page(request: Request) -> Response:
    """``GET /static/router.html``: 308 to ``../``, where its relative links resolve."""
    return RedirectResponse("../", status_code=308)


def page_routes() -> list[BaseRoute]:
    """``/``, ``/static/router.html`` (a redirect to ``/``) and the files under ``/static/``."""
    return [
        Route("/", router_page, methods=["GET"]),
        Route("/static/router.html", _to_the_page, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]

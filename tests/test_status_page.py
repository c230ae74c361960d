"""The status page at ``GET /``: its files over HTTP, then the page itself in a real headless Chromium.

The browser is Debian's ``chromium`` package (``.ci/run`` installs it), driven by
playwright's Python API through the driver inside the playwright wheel;
``playwright install`` is never run (nothing is downloaded).  Without chromium
the browser tests skip, or fail when ``HYDRA_TRIO_REQUIRE_BROWSER=1`` (CI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hydra_trio.http.app import STATIC_DIR

from .conftest import ServerProcess

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 120_000  # generous: the machine may be busy with other work
SCREENSHOT_COPY = os.environ.get("HYDRA_TRIO_SCREENSHOT_COPY")  # docs/status-page.png is made with this set


def _browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if shutil.which("chromium") is None:
        return "Debian's chromium is not installed (apt-get install -y chromium; .ci/run installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    return None


@pytest.fixture
def page() -> Iterator[Any]:
    """A playwright page in a fresh headless Chromium (Debian's)."""
    missing = _browser_missing()
    if missing is not None:
        if os.environ.get("HYDRA_TRIO_REQUIRE_BROWSER") == "1":
            pytest.fail(f"HYDRA_TRIO_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    from playwright.sync_api import expect, sync_playwright

    # expect()'s assertions poll for 5 s unless told otherwise: page.set_default_timeout does not reach them
    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which("chromium"), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1000, "height": 900})
            pg = context.new_page()
            pg.set_default_timeout(WAIT_MS)
            errors: list[str] = []
            pg.on("pageerror", lambda exc: errors.append(str(exc)))
            yield pg
            assert not errors, f"JavaScript errors on the page: {errors}"
        finally:
            browser.close()
            expect.set_options(timeout=None)  # back to playwright's 5 s


# ------------------------------------------------------------------ the files, over HTTP
def test_the_page_and_its_files_are_served_and_fetch_nothing_from_elsewhere(http: httpx.Client) -> None:
    r = http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'src="static/status.js"' in r.text and 'href="static/status.css"' in r.text
    assert r.text.index('src="static/page.js"') < r.text.index('src="static/status.js"')  # its helpers first
    for name, kind in [("status.js", "javascript"), ("page.js", "javascript"), ("status.css", "text/css")]:
        f = http.get(f"/static/{name}")
        assert f.status_code == 200 and kind in f.headers["content-type"]
        assert f.content == (STATIC_DIR / name).read_bytes()
    assert http.get("/static/nope.js").status_code == 404
    for path in STATIC_DIR.iterdir():  # no CDN, no web fonts: the page works with no internet
        text = path.read_text()
        assert not re.search(r"https?://|@import|url\(", text), f"{path.name} refers to something elsewhere"


def test_the_page_is_only_served_where_its_relative_links_resolve(http: httpx.Client) -> None:
    """The page links ``static/status.js`` and ``v1/events`` relative to itself (so it works behind a proxy's
    prefix); at ``/static/index.html`` they would point at ``/static/static/...``: that address redirects
    to the page's own, relatively, so a prefix is kept."""
    r = http.get("/static/index.html")
    assert r.status_code == 308 and r.headers["location"] == "../", (r.status_code, r.headers)
    followed = http.get("/static/index.html", follow_redirects=True)
    assert followed.status_code == 200 and str(followed.url).endswith(f":{followed.url.port}/")
    assert 'src="static/status.js"' in followed.text


def test_with_api_keys_the_page_is_open_and_the_event_socket_takes_the_key_as_a_query_parameter(spawn: Any) -> None:
    import trio
    from trio_websocket import ConnectionRejected, open_websocket_url

    srv: ServerProcess = spawn("-np", "1", "--api-key", "sk-page")
    srv.wait_ready()
    assert httpx.get(srv.base + "/", timeout=60).status_code == 200
    assert httpx.get(srv.base + "/static/status.js", timeout=60).status_code == 200
    assert httpx.get(srv.base + "/v1/models", timeout=60).status_code == 401

    async def first_event(query: str) -> dict[str, Any]:
        async with open_websocket_url(f"ws://127.0.0.1:{srv.port}/v1/events{query}") as ws:
            return json.loads(await ws.get_message())

    assert trio.run(first_event, "?api_key=sk-page")["type"] == "hello"
    for query in ("", "?api_key=wrong"):  # the same 401 as the rest of HTTP
        with pytest.raises(ConnectionRejected) as info:
            trio.run(first_event, query)
        assert info.value.status_code == 401 and json.loads(info.value.body)["error"]["code"] == 401


# ------------------------------------------------------------------ in Chromium
def test_the_page_shows_a_slot_busy_with_its_tokens_then_idle_and_the_finished_event(
    server: ServerProcess, page: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    page.goto(server.base + "/")
    expect(page.locator("#link")).to_have_attribute("data-state", "open")
    expect(page.locator("#model")).to_have_text("smollm2-135m")
    row = page.locator('#slots-body tr[data-slot="0"]')
    expect(row).to_have_attribute("data-state", "idle")
    expect(page.locator("#slots-body tr")).to_have_count(4)
    expect(page.locator("#stage")).to_have_text("ready")

    # a long streamed completion on slot 0, read to its end in a thread
    body = {
        "prompt": "Count to one thousand:",
        "max_tokens": 1000,
        "ignore_eos": True,
        "temperature": 0,
        "id_slot": 0,
        "stream": True,
    }
    ids: list[str] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=WAIT_MS / 1e3) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and not ids:
                        ids.append(json.loads(line[6:])["id"])
        except BaseException as exc:  # reported by the test below
            failed.append(exc)

    streamer = threading.Thread(target=run)
    streamer.start()
    try:
        expect(row).to_have_attribute("data-state", "processing")
        expect(row.locator(".state")).to_have_text("busy")
        expect(row.locator(".trace-id")).not_to_have_text("")
        first = int(row.locator(".n-decoded").inner_text())
        # the generated-token count grows while the slot works
        page.wait_for_function(
            """([sel, n]) => { const r = document.querySelector(sel);
                               return r.dataset.state === "processing"
                                      && +r.querySelector(".n-decoded").textContent > n; }""",
            arg=['#slots-body tr[data-slot="0"]', max(first, 0)],
        )
        assert int(row.locator(".n-decoded").inner_text()) > first
        page.wait_for_function("document.getElementById('chart-line').getAttribute('points').split(' ').length >= 2")
        page.screenshot(path=tmp_path / "status-busy.png")
        if SCREENSHOT_COPY:  # docs/operations.md's picture: the top of the page
            page.screenshot(path=SCREENSHOT_COPY, clip={"x": 0, "y": 0, "width": 1000, "height": 660})
    finally:
        streamer.join(WAIT_MS / 1e3)
    assert not streamer.is_alive() and not failed, failed
    assert ids, "the stream sent no chunk"

    # the stream ended: the slot shows idle again and the list has its slot.finished
    expect(row).to_have_attribute("data-state", "idle")
    expect(row.locator(".n-decoded")).to_have_text("0")
    finished = page.locator(f'#events li[data-type="slot.finished"]:has(.trace:text-is("{ids[0]}"))')
    expect(finished).to_have_count(1)
    expect(finished.locator(".fields")).to_contain_text("finish_reason=length")
    # newest first: the request's own events, in reverse order
    types = page.locator("#events li").evaluate_all(
        f"els => els.filter(e => e.querySelector('.trace').textContent.trim() === {json.dumps(ids[0])})"
        ".map(e => e.dataset.type)"
    )
    assert types == ["slot.finished", "slot.first_token", "slot.assigned"]
    assert page.locator("#events li").count() <= 30
    page.screenshot(path=tmp_path / "status-idle.png")
    assert (tmp_path / "status-busy.png").stat().st_size > 0


def test_the_page_says_why_it_cannot_connect_and_uses_the_key_from_its_fragment(spawn: Any, page: Any) -> None:
    from playwright.sync_api import expect

    srv: ServerProcess = spawn("-np", "1", "--api-key", "sk-page")
    srv.wait_ready()
    page.goto(srv.base + "/")  # no key: the socket is refused, the page says why and keeps trying
    expect(page.locator("#link")).to_have_attribute("data-state", "closed")
    expect(page.locator("#link")).to_contain_text("API key")
    page.goto(srv.base + "/#key=sk-page")
    page.reload()
    expect(page.locator("#link")).to_have_attribute("data-state", "open")
    expect(page.locator('#slots-body tr[data-slot="0"]')).to_have_attribute("data-state", "idle")


def test_query_key_reads_the_first_api_key_parameter() -> None:
    from hydra_trio.http.auth import query_key

    assert query_key(b"recent=50&api_key=sk%20a&api_key=other") == b"sk a"
    assert query_key(b"api_key=") == b"" and query_key(b"recent=5") is None


def test_the_page_reconnects_when_the_node_comes_back(spawn: Any, page: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    from hydra_trio.testing import spawn as _spawn

    srv: ServerProcess = spawn("-np", "1")
    srv.wait_ready()
    page.goto(srv.base + "/")
    link = page.locator("#link")
    expect(link).to_have_attribute("data-state", "open")
    assert srv.stop() == 0
    expect(link).to_have_attribute("data-state", "closed")  # 1001 at shutdown, then refused while down
    page.evaluate("document.getElementById('slots-body').replaceChildren()")
    with open(tmp_path / "again.log", "wb") as log:
        proc, _ = _spawn.spawn("-np", "2", port=srv.port, output=log)  # the same port, now with two slots
        try:
            _spawn.wait_healthy(srv.port, proc, WAIT_MS / 1e3)
            expect(link).to_have_attribute("data-state", "open")
            expect(page.locator("#slots-body tr")).to_have_count(2)
        finally:
            proc.terminate()
            proc.wait(60)

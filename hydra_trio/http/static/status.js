// hydra-trio status page: one WebSocket to GET /v1/events, drawn into the page.
// Plain JS, no build step, nothing fetched from elsewhere. Event shapes: docs/operations.md "Live events".
// With API keys on the node, open the page as /#key=KEY: the key (never sent in the page's
// own request, fragments are not) goes to the WebSocket as ?api_key=KEY.
"use strict";
(() => {
  const MAX_EVENTS = 30;        // events kept in the list
  const CHART_SECONDS = 60;     // the chart's window
  const MAX_BACKOFF_MS = 10000; // reconnect delay: 0.5 s doubling up to this
  const { $, setText, setLink } = window.hydraPage; // static/page.js
  let points = [];              // [ts, tok_s] from stats events
  let backoff = 500;

  function eventsUrl() {
    const url = new URL("v1/events", location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    url.hash = "";
    url.search = "?recent=50";
    const key = new URLSearchParams(location.hash.slice(1)).get("key");
    if (key) url.searchParams.set("api_key", key);
    return url.href;
  }

  function onHello(e) {
    setText("model", e.model || "(no model)");
    setText("version", e.version);
    // a (re)connection replays recent events: start the views afresh
    $("slots-body").replaceChildren();
    $("events").replaceChildren();
    points = [];
  }

  function onStats(e) {
    setText("stage", e.stage);
    setText("mode", e.mode);
    setText("peer", e.peer ? e.peer + (e.peer_reachable ? "" : " (unreachable)") : "none");
    setText("queue", e.queue);
    setText("processing", e.processing);
    setText("tok-s", `${(e.tok_s || 0).toFixed(1)} tok/s`);
    drawSlots(e.slots || []);
    drawConnections(e.connections || {}, e.connections_per_s || {}, e.connections_open);
    points.push([e.ts, e.tok_s || 0]);
    drawChart();
  }

  const SLOT_CELLS = ["id", "state", "n-prompt", "n-decoded", "tok-s", "trace-id"];

  function drawSlots(slots) {
    const body = $("slots-body");
    const ids = new Set(slots.map((s) => String(s.id)));
    for (const row of [...body.rows]) if (!ids.has(row.dataset.slot)) row.remove();
    for (const s of slots) {
      let row = body.querySelector(`tr[data-slot="${s.id}"]`);
      if (!row) {
        row = body.insertRow();
        row.dataset.slot = s.id;
        for (const name of SLOT_CELLS) row.insertCell().className = name;
      }
      row.dataset.state = s.state;
      const cells = { "id": s.id, "state": s.state === "processing" ? "busy" : "idle",
                      "n-prompt": s.n_prompt, "n-decoded": s.n_decoded,
                      "tok-s": (s.tok_s || 0).toFixed(1), "trace-id": s.trace_id || "" };
      for (const [name, value] of Object.entries(cells)) row.querySelector("." + name).textContent = value;
    }
  }

  function drawConnections(total, perSecond, open) {
    const body = $("connections-body");
    body.replaceChildren();
    for (const proto of Object.keys(total).sort()) {
      const row = body.insertRow();
      row.dataset.protocol = proto;
      row.insertCell().textContent = proto;
      row.insertCell().textContent = `${total[proto]} (${(perSecond[proto] || 0).toFixed(1)}/s)`;
    }
    setText("connections-open", open);
  }

  function drawChart() {
    const now = points.length ? points[points.length - 1][0] : 0;
    points = points.filter(([ts]) => ts >= now - CHART_SECONDS);
    const top = Math.max(1, ...points.map(([, v]) => v));
    const xy = points.map(([ts, v]) => {
      const x = 600 * (1 - (now - ts) / CHART_SECONDS);
      const y = 118 - 110 * (v / top);
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    $("chart-line").setAttribute("points", xy.join(" "));
    setText("chart-max", top.toFixed(0));
  }

  function summary(e) {
    const rest = [];
    for (const [k, v] of Object.entries(e)) {
      if (k === "ts" || k === "type" || k === "trace_id") continue;
      if (k === "timings" && v) rest.push(`${(v.predicted_per_second || 0).toFixed(1)} tok/s`);
      else if (v === null || typeof v !== "object") rest.push(`${k}=${v}`);
      else rest.push(`${k}=${JSON.stringify(v)}`);
    }
    return rest.join(" ");
  }

  function addEvent(e) {
    const li = document.createElement("li");
    li.dataset.type = e.type;
    const time = new Date(e.ts * 1000).toLocaleTimeString();
    for (const [cls, text] of [["time", time], ["type", e.type], ["trace", e.trace_id || ""], ["fields", summary(e)]]) {
      const span = document.createElement("span");
      span.className = cls;
      span.textContent = text;
      li.append(span);
    }
    const list = $("events");
    list.prepend(li);
    while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
  }

  function onEvent(e) {
    if (e.type === "hello") onHello(e);
    else if (e.type === "stats") onStats(e);
    else addEvent(e);
  }

  function connect() {
    setLink("connecting", "connecting…");
    const ws = new WebSocket(eventsUrl());
    let opened = false;
    ws.onopen = () => { opened = true; backoff = 500; setLink("open", "live"); };
    ws.onmessage = (msg) => { try { onEvent(JSON.parse(msg.data)); } catch (err) { console.error(err); } };
    ws.onclose = (ev) => {
      // a refused key is an HTTP 401 to the handshake: the browser only says 1006
      const why = !opened ? "cannot connect (node down, or it needs an API key: open this page as /#key=KEY)"
        : ev.code === 1001 ? "the node is shutting down" : `disconnected (${ev.code})`;
      setLink("closed", `${why}; retrying in ${(backoff / 1000).toFixed(1)} s`);
      setTimeout(connect, backoff);
      backoff = Math.min(backoff * 2, MAX_BACKOFF_MS);
    };
  }

  connect();
})();

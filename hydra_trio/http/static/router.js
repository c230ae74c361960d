// hydra-trio router status page: every model of GET models with its status, redrawn on each event of
// GET models/sse (llama-server's router events). Links are relative (a proxy's path prefix is kept); an API
// key given in the page's fragment (/#key=KEY: never sent to the server as part of the page's own request)
// goes to each request as Authorization: Bearer KEY.
(function () {
  "use strict";
  const { $, setText, setLink } = window.hydraPage; // static/page.js
  const key = new URLSearchParams(location.hash.slice(1)).get("key");
  const headers = key ? { Authorization: "Bearer " + key } : {};
  const CELLS = ["id", "aliases", "status", "source", "n_ctx", "ftype", "port"];

  async function getJson(path) {
    const r = await fetch(new URL(path, location.href), { headers, cache: "no-store" });
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return r.json();
  }

  function statusText(m) {
    const s = m.status || {};
    if (s.failed) return `${s.value} (failed, exit ${s.exit_code})`;
    return s.value;
  }

  function portOf(m) {
    const args = (m.status && m.status.args) || [];
    const i = args.indexOf("--port");
    const port = i >= 0 ? args[i + 1] : "0";
    return port === "0" ? "" : port;
  }

  function drawModels(models) {
    const body = $("models-body");
    const ids = new Set(models.map((m) => m.id));
    for (const row of [...body.rows]) if (!ids.has(row.dataset.model)) row.remove();
    for (const m of models) {
      let row = [...body.rows].find((r) => r.dataset.model === m.id);
      if (!row) {
        row = body.insertRow();
        row.dataset.model = m.id;
        for (const name of CELLS) row.insertCell().className = name;
      }
      const meta = m.meta || {};
      row.dataset.state = m.status.value === "loaded" ? "idle" : m.status.value;
      row.dataset.status = m.status.value;
      const cells = {
        id: m.id,
        aliases: (m.aliases || []).join(", "),
        status: statusText(m),
        source: m.source,
        n_ctx: meta.n_ctx === undefined ? "" : meta.n_ctx,
        ftype: meta.ftype === undefined ? "" : meta.ftype,
        port: portOf(m),
      };
      for (const [name, value] of Object.entries(cells)) row.querySelector("." + name).textContent = value;
    }
    // keep the server's order (by name)
    for (const m of models) body.appendChild([...body.rows].find((r) => r.dataset.model === m.id));
    setText("count", models.length);
    setText("running", models.filter((m) => ["loading", "loaded"].includes(m.status.value)).length);
  }

  async function refresh() {
    drawModels((await getJson("models")).data);
  }

  function addEvent(e) {
    const li = document.createElement("li");
    const parts = [
      ["time", new Date().toLocaleTimeString()],
      ["type", e.event],
      ["model", e.model],
      ["data", e.data ? (e.data.status || "") + (e.data.exit_code ? ` exit ${e.data.exit_code}` : "") : ""],
    ];
    for (const [cls, text] of parts) {
      const span = document.createElement("span");
      span.className = cls;
      span.textContent = text;
      li.appendChild(span);
    }
    const list = $("events");
    list.insertBefore(li, list.firstChild);
    while (list.children.length > 50) list.lastChild.remove();
  }

  async function follow() {
    // fetch, not EventSource: it can send the API key as a header
    const r = await fetch(new URL("models/sse", location.href), { headers, cache: "no-store" });
    if (!r.ok || !r.body) throw new Error(`models/sse: HTTP ${r.status}`);
    setLink("open", "live");
    await refresh(); // what changed before the stream opened
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of block.split("\n")) {
          if (line.startsWith("data: ")) addEvent(JSON.parse(line.slice(6)));
        }
        await refresh();
      }
    }
  }

  async function start() {
    try {
      const [props, version] = await Promise.all([getJson("props"), getJson("version")]);
      setText("version", version.version);
      setText("models-max", props.max_instances || "no limit");
      setText("autoload", props.models_autoload ? "on" : "off");
      await refresh();
    } catch (err) {
      setLink("closed", String(err.message || err));
    }
    for (;;) {
      try {
        await follow();
        setLink("closed", "stream ended; reconnecting");
      } catch (err) {
        setLink("closed", String(err.message || err));
      }
      await new Promise((resolve) => setTimeout(resolve, 2000));
    }
  }

  start();
})();

// What the node's status page (status.js) and the router's (router.js) share: loaded before either.
// Plain JS, no build step.
"use strict";
window.hydraPage = (() => {
  const $ = (id) => document.getElementById(id);

  // the element's text: the value, or "–" when there is none
  function setText(id, value) {
    $(id).textContent = value === undefined || value === null || value === "" ? "–" : String(value);
  }

  // the connection badge (#link): its state drives the stylesheet's colour
  function setLink(state, text) {
    const el = $("link");
    el.dataset.state = state;
    el.textContent = text;
  }

  return { $, setText, setLink };
})();

"""The page's script and style, served from /static (a Content-Security-Policy of 'self' allows
no inline script at all)."""

SCRIPT = r"""
(function () {
  "use strict";
  const box = document.getElementById("message");
  function show(text, kind) { box.textContent = text; box.className = kind; }
  const flash = sessionStorage.getItem("spotdrain-flash");
  if (flash) { sessionStorage.removeItem("spotdrain-flash"); show(flash, "ok"); }
  const tokenForm = document.getElementById("token-form");
  if (tokenForm) {
    tokenForm.addEventListener("submit", function (ev) {
      ev.preventDefault();
      sessionStorage.setItem("spotdrain-token", document.getElementById("token").value);
      show("token kept for this tab", "ok");
    });
  }
  async function act(url, body) {
    const headers = {"Content-Type": "application/json"};
    const token = sessionStorage.getItem("spotdrain-token");
    if (token) { headers["X-Spotdrain-Token"] = token; }
    const answer = await fetch(url, {method: "POST", headers: headers,
                                     body: JSON.stringify(body || {})});
    let doc = {};
    try { doc = await answer.json(); } catch (err) { doc = {error: answer.statusText}; }
    if (!answer.ok) { show("refused (" + answer.status + "): " + doc.error, "refused"); return; }
    sessionStorage.setItem("spotdrain-flash", doc.message || "done");
    location.reload();
  }
  document.querySelectorAll("button[data-action]").forEach(function (button) {
    button.addEventListener("click", function () {
      act(button.dataset.action, button.dataset.body ? JSON.parse(button.dataset.body) : {});
    });
  });
  const replicas = document.getElementById("replicas-form");
  if (replicas) {
    replicas.addEventListener("submit", function (ev) {
      ev.preventDefault();
      const f = new FormData(replicas);
      act("/api/models/" + encodeURIComponent(f.get("model")) + "/replicas",
          {replicas: Number(f.get("replicas")), image: f.get("image") || "",
           slots: Number(f.get("slots") || 0)});
    });
  }
  const diagram = document.getElementById("diagram");
  if (diagram && diagram.dataset.live) {
    const source = new EventSource(diagram.dataset.live);
    source.addEventListener("timeline", function (ev) {
      const doc = JSON.parse(ev.data);
      diagram.innerHTML = doc.svg;  // the renderer's own output, escaped there
      document.getElementById("outcome").textContent = doc.outcome;
    });
    // The server's word that no more steps are coming (it follows a while after the outcome).
    source.addEventListener("done", function () { source.close(); });
  }
})();
"""

STYLE = """
body { font-family: sans-serif; font-size: 14px; margin: 1em 2em; color: #222; }
nav a { margin-right: 1em; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { border: 1px solid #ccc; padding: 3px 6px; vertical-align: top; text-align: left; }
th { background: #eee; }
#message { min-height: 1.4em; margin: 0.5em 0; font-weight: bold; }
#message.refused { color: #b00020; }
#message.ok { color: #2e7d32; }
.warn { color: #b00020; }
.note { color: #666; }
#diagram svg { border: 1px solid #ccc; background: #fff; }
form { margin: 0.5em 0; }
"""

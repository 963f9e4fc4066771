// The machine page's serial console: xterm.js over the console WebSocket (the session cookie,
// this page's Origin and the session's CSRF token authenticate it; see docs/ui.md).
"use strict";
(function () {
  const button = document.getElementById("console-open");
  if (!button) return;
  const state = document.getElementById("console-state");
  const mode = document.getElementById("console-mode");
  button.addEventListener("click", () => {
    button.disabled = true;
    const term = new window.Terminal({ convertEol: false, cursorBlink: true, fontSize: 14, rows: 24 });
    const fit = new window.FitAddon.FitAddon();
    term.loadAddon(fit);
    term.open(document.getElementById("term"));
    fit.fit();
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    const url = proto + "//" + location.host + "/ui/machines/" + encodeURIComponent(button.dataset.machine)
      + "/console?csrf=" + encodeURIComponent(document.body.dataset.csrf);
    const ws = new WebSocket(url);
    ws.binaryType = "arraybuffer";
    window.metaldConsole = { term: term, ws: ws };
    ws.onmessage = (m) => {
      if (typeof m.data === "string") {
        const note = JSON.parse(m.data);
        if (note.type === "hello") {
          mode.textContent = note.mode === "write" ? "you type" : "you watch read-only (" + (note.writer || "someone") + " types)";
          state.textContent = note.state || "";
        }
        else if (note.type === "status") state.textContent = note.state + (note.detail ? ": " + note.detail : "");
        else if (note.type === "error" || note.type === "closed") state.textContent = note.detail;
        return;
      }
      term.write(new Uint8Array(m.data));
    };
    ws.onclose = () => { state.textContent += " (closed)"; button.disabled = false; };
    const enc = new TextEncoder();
    term.onData((d) => { if (ws.readyState === WebSocket.OPEN) ws.send(enc.encode(d)); });
    term.focus();
  });
})();

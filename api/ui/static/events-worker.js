// One event stream per browser session, shared by every tab of the console (a SharedWorker):
// a technician with ten tabs holds one stream, not ten (the API caps streams per token).
// Each tab says where its page starts (the newest event it rendered) and its filters; the
// worker replays what it already holds past that point and then forwards each new event
// that matches. When the last tab goes the worker ends, its fetch is aborted and the server
// frees the stream (it watches the connection). Tabs in a browser without SharedWorker read
// the stream themselves (ui.js).
"use strict";
const tabs = new Map(); // port -> {after, params}
const recent = []; // the newest events this worker saw, for tabs that join later
const KEEP = 1000;
let status = "connecting";
let last = null;
let started = false;

function wanted(tab, e) {
  if (tab.after !== null && Number(e.id) <= Number(tab.after)) return false;
  if (tab.params.machine_id && e.machine_id !== tab.params.machine_id) return false;
  if (tab.params.kind && e.kind !== tab.params.kind) return false;
  return true;
}

function deliver(e) {
  recent.push(e);
  if (recent.length > KEEP) recent.shift();
  tabs.forEach((tab, port) => { if (wanted(tab, e)) port.postMessage({ type: "event", event: e }); });
}

function setStatus(s) {
  status = s;
  tabs.forEach((_tab, port) => port.postMessage({ type: "status", status: s }));
}

async function run() {
  for (;;) {
    try {
      const q = new URLSearchParams({ after: String(last), mux: "1" });
      const r = await fetch("/ui/events/stream?" + q, { headers: { Accept: "text/event-stream" }, credentials: "same-origin" });
      if (r.status === 401) { setStatus("session ended: log in again"); return; }
      if (!r.ok) throw new Error("HTTP " + r.status);
      setStatus("on");
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          let data = "";
          let id = null;
          block.split("\n").forEach((line) => {
            if (line.startsWith("data: ")) data += line.slice(6);
            else if (line.startsWith("id: ")) id = line.slice(4);
          });
          if (id !== null) last = id;
          if (data) { try { deliver(JSON.parse(data)); } catch (err) { /* not an event */ } }
        }
      }
    } catch (err) {
      setStatus("reconnecting");
    }
    await new Promise((res) => setTimeout(res, 1000));
  }
}

self.onconnect = (c) => {
  const port = c.ports[0];
  port.onmessage = (m) => {
    const msg = m.data || {};
    if (msg.type === "follow") {
      const tab = { after: msg.after === undefined ? null : String(msg.after), params: msg.params || {} };
      tabs.set(port, tab);
      port.postMessage({ type: "status", status: status });
      recent.forEach((e) => { if (wanted(tab, e)) port.postMessage({ type: "event", event: e }); });
      if (!started) { started = true; last = tab.after || "0"; run(); }
    } else if (msg.type === "bye") {
      tabs.delete(port);
    }
  };
  port.start();
};

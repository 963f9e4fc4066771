// metald web console: the little the server-rendered pages need in the browser.
// Column choice, bulk selection with confirmation, on-demand fragments, and live updates
// from the event stream (Server-Sent Events read with fetch, so every event kind arrives).
"use strict";
(function () {
  const csrf = document.body.dataset.csrf || "";
  const $ = (sel, root) => (root || document).querySelector(sel);
  const $$ = (sel, root) => Array.from((root || document).querySelectorAll(sel));

  // --- columns chosen, remembered in this browser ---
  const COLS_KEY = "metald.ui.hiddenColumns";
  const hidden = new Set(JSON.parse(localStorage.getItem(COLS_KEY) || "[]"));
  function applyColumns() {
    $$("[data-col]").forEach((el) => { el.hidden = hidden.has(el.dataset.col); });
  }
  $$("[data-toggle-col]").forEach((box) => {
    box.checked = !hidden.has(box.dataset.toggleCol);
    box.addEventListener("change", () => {
      if (box.checked) hidden.delete(box.dataset.toggleCol); else hidden.add(box.dataset.toggleCol);
      localStorage.setItem(COLS_KEY, JSON.stringify(Array.from(hidden)));
      applyColumns();
    });
  });
  applyColumns();

  // --- bulk selection ---
  function countSelected() {
    const n = $$('input[name="id"][type="checkbox"]:checked').length;
    const out = $("#selected");
    if (out) out.textContent = n + " selected";
  }
  const all = $("#select-all");
  if (all) all.addEventListener("change", () => {
    $$('#fleet tbody input[name="id"]').forEach((b) => { b.checked = all.checked; });
    countSelected();
  });
  document.addEventListener("change", (e) => {
    if (e.target.matches && e.target.matches('input[name="id"]')) countSelected();
  });

  // --- destructive actions are confirmed in a dialog that names the machines (the server
  // refuses them otherwise); actions are sent in place: the page, its scroll position and an
  // open serial console stay ---
  const dialog = $("#confirm");
  function ask(text, reason) {
    return new Promise((resolve) => {
      $("#confirm-text").textContent = text;
      $("#confirm-reason-p").hidden = !reason;
      $("#confirm-reason").required = reason === "required";
      $("#confirm-reason").value = "";
      dialog.returnValue = "";
      dialog.showModal();
      dialog.addEventListener("close", function once() {
        dialog.removeEventListener("close", once);
        resolve(dialog.returnValue === "ok" ? { reason: $("#confirm-reason").value } : null);
      });
    });
  }
  function machinesText(names) {
    const shown = names.slice(0, 10).join(", ");
    const more = names.length > 10 ? " and " + (names.length - 10) + " more" : "";
    return names.length + " machine" + (names.length === 1 ? "" : "s") + ": " + shown + more;
  }
  async function send(form, submitter) {
    const data = new FormData(form);
    if (submitter && submitter.name) data.set(submitter.name, submitter.value);
    const r = await fetch(form.getAttribute("action"), {
      method: "POST", body: data,
      headers: { Accept: "application/json", "X-CSRF-Token": csrf },
    });
    let body = null;
    try { body = await r.json(); } catch (err) { body = { detail: "HTTP " + r.status }; }
    return { ok: r.ok, status: r.status, body: body };
  }
  function say(el, text, bad) {
    if (!el) return;
    el.textContent = text;
    el.className = bad ? "problem-line" : "ok";
    el.setAttribute("role", bad ? "alert" : "status");
  }

  // Fleet: the bulk form.
  const bulk = $("#bulk");
  if (bulk && dialog) {
    bulk.addEventListener("submit", async (e) => {
      const button = e.submitter;
      if (!button) return;
      e.preventDefault();
      const boxes = $$('input[name="id"][type="checkbox"]:checked');
      const names = boxes.map((b) => b.dataset.name || b.value.slice(0, 8));
      const action = button.value.replace(/-/g, " ");
      bulk.elements.confirm.value = ""; bulk.elements.reason.value = "";
      if (button.dataset.confirm || button.dataset.reason) {
        const answer = await ask(action + " on " + machinesText(names) + "?", button.dataset.reason ? "required" : "");
        if (!answer) return;
        bulk.elements.confirm.value = "yes";
        bulk.elements.reason.value = answer.reason;
      }
      const out = $("#bulk-status");
      const r = await send(bulk, button);
      if (!r.ok && !(r.body && "done" in r.body)) { say(out, (r.body.title || "Refused") + ": " + (r.body.detail || ""), true); return; }
      const failed = r.body.failed || [];
      let text = r.body.done + " machine" + (r.body.done === 1 ? "" : "s") + " done.";
      if (failed.length) text += " Refused: " + failed.map((f) => f.name + " (" + f.why + ")").join("; ");
      say(out, text, failed.length > 0);
    });
  }

  // Machine: each action form, in place; the panel comes back from the answer.
  const actions = $("#m-actions");
  if (actions) {
    document.addEventListener("submit", async (e) => {
      const form = e.target;
      if (!form.matches || !form.matches("form.act")) return;
      e.preventDefault();
      const name = $("#m-actions").dataset.name;
      if (form.elements.confirm) form.elements.confirm.value = "";
      if (form.dataset.confirm || form.dataset.reason) {
        const why = form.dataset.why ? " It " + form.dataset.why + "." : "";
        const answer = await ask(form.dataset.label + " " + name + "?" + why, form.dataset.reason || "");
        if (!answer) return;
        form.elements.confirm.value = "yes";
        form.elements.reason.value = answer.reason;
      }
      const out = $("#act-status");
      const r = await send(form, e.submitter);
      if (!r.ok) { say(out, (r.body.title || "Refused") + ": " + (r.body.detail || ""), true); return; }
      say(out, r.body.message, false);
      const tpl = document.createElement("template"); tpl.innerHTML = r.body.actions.trim();
      $("#m-actions").replaceWith(tpl.content.firstElementChild);
      const s = $("#m-state"); s.textContent = r.body.state; s.className = "state state-" + r.body.state;
    });
  }

  // --- fragments read on demand (sensors, BMC log) ---
  $$("button[data-load]").forEach((b) => b.addEventListener("click", async () => {
    const into = document.getElementById(b.dataset.into);
    into.textContent = "reading…";
    const r = await fetch(b.dataset.load, { headers: { Accept: "text/html" } });
    into.innerHTML = await r.text();
  }));

  // --- the event stream: one per browser session, shared by the tabs through a
  // SharedWorker (events-worker.js); a browser without one reads its own stream ---
  let worker = null;
  function follow(after, params, onEvent) {
    if (window.SharedWorker && !window.metaldNoWorker) {
      try {
        if (!worker) {
          worker = new SharedWorker("/ui/static/events-worker.js", { name: "metald-events" });
          window.addEventListener("pagehide", () => worker.port.postMessage({ type: "bye" }));
        }
        const status = $("#live");
        worker.port.addEventListener("message", (m) => {
          const msg = m.data || {};
          if (msg.type === "status" && status) status.textContent = msg.status;
          else if (msg.type === "event") { try { onEvent(msg.event); } catch (err) { console.error(err); } }
        });
        worker.port.start();
        worker.port.postMessage({ type: "follow", after: String(after), params: params });
        return () => worker.port.postMessage({ type: "bye" });
      } catch (err) {
        worker = null; // refused (a CSP or a browser without workers): read the stream here
      }
    }
    return direct(after, params, onEvent);
  }
  function direct(after, params, onEvent) {
    const status = $("#live");
    let last = after;
    let stopped = false;
    async function run() {
      while (!stopped) {
        try {
          const q = new URLSearchParams(Object.assign({ after: String(last) }, params));
          const r = await fetch("/ui/events/stream?" + q, { headers: { Accept: "text/event-stream" } });
          if (r.status === 401) { if (status) status.textContent = "session ended: log in again"; return; }
          if (!r.ok) throw new Error("HTTP " + r.status);
          if (status) status.textContent = "on";
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
              if (data) { try { onEvent(JSON.parse(data)); } catch (err) { console.error(err); } }
            }
          }
        } catch (err) {
          if (status) status.textContent = "reconnecting";
        }
        await new Promise((res) => setTimeout(res, 1000));
      }
    }
    run();
    return () => { stopped = true; };
  }
  window.metaldFollow = follow;

  function eventItem(e) {
    const li = document.createElement("li");
    li.dataset.event = e.id;
    const t = document.createElement("time");
    t.dateTime = e.at; t.textContent = String(e.at).slice(0, 19).replace("T", " ");
    const b = document.createElement("b"); b.textContent = e.kind;
    li.append(t, " ", b, " ");
    if (e.from_state || e.to_state) li.append((e.from_state || "") + " → " + (e.to_state || "") + " ");
    const who = document.createElement("span"); who.className = "muted"; who.textContent = e.actor;
    li.append(who);
    if (e.reason) li.append(": " + e.reason);
    if (e.machine_id) {
      const a = document.createElement("a");
      a.href = "/ui/machines/" + e.machine_id; a.textContent = e.machine_id.slice(0, 8);
      li.append(" ", a);
    }
    return li;
  }

  // Fleet: rows of machines that changed are fetched again and replaced in place. A machine
  // the page does not show (new, or one that may now match the filters) is asked for with the
  // page's own query: the server answers it only if its scoped, filtered query lists it.
  const table = $("#fleet");
  if (table) {
    const pending = new Set();
    const pendingAdd = new Set();
    let timer = null;
    const body = table.tBodies[0];
    const before = (a, b) => a.key < b.key || (a.key === b.key && a.id < b.id);
    function place(item) {
      if (body.querySelector('tr[data-id="' + CSS.escape(item.id) + '"]')) return;
      const rows = Array.from(body.rows);
      const next = rows.find((tr) => before(item, { key: tr.dataset.key, id: tr.dataset.id }));
      // Rows sorting before this page's first belong to an earlier page, after its last to a
      // later one (keyset pages): those stay where the pager finds them.
      if (next && next === rows[0] && table.dataset.laterPage) return;
      if (!next && table.dataset.more) return;
      // Sorted by another column or grouped: where it goes is the server's to say (reload).
      if (table.dataset.customOrder) return;
      const empty = body.querySelector("tr.nothing");
      if (empty) empty.remove();
      const tpl = document.createElement("template"); tpl.innerHTML = item.html.trim();
      body.insertBefore(tpl.content.firstElementChild, next || null);
    }
    async function refresh() {
      timer = null;
      const ids = Array.from(pending); pending.clear();
      const adds = Array.from(pendingAdd).slice(0, 200); pendingAdd.clear();
      const q = new URLSearchParams(table.dataset.query || "");
      ids.forEach((i) => q.append("id", i));
      adds.forEach((i) => q.append("add", i));
      const r = await fetch("/ui/fleet/rows?" + q, { headers: { Accept: "application/json" } });
      if (!r.ok) return;
      const data = await r.json();
      Object.entries(data.rows).forEach(([id, html]) => {
        const old = table.querySelector('tr[data-id="' + CSS.escape(id) + '"]');
        if (!old) return;
        const was = old.querySelector('input[name="id"]');
        const tpl = document.createElement("template"); tpl.innerHTML = html.trim();
        const row = tpl.content.firstElementChild;
        const box = row.querySelector('input[name="id"]');
        if (was && box) box.checked = was.checked;
        old.replaceWith(row);
      });
      (data.added || []).forEach(place);
      const counts = $("#counts");
      $$("[data-count]", counts).forEach((el) => { if (!(el.dataset.count in data.counts)) el.closest("li").remove(); });
      Object.entries(data.counts).sort().forEach(([state, n]) => {
        let el = counts.querySelector('[data-count="' + CSS.escape(state) + '"]');
        if (!el) {
          const li = document.createElement("li");
          const a = document.createElement("a"); a.href = "/ui/?state=" + encodeURIComponent(state);
          const s = document.createElement("span"); s.className = "state state-" + state; s.textContent = state;
          el = document.createElement("b"); el.dataset.count = state;
          a.append(s, " ", el); li.append(a); counts.append(li);
        }
        el.textContent = n;
      });
      applyColumns();
    }
    follow(table.dataset.liveAfter, {}, (e) => {
      if (!e.machine_id) return;
      if (table.querySelector('tr[data-id="' + CSS.escape(e.machine_id) + '"]')) pending.add(e.machine_id);
      else pendingAdd.add(e.machine_id);
      if (!timer) timer = setTimeout(refresh, 100);
    });
  }

  // Events: a live tail, newest first.
  const tail = $("#tail");
  if (tail) {
    let paused = false;
    const pause = $("#pause");
    pause.addEventListener("click", () => {
      paused = !paused; pause.setAttribute("aria-pressed", String(paused));
      pause.textContent = paused ? "Resume" : "Pause";
    });
    const params = {};
    if (tail.dataset.kind) params.kind = tail.dataset.kind;
    if (tail.dataset.machine) params.machine_id = tail.dataset.machine;
    follow(tail.dataset.liveAfter, params, (e) => {
      if (paused) return;
      tail.prepend(eventItem(e));
      while (tail.children.length > 500) tail.lastElementChild.remove();
    });
  }

  // Machine: the timeline, the state and who watches the console, live.
  const machine = $("#machine");
  if (machine) {
    const id = machine.dataset.id;
    follow(machine.dataset.liveAfter, { machine_id: id }, (e) => {
      $("#timeline").prepend(eventItem(e));
      if (e.to_state) {
        const s = $("#m-state"); s.textContent = e.to_state; s.className = "state state-" + e.to_state;
      }
      const w = $("#watching");
      if (w && (e.kind === "console.attached" || e.kind === "console.detached")) {
        const who = w.textContent === "nobody" ? [] : w.textContent.split(", ");
        if (e.kind === "console.attached") who.push(e.actor);
        else { const i = who.indexOf(e.actor); if (i >= 0) who.splice(i, 1); }
        w.textContent = who.sort().join(", ") || "nobody";
      }
    });
  }

  // Claims: a claim whose machines moved is fetched again.
  const claims = $("#claims");
  if (claims) {
    const pending = new Set();
    let timer = null;
    async function refresh() {
      timer = null;
      for (const cid of Array.from(pending)) {
        pending.delete(cid);
        const r = await fetch("/ui/claims/" + encodeURIComponent(cid));
        if (!r.ok) continue;
        const old = claims.querySelector('[data-claim="' + CSS.escape(cid) + '"]');
        const tpl = document.createElement("template"); tpl.innerHTML = (await r.text()).trim();
        if (old) old.replaceWith(tpl.content.firstElementChild);
      }
    }
    follow(claims.dataset.liveAfter, {}, (e) => {
      let cid = e.data && e.data.claim_id;
      if (!cid && e.machine_id) {
        const li = claims.querySelector('li[data-machine="' + CSS.escape(e.machine_id) + '"]');
        if (li) cid = li.closest("[data-claim]").dataset.claim;
      }
      if (!cid || !claims.querySelector('[data-claim="' + CSS.escape(cid) + '"]')) return;
      pending.add(cid);
      if (!timer) timer = setTimeout(refresh, 150);
    });
  }
  window.metaldCsrf = csrf;
})();

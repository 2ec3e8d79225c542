// agentrt dashboard: polls GET dashboard/status every refresh_s seconds and draws it.
// Plain DOM and SVG, no library. Every value from the server goes in through textContent or an
// attribute (never innerHTML), so session ids and the like cannot inject markup. Cells carry their raw
// value in data-value and rows their id in data-worker / data-request, so tests read the rendered page.
"use strict";

(function () {
  const STATUS_URL = "dashboard/status";
  const KEY_ITEM = "agentrt.dashboard.key";
  const SVG = "http://www.w3.org/2000/svg";
  let timer = null;
  let refreshMs = 2000;

  // The key: from the URL fragment (#key=..., never sent to a server), else this tab's sessionStorage.
  function takeKeyFromFragment() {
    const m = /(?:^#|&)key=([^&]*)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem(KEY_ITEM, decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
  }

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined) e.setAttribute(k, String(v));
    }
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function fmtInt(v) { return v === null || v === undefined ? "–" : Number(v).toLocaleString("en-US"); }
  function fmtPct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%"; }
  function fmtMB(v) { return v === null || v === undefined ? "–" : (v / 1e6).toFixed(1) + " MB"; }
  function movesCell(m) {
    if (!m) return cell("kv_moves", null, "off", "num");
    return cell("kv_moves", [m.pulled_bytes, m.served_bytes, m.pulls, m.pull_failures],
                fmtMB(m.pulled_bytes) + " / " + fmtMB(m.served_bytes) +
                (m.pulls ? " (" + fmtInt(m.pulls) + " pulls, " + fmtInt(m.pull_failures) + " failed)" : ""), "num");
  }
  function fmtMs(v) { return v === null || v === undefined ? "–" : (1000 * v).toFixed(0) + " ms"; }
  function raw(v) { return v === null || v === undefined ? "" : JSON.stringify(v); }

  function cell(field, value, text, cls) {
    return el("td", {"data-field": field, "data-value": raw(value), "class": cls}, text);
  }

  function waitingCell(load) {
    // the queue by priority class ("<high|normal|low>/<new|started>" -> requests): later turns of started
    // sessions beside new sessions' first turns, which an overloaded engine sheds first
    const by = load.waiting_by_priority || {};
    let started = 0;
    for (const [k, n] of Object.entries(by)) if (k.endsWith("/started")) started += n;
    const td = cell("waiting", load.waiting, fmtInt(load.waiting) +
                    (load.waiting ? " (" + fmtInt(started) + " started)" : ""), "num");
    td.setAttribute("data-by-priority", JSON.stringify(by));
    td.title = Object.keys(by).sort().map(function (k) { return k + " " + by[k]; }).join(", ");
    return td;
  }

  function setText(id, text) { document.getElementById(id).textContent = text; }

  function replaceBody(tableId, rows) {
    const body = document.querySelector("#" + tableId + " tbody");
    body.replaceChildren(...rows);
  }

  function kvCell(kv) {
    const td = el("td", {"data-field": "kv", "data-value": raw(kv)});
    const tiers = Object.keys(kv || {});
    if (!tiers.length) { td.textContent = "–"; return td; }
    for (const tier of tiers) {
      const t = kv[tier];
      const total = t.pages_total || 0, used = t.pages_used || 0;
      const line = el("span", {"class": "tier", "data-tier": tier});
      const bar = el("span", {"class": "bar"});
      const fill = el("span");
      fill.style.width = (total ? Math.min(100, 100 * used / total) : 0).toFixed(1) + "%";
      bar.appendChild(fill);
      line.appendChild(bar);
      line.appendChild(document.createTextNode(
        tier + " " + fmtInt(used) + "/" + fmtInt(total) + " pages" +
        (t.pages_pinned ? " (" + fmtInt(t.pages_pinned) + " pinned)" : "") +
        (t.bytes_per_token ? ", " + fmtInt(t.bytes_per_token) + " B/token" : "")));
      td.appendChild(line);
    }
    return td;
  }

  function drawWorkers(s) {
    replaceBody("workers", s.workers.map(function (w) {
      const load = w.load || {};
      const inFlight = w.router_in_flight !== undefined ? w.router_in_flight : load.in_flight;
      const tr = el("tr", {"data-worker": w.id, "data-state": w.state});
      tr.append(
        el("td", {"data-field": "id", "title": w.url || ""}, w.id),
        cell("state", w.state, w.state, "state-" + w.state),
        cell("running", load.running, fmtInt(load.running), "num"),
        waitingCell(load),
        cell("in_flight", inFlight, fmtInt(inFlight), "num"),
        kvCell(w.kv),
        cell("cached_blocks", w.cached_blocks, fmtInt(w.cached_blocks), "num"),
        cell("indexed_blocks", w.indexed_blocks, fmtInt(w.indexed_blocks), "num"),
        cell("pins", w.pins, fmtInt(w.pins), "num"),
        cell("hit_rate", w.hit_rate, fmtPct(w.hit_rate), "num"),
        cell("tokens", [w.prompt_tokens_total, w.cached_tokens_total],
             fmtInt(w.prompt_tokens_total) + " / " + fmtInt(w.cached_tokens_total), "num"),
        movesCell(w.kv_moves));
      return tr;
    }));
    const t = s.totals;
    const totals = document.getElementById("totals");
    totals.replaceChildren(
      el("span", {"data-field": "workers", "data-value": s.workers.length},
         s.workers.length + (s.workers.length === 1 ? " worker" : " workers")),
      el("span", {"data-field": "hit_rate", "data-value": raw(t.hit_rate)}, "fleet hit rate " + fmtPct(t.hit_rate)),
      el("span", {"data-field": "prompt_tokens_total", "data-value": t.prompt_tokens_total},
         fmtInt(t.prompt_tokens_total) + " prompt tokens, " + fmtInt(t.cached_tokens_total) + " from cache"));
  }

  function drawSessions(s) {
    const x = s.sessions;
    document.getElementById("sessions-summary").replaceChildren(
      el("span", {"data-field": "count", "data-value": x.count}, fmtInt(x.count) + " sessions"),
      el("span", {"data-field": "pinned", "data-value": x.pinned}, fmtInt(x.pinned) + " pinned"),
      el("span", {"class": "muted"}, s.scope === "tenant" ? "tenant " + s.tenant + " only" : "all tenants"));
    replaceBody("sessions", x.by_tenant.map(function (t) {
      const tr = el("tr", {"data-tenant": t.tenant});
      tr.append(el("td", {}, t.tenant), cell("count", t.count, fmtInt(t.count), "num"),
                cell("pinned", t.pinned, fmtInt(t.pinned), "num"));
      return tr;
    }));
  }

  function drawRouting(s) {
    const r = s.routing;
    setText("policy", r.policy ? "policy " + r.policy : "one process: no routing");
    document.getElementById("decision-counts").replaceChildren(...Object.keys(r.counts).map(function (k) {
      return el("span", {"data-kind": k, "data-value": r.counts[k]}, k + " " + fmtInt(r.counts[k]));
    }));
    replaceBody("decisions", r.recent.map(function (d) {
      const tr = el("tr", {"data-request": d.request_id, "data-worker": d.worker, "data-kind": d.kind});
      const kind = el("td", {"data-field": "kind", "data-value": raw(d.kind)});
      kind.appendChild(el("span", {"class": "kind kind-" + d.kind}, d.kind));
      tr.append(
        el("td", {}, new Date(d.ts * 1000).toLocaleTimeString()),
        el("td", {"data-field": "request_id"}, d.request_id),
        el("td", {"data-field": "session"}, d.session || "–"),
        el("td", {"data-field": "worker"}, d.worker),
        cell("matched_blocks", d.matched_blocks, fmtInt(d.matched_blocks) + " / " + fmtInt(d.prompt_blocks), "num"),
        kind,
        el("td", {"data-field": "rule"}, d.rule),
        el("td", {"data-field": "failed"}, d.failed.join(", ") || "–"));
      return tr;
    }));
  }

  // A line chart of series (each {name, color, values}) over the points' times, y from 0 to yMax.
  function drawChart(id, points, series, yMax, yFmt) {
    const svg = document.getElementById(id);
    const W = 600, H = 180, L = 44, R = 8, T = 8, B = 18;
    const n = points.length;
    const x = function (i) { return L + (n > 1 ? i * (W - L - R) / (n - 1) : 0); };
    const y = function (v) { return T + (H - T - B) * (1 - Math.min(v, yMax) / yMax); };
    const kids = [];
    for (const f of [0, 0.5, 1]) {
      kids.push(svgEl("line", {x1: L, x2: W - R, y1: y(f * yMax), y2: y(f * yMax), stroke: "#e3e7eb"}));
      kids.push(svgEl("text", {x: 2, y: y(f * yMax) + 3}, yFmt(f * yMax)));
    }
    if (n) {
      const span = points[n - 1].t - points[0].t;
      kids.push(svgEl("text", {x: L, y: H - 4}, "-" + Math.round(span / 60) + " min"));
      kids.push(svgEl("text", {x: W - R - 24, y: H - 4}, "now"));
    }
    const legend = [];
    for (const s of series) {
      let d = "", pen = false, last = null;
      s.values.forEach(function (v, i) {
        if (v === null || v === undefined) { pen = false; return; }
        d += (pen ? "L" : "M") + x(i).toFixed(1) + " " + y(v).toFixed(1) + " ";
        pen = true; last = v;
      });
      if (d) kids.push(svgEl("path", {d: d, fill: "none", stroke: s.color, "stroke-width": 2, "data-series": s.name}));
      s.values.forEach(function (v, i) {  // dots, so a lone interval between gaps still shows
        if (v !== null && v !== undefined) kids.push(svgEl("circle", {cx: x(i), cy: y(v), r: 2, fill: s.color}));
      });
      legend.push(s.name + " " + (last === null ? "–" : yFmt(last)));
    }
    kids.push(svgEl("text", {x: L + 4, y: T + 10, "data-field": "legend"}, legend.join("   ")));
    svg.replaceChildren(...kids);
    svg.setAttribute("data-points", String(points.filter(function (p) { return p.requests || p.ttft_count; }).length));
  }

  function svgEl(tag, attrs, text) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function drawCharts(s) {
    const pts = s.series.points;
    const p50 = pts.map(function (p) { return p.ttft_p50_s; });
    const p95 = pts.map(function (p) { return p.ttft_p95_s; });
    const top = Math.max(0.05, ...p95.filter(function (v) { return v !== null; }));
    drawChart("chart-ttft", pts, [{name: "p50", color: "#2f6fdb", values: p50},
                                  {name: "p95", color: "#d9822b", values: p95}], top * 1.1, fmtMs);
    drawChart("chart-hit", pts, [{name: "hit rate", color: "#1a7f37",
                                  values: pts.map(function (p) { return p.hit_rate; })}], 1, fmtPct);
  }

  function drawSLO(s) {
    const slo = s.slo, m = slo.last_minute;
    setText("slo-targets", "(first token within " + fmtMs(slo.ttft_s) + ", " + fmtMs(slo.tpot_s) +
            " per output token)");
    document.getElementById("slo-summary").replaceChildren(
      el("span", {"data-field": "goodput_sessions_per_min", "data-value": raw(m.goodput_sessions_per_min)},
         "goodput " + (m.goodput_sessions_per_min === null ? "–" : m.goodput_sessions_per_min.toFixed(1)) +
         " sessions/min"),
      el("span", {"data-field": "sessions_in_slo", "data-value": raw([m.sessions_in_slo, m.sessions_ended])},
         fmtInt(m.sessions_in_slo) + " of " + fmtInt(m.sessions_ended) + " ended sessions within SLO"),
      el("span", {"data-field": "requests_in_slo_ratio", "data-value": raw(m.requests_in_slo_ratio)},
         "requests within SLO " + fmtPct(m.requests_in_slo_ratio)),
      el("span", {"class": "muted"}, "last minute"));
    drawChart("chart-slo", s.series.points, [{name: "requests within SLO", color: "#8250df",
                                              values: s.series.points.map(function (p) { return p.slo_ratio; })}],
              1, fmtPct);
  }

  function draw(s) {
    setText("mode", (s.mode === "router" ? "router" : "agentrt serve") + " · " + s.workers.length + " worker" +
            (s.workers.length === 1 ? "" : "s"));
    setText("model", s.model);
    drawWorkers(s);
    drawSessions(s);
    drawRouting(s);
    drawCharts(s);
    drawSLO(s);
    const updated = document.getElementById("updated");
    updated.textContent = "updated " + new Date(s.generated_at * 1000).toLocaleTimeString();
    updated.setAttribute("data-updated", String(s.generated_at));
    setText("error", "");
    document.body.setAttribute("data-loaded", "true");
  }

  function askForKey(message) {
    document.getElementById("auth").classList.add("shown");
    setText("error", message);
  }

  async function poll() {
    const key = sessionStorage.getItem(KEY_ITEM);
    const headers = key ? {"Authorization": "Bearer " + key} : {};
    try {
      const resp = await fetch(STATUS_URL, {headers: headers, cache: "no-store", credentials: "omit"});
      if (resp.status === 401) {
        askForKey(key ? "the key was refused" : "");
        return;  // no more polling until a key is given
      }
      if (!resp.ok) throw new Error("status " + resp.status);
      const s = await resp.json();
      document.getElementById("auth").classList.remove("shown");
      refreshMs = Math.max(500, 1000 * (s.refresh_s || 2));
      draw(s);
    } catch (err) {
      setText("error", "cannot read status: " + err.message);
    }
    schedule();
  }

  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(poll, refreshMs);
  }

  document.getElementById("key-form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    const input = document.getElementById("key");
    sessionStorage.setItem(KEY_ITEM, input.value);
    input.value = "";
    poll();
  });

  takeKeyFromFragment();
  poll();
})();

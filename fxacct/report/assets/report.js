// fxacct HTML report: draws the embedded profile document (schema fxacct.profile/1 plus "timeline").
// No library and no network: plain DOM and SVG. Every text from the data goes in through
// textContent, never as markup.
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("fxacct-data").textContent);
  const SVGNS = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);

  // ---- formatting: the conventions of fxacct/units.py (GiB = 2^30 B; k, M, G = 1e3, 1e6, 1e9)
  function fmtInt(n) { return n == null ? "–" : Number(n).toLocaleString("en-US"); }
  function fmtBytes(n) {
    if (n == null) return "–";
    if (Math.abs(n) < 1024) return n + " B";
    for (const [unit, size] of [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
      if (Math.abs(n) >= size) return (n / size).toFixed(2) + " " + unit;
    }
    return n + " B";
  }
  function fmtCount(n) {
    if (n == null) return "–";
    if (Math.abs(n) < 1000) return Number.isInteger(n) ? fmtInt(n) : n.toPrecision(3);
    for (const [unit, size] of [["E", 1e18], ["P", 1e15], ["T", 1e12], ["G", 1e9], ["M", 1e6], ["k", 1e3]]) {
      if (Math.abs(n) >= size) return (n / size).toFixed(3) + unit;
    }
    return String(n);
  }
  function fmtMs(ms) {  // fxacct/report/durations.py: µs below 1 ms, ms below 1 s, s above
    if (ms == null) return "–";
    if (Math.abs(ms) < 1) return +(ms * 1e3).toPrecision(3) + " µs";
    if (Math.abs(ms) < 1000) return +ms.toPrecision(3) + " ms";
    return +(ms / 1e3).toPrecision(3) + " s";
  }
  function fmtRatio(r) { return r == null ? "–" : r.toFixed(2) + "×"; }
  function pct(part, whole) { return whole ? (100 * part / whole).toFixed(1) + "%" : "–"; }
  const moduleName = (m) => (m === "" ? "(root)" : m);

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text != null) e.textContent = text;
    return e;
  }
  function svgEl(tag, attrs, text) {
    const e = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text != null) e.textContent = text;
    return e;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  // ---- tooltips: one fixed box each, beside the pointer, inside the window
  function showTip(tip, lines, event) {
    clear(tip);
    for (const line of lines) tip.appendChild(line);
    tip.hidden = false;
    const pad = 14, box = tip.getBoundingClientRect();
    let x = event.clientX + pad, y = event.clientY + pad;
    if (x + box.width > window.innerWidth) x = Math.max(0, event.clientX - pad - box.width);
    if (y + box.height > window.innerHeight) y = Math.max(0, event.clientY - pad - box.height);
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  function tipLine(label, value, mono) {
    const div = el("div");
    if (label) div.appendChild(el("b", {}, label + " "));
    div.appendChild(el("span", mono ? { class: "mono" } : {}, value));
    return div;
  }
  function tipTable(rows) {
    const table = el("table");
    for (const [label, value] of rows) {
      const tr = el("tr");
      tr.appendChild(el("td", {}, label));
      tr.appendChild(el("td", { class: "num" }, value));
      table.appendChild(tr);
    }
    return table;
  }

  // ---- summary
  function peakOf(memory) { return memory && (memory.per_rank || memory.peak_train); }
  function topCategories(peak, k) {
    return Object.entries(peak.by_category).filter(([, b]) => b > 0).sort((a, b) => b[1] - a[1]).slice(0, k)
      .map(([c, b]) => c.replace(/_/g, " ") + " " + fmtBytes(b)).join(", ");
  }
  function card(title, big, small, cls) {
    const c = el("div", { class: "card" + (cls ? " " + cls : "") });
    c.appendChild(el("h3", {}, title));
    c.appendChild(el("div", { class: "big" }, big));
    for (const s of [].concat(small || [])) if (s) c.appendChild(el("div", { class: "small" }, s));
    return c;
  }
  function subtitle() {
    const c = DATA.config;
    const parts = [DATA.model || "module", "batch " + c.batch];
    if (c.dtype) parts.push("dtype " + c.dtype);
    if (c.amp) parts.push("amp " + c.amp);
    parts.push("inputs " + (c.inputs.join(" ") || "–"), "optimizer " + c.optimizer);
    if (c.gpu) parts.push("target " + c.gpu);
    if (c.world_size > 1) parts.push("world size " + c.world_size + ", shard " + c.shard);
    $("subtitle").textContent = parts.join(" · ");
  }
  function flopsCard(t, c) {
    const total = t.forward_flops + t.backward_flops;
    const small = ["forward " + fmtCount(t.forward_flops) + ", backward " + fmtCount(t.backward_flops) +
                   "; loss " + fmtCount(t.loss_flops) + " apart"];
    if (c.tokens_per_example) {
      const tokens = c.batch * c.tokens_per_example;
      small.push(fmtCount(Math.floor(total / tokens)) + " per token (" + fmtInt(tokens) + " tokens)");
    }
    small.push("1 multiply-add = " + DATA.conventions.flops_per_fma + " FLOPs; " + fmtInt(total) + " exact");
    return card("FLOPs per training step", fmtCount(total), small);
  }
  function timeCards(t, c) {
    const cards = [], rt = DATA.runtime, pred = DATA.predicted;
    if (t.predicted_step_ms != null) {
      const small = [pred ? "on " + pred.device + " (" + pred.source + ")" : null];
      if (c.tokens_per_example) {
        small.push(fmtCount(c.batch * c.tokens_per_example / (t.predicted_step_ms / 1e3)) + " tokens/s per rank");
      }
      cards.push(card("Predicted step time", fmtMs(t.predicted_step_ms), small));
    } else {
      cards.push(card("Predicted step time", "not predicted",
                      "give --gpu NAME, or run `fxacct calibrate --device cpu` for this CPU"));
    }
    if (rt) {
      cards.push(card("Measured step time", fmtMs(rt.step_ms), [
        "median of " + rt.steps + " steps on " + rt.device + (rt.device_name ? " (" + rt.device_name + ")" : ""),
        "measured ÷ predicted " + fmtRatio(rt.step_ratio) + (rt.mfu != null ? "; MFU " + (100 * rt.mfu).toFixed(1) + "%" : "")]));
    }
    return cards;
  }
  function renderSummary() {
    subtitle();
    const t = DATA.totals, c = DATA.config, memory = DATA.memory || {}, box = $("summary-cards");
    box.appendChild(flopsCard(t, c));
    box.appendChild(card("Parameters", fmtCount(t.params), [
      "trainable " + fmtCount(t.trainable_params) + "; weights " + fmtBytes(t.param_bytes),
      "gradients " + fmtBytes(t.grad_bytes) + "; optimizer state " + fmtBytes(t.optimizer_bytes)]));
    const peak = peakOf(memory);
    if (peak) {
      box.appendChild(card("Training peak" + (memory.per_rank ? " (per rank)" : ""), fmtBytes(peak.bytes), [
        "at " + (peak.node || "the start") + " (" + peak.phase + ")", topCategories(peak, 3)]));
    }
    if (memory.peak_inference) {
      box.appendChild(card("Inference peak", fmtBytes(memory.peak_inference.bytes), "eval, no_grad, at " +
                           (memory.peak_inference.node || "the start")));
    }
    const fit = memory.fit;
    if (fit) {
      const fits = fit.headroom_bytes >= 0;
      box.appendChild(card("Fit on " + fit.gpu, fits ? "fits" : "does not fit", [
        "capacity " + fmtBytes(fit.capacity_bytes) + "; headroom " + fmtBytes(fit.headroom_bytes),
        fit.max_batch != null ? "largest batch " + fmtInt(fit.max_batch) + (fit.max_batch_verified ? " (traced)" : " (estimated)") : null],
        fits ? "good" : "bad"));
    }
    for (const c2 of timeCards(t, c)) box.appendChild(c2);
    renderNotes();
  }
  function renderNotes() {
    const notes = $("summary-notes"), unsupported = Object.entries(DATA.unsupported_ops || {});
    notes.appendChild(el("li", unsupported.length ? { class: "warn" } : {}, unsupported.length
      ? "ops without a cost formula (FLOPs unknown): " + unsupported.map(([op, n]) => op + " ×" + n).join(", ")
      : "every op has a cost formula"));
    for (const w of DATA.warnings || []) notes.appendChild(el("li", { class: "warn" }, w));
    notes.appendChild(el("li", {}, "attention " + DATA.conventions.causal_attention + "; recompute " +
                         DATA.conventions.recompute + "; GB = 1e9 B, GiB = 2^30 B"));
  }

  // ---- module tree and treemap
  const METRICS = { flops: { label: "FLOPs", fmt: fmtCount }, activation_bytes: { label: "activation bytes", fmt: fmtBytes } };
  const PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd"];

  function buildTree(modules) {
    const nodes = new Map();
    for (const m of modules) {
      nodes.set(m.module, { fqn: m.module, flops: m.forward_flops + m.backward_flops,
                            activation_bytes: m.activation_bytes, children: [], parent: null });
    }
    if (!nodes.has("")) {
      const root = { fqn: "", flops: 0, activation_bytes: 0, children: [], parent: null };
      for (const n of nodes.values()) if (!n.fqn.includes(".")) { root.flops += n.flops; root.activation_bytes += n.activation_bytes; }
      nodes.set("", root);
    }
    for (const n of nodes.values()) {
      if (n.fqn === "") continue;
      let up = n.fqn;
      do { up = up.includes(".") ? up.slice(0, up.lastIndexOf(".")) : ""; } while (!nodes.has(up));
      n.parent = nodes.get(up);
      n.parent.children.push(n);
    }
    return nodes.get("");
  }
  function childName(node) {
    const prefix = node.parent && node.parent.fqn ? node.parent.fqn + "." : "";
    return node.fqn.slice(prefix.length);
  }
  function hasChildren(node, key) { return !!node && node.children.some((c) => c[key] > 0); }
  function cellsOf(node, key) {
    const cells = node.children.filter((c) => c[key] > 0).map((c) => ({ node: c, value: c[key], label: childName(c) }));
    const own = node[key] - cells.reduce((s, c) => s + c.value, 0);
    if (own > 0) cells.push({ node: null, value: own, label: "(own ops)" });
    return cells.sort((a, b) => b.value - a.value);
  }

  // Squarified treemap (Bruls, Huizing, van Wijk 2000): rows of cells whose worst aspect ratio
  // stops improving; each cell's area is exactly value / total of the rectangle.
  function worst(row, side) {
    const s = row.reduce((a, b) => a + b, 0), max = Math.max(...row), min = Math.min(...row);
    return Math.max(side * side * max / (s * s), (s * s) / (side * side * min));
  }
  function squarify(values, x, y, w, h) {
    const total = values.reduce((a, b) => a + b, 0), rects = [];
    if (!(total > 0) || w <= 0 || h <= 0) return rects;
    const areas = values.map((v) => v * w * h / total);
    let row = [], i = 0;
    const place = () => {
      const s = row.reduce((a, b) => a + b, 0);
      if (w >= h) {  // a column at the left
        const cw = s / h; let cy = y;
        for (const a of row) { rects.push({ x: x, y: cy, w: cw, h: a / cw }); cy += a / cw; }
        x += cw; w -= cw;
      } else {  // a row at the top
        const rh = s / w; let cx = x;
        for (const a of row) { rects.push({ x: cx, y: y, w: a / rh, h: rh }); cx += a / rh; }
        y += rh; h -= rh;
      }
      row = [];
    };
    while (i < areas.length) {
      const side = Math.min(w, h), next = row.concat([areas[i]]);
      if (row.length === 0 || worst(next, side) <= worst(row, side)) { row = next; i++; } else place();
    }
    if (row.length) place();
    return rects;
  }

  const treemap = { root: null, focus: null, key: "flops" };
  function renderTreemap() {
    const svg = $("treemap"), W = svg.getBoundingClientRect().width, H = 420, key = treemap.key;
    clear(svg);
    svg.setAttribute("width", W);
    const focus = treemap.focus, cells = focus ? cellsOf(focus, key) : [];
    if (!cells.length) {
      svg.appendChild(svgEl("text", { x: 12, y: 24, class: "empty" }, "no " + METRICS[key].label + " in " +
                            (focus ? moduleName(focus.fqn) : "this profile")));
    }
    const rects = squarify(cells.map((c) => c.value), 0, 0, W, H);
    cells.forEach((cell, i) => drawCell(svg, cell, rects[i], i, focus[key]));
    renderCrumbs();
  }
  function drawCell(svg, cell, r, i, whole) {
    const key = treemap.key, zoomable = hasChildren(cell.node, key);
    const g = svgEl("g", { class: "cell-g" + (zoomable ? " zoomable" : ""), "data-module": cell.node ? cell.node.fqn : treemap.focus.fqn,
                           "data-value": cell.value });
    if (!cell.node) g.setAttribute("data-own", "1");
    g.appendChild(svgEl("rect", { class: "cell", x: r.x, y: r.y, width: r.w, height: r.h,
                                  fill: cell.node ? PALETTE[i % PALETTE.length] : "#9aa3ad" }));
    if (zoomable && r.w > 60 && r.h > 56) drawPreview(g, cell.node, r);
    if (r.w > 46 && r.h > 18) {
      g.appendChild(svgEl("text", { x: r.x + 5, y: r.y + 15 }, shorten(cell.label, r.w)));
      if (r.h > 34) g.appendChild(svgEl("text", { x: r.x + 5, y: r.y + 30, class: "sub" },
                                        METRICS[key].fmt(cell.value) + " · " + pct(cell.value, whole)));
    }
    g.addEventListener("mousemove", (e) => showTip($("tm-tip"), cellTip(cell, whole), e));
    g.addEventListener("mouseleave", () => { $("tm-tip").hidden = true; });
    if (zoomable) g.addEventListener("click", () => { $("tm-tip").hidden = true; zoomTo(cell.node); });
    svg.appendChild(g);
  }
  // The submodules of a cell, drawn inside it below its label: what a click would open.
  function drawPreview(g, node, r) {
    const cells = cellsOf(node, treemap.key), top = 36;
    const rects = squarify(cells.map((c) => c.value), r.x + 3, r.y + top, r.w - 6, r.h - top - 3);
    cells.forEach((c, i) => {
      const q = rects[i];
      g.appendChild(svgEl("rect", { class: "preview", x: q.x, y: q.y, width: q.w, height: q.h }));
      if (q.w > 40 && q.h > 16) g.appendChild(svgEl("text", { class: "sub", x: q.x + 4, y: q.y + 13 }, shorten(c.label, q.w)));
    });
  }
  function shorten(label, width) {
    const maxChars = Math.floor((width - 8) / 7);
    return label.length > maxChars ? label.slice(0, Math.max(1, maxChars - 1)) + "…" : label;
  }
  function cellTip(cell, whole) {
    const key = treemap.key, fqn = cell.node ? cell.node.fqn : treemap.focus.fqn, root = treemap.root[key];
    const lines = [tipLine(cell.node ? "module" : "own ops of", moduleName(fqn), true),
                   tipLine(METRICS[key].label, METRICS[key].fmt(cell.value) + " (" + fmtInt(cell.value) + ")"),
                   tipLine("share", pct(cell.value, whole) + " of " + moduleName(treemap.focus.fqn) + ", " + pct(cell.value, root) + " of the model")];
    if (cell.node) {
      const other = key === "flops" ? "activation_bytes" : "flops";
      lines.push(tipLine(METRICS[other].label, METRICS[other].fmt(cell.node[other])));
      if (hasChildren(cell.node, key)) lines.push(tipLine("", "click to zoom in"));
    }
    return lines;
  }
  function zoomTo(node) { treemap.focus = node; renderTreemap(); }
  function renderCrumbs() {
    const nav = $("tm-crumbs"), path = [];
    clear(nav);
    for (let n = treemap.focus; n; n = n.parent) path.unshift(n);
    path.forEach((n, i) => {
      if (i) nav.appendChild(el("span", { class: "sep" }, "›"));
      const label = n.fqn === "" ? "(model)" : childName(n);
      if (i === path.length - 1) { nav.appendChild(el("b", {}, label)); return; }
      const a = el("a", { role: "link", tabindex: "0", "data-module": n.fqn }, label);
      a.addEventListener("click", () => zoomTo(n));
      a.addEventListener("keydown", (e) => { if (e.key === "Enter") zoomTo(n); });
      nav.appendChild(a);
    });
    $("tm-up").disabled = !(treemap.focus && treemap.focus.parent);
  }
  function setupTreemap() {
    treemap.root = treemap.focus = DATA.modules && DATA.modules.length ? buildTree(DATA.modules) : null;
    $("tm-metric").addEventListener("change", (e) => { treemap.key = e.target.value; renderTreemap(); });
    $("tm-up").addEventListener("click", () => { if (treemap.focus && treemap.focus.parent) zoomTo(treemap.focus.parent); });
    document.addEventListener("keydown", (e) => {
      const typing = e.target instanceof HTMLInputElement || e.target instanceof HTMLSelectElement;
      if (e.key === "Backspace" && !typing && treemap.focus && treemap.focus.parent) zoomTo(treemap.focus.parent);
    });
    renderTreemap();
  }

  // ---- memory timeline: the data of fxacct/report/plot.py, stacked by category
  const CATEGORY_COLORS = { parameters: "#1f77b4", master_weights: "#ff7f0e", buffers: "#2ca02c", inputs: "#d62728",
                            gradients: "#9467bd", optimizer_state: "#8c564b", activations: "#e377c2", temporaries: "#7f7f7f" };
  const PHASE_COLORS = { forward: "#4c72b0", loss: "#c44e52", backward: "#dd8452", optimizer: "#55a868" };
  const BYTE_UNITS = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10], ["B", 1]];
  const timeline = { bins: null, cursor: null, op: null };

  function niceStep(max, ticks) {
    const raw = max / ticks, mag = 10 ** Math.floor(Math.log10(raw));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
    return 10 * mag;
  }
  // Columns of at least 2 px; each shows its highest op (first one on a tie, as the peak walk).
  function binOps(totals, columns) {
    const n = totals.length, bins = [];
    for (let j = 0; j < columns; j++) {
      const a = Math.floor(j * n / columns), b = Math.floor((j + 1) * n / columns);
      let best = a;
      for (let i = a + 1; i < b; i++) if (totals[i] > totals[best]) best = i;
      bins.push({ a: a, b: b, op: best });
    }
    return bins;
  }
  function renderTimeline() {
    const T = DATA.timeline, svg = $("timeline");
    clear(svg);
    if (!T || !T.names.length) { svg.appendChild(svgEl("text", { x: 12, y: 24 }, "no ops in the step")); return; }
    const W = svg.getBoundingClientRect().width, H = 320, m = { l: 70, r: 16, t: 34, b: 30 };
    svg.setAttribute("width", W);
    const plotW = Math.max(10, W - m.l - m.r), plotH = H - m.t - m.b;
    const totals = T.bytes.map((row) => row.reduce((a, b) => a + b, 0));
    const bins = binOps(totals, Math.max(1, Math.min(totals.length, Math.floor(plotW / 2))));
    const bw = plotW / bins.length, maxY = totals.reduce((a, b) => Math.max(a, b), 1) * 1.12;  // no spread: 10^5 ops
    const X = (j) => m.l + j * bw, Y = (v) => m.t + plotH - plotH * v / maxY;
    timeline.bins = bins; timeline.geom = { m: m, bw: bw, plotH: plotH, X: X, Y: Y, totals: totals };
    drawAxes(svg, maxY, m, plotW, plotH, Y, totals.length);
    drawPhases(svg, T, bins, X, bw, m, plotH);
    drawStacks(svg, T, bins, X, bw, Y);
    drawPeak(svg, T, bins, X, bw, Y, W);
    const overlay = svgEl("rect", { id: "tl-overlay", x: m.l, y: m.t, width: plotW, height: plotH, fill: "#000", "fill-opacity": 0 });
    overlay.addEventListener("mousemove", (e) => hoverTimeline(e));
    overlay.addEventListener("mouseleave", () => { $("tl-tip").hidden = true; setCursor(null); });
    svg.appendChild(overlay);
  }
  function drawAxes(svg, maxY, m, plotW, plotH, Y, n) {
    const [unit, size] = BYTE_UNITS.find(([, s]) => maxY >= s) || ["B", 1];
    const step = niceStep(maxY / size, 5);
    for (let v = 0; v * size <= maxY; v += step) {
      svg.appendChild(svgEl("line", { class: "grid", x1: m.l, x2: m.l + plotW, y1: Y(v * size), y2: Y(v * size) }));
      svg.appendChild(svgEl("text", { x: m.l - 6, y: Y(v * size) + 4, "text-anchor": "end" }, +v.toPrecision(6) + " " + unit));
    }
    svg.appendChild(svgEl("text", { x: m.l + plotW / 2, y: m.t + plotH + 22, "text-anchor": "middle" },
                          "op index in the step (" + fmtInt(n) + " ops)"));
  }
  function drawPhases(svg, T, bins, X, bw, m, plotH) {
    const spans = [];
    bins.forEach((bin, j) => {
      const phase = T.phases[bin.op], last = spans[spans.length - 1];
      if (last && last.phase === phase) last.to = j; else spans.push({ phase: phase, from: j, to: j });
    });
    for (const s of spans) {
      const color = PHASE_COLORS[s.phase] || "#999", x = X(s.from), w = X(s.to) + bw - x;
      svg.appendChild(svgEl("rect", { x: x, y: m.t, width: w, height: plotH, fill: color, "fill-opacity": 0.07 }));
      svg.appendChild(svgEl("rect", { x: x, y: m.t - 8, width: w, height: 5, fill: color, class: "phase-band", "data-phase": s.phase }));
      if (w > 50) svg.appendChild(svgEl("text", { x: x + 2, y: m.t - 12 }, s.phase));
    }
  }
  function drawStacks(svg, T, bins, X, bw, Y) {
    const under = bins.map(() => 0);
    T.categories.forEach((cat, k) => {
      const top = bins.map((bin, j) => under[j] + T.bytes[bin.op][k]);
      let d = "";
      bins.forEach((bin, j) => { d += (j ? "L" : "M") + X(j) + "," + Y(top[j]) + "L" + (X(j) + bw) + "," + Y(top[j]); });
      for (let j = bins.length - 1; j >= 0; j--) d += "L" + (X(j) + bw) + "," + Y(under[j]) + "L" + X(j) + "," + Y(under[j]);
      svg.appendChild(svgEl("path", { d: d + "Z", fill: CATEGORY_COLORS[cat] || "#999", "fill-opacity": 0.85, "data-category": cat }));
      top.forEach((v, j) => { under[j] = v; });
    });
    const legend = $("tl-legend");
    clear(legend);
    for (const cat of T.categories) {
      const item = el("span");
      item.appendChild(el("span", { class: "sw", style: "background:" + (CATEGORY_COLORS[cat] || "#999") }));
      item.appendChild(document.createTextNode(cat.replace(/_/g, " ")));
      legend.appendChild(item);
    }
  }
  function drawPeak(svg, T, bins, X, bw, Y, W) {
    const peak = T.peak;
    if (!peak) return;
    const j = bins.findIndex((bin) => peak.index >= bin.a && peak.index < bin.b), cx = X(j) + bw / 2, cy = Y(peak.bytes);
    const g = svgEl("g", { id: "tl-peak", "pointer-events": "none", "data-index": peak.index, "data-node": peak.node });
    g.appendChild(svgEl("path", { id: "tl-peak-marker", d: "M" + (cx - 6) + "," + (cy - 11) + "L" + (cx + 6) + "," + (cy - 11) + "L" + cx + "," + (cy - 1) + "Z", fill: "#000" }));
    const right = cx > W / 2;
    g.appendChild(svgEl("text", { class: "peak-label", x: right ? cx - 9 : cx + 9, y: cy - 3, "text-anchor": right ? "end" : "start" },
                        "peak " + fmtBytes(peak.bytes) + " at " + peak.node + " (" + peak.phase + ")"));
    svg.appendChild(g);
  }
  function setCursor(j) {
    const svg = $("timeline"), old = $("tl-cursor");
    if (old) old.remove();
    timeline.cursor = j;
    if (j == null) return;
    const { X, bw, m, plotH } = timeline.geom, x = X(j) + bw / 2;
    svg.insertBefore(svgEl("line", { id: "tl-cursor", class: "cursor", x1: x, x2: x, y1: m.t, y2: m.t + plotH }), $("tl-overlay"));
  }
  function stepTimeline(e) {  // keyboard: ← → step op by op (every op, not one per column), Home / End
    const n = DATA.timeline ? DATA.timeline.names.length : 0, moves = { ArrowLeft: -1, ArrowRight: 1, Home: -n, End: n };
    if (!n || !timeline.bins || !(e.key in moves)) return;
    e.preventDefault();
    const i = Math.min(n - 1, Math.max(0, (timeline.op == null ? -1 : timeline.op) + moves[e.key]));
    const j = timeline.bins.findIndex((bin) => i >= bin.a && i < bin.b);
    setCursor(j);
    timeline.op = i;
    const box = $("timeline").getBoundingClientRect(), { X, bw, m } = timeline.geom;
    showTip($("tl-tip"), timelineTip({ a: i, b: i + 1, op: i }), { clientX: box.left + X(j) + bw / 2, clientY: box.top + m.t + 20 });
  }
  function hoverTimeline(e) {
    const { m, bw } = timeline.geom, box = $("timeline").getBoundingClientRect();
    const j = Math.min(timeline.bins.length - 1, Math.max(0, Math.floor((e.clientX - box.left - m.l) / bw)));
    setCursor(j);
    timeline.op = timeline.bins[j].op;
    showTip($("tl-tip"), timelineTip(timeline.bins[j]), e);
  }
  function timelineTip(bin) {
    const T = DATA.timeline, i = bin.op, total = timeline.geom.totals[i];
    const lines = [tipLine("node", T.names[i], true), tipLine("module", moduleName(T.modules[i]), true),
                   tipLine("phase", T.phases[i] + (T.peak && i === T.peak.index ? " · the peak" : "")),
                   tipLine("op", bin.b - bin.a > 1 ? "#" + i + " (highest of ops " + bin.a + "–" + (bin.b - 1) + ")" : "#" + i),
                   tipLine("live", fmtBytes(total) + " (" + fmtInt(total) + " B)")];
    lines.push(tipTable(T.categories.map((c, k) => [c.replace(/_/g, " "), fmtBytes(T.bytes[i][k])])));
    return lines;
  }

  // ---- sortable tables: click a header to sort (numbers descending first), again to reverse
  function sortableTable(table, columns, rows, opts) {
    const state = { key: null, dir: 1, query: "", limit: (opts && opts.limit) || Infinity };
    const head = table.tHead.rows[0] || table.tHead.insertRow(), body = table.tBodies[0] || table.createTBody();
    clear(head);
    for (const col of columns) {
      const th = el("th", { "data-key": col.key, scope: "col", title: col.title || "click to sort" }, col.label);
      if (col.num) th.classList.add("num");
      th.addEventListener("click", () => {
        state.dir = state.key === col.key ? -state.dir : (col.num ? -1 : 1);
        state.key = col.key;
        for (const other of head.children) other.removeAttribute("aria-sort");
        th.setAttribute("aria-sort", state.dir < 0 ? "descending" : "ascending");
        draw();
      });
      head.appendChild(th);
    }
    const value = (row, col) => (col.get ? col.get(row) : row[col.key]);
    function draw() {
      let shown = rows.filter((row) => !state.query || state.query.every((q) => row._text.includes(q)));
      if (state.key) {
        const col = columns.find((c) => c.key === state.key);
        shown = shown.slice().sort((a, b) => {  // stable: ties keep the document's order
          const va = value(a, col), vb = value(b, col);
          if (va == null || vb == null) return (va == null) - (vb == null);
          return state.dir * (col.num ? va - vb : String(va).localeCompare(String(vb)));
        });
      }
      clear(body);
      for (const row of shown.slice(0, state.limit)) {
        const tr = el("tr");
        for (const col of columns) {
          const v = value(row, col), td = el("td", {}, col.render ? null : col.fmt ? col.fmt(v) : (v == null ? "–" : String(v)));
          if (col.render) col.render(td, row);
          if (col.num) { td.classList.add("num"); if (v != null) td.title = fmtInt(v); }
          if (col.mono) td.classList.add("mono");
          tr.appendChild(td);
        }
        body.appendChild(tr);
      }
      if (opts && opts.onDraw) opts.onDraw(shown.length, rows.length, Math.min(shown.length, state.limit));
    }
    for (const row of rows) row._text = (opts && opts.text ? opts.text(row) : "").toLowerCase();
    draw();
    return { filter: (q) => { state.query = q.toLowerCase().split(/\s+/).filter(Boolean); draw(); } };
  }

  function renderNodes() {
    const measured = new Map(((DATA.runtime && DATA.runtime.nodes) || []).map((r) => [r.name, r]));
    const rows = DATA.nodes.map((n) => Object.assign({}, n, { flops: n.forward_flops + n.backward_flops }, measured.get(n.name)
      ? { predicted_ms: measured.get(n.name).predicted_ms, measured_ms: measured.get(n.name).measured_ms } : {}));
    const columns = [
      { key: "name", label: "node", mono: true }, { key: "op", label: "op", mono: true },
      { key: "module", label: "module", mono: true, fmt: moduleName },
      { key: "shape", label: "shape", get: (r) => r.shape.join("×") }, { key: "dtype", label: "dtype" }, { key: "kind", label: "kind" },
      { key: "forward_flops", label: "forward FLOPs", num: true, fmt: fmtCount },
      { key: "backward_flops", label: "backward FLOPs", num: true, fmt: fmtCount },
      { key: "flops", label: "FLOPs", num: true, fmt: fmtCount, title: "forward + backward; click to sort" },
      { key: "activation_bytes", label: "saved", num: true, fmt: fmtBytes, title: "bytes saved for backward; click to sort" },
      { key: "output_bytes", label: "new bytes", num: true, fmt: fmtBytes, title: "newly allocated output bytes; click to sort" }];
    if (measured.size) {
      columns.push({ key: "predicted_ms", label: "predicted", num: true, fmt: fmtMs },
                   { key: "measured_ms", label: "measured", num: true, fmt: fmtMs });
    }
    const table = sortableTable($("node-table"), columns, rows, {
      limit: 2000,
      text: (r) => [r.name, r.op, r.module, r.kind, r.dtype].join(" "),
      onDraw: (shown, all, drawn) => {
        $("nt-count").textContent = shown === all ? fmtInt(all) + " nodes" : fmtInt(shown) + " of " + fmtInt(all) + " nodes";
        $("nt-more").hidden = drawn === shown;
        $("nt-more").textContent = "showing the first " + fmtInt(drawn) + " rows; filter or sort to see others";
      } });
    $("nt-filter").addEventListener("input", (e) => table.filter(e.target.value));
  }

  // ---- --mesh: the mesh and whose account this is, the collectives by op, mesh dim and phase
  // (fxacct/report/collectives.py's table), and under pp each rank's stages
  function renderParallel() {
    const mesh = DATA.mesh;
    if (!mesh) return;
    $("parallel").hidden = false;
    const dims = Object.entries(mesh.dims).map(([d, n]) => d + "=" + n).join(",");
    const wire = DATA.totals.comm_wire_bytes;
    $("mesh-line").textContent = "--mesh " + dims + ": " + mesh.world_size + " ranks; every figure on this page is rank "
      + mesh.rank + "'s" + (DATA.pipeline ? " (pipeline stage 0)" : "")
      + (wire != null ? "; it puts " + fmtBytes(wire) + " on the wire per step" : "");
    const body = $("parallel-body");
    const groups = new Map();
    for (const c of DATA.collectives || []) {
      const key = [c.op, c.mesh_dim, c.phase].join("\u0000");
      const g = groups.get(key) || { op: c.op, mesh_dim: c.mesh_dim, phase: c.phase, count: 0, bytes: 0, wire_bytes: 0,
                                     predicted_ms: null };
      g.count += c.count; g.bytes += c.bytes; g.wire_bytes += c.wire_bytes;
      if (c.predicted_ms != null) g.predicted_ms = (g.predicted_ms || 0) + c.predicted_ms;
      groups.set(key, g);
    }
    if (groups.size) {
      body.appendChild(el("h3", {}, "collectives (count, buffer bytes on this rank, bytes it sends)"));
      const table = body.appendChild(el("table", { class: "data", id: "collectives" }));
      table.appendChild(el("thead"));
      sortableTable(table, [
        { key: "op", label: "op", mono: true }, { key: "mesh_dim", label: "mesh dim", mono: true },
        { key: "phase", label: "phase" }, { key: "count", label: "count", num: true, fmt: fmtInt },
        { key: "bytes", label: "bytes", num: true, fmt: fmtBytes }, { key: "wire_bytes", label: "wire", num: true, fmt: fmtBytes },
        { key: "predicted_ms", label: "predicted", num: true, fmt: fmtMs }], [...groups.values()]);
    }
    const pipe = DATA.pipeline;
    if (!pipe) return;
    body.appendChild(el("h3", {}, "pipeline: " + pipe.schedule + ", " + pipe.microbatches + " micro-batches, bubble "
      + pct(pipe.bubble_fraction, 1) + " of the step"));
    const stages = body.appendChild(el("table", { class: "data", id: "pipeline-stages" }));
    stages.appendChild(el("thead"));
    sortableTable(stages, [
      { key: "stage", label: "rank", num: true, fmt: String }, { key: "stages_on_rank", label: "stages", get: (r) => r.stages_on_rank.join(", ") },
      { key: "in_flight_microbatches", label: "in flight", num: true, fmt: fmtInt },
      { key: "peak_bytes", label: "peak", num: true, fmt: fmtBytes }, { key: "param_bytes", label: "parameters", num: true, fmt: fmtBytes },
      { key: "send_bytes", label: "sends", num: true, fmt: fmtBytes }, { key: "recv_bytes", label: "receives", num: true, fmt: fmtBytes }],
      pipe.stages.map((s) => Object.assign({}, s)));
  }

  // ---- predicted beside measured: by phase, and per module after --runtime
  function renderTime() {
    const rt = DATA.runtime, pred = DATA.predicted;
    if (!rt && !pred) return;
    $("time").hidden = false;
    const body = $("time-body"), phases = ["forward", "backward", "optimizer", "step"];
    const predicted = (p) => (rt ? rt[p === "step" ? "predicted_step_ms" : "predicted_" + p + "_ms"] : pred[p + "_ms"]);
    const phaseRows = phases.map((p) => ({ phase: p, predicted_ms: predicted(p), measured_ms: rt ? rt[p + "_ms"] : null }))
      .map((r) => Object.assign(r, { ratio: r.measured_ms != null && r.predicted_ms ? r.measured_ms / r.predicted_ms : null }));
    body.appendChild(el("h3", {}, "by phase" + (pred ? " (prediction: " + pred.device + ", " + pred.source + ")" : "")));
    if (!pred) body.appendChild(el("p", { class: "hint" }, "no prediction: give --gpu NAME, or run `fxacct calibrate --device cpu` for this CPU"));
    const phaseTable = body.appendChild(el("table", { class: "data", id: "time-phases" }));
    phaseTable.appendChild(el("thead"));
    sortableTable(phaseTable, timeColumns("phase", "phase", !!rt), phaseRows);
    const modules = rt ? rt.modules : pred.modules.map((m) => ({ module: m.module, predicted_ms: (m.forward_ms || 0) + (m.backward_ms || 0) }));
    if (!modules.length) return;
    body.appendChild(el("h3", {}, rt ? "by module: predicted beside measured (forward + backward)" : "by module: predicted (forward + backward)"));
    const table = body.appendChild(el("table", { class: "data", id: "time-modules" }));
    table.appendChild(el("thead"));
    const max = modules.reduce((a, m) => Math.max(a, m.predicted_ms || 0, m.measured_ms || 0), 1e-12);
    const columns = timeColumns("module", "module", !!rt);
    columns.push({ key: "bars", label: rt ? "predicted / measured" : "predicted", get: () => null,
                   render: (td, row) => drawBars(td, row, max) });
    sortableTable(table, columns, modules.map((m) => Object.assign({}, m)));
  }
  function timeColumns(key, label, measured) {
    const cols = [{ key: key, label: label, mono: key === "module", fmt: key === "module" ? moduleName : null }];
    if (key === "module" && measured) cols.push({ key: "flops", label: "FLOPs", num: true, fmt: fmtCount });
    cols.push({ key: "predicted_ms", label: "predicted", num: true, fmt: fmtMs });
    if (measured) cols.push({ key: "measured_ms", label: "measured", num: true, fmt: fmtMs },
                            { key: "ratio", label: "measured ÷ predicted", num: true, fmt: fmtRatio });
    return cols;
  }
  function drawBars(td, row, max) {
    for (const [cls, v] of [["pred", row.predicted_ms], ["meas", row.measured_ms]]) {
      if (v == null) continue;
      td.appendChild(el("span", { class: "bar " + cls, style: "width:" + Math.max(1, 160 * v / max).toFixed(1) + "px",
                                  title: (cls === "pred" ? "predicted " : "measured ") + fmtMs(v) }));
      td.appendChild(el("br"));
    }
  }

  // ---- start
  function render() { renderTreemap(); renderTimeline(); }
  renderSummary();
  renderParallel();
  setupTreemap();
  renderTimeline();
  $("timeline").addEventListener("keydown", stepTimeline);
  $("timeline").addEventListener("blur", () => { $("tl-tip").hidden = true; setCursor(null); });
  renderTime();
  renderNodes();
  let resizeTimer = null;
  window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(render, 120); });
  document.body.setAttribute("data-ready", "1");
})();

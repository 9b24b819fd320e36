"use strict";
const $ = (id) => document.getElementById(id);
const pct = (v) => v === null || v === undefined ? "-" : (100 * v).toFixed(2) + "%";
const num = (v, d = 2) => v === null || v === undefined ? "-" : Number(v).toFixed(d);
const ms = (v) => v === null || v === undefined ? "-" : Math.abs(v) < 0.001 ? (1e6 * v).toFixed(0) + " \u00b5s" : (1000 * v).toFixed(1) + " ms";
// the error budget left: a share while some is left; once spent, how many budgets were spent
// (1 - left: the misses over the misses allowed), as the SRE workbook counts budget consumed
const budget = (v) => v === null || v === undefined ? "no data" : v > 0 ? pct(v) : `exhausted (${times(1 - v)}\u00a0spent)`;
const times = (v) => (v >= 100 ? Math.round(v).toLocaleString("en-US") : Number(v).toFixed(1)) + "x";
const burn = (v) => v === null || v === undefined ? "no data" : times(v);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({"&":"&amp;","<":"&lt;",">":"&gt;","\"":"&quot;","'":"&#39;"}[c]));
// the objectives' units, as the tuner names them (tuner/spec.py; the page handler writes them)
const unit = (objective) => JSON.parse(document.body.dataset.objectiveUnits || "{}")[objective] ?? "";
let selected = location.hash.startsWith("#tenant=") ? decodeURIComponent(location.hash.slice(8)) : null;

async function getJSON(path) {
  const resp = await fetch(path, {credentials: "same-origin", headers: {"Accept": "application/json"}});
  if (resp.status === 401) { location.href = "/dashboard/login"; throw new Error("logged out"); }
  if (!resp.ok) throw new Error(path + ": " + resp.status);
  return resp.json();
}

function cell(value, field, text, cls, title) {
  return `<td data-field="${field}" data-value="${value === null || value === undefined ? "" : esc(value)}"${cls ? ` class="${cls}"` : ""}` +
    `${title ? ` title="${esc(title)}"` : ""}>${esc(text)}</td>`;
}

function budgetTitle(v) {
  if (v === null || v === undefined) return "no requests checked against a target in 30 days";
  return v > 0 ? `${pct(1 - v)} of the 30-day error budget spent` :
    `the 30-day error budget is spent ${times(1 - v)} over (${pct(1 - v)} of it consumed)`;
}

function renderTenants(data) {
  const rows = data.tenants.map((t) => {
    const ttftMiss = t.slo.ttft_p99_s !== null && t.p99_1h.ttft !== null && t.p99_1h.ttft > t.slo.ttft_p99_s;
    const tpotMiss = t.slo.tpot_p99_s !== null && t.p99_1h.tpot !== null && t.p99_1h.tpot > t.slo.tpot_p99_s;
    // ITL is pooled over gaps: the share of the hour's gaps within the target (p99 ITL <= X: 99% of them)
    const itl = t.itl_attainment["1h"], itlMiss = t.slo.itl_p99_s !== null && itl !== null && itl < t.target;
    const queued = t.queue ? t.queue.queued_requests : "-";
    return `<tr class="tenant ${esc(t.state)}" data-tenant="${esc(t.name)}" data-state="${esc(t.state)}">` +
      `<td>${esc(t.name)}</td><td><span class="state ${esc(t.state)}">${esc(t.state.replace("_", " "))}</span></td>` +
      cell(t.requests_per_s, "requests_per_s", num(t.requests_per_s)) +
      cell(t.rejected_1h, "rejected_1h", t.rejected_1h) +
      cell(t.p99_1h.ttft, "p99_ttft", `${ms(t.p99_1h.ttft)} / ${ms(t.slo.ttft_p99_s)}`, ttftMiss ? "miss" : "") +
      cell(t.p99_1h.tpot, "p99_tpot", `${ms(t.p99_1h.tpot)} / ${ms(t.slo.tpot_p99_s)}`, tpotMiss ? "miss" : "") +
      cell(itl, "itl_attainment_1h", t.slo.itl_p99_s === null ? "no target" : itl === null ? "no data" : `${pct(itl)} \u2264 ${ms(t.slo.itl_p99_s)}`,
           itlMiss ? "miss" : itl === null ? "muted" : "") +
      cell(t.attainment["1h"], "attainment_1h", pct(t.attainment["1h"]), t.attainment["1h"] !== null && t.attainment["1h"] < t.target ? "miss" : "") +
      cell(t.attainment["24h"], "attainment_24h", pct(t.attainment["24h"])) +
      cell(t.attainment["30d"], "attainment_30d", pct(t.attainment["30d"])) +
      cell(t.budget_left_30d, "budget_left_30d", budget(t.budget_left_30d), t.budget_left_30d === null ? "muted" : t.budget_left_30d <= 0 ? "miss" : "", budgetTitle(t.budget_left_30d)) +
      cell(t.burn_rate["1h"], "burn_1h", burn(t.burn_rate["1h"]), t.burn_rate["1h"] === null ? "muted" : "") +
      cell(t.burn_rate["6h"], "burn_6h", burn(t.burn_rate["6h"]), t.burn_rate["6h"] === null ? "muted" : "") +
      `<td>${esc(queued)}</td></tr>`;
  });
  document.querySelector("#tenants tbody").innerHTML = rows.join("") ||
    `<tr><td colspan="14" class="muted">no tenants</td></tr>`;
  $("tenants-note").textContent = data.note;
  document.querySelectorAll("tr.tenant").forEach((tr) => tr.addEventListener("click", () => {
    selected = tr.dataset.tenant; location.hash = "tenant=" + encodeURIComponent(selected); refreshDetail();
  }));
}

// ---- plots: inline SVG drawn at the box's own pixel size, so text is never scaled ---------------
const MARGIN = {left: 58, right: 16, top: 22, bottom: 40};  // top: room for the target's label
const MINUTE_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440];
const clock = (minute) => new Date(minute * 60000).toLocaleTimeString([], {hour: "2-digit", minute: "2-digit", hourCycle: "h23"});
const general = (v) => Number(v.toPrecision(3)).toString();

// round tick values over [lo, hi], about `n` of them (steps of 1, 2 or 5 times a power of ten,
// or, on a time axis, whole minutes and hours)
function tickStep(span, n, time) {
  const raw = span / n, tenth = 10 ** Math.floor(Math.log10(raw || 1));
  return time ? (MINUTE_STEPS.find((s) => s >= raw) ?? 1440) : [1, 2, 5, 10].map((m) => m * tenth).find((s) => s >= raw);
}

function ticks(lo, hi, step) {
  const out = [];
  for (let v = Math.ceil(lo / step - 1e-9) * step; v <= hi + 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

// x and y: {label, min, max, format, time, integer}; a time axis counts minutes since the epoch;
// an axis without a max ends at the first round step above the data
function plot(svg, points, {x = {}, y = {}, target = null, color = "#2f5bd3", bars = false, second = null} = {}) {
  const w = svg.clientWidth || 600, h = svg.clientHeight || 200;
  const left = MARGIN.left, right = w - MARGIN.right, top = MARGIN.top, bottom = h - MARGIN.bottom;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  const all = points.concat(second || []);
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let x0 = x.min ?? Math.min(...xs), x1 = x.max ?? Math.max(...xs);
  if (!all.length) [x0, x1] = [x.min ?? 0, x.max ?? 1];
  if (x1 <= x0) [x0, x1] = [x0 - 0.5, x1 + 0.5];
  const y0 = y.min ?? Math.min(0, ...ys), yHigh = y.max ?? Math.max(y0 + 1e-9, ...ys);
  const yStep = tickStep(yHigh - y0, 4), y1 = y.max ?? Math.ceil(yHigh / yStep - 1e-9) * yStep;
  const yTicks = ticks(y0, y1, yStep);
  const X = (v) => left + (right - left) * (v - x0) / (x1 - x0), Y = (v) => bottom - (bottom - top) * (v - y0) / (y1 - y0);
  const fx = x.format ?? (x.time ? clock : general), fy = y.format ?? general;
  let out = `<line x1="${left}" y1="${bottom}" x2="${right}" y2="${bottom}" stroke="#9aa1ad"/>` +
    `<line x1="${left}" y1="${top}" x2="${left}" y2="${bottom}" stroke="#9aa1ad"/>`;
  out += yTicks.map((v) => `<line x1="${left}" x2="${right}" y1="${Y(v)}" y2="${Y(v)}" stroke="#eceef2"/>` +
    `<text class="tick y-tick" x="${left - 6}" y="${Y(v) + 4}" text-anchor="end">${esc(fy(v))}</text>`).join("");
  // a tick's label is centred on it, or kept inside the box at either end
  const anchor = (px) => px < left + 24 ? "start" : px > right - 24 ? "end" : "middle";
  const xTicks = ticks(x0, x1, Math.max(x.integer ? 1 : 0, tickStep(x1 - x0, Math.max(2, Math.floor((right - left) / 90)), x.time)));
  out += xTicks.map((v) => `<line x1="${X(v)}" x2="${X(v)}" y1="${bottom}" y2="${bottom + 4}" stroke="#9aa1ad"/>` +
    `<text class="tick x-tick" x="${X(v)}" y="${bottom + 16}" text-anchor="${anchor(X(v))}">${esc(fx(v))}</text>`).join("");
  out += `<text class="x-label" x="${(left + right) / 2}" y="${h - 6}" text-anchor="middle">${esc(x.label ?? "")}</text>` +
    `<text class="y-label" transform="translate(14 ${(top + bottom) / 2}) rotate(-90)" text-anchor="middle">${esc(y.label ?? "")}</text>`;
  if (!points.length) out += `<text class="empty" x="${(left + right) / 2}" y="${(top + bottom) / 2}" text-anchor="middle">no data in this window</text>`;
  // a minute's bar spans its minute (on a time axis), at least 2 px and at most 12 px wide
  const barWidth = Math.max(2, Math.min(12, 0.8 * (right - left) / (x1 - x0)));
  const middle = x.time ? 0.5 : 0;
  const draw = (pts, c) => bars
    ? pts.map((p) => `<rect x="${X(p[0] + middle) - barWidth / 2}" y="${Y(p[1])}" width="${barWidth}" height="${Y(y0) - Y(p[1])}" fill="${c}"/>`).join("")
    : `<polyline fill="none" stroke="${c}" stroke-width="2" points="${pts.map((p) => `${X(p[0] + middle)},${Y(p[1])}`).join(" ")}"/>` +
      pts.map((p) => `<circle cx="${X(p[0] + middle)}" cy="${Y(p[1])}" r="2.5" fill="${c}"/>`).join("");
  out += draw(points, color);
  if (second) out += draw(second, "#c5221f");
  // the target over the data, labelled, in the headroom the axis leaves above it
  if (target !== null) out += `<line class="target" x1="${left}" x2="${right}" y1="${Y(target)}" y2="${Y(target)}" stroke="#1d2330" stroke-width="1.5" stroke-dasharray="6 4"/>` +
    `<text class="target-label" x="${left + 6}" y="${Y(target) - 5}">${esc(fy(target))} target</text>`;
  svg.innerHTML = out;
}

// the minutes a tenant's series spans: from its first minute with traffic (at least the last
// 30 minutes) to now
function timeAxis(series, now) {
  const last = Math.floor(now / 60) + 1;
  return {time: true, label: "time (local, per minute)", min: Math.min(last - 30, ...series.map((m) => m.minute)), max: last};
}
const pct0 = (v) => (100 * v).toFixed(0) + "%";

async function refreshDetail() {
  if (!selected) return;
  const d = await getJSON(`/admin/slo/tenants/${encodeURIComponent(selected)}?hours=6`);
  $("detail").style.display = "block";
  $("detail-title").textContent = `${d.name}, the last ${d.hours} hours: ${d.state.replace("_", " ")}; error budget 30d: ${budget(d.budget_left_30d)}`;
  const time = timeAxis(d.series, Date.now() / 1000);
  plot($("plot-requests"), d.series.map((m) => [m.minute, m.requests]), {bars: true, x: time, y: {label: "requests / min"},
       second: d.series.filter((m) => m.rejected).map((m) => [m.minute, m.rejected])});
  // 0 to 110%: the 99% target sits below the top edge, with its label above it
  plot($("plot-attainment"), d.series.filter((m) => m.slo_checked).map((m) => [m.minute, m.slo_met / m.slo_checked]),
       {x: time, y: {label: "met the SLO (%)", min: 0, max: 1.1, format: pct0}, target: d.target,
        second: d.series.filter((m) => m.itl_gaps).map((m) => [m.minute, m.itl_gaps_met / m.itl_gaps])});
  const limits = Object.entries(d.limits).filter(([, v]) => v !== null).map(([k, v]) => `${k} ${v}`).join(", ");
  $("detail-limits").textContent = `limits: ${limits || "none"}; SLO: p99 TTFT <= ${ms(d.slo.ttft_p99_s)}, p99 TPOT <= ${ms(d.slo.tpot_p99_s)}, ` +
    `p99 ITL <= ${ms(d.slo.itl_p99_s)} (ITL gaps: error budget 30d: ${budget(d.itl_budget_left_30d)}, burn 1h: ${burn(d.itl_burn_rate["1h"])})`;
}

// ejected: outlier detection keeps it out of dispatch until `ejected_until` (its requests failed)
function engineHealth(e) {
  const o = e.outlier;
  if (o.ejected) {
    const left = Math.max(0, Math.round(o.ejected_until - Date.now() / 1000));
    return `<span class="miss" title="ejection ${esc(o.ejections)} (${esc(o.ejections_total)} in all)">ejected ${esc(left)} s</span>`;
  }
  if (!e.healthy) return '<span class="miss">down</span>';
  return e.draining ? "draining" : "healthy";
}

function errorRate(o) {
  if (o.error_rate === null) return "-";
  const fails = o.consecutive_failures ? `, ${o.consecutive_failures} in a row` : "";
  return `${pct(o.error_rate)} of ${o.window_requests}${fails}`;
}

function renderEngines(data) {
  document.querySelector("#engines tbody").innerHTML = data.engines.map((e) => {
    const l = e.load || {}, kv = l.kv_usage ?? null;
    const hits = l.prefix_cache_queries ? l.prefix_cache_hits / l.prefix_cache_queries : null;
    const problems = e.problems.map((p) => esc(p.what)).join("; ");
    return `<tr data-engine="${esc(e.name)}"><td>${esc(e.name)}</td><td>${engineHealth(e)}</td><td>${esc(errorRate(e.outlier))}</td>` +
      `<td>${esc(l.running ?? "-")}</td><td>${esc(l.waiting ?? "-")}</td><td>${esc(l.swapped ?? "-")}</td>` +
      `<td>${kv === null || !isFinite(Number(kv)) ? "-" : `<span class="bar${kv > 0.95 ? " hot" : ""}"><i style="width:${(100 * Number(kv)).toFixed(0)}%"></i></span>${esc(pct(kv))}`}</td>` +
      `<td>${esc(l.num_preemptions ?? "-")}</td><td>${esc(pct(hits))}</td><td>${esc(l.max_num_seqs ?? "-")}</td><td>${esc(l.max_num_batched_tokens ?? "-")}</td>` +
      `<td class="problem">${problems}</td></tr>`;
  }).join("");
}

// one reason copies failed: the target's status (none: it did not answer) and error code
function failure(f) {
  return `<span class="failure" data-status="${esc(f.status ?? "")}" data-code="${esc(f.code)}" title="${esc(f.message)}">` +
    `${esc(f.count)} x ${f.status === null ? "no answer" : esc(f.status)} ${esc(f.code)}</span>`;
}

async function renderShadows() {
  const data = await getJSON("/admin/shadow");
  const rows = await Promise.all(data.shadows.map(async (s) => {
    let diff = "-", att = "-";
    try {
      const st = await getJSON(`/admin/shadow/${encodeURIComponent(s.name)}/stats?window=300`);
      const d = st.p99_difference.ttft;
      if (d.shadow_minus_live_s !== null) diff = `${ms(d.shadow_minus_live_s)} (${ms(d.ci95[0])} .. ${ms(d.ci95[1])})`;
      const mean = (side) => { const v = Object.values(st[side].slo_attainment); return v.length ? v.reduce((a, b) => a + b.fraction, 0) / v.length : null; };
      att = `${pct(mean("shadow"))} / ${pct(mean("live"))}`;
    } catch (e) { /* the stats may not be ready */ }
    return `<tr data-shadow="${esc(s.name)}"><td>${esc(s.name)}</td><td>${esc(s.model ?? "-")}</td><td>${esc(s.sample)}</td><td>${esc(s.sent)}</td><td>${esc(s.dropped)}</td>` +
      `<td${s.failed ? ' class="miss"' : ""}>${esc(s.failed)}</td><td>${esc(s.pairs)}</td><td>${esc(diff)}</td><td>${esc(att)}</td>` +
      `<td class="problem">${s.failures.map(failure).join("; ")}</td></tr>`;
  }));
  document.querySelector("#shadows tbody").innerHTML = rows.join("") || `<tr><td colspan="10" class="muted">no shadow targets</td></tr>`;
}

async function renderJobs() {
  const data = await getJSON("/admin/tune-jobs");
  document.querySelector("#jobs tbody").innerHTML = data.jobs.map((j) => {
    const p = j.progress;
    // a knob each, wrapping inside the cell: a best config of many knobs keeps the table in its card
    const best = j.best ? `#${esc(j.best.number)} ${esc(num(j.best.value, 3))} ${esc(unit(j.spec.objective))} ` +
      Object.entries(j.best.params).map(([k, v]) => `<span class="knob">${esc(k)}=${esc(v)}</span>`).join(" ") : "-";
    const canary = j.apply ? `${esc(j.apply.state)}: ${esc((j.apply.steps.at(-1) || {}).step || "")}` : "-";
    return `<tr data-job="${esc(j.id)}"><td>${esc(j.id)}</td><td>${esc(j.state)}</td><td>${esc(j.spec.mode)}</td>` +
      `<td>${esc(p.trials_done)}${p.trials_planned ? "/" + esc(p.trials_planned) : ""}</td><td class="wrap">${best}</td><td class="wrap">${canary}</td></tr>`;
  }).join("") || `<tr><td colspan="6" class="muted">no tuning jobs</td></tr>`;
  const last = data.jobs.filter((j) => j.progress.trials_done).at(-1);
  const box = $("job-plots");
  if (!last) { box.innerHTML = ""; return; }
  const job = await getJSON(`/admin/tune-jobs/${encodeURIComponent(last.id)}`);
  const done = job.trials.filter((t) => t.value !== null);
  let best = -Infinity;
  const history = done.map((t) => [t.number, t.value]);
  const bestSoFar = done.map((t) => [t.number, best = Math.max(best, t.feasible ? t.value : best)]).filter((p) => isFinite(p[1]));
  box.innerHTML = `<div class="plot"><h3>${esc(job.id)}: optimisation history (objective by trial; best feasible so far in red)</h3><svg id="plot-history"></svg></div>` +
    `<div class="plot"><h3>p99 TTFT (s) against the objective, each trial</h3><svg id="plot-pareto"></svg></div>`;
  const objective = {label: `${job.spec.objective} (${unit(job.spec.objective)})`};
  plot($("plot-history"), history, {second: bestSoFar, x: {label: "trial", integer: true, format: (v) => `#${v}`}, y: objective});
  const pareto = done.filter((t) => t.measures && t.measures.p99_ttft_s !== undefined && isFinite(t.measures.p99_ttft_s)).map((t) => [t.measures.p99_ttft_s, t.value]);
  plot($("plot-pareto"), pareto.sort((a, b) => a[0] - b[0]), {x: {label: "p99 TTFT (s)"}, y: objective});
}

async function refresh() {
  try {
    const [tenants, engines] = await Promise.all([getJSON("/admin/slo/tenants"), getJSON("/admin/engines")]);
    renderTenants(tenants); renderEngines(engines);
    await Promise.all([renderShadows(), renderJobs(), refreshDetail()]);
    $("when").textContent = "updated " + new Date().toLocaleTimeString() + " (every 5 s)";
    document.body.dataset.loaded = "1";
  } catch (e) { $("when").textContent = "could not refresh: " + e.message; }
}
refresh();
setInterval(refresh, 5000);

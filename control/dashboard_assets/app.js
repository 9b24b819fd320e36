"use strict";
const $ = (id) => document.getElementById(id);
const pct = (v) => v === null || v === undefined ? "-" : (100 * v).toFixed(2) + "%";
const num = (v, d = 2) => v === null || v === undefined ? "-" : Number(v).toFixed(d);
const ms = (v) => v === null || v === undefined ? "-" : Math.abs(v) < 0.001 ? (1e6 * v).toFixed(0) + " \u00b5s" : (1000 * v).toFixed(1) + " ms";
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({"&":"&amp;","<":"&lt;",">":"&gt;","\"":"&quot;","'":"&#39;"}[c]));
let selected = location.hash.startsWith("#tenant=") ? decodeURIComponent(location.hash.slice(8)) : null;

async function getJSON(path) {
  const resp = await fetch(path, {credentials: "same-origin", headers: {"Accept": "application/json"}});
  if (resp.status === 401) { location.href = "/dashboard/login"; throw new Error("logged out"); }
  if (!resp.ok) throw new Error(path + ": " + resp.status);
  return resp.json();
}

function cell(value, field, text, cls) {
  return `<td data-field="${field}" data-value="${value === null || value === undefined ? "" : esc(value)}"${cls ? ` class="${cls}"` : ""}>${esc(text)}</td>`;
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
      cell(itl, "itl_attainment_1h", `${pct(itl)} \u2264 ${ms(t.slo.itl_p99_s)}`, itlMiss ? "miss" : "") +
      cell(t.attainment["1h"], "attainment_1h", pct(t.attainment["1h"]), t.attainment["1h"] !== null && t.attainment["1h"] < t.target ? "miss" : "") +
      cell(t.attainment["24h"], "attainment_24h", pct(t.attainment["24h"])) +
      cell(t.attainment["30d"], "attainment_30d", pct(t.attainment["30d"])) +
      cell(t.budget_left_30d, "budget_left_30d", pct(t.budget_left_30d), t.budget_left_30d !== null && t.budget_left_30d <= 0 ? "miss" : "") +
      cell(t.burn_rate["1h"], "burn_1h", num(t.burn_rate["1h"], 1) + "x") +
      cell(t.burn_rate["6h"], "burn_6h", num(t.burn_rate["6h"], 1) + "x") +
      `<td>${esc(queued)}</td></tr>`;
  });
  document.querySelector("#tenants tbody").innerHTML = rows.join("") ||
    `<tr><td colspan="14" class="muted">no tenants</td></tr>`;
  $("tenants-note").textContent = data.note;
  document.querySelectorAll("tr.tenant").forEach((tr) => tr.addEventListener("click", () => {
    selected = tr.dataset.tenant; location.hash = "tenant=" + encodeURIComponent(selected); refreshDetail();
  }));
}

function plot(svg, points, {maxY = null, target = null, color = "#2f5bd3", bars = false, second = null} = {}) {
  const w = 600, h = 170, pad = 28;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  if (!points.length) { svg.innerHTML = `<text x="${w / 2}" y="${h / 2}" text-anchor="middle" fill="#8a8f99">no data in this window</text>`; return; }
  const xs = points.map((p) => p[0]), x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const top = maxY ?? Math.max(1, ...points.map((p) => p[1]), ...(second || []).map((p) => p[1]));
  const X = (x) => pad + (w - 2 * pad) * (x - x0) / (x1 - x0), Y = (y) => h - pad - (h - 2 * pad) * y / top;
  let out = `<line x1="${pad}" y1="${h - pad}" x2="${w - pad}" y2="${h - pad}" stroke="#c8cdd6"/>` +
    `<text x="4" y="${pad}" font-size="10" fill="#5b6475">${top >= 1 ? top.toFixed(0) : top.toFixed(2)}</text>`;
  if (target !== null) out += `<line x1="${pad}" x2="${w - pad}" y1="${Y(target)}" y2="${Y(target)}" stroke="#c5221f" stroke-dasharray="4 3"/>`;
  const draw = (pts, c) => bars
    ? pts.map((p) => `<rect x="${X(p[0]) - 2}" y="${Y(p[1])}" width="4" height="${h - pad - Y(p[1])}" fill="${c}"/>`).join("")
    : `<polyline fill="none" stroke="${c}" stroke-width="2" points="${pts.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ")}"/>` +
      pts.map((p) => `<circle cx="${X(p[0])}" cy="${Y(p[1])}" r="2.5" fill="${c}"/>`).join("");
  out += draw(points, color);
  if (second) out += draw(second, "#c5221f");
  svg.innerHTML = out;
}

async function refreshDetail() {
  if (!selected) return;
  const d = await getJSON(`/admin/slo/tenants/${encodeURIComponent(selected)}?hours=6`);
  $("detail").style.display = "block";
  $("detail-title").textContent = `${d.name}: the last ${d.hours} hours (state ${d.state.replace("_", " ")}, budget left ${pct(d.budget_left_30d)})`;
  plot($("plot-requests"), d.series.map((m) => [m.minute, m.requests]), {bars: true,
       second: d.series.filter((m) => m.rejected).map((m) => [m.minute, m.rejected])});
  plot($("plot-attainment"), d.series.filter((m) => m.slo_checked).map((m) => [m.minute, m.slo_met / m.slo_checked]),
       {maxY: 1, target: d.target, second: d.series.filter((m) => m.itl_gaps).map((m) => [m.minute, m.itl_gaps_met / m.itl_gaps])});
  const limits = Object.entries(d.limits).filter(([, v]) => v !== null).map(([k, v]) => `${k} ${v}`).join(", ");
  $("detail-limits").textContent = `limits: ${limits || "none"}; SLO: p99 TTFT <= ${ms(d.slo.ttft_p99_s)}, p99 TPOT <= ${ms(d.slo.tpot_p99_s)}, ` +
    `p99 ITL <= ${ms(d.slo.itl_p99_s)} (gaps: budget left ${pct(d.itl_budget_left_30d)}, burn 1h ${num(d.itl_burn_rate["1h"], 1)}x)`;
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
    const p = j.progress, best = j.best ? `#${j.best.number} ${num(j.best.value, 3)} (${Object.entries(j.best.params).map(([k, v]) => `${k}=${v}`).join(", ")})` : "-";
    const canary = j.apply ? `${esc(j.apply.state)}: ${esc((j.apply.steps.at(-1) || {}).step || "")}` : "";
    return `<tr data-job="${esc(j.id)}"><td>${esc(j.id)}</td><td>${esc(j.state)}</td><td>${esc(j.spec.mode)}</td>` +
      `<td>${esc(p.trials_done)}${p.trials_planned ? "/" + esc(p.trials_planned) : ""}</td><td>${esc(best)}</td><td style="text-align:left">${canary}</td></tr>`;
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
  plot($("plot-history"), history, {second: bestSoFar});
  const pareto = done.filter((t) => t.measures && t.measures.p99_ttft_s !== undefined && isFinite(t.measures.p99_ttft_s)).map((t) => [t.measures.p99_ttft_s, t.value]);
  plot($("plot-pareto"), pareto.sort((a, b) => a[0] - b[0]));
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

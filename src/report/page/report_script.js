'use strict';
// The run report: draws the runs' data (inline JSON, written by src/report/) as SVG plots.
// Every plot's <svg> carries its axis transform (data-x0/x1/y0/y1: the domain; data-left/right/
// top/bottom: the pixels; data-log: log10 y), so a test can invert each polyline's points.
(function () {
  const DATA = JSON.parse(document.getElementById('moe-data').textContent);
  const NS = 'http://www.w3.org/2000/svg';
  const COLORS = ['#1f6fd1', '#e0562d', '#2a9d3a', '#8b2bd6', '#c8a000', '#0aa3a3', '#d43f8d', '#6b7280', '#7a4a00', '#3346a8'];
  const DASHES = ['', '6 3', '2 2', '8 3 2 3'];
  const W = 640, H = 250, M = { left: 72, right: 14, top: 10, bottom: 38 };
  const state = { x: 'step', log: false, ema: false, alpha: 0.9, heatRun: 0, heatLayer: 0, column: -1 };

  // ---- data ----------------------------------------------------------------------------------
  function decode(s) {
    const n = s.y.length, step = new Array(n), tokens = new Array(n), wall = new Array(n);
    let a = 0, b = 0;
    for (let i = 0; i < n; ++i) {
      a += s.s[i]; b += s.t[i];
      step[i] = a; tokens[i] = b; wall[i] = s.x[i] === null ? NaN : s.x[i];
    }
    return { step, tokens, wall, y: s.y, k: s.k, m: s.m || null, w: s.w, st: s.st };
  }
  const runs = DATA.runs.map((r, i) => {
    const S = {};
    for (const key of Object.keys(r.series)) S[key] = decode(r.series[key]);
    return Object.assign({}, r, { index: i, S, P: decode(r.positions) });
  });
  const xs = (d) => (state.x === 'step' ? d.step : state.x === 'tokens' ? d.tokens : d.wall);

  // Where step lies on the current x-axis: exact for a point of the positions table, linear
  // between its neighbours otherwise (the table keeps each bucket's first and last step).
  function xOfStep(run, step) {
    const P = run.P, s = P.step, v = xs(P), n = s.length;
    if (state.x === 'step' || n === 0) return step;
    let lo = 0, hi = n - 1;
    if (step <= s[0]) return v[0];
    if (step >= s[hi]) return v[hi];
    while (hi - lo > 1) { const mid = (lo + hi) >> 1; if (s[mid] <= step) lo = mid; else hi = mid; }
    return v[lo] + (v[hi] - v[lo]) * (step - s[lo]) / (s[hi] - s[lo]);
  }
  const xOfPos = (p) => (state.x === 'step' ? p[0] : state.x === 'tokens' ? p[1] : p[2]);

  // ---- formatting ----------------------------------------------------------------------------
  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return 'n/a';
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(3);
    return Number(v.toPrecision(6)).toString();
  }
  function fmtDuration(s) {
    if (!isFinite(s)) return 'n/a';
    if (s < 120) return (Math.round(s * 10) / 10) + 's';
    if (s < 7200) return Math.floor(s / 60) + 'm' + String(Math.round(s % 60)).padStart(2, '0') + 's';
    return Math.floor(s / 3600) + 'h' + String(Math.round((s % 3600) / 60)).padStart(2, '0') + 'm';
  }
  function fmtX(v) {
    if (state.x === 'wall') return fmtDuration(v);
    if (state.x === 'tokens') return v >= 1e9 ? (v / 1e9).toPrecision(3) + 'G' : v >= 1e6 ? (v / 1e6).toPrecision(3) + 'M' : v >= 1e3 ? (v / 1e3).toPrecision(3) + 'k' : String(v);
    return v >= 1e6 ? (v / 1e6).toPrecision(3) + 'M' : v >= 1e4 ? (v / 1e3).toPrecision(3) + 'k' : String(Math.round(v));
  }
  const xLabel = () => ({ step: 'optimizer step', tokens: 'tokens trained', wall: 'wall time (training time, stitched across resumes)' })[state.x];
  function esc(s) { return String(s).replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[c]); }

  // ---- scales --------------------------------------------------------------------------------
  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((f) => f * mag).find((s) => s >= raw) || 10 * mag;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }
  function makeScale(x0, x1, y0, y1, log) {
    const Y = (y) => (log ? Math.log10(y) : y);
    const Y0 = Y(y0), Y1 = Y(y1);
    return {
      x0, x1, y0, y1, log,
      px: (x) => M.left + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (W - M.left - M.right),
      py: (y) => H - M.bottom - (Y1 > Y0 ? (Y(y) - Y0) / (Y1 - Y0) : 0.5) * (H - M.top - M.bottom),
      inv: (px) => x0 + (px - M.left) / (W - M.left - M.right) * (x1 - x0),
    };
  }
  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }

  // ---- what each plot draws ------------------------------------------------------------------
  const PLOTS = [
    { id: 'loss', title: 'Training loss', unit: 'nats/token', series: [['loss', 'total loss'], ['ce', 'cross-entropy']], marks: ['skipped', 'resume', 'checkpoint'] },
    { id: 'valid', title: 'Validation cross-entropy', unit: 'nats/token', series: [['valid_ce', 'validation CE']], bigram: true, marks: ['resume', 'checkpoint'] },
    { id: 'lr', title: 'Learning rate', unit: 'learning rate', series: [['lr', 'lr']] },
    { id: 'grad', title: 'Gradient norm (before clipping)', unit: 'L2 norm', series: [['grad_norm', 'grad norm']], marks: ['clipped', 'skipped'] },
    { id: 'tps', title: 'Throughput', unit: 'tokens/s', series: [['tokens_per_s', 'tokens/s']], marks: ['resume'] },
    { id: 'mfu', title: 'Model FLOP utilization', unit: 'fraction of peak', series: [['mfu', 'MFU']] },
    { id: 'mem', title: 'Peak memory', unit: 'MiB', series: [['peak_rss_mb', 'host peak RSS'], ['peak_device_mb', 'device peak']], nonzero: true },
    { id: 'lbl', title: 'Load-balancing loss per MoE layer', unit: 'unweighted loss', layers: 'lbl', marks: ['warning'] },
    { id: 'rz', title: 'Router z-loss per MoE layer', unit: 'unweighted loss', layers: 'router_z' },
    { id: 'load', title: 'Max / mean expert load per MoE layer', unit: 'ratio (1 = balanced)', layers: 'max_load', marks: ['warning'] },
    { id: 'cv', title: 'Expert load coefficient of variation per MoE layer', unit: 'std / mean', layers: 'load_cv' },
    { id: 'drop', title: 'Expert-parallel drop fraction per MoE layer', unit: 'fraction of routed rows', layers: 'ep_drop_fraction' },
    { id: 'rows', title: 'Rows per expert-parallel rank (heat-map layer)', unit: 'rows per step', ranks: 'ep_rows_received' },
    { id: 'bubble', title: 'Pipeline bubble', unit: 's per step (blocked receiving)', series: [['pp_bubble_s', 'bubble']], nonzero: true },
  ];

  // The lines of one plot: [{run, key, label, color, dash}].
  function linesOf(p) {
    const out = [], multi = runs.length > 1;
    for (const run of runs) {
      const dash = multi ? DASHES[run.index % DASHES.length] : '';
      const rl = multi ? run.label + ': ' : '';
      if (p.series) {
        p.series.forEach(([key, label], j) => {
          const d = run.S[key];
          if (!d || d.y.length === 0) return;
          if (p.nonzero && !(d.st.max > 0 || d.st.min < 0)) return;
          out.push({ run, key, label: rl + label, color: COLORS[(multi ? run.index : j) % COLORS.length], dash: multi ? DASHES[j % DASHES.length] : '' });
        });
      } else if (p.layers) {
        for (let l = 0; run.S[p.layers + '.' + l]; ++l) {
          const key = p.layers + '.' + l;
          if (run.S[key].y.length === 0) continue;
          out.push({ run, key, label: rl + 'layer ' + l, color: COLORS[l % COLORS.length], dash });
        }
      } else if (p.ranks) {
        for (let k = 0; run.S[p.ranks + '.' + state.heatLayer + '.' + k]; ++k)
          out.push({ run, key: p.ranks + '.' + state.heatLayer + '.' + k, label: rl + 'rank ' + k, color: COLORS[k % COLORS.length], dash });
      }
    }
    return out;
  }

  // Points to draw for one line on the current axes: raw envelope, or its EMA.
  function pointsOf(line) {
    const d = line.run.S[line.key], X = xs(d), out = [];
    for (let i = 0; i < d.y.length; ++i) {
      if (!isFinite(X[i])) continue;
      if (state.log && !(d.y[i] > 0)) continue;
      out.push([X[i], d.y[i]]);
    }
    return out;
  }
  // EMA with weight alpha per step: exact when every step is a point; over a downsampled
  // envelope, each bucket's mean enters with weight alpha^(steps in it), drawn at its last point.
  function emaOf(line) {
    const d = line.run.S[line.key], X = xs(d), out = [], a = state.alpha;
    let e = null, i = 0;
    for (let b = 0; b < d.k.length; ++b) {
      const last = i + d.k[b] - 1;
      const n = d.m ? Math.max(1, Math.round(d.w)) : 1;
      const v = d.m ? d.m[b] : d.y[i];
      const w = Math.pow(a, d.m ? n : 1);
      e = e === null ? v : w * e + (1 - w) * v;
      if (isFinite(X[last]) && (!state.log || e > 0)) out.push([X[last], e]);
      i = last + 1;
    }
    return out;
  }

  function marksOf(p, run) {  // [{kind, x, text}]
    const out = [];
    for (const kind of p.marks || []) {
      if (kind === 'clipped' || kind === 'skipped') {
        for (const [pos, count] of run.marks[kind].at)
          out.push({ kind, x: xOfPos(pos), count, text: (count > 1 ? count + ' ' + kind + ' steps from ' : kind + ' step ') + pos[0] });
      }
      if (kind === 'warning') for (const [pos, text] of run.marks.warnings.at) out.push({ kind, x: xOfPos(pos), text });
      if (kind === 'resume' || kind === 'checkpoint')
        for (const [step, what, detail] of run.events) if (what === kind) out.push({ kind, x: xOfStep(run, step), text: kind + ' at step ' + step + ' ' + detail });
    }
    return out;
  }

  // ---- drawing -------------------------------------------------------------------------------
  const plotted = [];  // what is on the page now: [{plot, line, points}] (CSV export)

  function drawPlot(p, container) {
    const lines = linesOf(p);
    if (lines.length === 0) return false;
    const div = document.createElement('div');
    div.className = 'plot';
    div.dataset.plot = p.id;
    let title = p.title;
    if (p.id === 'mfu') {  // the denominator(s) the records name: peak and its source
      const peaks = [...new Set(runs.flatMap((r) => r.mfu_peaks || []))];
      if (peaks.length) title += ' (of ' + peaks.join('; ') + ')';
    }
    div.innerHTML = '<h3>' + esc(title) + '</h3>';
    const drawn = lines.map((line) => ({ line, points: pointsOf(line), ema: state.ema ? emaOf(line) : null }));
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const d of drawn) for (const [x, y] of d.points) { x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y); }
    for (const run of runs) {  // the whole run, even where a flat envelope's last point is its bucket's first
      const X = xs(run.P);
      for (const x of [X[0], X[X.length - 1]]) if (isFinite(x)) { x0 = Math.min(x0, x); x1 = Math.max(x1, x); }
    }
    const bigram = p.bigram ? runs.map((r) => r.bigram).filter((v) => v !== null && isFinite(v)) : [];
    for (const b of bigram) { y0 = Math.min(y0, b); y1 = Math.max(y1, b); }
    if (!isFinite(x0)) { x0 = 0; x1 = 1; }
    if (x1 === x0) { x0 -= 0.5; x1 += 0.5; }
    if (!isFinite(y0)) { y0 = state.log ? 1 : 0; y1 = state.log ? 10 : 1; }
    if (state.log) {
      if (y1 === y0) { y0 /= 2; y1 *= 2; }
      const pad = Math.pow(y1 / y0, 0.04); y0 /= pad; y1 *= pad;
    } else {
      if (y1 === y0) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
      const pad = (y1 - y0) * 0.04; y0 -= pad; y1 += pad;
    }
    const sc = makeScale(x0, x1, y0, y1, state.log);
    const svg = el('svg', { width: W, height: H, viewBox: `0 0 ${W} ${H}`, 'data-plot': p.id, 'data-x0': x0, 'data-x1': x1,
      'data-y0': y0, 'data-y1': y1, 'data-left': M.left, 'data-right': W - M.right, 'data-top': M.top,
      'data-bottom': H - M.bottom, 'data-log': state.log ? 1 : 0, 'data-xmode': state.x });
    // grid and axes
    const xt = niceTicks(x0, x1, 6);
    for (const t of xt) {
      const x = sc.px(t);
      el('line', { class: 'grid', x1: x, x2: x, y1: M.top, y2: H - M.bottom }, svg);
      el('text', { x, y: H - M.bottom + 13, 'text-anchor': 'middle' }, svg).textContent = fmtX(t);
    }
    let yt;
    if (state.log) {
      yt = [];
      for (let e = Math.floor(Math.log10(y0)); e <= Math.ceil(Math.log10(y1)); ++e)
        for (const f of (Math.log10(y1 / y0) < 2.5 ? [1, 2, 5] : [1])) { const v = f * Math.pow(10, e); if (v >= y0 && v <= y1) yt.push(v); }
    } else yt = niceTicks(y0, y1, 5);
    for (const t of yt) {
      const y = sc.py(t);
      el('line', { class: 'grid', x1: M.left, x2: W - M.right, y1: y, y2: y }, svg);
      el('text', { x: M.left - 4, y: y + 3, 'text-anchor': 'end' }, svg).textContent = fmt(t);
    }
    el('line', { class: 'axis', x1: M.left, x2: M.left, y1: M.top, y2: H - M.bottom }, svg);
    el('line', { class: 'axis', x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom }, svg);
    el('text', { x: (M.left + W - M.right) / 2, y: H - 6, 'text-anchor': 'middle' }, svg).textContent = xLabel();
    el('text', { x: 12, y: (M.top + H - M.bottom) / 2, 'text-anchor': 'middle', transform: `rotate(-90 12 ${(M.top + H - M.bottom) / 2})` }, svg).textContent = p.unit + (state.log ? ' (log)' : '');
    for (const b of bigram) {
      const y = sc.py(b);
      el('line', { class: 'bigram', x1: M.left, x2: W - M.right, y1: y, y2: y, 'data-value': b }, svg);
    }
    // marks under the lines
    for (const run of runs) {
      for (const m of marksOf(p, run)) {
        if (!isFinite(m.x) || m.x < x0 || m.x > x1) continue;
        const x = sc.px(m.x);
        const e = m.kind === 'clipped'
          ? el('path', { class: 'mark-clipped', d: `M${x - 3},${M.top} L${x + 3},${M.top} L${x},${M.top + 6} Z` }, svg)
          : el('line', { class: 'mark-' + m.kind, x1: x, x2: x, y1: M.top, y2: H - M.bottom }, svg);
        e.setAttribute('data-kind', m.kind);
        e.setAttribute('data-count', m.count || 1);
        el('title', {}, e).textContent = m.text;
      }
    }
    const legend = document.createElement('div');
    legend.className = 'legend';
    for (const d of drawn) {
      const attrs = { points: d.points.map(([x, y]) => sc.px(x).toFixed(2) + ',' + sc.py(y).toFixed(2)).join(' '),
        stroke: d.line.color, 'data-run': d.line.run.index, 'data-series': d.line.key, 'data-width': d.line.run.S[d.line.key].w,
        'data-ema': 0 };
      if (d.line.dash) attrs['stroke-dasharray'] = d.line.dash;
      if (d.ema) attrs.class = 'raw-under';
      el('polyline', attrs, svg);
      if (d.points.length === 1 || d.line.key === 'valid_ce')
        for (const [x, y] of d.points) el('circle', { cx: sc.px(x), cy: sc.py(y), r: 2.5, fill: d.line.color }, svg);
      if (d.ema) {
        const ea = { points: d.ema.map(([x, y]) => sc.px(x).toFixed(2) + ',' + sc.py(y).toFixed(2)).join(' '), stroke: d.line.color,
          'data-run': d.line.run.index, 'data-series': d.line.key, 'data-ema': 1 };
        if (d.line.dash) ea['stroke-dasharray'] = d.line.dash;
        el('polyline', ea, svg);
      }
      legend.insertAdjacentHTML('beforeend', `<span><i class="swatch" style="border-color:${d.line.color}${d.line.dash ? ';border-top-style:dashed' : ''}"></i>${esc(d.line.label)}</span>`);
      plotted.push({ plot: p.id, line: d.line, points: d.ema || d.points, ema: !!d.ema });
    }
    if (bigram.length) legend.insertAdjacentHTML('beforeend', `<span><i class="swatch" style="border-color:#2a9d3a;border-top-style:dashed"></i>bigram entropy of the training text</span>`);
    div.appendChild(legend);
    div.appendChild(svg);
    const notes = [];
    if (p.bigram) for (const r of runs) if (r.bigram === null && r.bigram_source) notes.push((runs.length > 1 ? r.label + ': ' : '') + 'bigram entropy ' + r.bigram_source);
    if (p.marks && p.marks.includes('clipped')) for (const r of runs) if (r.marks.clipped.total) notes.push((runs.length > 1 ? r.label + ': ' : '') + r.marks.clipped.total + ' clipped steps marked (triangles)');
    if (p.marks && p.marks.includes('warning')) for (const r of runs) if (r.marks.warnings.total) notes.push((runs.length > 1 ? r.label + ': ' : '') + r.marks.warnings.total + ' token-gerrymandering warnings marked (purple)');
    if (notes.length) div.insertAdjacentHTML('beforeend', '<div class="note">' + notes.map(esc).join('<br>') + '</div>');
    hover(svg, sc, drawn);
    container.appendChild(div);
    return true;
  }

  function hover(svg, sc, drawn) {
    const tip = document.getElementById('tooltip');
    const cursor = el('line', { class: 'cursor', y1: M.top, y2: H - M.bottom, visibility: 'hidden' }, svg);
    svg.addEventListener('mousemove', (ev) => {
      const r = svg.getBoundingClientRect(), px = ev.clientX - r.left;
      if (px < M.left || px > W - M.right) { tip.hidden = true; cursor.setAttribute('visibility', 'hidden'); return; }
      const x = sc.inv(px), rows = [state.x + ' ' + fmtX(x)];
      for (const d of drawn) {
        const pts = d.ema || d.points;
        if (!pts.length) continue;
        let lo = 0, hi = pts.length - 1;
        while (hi - lo > 1) { const mid = (lo + hi) >> 1; if (pts[mid][0] <= x) lo = mid; else hi = mid; }
        const best = Math.abs(pts[lo][0] - x) <= Math.abs(pts[hi][0] - x) ? pts[lo] : pts[hi];
        rows.push(d.line.label + ': ' + fmt(best[1]) + '  (at ' + fmtX(best[0]) + ')');
      }
      cursor.setAttribute('x1', px); cursor.setAttribute('x2', px); cursor.setAttribute('visibility', 'visible');
      tip.textContent = rows.join('\n');
      tip.hidden = false;
      tip.style.left = (ev.clientX + 14) + 'px';
      tip.style.top = (ev.clientY + 10) + 'px';
    });
    svg.addEventListener('mouseleave', () => { tip.hidden = true; cursor.setAttribute('visibility', 'hidden'); });
  }

  // ---- heat map and P against f ----------------------------------------------------------------
  function heatColor(ratio) {  // tokens per expert relative to uniform: blue 1/4x, white 1x, red 4x
    const t = ratio > 0 ? Math.max(-1, Math.min(1, Math.log2(ratio) / 2)) : -1;
    const mix = (a, b, u) => Math.round(a + (b - a) * u);
    return t < 0 ? `rgb(${mix(255, 31, -t)},${mix(255, 90, -t)},${mix(255, 200, -t)})` : `rgb(${mix(255, 200, t)},${mix(255, 40, t)},${mix(255, 30, t)})`;
  }
  function drawHeat() {
    const box = document.getElementById('heat'), controls = document.getElementById('heat-controls');
    box.innerHTML = '';
    const withVectors = runs.filter((r) => r.vectors.length > 0);
    if (withVectors.length === 0) {
      box.innerHTML = '<p class="note">no per-expert vectors in these runs (metrics.vectors_every = 0, or no MoE layers)</p>';
      controls.innerHTML = '';
      return;
    }
    if (!runs[state.heatRun].vectors.length) state.heatRun = withVectors[0].index;
    const run = runs[state.heatRun];
    state.heatLayer = Math.min(state.heatLayer, run.vectors.length - 1);
    const v = run.vectors[state.heatLayer], C = v.steps.length, E = C ? v.f[0].length : 0;
    if (state.column < 0 || state.column >= C) state.column = C - 1;
    controls.innerHTML = (runs.length > 1 ? '<label>run <select id="heat-run">' + runs.map((r) => `<option value="${r.index}"${r.index === run.index ? ' selected' : ''}>${esc(r.label)}</option>`).join('') + '</select></label>' : '') +
      '<label>MoE layer <select id="heat-layer">' + run.vectors.map((_, l) => `<option value="${l}"${l === state.heatLayer ? ' selected' : ''}>${l}</option>`).join('') + '</select></label>' +
      `<label>P against f at <input type="range" id="heat-column" min="0" max="${Math.max(0, C - 1)}" value="${state.column}"></label><span id="heat-column-steps"></span>`;
    const cw = Math.max(2, Math.min(12, Math.floor(600 / Math.max(1, C)))), ch = Math.max(3, Math.min(14, Math.floor(320 / Math.max(1, E))));
    const L = 40, T = 8, width = L + cw * C + 10, height = T + ch * E + 34;
    const svg = el('svg', { width, height, 'data-plot': 'heat', 'data-columns': C, 'data-experts': E });
    for (let c = 0; c < C; ++c) {
      for (let e = 0; e < E; ++e) {
        const f = v.f[c][e];
        const r = el('rect', { x: L + c * cw, y: T + e * ch, width: cw, height: ch, fill: heatColor(f * E), 'data-col': c, 'data-expert': e, 'data-value': f }, svg);
        el('title', {}, r).textContent = `steps ${v.steps[c][0]}-${v.steps[c][1]}, expert ${e}: ${(100 * f).toFixed(2)}% of routed tokens (uniform ${(100 / E).toFixed(2)}%)`;
      }
    }
    el('rect', { x: L + state.column * cw, y: T - 1, width: cw, height: ch * E + 2, fill: 'none', stroke: '#111', 'stroke-width': 1.5, id: 'heat-selected' }, svg);
    for (const c of [0, Math.floor((C - 1) / 2), C - 1]) if (C) el('text', { x: L + c * cw + cw / 2, y: T + ch * E + 13, 'text-anchor': 'middle' }, svg).textContent = 'step ' + v.steps[c][1];
    for (let e = 0; e < E; e += Math.max(1, Math.ceil(E / 16))) el('text', { x: L - 4, y: T + e * ch + ch / 2 + 3, 'text-anchor': 'end' }, svg).textContent = e;
    el('text', { x: L, y: height - 4 }, svg).textContent = `expert (rows) by step (columns, ${v.width} vector step(s) each): blue 1/4x, white 1x, red 4x the uniform share`;
    svg.addEventListener('click', (ev) => { const c = ev.target.getAttribute && ev.target.getAttribute('data-col'); if (c !== null) { state.column = +c; drawHeat(); } });
    const left = document.createElement('div');
    left.appendChild(svg);
    box.appendChild(left);
    box.appendChild(drawScatter(v, E));
    document.getElementById('heat-column-steps').textContent = C ? `steps ${v.steps[state.column][0]}-${v.steps[state.column][1]} (${v.steps[state.column][2]} vector records)` : '';
    const on = (id, f) => { const e = document.getElementById(id); if (e) e.addEventListener('change', f); };
    on('heat-run', (e) => { state.heatRun = +e.target.value; state.column = -1; drawHeat(); redrawPlots(); });
    on('heat-layer', (e) => { state.heatLayer = +e.target.value; drawHeat(); redrawPlots(); });
    const range = document.getElementById('heat-column');
    range.addEventListener('input', (e) => { state.column = +e.target.value; drawHeat(); });
  }
  function drawScatter(v, E) {
    const S = 260, L = 50, B = 36, c = state.column, f = v.f[c] || [], p = v.P[c] || [];
    let hi = 0;
    for (let e = 0; e < E; ++e) hi = Math.max(hi, f[e], p[e]);
    hi = hi > 0 ? hi * 1.08 : 1;
    const sc = (t) => t / hi * (S - L - 8);
    const svg = el('svg', { width: S, height: S, 'data-plot': 'p-vs-f', 'data-max': hi });
    el('line', { class: 'axis', x1: L, y1: S - B, x2: S - 8, y2: S - B }, svg);
    el('line', { class: 'axis', x1: L, y1: S - B, x2: L, y2: 8 }, svg);
    el('line', { class: 'grid', x1: L, y1: S - B, x2: L + sc(hi), y2: S - B - sc(hi) }, svg);
    for (const t of niceTicks(0, hi, 4)) {
      el('text', { x: L + sc(t), y: S - B + 12, 'text-anchor': 'middle' }, svg).textContent = fmt(t);
      el('text', { x: L - 4, y: S - B - sc(t) + 3, 'text-anchor': 'end' }, svg).textContent = fmt(t);
    }
    el('text', { x: (L + S) / 2, y: S - 8, 'text-anchor': 'middle' }, svg).textContent = 'f: fraction of routed tokens';
    el('text', { x: 10, y: S / 2, 'text-anchor': 'middle', transform: `rotate(-90 10 ${S / 2})` }, svg).textContent = 'P: mean router probability';
    for (let e = 0; e < E; ++e) {
      const d = el('circle', { cx: L + sc(f[e]), cy: S - B - sc(p[e]), r: 3, fill: COLORS[0], 'data-expert': e, 'data-f': f[e], 'data-p': p[e] }, svg);
      el('title', {}, d).textContent = `expert ${e}: f ${fmt(f[e])}, P ${fmt(p[e])}`;
    }
    const div = document.createElement('div');
    div.innerHTML = '<div class="note">P against f (the diagonal: probability matches load)</div>';
    div.appendChild(svg);
    return div;
  }

  // ---- tables ----------------------------------------------------------------------------------
  function table(head, rows, cls) {
    return '<table><tr>' + head.map((h) => '<th>' + esc(h) + '</th>').join('') + '</tr>' +
      rows.map((r, i) => '<tr' + (cls && cls[i] ? ` class="${cls[i]}"` : '') + '>' + r.map((c) => '<td>' + esc(c) + '</td>').join('') + '</tr>').join('') + '</table>';
  }
  function drawTables() {
    const rows = [];
    for (const run of runs) {
      for (const key of Object.keys(run.S)) {
        const st = run.S[key].st;
        rows.push([runs.length > 1 ? run.label : '', key, st.count, fmt(st.first), fmt(st.last), fmt(st.min) + ' @' + st.min_step,
          fmt(st.max) + ' @' + st.max_step, fmt(st.mean), st.nonfinite]);
      }
    }
    document.getElementById('summary').innerHTML = table(['run', 'series', 'steps', 'first', 'last', 'min @step', 'max @step', 'mean', 'non-finite'], rows);
    const env = (r) => {
      const s = r.start || {}, L = s.layout || {};
      const status = r.stop ? r.stop.reason + ' at step ' + r.stop.step + (r.stop.message ? ': ' + r.stop.message : '') : (r.records ? 'running, or stopped without a stop event (killed)' : 'no steps');
      return [s.version, s.git, s.build, s.precision, s.backend, s.threads, s.ranks,
        s.layout ? `pp=${L.pp} dp=${L.dp} ep=${L.ep} zero1=${L.zero1}` : undefined, s.config_hash, r.resumes, r.records, r.last_step, status, r.dir];
    };
    const names = ['version', 'git commit', 'build', 'precision', 'backend', 'threads', 'ranks', 'layout', 'config hash', 'resumes', 'records', 'last step', 'status', 'directory'];
    const envs = runs.map(env);
    document.getElementById('environment').innerHTML = table(['', ...runs.map((r) => r.label)],
      names.map((n, i) => [n, ...envs.map((e) => (e[i] === undefined || e[i] === null ? 'n/a' : e[i]))]));
    const keys = [...new Set(runs.flatMap((r) => Object.keys(r.config)))].sort();
    const cfgRows = keys.map((k) => [k, ...runs.map((r) => (k in r.config ? r.config[k] : '(unset)'))]);
    document.getElementById('config').innerHTML = table(['key', ...runs.map((r) => r.label)], cfgRows,
      cfgRows.map((r) => (new Set(r.slice(1)).size > 1 ? 'differs' : '')));
    const ev = [];
    for (const r of runs) for (const [step, what, detail] of r.events) ev.push([runs.length > 1 ? r.label : '', step, what, detail]);
    document.getElementById('events').innerHTML = ev.length ? table(['run', 'step', 'event', 'detail'], ev) : '<p class="note">no events.jsonl records</p>';
  }
  function drawHeader() {
    document.getElementById('runs').innerHTML = runs.map((r) => `<span class="run"><i class="swatch" style="border-color:${COLORS[r.index % COLORS.length]}${r.index % DASHES.length ? ';border-top-style:dashed' : ''}"></i>${esc(r.label)}: ${r.records} steps</span>`).join('');
    const list = document.getElementById('notices');
    list.innerHTML = '';
    for (const r of runs) for (const n of r.notices) list.insertAdjacentHTML('beforeend', `<li class="notice" data-run="${r.index}">${esc((runs.length > 1 ? r.label + ': ' : '') + n)}</li>`);
    document.getElementById('notices-section').hidden = list.children.length === 0;
  }

  // ---- CSV of what is plotted --------------------------------------------------------------------
  function csv() {
    const out = ['plot,run,series,smoothed,' + state.x + ',value'];
    const q = (s) => (/[",\n]/.test(s) ? '"' + s.replace(/"/g, '""') + '"' : s);
    for (const p of plotted) for (const [x, y] of p.points) out.push([p.plot, q(p.line.run.label), p.line.key, p.ema ? 1 : 0, x, y].join(','));
    return out.join('\n') + '\n';
  }

  function redrawPlots() {
    const box = document.getElementById('plots');
    box.innerHTML = '';
    plotted.length = 0;
    for (const p of PLOTS) drawPlot(p, box);
  }
  function bind() {
    const on = (id, ev, f) => document.getElementById(id).addEventListener(ev, f);
    on('xaxis', 'change', (e) => { state.x = e.target.value; redrawPlots(); });
    on('logy', 'change', (e) => { state.log = e.target.checked; redrawPlots(); });
    on('ema', 'change', (e) => { state.ema = e.target.checked; redrawPlots(); });
    on('alpha', 'change', (e) => { const a = parseFloat(e.target.value); if (a >= 0 && a < 1) { state.alpha = a; redrawPlots(); } });
    on('csv', 'click', () => {
      const a = document.createElement('a');
      a.href = URL.createObjectURL(new Blob([csv()], { type: 'text/csv' }));
      a.download = 'moecore-report-' + state.x + '.csv';
      document.body.appendChild(a); a.click(); a.remove();
    });
  }

  drawHeader();
  redrawPlots();
  drawHeat();
  drawTables();
  bind();
  window.moeReport = { csv, state, runs, redraw: redrawPlots };
  document.body.dataset.ready = '1';
  if (location.hash === '#plant-error') {  // the browser test's check of itself
    console.error('planted console error');
    setTimeout(() => { throw new Error('planted error: the browser test must catch this'); }, 0);
  }
})();

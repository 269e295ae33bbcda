#!/usr/bin/env python3
"""The run report (`moecore report`, and the report.html `moecore train` writes) in a real browser:
Debian's headless Chromium over the DevTools protocol (tools/browser_test.py's harness), each page
opened from disk (file://).

What it checks, against the metrics.jsonl files read here with Python's json (not moecore's reader):
  trained   a small run trained, checkpointed and resumed, and a second run with another lr: every
            polyline on every plot, inverted through its plot's axis transform (the <svg>'s
            data-x0/x1/y0/y1 and pixel box), equals the records within half a pixel, on the steps,
            tokens and wall-time axes and with log y; the EMA lines equal an EMA computed here; the
            heat map's cells equal f / sum f; checkpoint and resume marks; hover; the CSV export; the
            page train wrote itself.
  multi     both runs overlaid: labelled with the config key that differs, both drawn, the config
            table marks the differing row.
  parallel  expert parallelism (2 ranks) and a pipeline (2 stages) under mpirun: every polyline as
            above, and the plots of the EP drop fraction and rows per rank, and of the PP bubble, drawn.
  broken    a truncated last line, NaN/Inf strings, repeated steps, a line that is not JSON, no MoE
            layers: the page renders and states exactly what it skipped.
  spike     10^6 steps with 64-expert vectors and a one-step spike: the page stays under 5 MB, the
            spike is drawn, and each polyline is exactly the bucket minima and maxima computed here.
Exceptions and console errors are collected through the protocol; any one fails the test.
--expect-planted-error opens a page with #plant-error and succeeds only if both planted errors
are caught (the check of the check).

Usage: tools/report_browser_test.py --moecore build/moecore [--expect-planted-error]
       tools/report_browser_test.py --moecore build/moecore --screenshot docs/report.png --run runs/default
"""
import argparse
import base64
import glob
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from browser_test import ROOT, Browser, open_page, planted_errors_caught  # noqa: E402

HALF_PIXEL = 0.5
TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.expert_hidden=64",
        "model.num_experts=4", "train.seq_len=64", "train.batch_size=4", "train.micro_batch_size=4",
        "train.eval_every=10", "train.eval_batches=2", "train.log_every=20", "data.train_path=data/train.bin",
        "data.valid_path=data/valid.bin", "checkpoint.every=20", "metrics.vectors_every=5", "optim.warmup_steps=5",
        "train.progress=off"]


def run(args, cwd):
    out = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def read_records(path):
    """metrics.jsonl as the page should draw it: complete JSON lines, the later record of a step wins."""
    by_step = {}
    with open(path, "rb") as f:
        data = f.read().decode()
    lines = data.split("\n")
    if lines and lines[-1] != "":
        lines = lines[:-1]  # no newline at the end: not a record yet
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and isinstance(r.get("step"), int):
            by_step[r["step"]] = r
    recs = [by_step[s] for s in sorted(by_step)]
    tokens = 0
    for r in recs:
        tokens += r.get("tokens", 0)
        r["_tokens"] = tokens
    return recs


def value(r, key):
    parts = key.split(".")
    v = r.get(parts[0])
    for p in parts[1:]:
        if not isinstance(v, list) or int(p) >= len(v):
            return None
        v = v[int(p)]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def xval(r, mode):
    return {"step": r["step"], "tokens": r["_tokens"], "wall": r.get("elapsed_s")}[mode]


def plots(b):
    """Every plot's transform and its polylines' pixel points, read back from the DOM."""
    return b.evaluate("""[...document.querySelectorAll('svg[data-xmode]')].map(s => ({
        plot: s.dataset.plot, x0: +s.dataset.x0, x1: +s.dataset.x1, y0: +s.dataset.y0, y1: +s.dataset.y1,
        left: +s.dataset.left, right: +s.dataset.right, top: +s.dataset.top, bottom: +s.dataset.bottom,
        log: s.dataset.log === '1', mode: s.dataset.xmode,
        lines: [...s.querySelectorAll('polyline')].map(p => ({run: +p.dataset.run, series: p.dataset.series,
            ema: p.dataset.ema === '1', width: +(p.dataset.width || 0),
            points: (p.getAttribute('points') || '').trim().split(/\\s+/).filter(t => t).map(t => t.split(',').map(Number))}))}))""")


def to_pixels(p, x, y):
    Y = (lambda v: math.log10(v)) if p["log"] else (lambda v: v)
    px = p["left"] + (x - p["x0"]) / (p["x1"] - p["x0"]) * (p["right"] - p["left"])
    py = p["bottom"] - (Y(y) - Y(p["y0"])) / (Y(p["y1"]) - Y(p["y0"])) * (p["bottom"] - p["top"])
    return px, py


def compare_line(p, line, want, label):
    """want: [(x, y)] in order; the drawn points must be the same points within half a pixel."""
    got = line["points"]
    if len(got) != len(want):
        return [f"{label}: {len(got)} points drawn, {len(want)} expected"]
    worst = 0.0
    for (gx, gy), (x, y) in zip(got, want):
        ex, ey = to_pixels(p, x, y)
        worst = max(worst, abs(gx - ex), abs(gy - ey))
    if worst > HALF_PIXEL:
        return [f"{label}: a point is {worst:.3f} px from its record"]
    return []


def check_all_lines(b, runs_records, label, expect_lines=1):
    """Every raw polyline of every plot against the records of its run (no downsampling here)."""
    bad, checked = [], 0
    for p in plots(b):
        for line in p["lines"]:
            if line["ema"]:
                continue
            recs = runs_records[line["run"]]
            want = []
            for r in recs:
                v, x = value(r, line["series"]), xval(r, p["mode"])
                if v is None or x is None or (p["log"] and v <= 0):
                    continue
                want.append((x, v))
            bad += compare_line(p, line, want, f"{label}: {p['plot']}/{line['series']} run {line['run']} ({p['mode']}{', log' if p['log'] else ''})")
            checked += 1
    if checked < expect_lines:
        bad.append(f"{label}: only {checked} polylines found")
    print(f"{label}: {checked} polylines equal metrics.jsonl within {HALF_PIXEL} px")
    return bad


def set_control(b, id_, v):
    if isinstance(v, bool):
        b.evaluate(f"(e => {{ e.checked = {str(v).lower()}; e.dispatchEvent(new Event('change')); }})(document.getElementById('{id_}'))")
    else:
        b.evaluate(f"(e => {{ e.value = {json.dumps(str(v))}; e.dispatchEvent(new Event('change')); }})(document.getElementById('{id_}'))")


def notices(b):
    return b.evaluate("[...document.querySelectorAll('#notices li')].map(e => e.textContent)")


def case_trained(b, work, moecore):
    bad = []
    # Training text: the repository's own pages (README.md and docs/, about 200 KB).
    pages = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    with open(os.path.join(work, "corpus.txt"), "w") as out:
        for page in pages:
            with open(page) as f:
                out.write(f.read())
    run([moecore, "prepare", "--input", "corpus.txt", "--out", "data"], work)
    sets = lambda extra: sum((["--set", s] for s in TINY + extra), [])
    run([moecore, "train", *sets(["train.steps=40", "train.out_dir=run_a"])], work)
    run([moecore, "train", "--resume", *sets(["train.steps=60", "train.out_dir=run_a"])], work)
    run([moecore, "train", *sets(["train.steps=30", "train.out_dir=run_b", "optim.lr=0.001"])], work)
    recs = read_records(os.path.join(work, "run_a/metrics.jsonl"))
    if [r["step"] for r in recs] != list(range(1, 61)):
        bad.append("run_a: metrics.jsonl does not hold steps 1-60")
    # The page train wrote at its last step.
    open_page(b, "file://" + os.path.join(work, "run_a/report.html"))
    bad += check_all_lines(b, [recs], "train's report.html", expect_lines=15)
    # moecore report on the same run, every axis and log y.
    run([moecore, "report", "run_a", "--out", "a.html"], work)
    open_page(b, "file://" + os.path.join(work, "a.html"))
    for mode in ("step", "tokens", "wall"):
        set_control(b, "xaxis", mode)
        bad += check_all_lines(b, [recs], f"run_a, x = {mode}", expect_lines=15)
    set_control(b, "xaxis", "step")
    set_control(b, "logy", True)
    bad += check_all_lines(b, [recs], "run_a, log y", expect_lines=15)
    set_control(b, "logy", False)
    # EMA: the smoothed line against an EMA of the records computed here.
    set_control(b, "alpha", 0.8)
    set_control(b, "ema", True)
    p = next(p for p in plots(b) if p["plot"] == "loss")
    line = next(l for l in p["lines"] if l["series"] == "ce" and l["ema"])
    e, want = None, []
    for r in recs:
        e = r["ce"] if e is None else 0.8 * e + 0.2 * r["ce"]
        want.append((r["step"], e))
    bad += compare_line(p, line, want, "run_a EMA of ce")
    set_control(b, "ema", False)
    # Marks: the checkpoints at steps 20, 40 (first run) and 20 ... 60 (resumed), one resume.
    events = [json.loads(l) for l in open(os.path.join(work, "run_a/events.jsonl"))]
    n_ck = sum(1 for ev in events if ev["event"] == "checkpoint")
    marks = b.evaluate("({c: document.querySelectorAll('svg[data-plot=loss] .mark-checkpoint').length,"
                       " r: document.querySelectorAll('svg[data-plot=loss] .mark-resume').length})")
    if marks["c"] != n_ck or marks["r"] != 1:
        bad.append(f"marks: {marks} on the loss plot, events.jsonl has {n_ck} checkpoints and 1 resume")
    # Bigram entropy line: the value prepare wrote.
    bigram = float(open(os.path.join(work, "data/bigram_entropy.txt")).read())
    shown = b.evaluate("+(document.querySelector('svg[data-plot=valid] .bigram') || {dataset: {value: NaN}}).dataset.value")
    if not (abs(shown - bigram) <= 1e-12 * bigram):
        bad.append(f"bigram entropy line {shown}, prepare wrote {bigram}")
    # Heat map: each cell is f / sum f of its vector record (one record per column here).
    vec = [r for r in recs if "f" in r]
    cells = b.evaluate("[...document.querySelectorAll('svg[data-plot=heat] rect[data-col]')].map(r => [+r.dataset.col, +r.dataset.expert, +r.dataset.value])")
    worst = 0.0
    for c, ex, v in cells:
        f = vec[c]["f"][0]
        worst = max(worst, abs(v - f[ex] / sum(f)))
    if len(cells) != len(vec) * 4 or worst > 1e-5:
        bad.append(f"heat map: {len(cells)} cells (expected {len(vec) * 4}), worst difference {worst}")
    else:
        print(f"heat map: {len(cells)} cells equal f / sum f (worst {worst:.1e})")
    dots = b.evaluate("[...document.querySelectorAll('svg[data-plot=p-vs-f] circle')].map(c => [+c.dataset.f, +c.dataset.p])")
    last = vec[-1]
    if len(dots) != 4 or any(abs(p_ - q) > 1e-5 * max(1, abs(q)) for (f_, p_), q in zip(dots, last["P"][0])):
        bad.append(f"P against f: {dots} for the last vector record's P {last['P'][0]}")
    # Hover shows the values under the cursor.
    b.evaluate("""(() => { const s = document.querySelector('svg[data-plot=loss]'), r = s.getBoundingClientRect();
        s.dispatchEvent(new MouseEvent('mousemove', {clientX: r.left + 300, clientY: r.top + 100, bubbles: true})); })()""")
    tip = b.evaluate("document.getElementById('tooltip').hidden ? '' : document.getElementById('tooltip').textContent")
    if "cross-entropy" not in tip:
        bad.append(f"hover: tooltip {tip!r}")
    # CSV: one row per plotted point.
    rows = b.evaluate("moeReport.csv().trim().split('\\n').length - 1")
    points = sum(len(l["points"]) for p in plots(b) for l in p["lines"])
    if rows != points:
        bad.append(f"CSV: {rows} rows, {points} points plotted")
    print(f"marks {marks}, hover {tip.splitlines()[0] if tip else '-'}, CSV {rows} rows")
    return bad, recs, read_records(os.path.join(work, "run_b/metrics.jsonl"))


def case_multi(b, work, moecore, recs_a, recs_b):
    bad = []
    run([moecore, "report", "run_a", "run_b", "--out", "multi.html"], work)
    open_page(b, "file://" + os.path.join(work, "multi.html"))
    bad += check_all_lines(b, [recs_a, recs_b], "two runs overlaid", expect_lines=30)
    labels = b.evaluate("[...document.querySelectorAll('#runs .run')].map(e => e.textContent)")
    if len(labels) != 2 or "optim.lr=0.003" not in labels[0] or "optim.lr=0.001" not in labels[1]:
        bad.append(f"run labels {labels}")
    differs = b.evaluate("[...document.querySelectorAll('#config tr.differs td:first-child')].map(e => e.textContent)")
    if "optim.lr" not in differs or "train.steps" not in differs:
        bad.append(f"config rows marked as differing: {differs}")
    print("labels:", labels)
    return bad


def case_parallel(b, work, moecore):
    """Expert parallelism (drop fraction, rows per rank) and a pipeline (the bubble), under mpirun."""
    mpirun = shutil.which("mpirun")
    if not mpirun:
        return ["parallel: mpirun not found"]
    bad = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Two data-parallel ranks run whole micro-batches of the global batch of 4: micro-batches of 2.
    for name, extra in (("run_ep", ["parallel.dp=2", "parallel.ep=2", "parallel.ep_capacity_factor=1.0",
                                    "train.micro_batch_size=2"]),
                        ("run_pp", ["parallel.pp=2", "train.micro_batch_size=2"])):
        sets = sum((["--set", x] for x in TINY + ["train.steps=20", "train.out_dir=" + name] + extra), [])
        out = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", moecore, "train", *sets],
                             cwd=work, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            return [f"parallel: {name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"]
        open_page(b, "file://" + os.path.join(work, name, "report.html"))
        recs = read_records(os.path.join(work, name, "metrics.jsonl"))
        bad += check_all_lines(b, [recs], name, expect_lines=15)
        drawn = b.evaluate("[...document.querySelectorAll('div[data-plot]')].map(e => e.dataset.plot)")
        want = ["drop", "rows"] if name == "run_ep" else ["bubble"]
        if any(w not in drawn for w in want):
            bad.append(f"{name}: plots {drawn} lack {want}")
        print(f"{name}: plots {', '.join(drawn)}")
    return bad


def case_broken(b, work, moecore):
    d = os.path.join(work, "broken")
    os.makedirs(d)
    rec = lambda s, ce: f'{{"step":{s},"ce":{ce},"loss":{ce},"lr":0.001,"grad_norm":1.0,"tokens":64,"elapsed_s":{s * 0.5}}}\n'
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.write(rec(1, 3.0) + rec(2, '"nan"') + rec(3, 2.5) + "this is not json\n" + rec(2, 2.8) + rec(4, '"inf"')
                + rec(5, 2.0) + rec(6, 1.9)[:30])
    run([moecore, "report", d], work)
    open_page(b, "file://" + os.path.join(d, "report.html"))
    got = notices(b)
    want = ["truncated line 8", "1 repeated step replaced", "line 4 skipped", "no MoE layers", "config.toml: not found",
            "non-finite values"]
    bad = [f"broken input: no notice with {w!r} in {got}" for w in want if not any(w in n for n in got)]
    bad += check_all_lines(b, [read_records(os.path.join(d, "metrics.jsonl"))], "broken input", expect_lines=4)
    moe_plots = b.evaluate("document.querySelectorAll('div[data-plot=lbl], div[data-plot=load]').length")
    if moe_plots:
        bad.append("broken input: load plots drawn for a run with no MoE layers")
    print("broken input notices:", got)
    return bad


def case_spike(b, work, moecore):
    d = os.path.join(work, "spike")
    os.makedirs(d)
    n, spike, E = 1_000_000, 654_321, 64
    rng = random.Random(5)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for s in range(1, n + 1):
            ce = 50.0 if s == spike else round(3.0 - 1e-6 * s + 0.01 * rng.random(), 6)
            line = f'{{"step":{s},"ce":{ce},"loss":{ce},"lr":0.001,"grad_norm":1.0,"tokens":4096,"elapsed_s":{s * 0.04:.2f},"lbl":[1.0,1.0],"max_load":[1.5,1.5]'
            if s % 1000 == 0:
                line += ',"clipped":true'
            if s == 300_500:
                line += ',"skipped":true,"nonfinite_tensor":"layers.1.w1"'
            if s == 500_000:
                line += ',"warning":"warning: possible token gerrymandering at step 500000"'
            if s % 100 == 0:
                fs = [[rng.randrange(1000) for _ in range(E)] for _ in range(2)]
                line += ',"f":' + json.dumps(fs) + ',"P":' + json.dumps([[round(x / 64000, 6) for x in row] for row in fs])
            f.write(line + "}\n")
    t0 = time.time()
    run([moecore, "report", d], work)
    secs = time.time() - t0
    size = os.path.getsize(os.path.join(d, "report.html"))
    print(f"spike: 10^6 steps, 64-expert vectors every 100 steps: report {size} bytes in {secs:.1f} s")
    bad = [] if size <= 5_000_000 else [f"spike: report is {size} bytes"]
    open_page(b, "file://" + os.path.join(d, "report.html"))
    recs = read_records(os.path.join(d, "metrics.jsonl"))
    p = next(p for p in plots(b) if p["plot"] == "loss")
    line = next(l for l in p["lines"] if l["series"] == "ce")
    w = line["width"]
    # The bucket minima and maxima, computed here: bucket = step // width; each drawn by its
    # lowest and highest record in step order (one point when they are the same record).
    buckets = {}
    for r in recs:
        k = r["step"] // w
        lo, hi = buckets.get(k, (r, r))
        if r["ce"] < lo["ce"]:
            lo = r
        if r["ce"] > hi["ce"]:
            hi = r
        buckets[k] = (lo, hi)
    want = []
    for k in sorted(buckets):
        lo, hi = buckets[k]
        for r in sorted({id(lo): lo, id(hi): hi}.values(), key=lambda r: r["step"]):
            want.append((r["step"], r["ce"]))
    bad += compare_line(p, line, want, f"spike: ce in buckets of {w} steps")
    top = min(line["points"], key=lambda q: q[1])  # the highest point is the smallest pixel y
    tx, ty = to_pixels(p, spike, 50.0)
    if abs(top[0] - tx) > HALF_PIXEL or abs(top[1] - ty) > HALF_PIXEL:
        bad.append(f"spike: highest drawn point {top}, the spike is at {(tx, ty)}")
    if not any("downsampled for drawing: 1000000 steps" in t for t in notices(b)):
        bad.append(f"spike: no downsampling notice in {notices(b)}")
    marks = b.evaluate("""(() => { const sum = (q) => [...document.querySelectorAll(q)].reduce((a, e) => a + +e.dataset.count, 0);
        return {clipped: sum('svg[data-plot=grad] .mark-clipped'), skipped: sum('svg[data-plot=grad] .mark-skipped'),
                warning_lbl: sum('svg[data-plot=lbl] .mark-warning'), warning_load: sum('svg[data-plot=load] .mark-warning')}; })()""")
    if marks != {"clipped": 1000, "skipped": 1, "warning_lbl": 1, "warning_load": 1}:
        bad.append(f"spike: marks {marks} (1000 clipped, 1 skipped, 1 warning expected)")
    print(f"spike: marks {marks}")
    print(f"spike: {len(line['points'])} points for 10^6 steps (buckets of {w}); the spike at step {spike} is drawn")
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moecore", required=True)
    ap.add_argument("--expect-planted-error", action="store_true")
    ap.add_argument("--screenshot", help="write a PNG of RUN's report (--run)")
    ap.add_argument("--run", help="with --screenshot: the run directory")
    ap.add_argument("--skip-spike", action="store_true")
    ap.add_argument("--skip-parallel", action="store_true", help="leave out the EP and PP runs under mpirun")
    a = ap.parse_args()
    moecore = os.path.abspath(a.moecore)
    work = tempfile.mkdtemp(prefix="moecore-report-")
    b = Browser()
    failures = []
    try:
        if a.screenshot:
            run([moecore, "report", a.run, "--out", os.path.join(work, "shot.html")], os.getcwd())
            open_page(b, "file://" + os.path.join(work, "shot.html"))
            b.send("Emulation.setDeviceMetricsOverride", {"width": 1360, "height": 1700, "deviceScaleFactor": 1, "mobile": False})
            b.pump(0.5)
            png = b.send("Page.captureScreenshot", {"format": "png"})["data"]
            with open(a.screenshot, "wb") as out:
                out.write(base64.b64decode(png))
            print("screenshot:", a.screenshot)
        elif a.expect_planted_error:
            d = os.path.join(work, "planted")
            os.makedirs(d)
            with open(os.path.join(d, "metrics.jsonl"), "w") as f:
                f.write('{"step":1,"ce":3.0}\n{"step":2,"ce":2.9}\n')
            run([moecore, "report", d], work)
            open_page(b, "file://" + os.path.join(d, "report.html") + "#plant-error")
            return 0 if planted_errors_caught(b) else 1
        else:
            bad, recs_a, recs_b = case_trained(b, work, moecore)
            failures += bad
            failures += case_multi(b, work, moecore, recs_a, recs_b)
            if not a.skip_parallel:
                failures += case_parallel(b, work, moecore)
            failures += case_broken(b, work, moecore)
            if not a.skip_spike:
                failures += case_spike(b, work, moecore)
        b.pump(0.3)
        failures += [f"browser reported {e}" for e in b.errors()]
    finally:
        b.close()
        shutil.rmtree(work, ignore_errors=True)
    for f in failures:
        print("FAIL:", f)
    print("report browser test:", "FAILED" if failures else "passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

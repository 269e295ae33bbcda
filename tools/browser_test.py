#!/usr/bin/env python3
"""The guide page in a real browser: Debian's headless Chromium driven over the DevTools protocol
(through --remote-debugging-pipe: no network, no packages beyond Python's own).

The page is opened from disk (file://) and driven through its own controls (inputs set and their
change events dispatched, a metrics.jsonl handed to its file input); every number it shows carries
its full-precision value in a data-value attribute, and each one is compared for equality with
`moecore plan --json` for the same input. Exceptions and console errors are collected through the
protocol: any one fails the test (headless Chromium would exit 0 and log them as info otherwise).
--expect-planted-error opens the page with #plant-error (it throws once loaded) and succeeds only
if that error is caught: the check of the check.

Usage: tools/browser_test.py --page build-web/moecore-planner.html --moecore build/moecore
                             [--screenshot docs/planner.png] [--expect-planted-error]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Browser:
    """Chromium with the DevTools protocol on fds 3 (commands in) and 4 (replies and events out)."""

    def __init__(self):
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        if not exe:
            sys.exit("browser test: chromium not found (Debian package chromium)")
        self.profile = tempfile.mkdtemp(prefix="moecore-chromium-")
        cmd_r, self.cmd_w = os.pipe()
        self.out_r, out_w = os.pipe()

        def child_fds():
            # Through fds above 4 first (a pipe end may already be 3 or 4), and inheritable: Python
            # opens pipes close-on-exec, and dup2 onto the same number keeps that flag.
            a, b = os.dup(cmd_r) + 100, os.dup(out_w) + 100
            os.dup2(cmd_r, a)
            os.dup2(out_w, b)
            os.dup2(a, 3)
            os.dup2(b, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--allow-file-access-from-files",
             f"--user-data-dir={self.profile}", "about:blank"],
            preexec_fn=child_fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(out_w)
        self.buf = b""
        self.next_id = 0
        self.events = []
        self.session = None

    def _read_message(self, deadline):
        while b"\0" not in self.buf:
            if time.time() > deadline:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self.out_r, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the protocol pipe")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method, params=None, session=True, timeout=60):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            m = self._read_message(deadline)
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def evaluate(self, expression, timeout=60):
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True},
                      timeout=timeout)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def pump(self, seconds):
        """Collects events for a while (timers, late errors)."""
        deadline = time.time() + seconds
        self.evaluate(f"new Promise(r => setTimeout(r, {int(seconds * 1000)}))", timeout=seconds + 30)
        while time.time() < deadline:
            time.sleep(0.05)

    def errors(self):
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append("exception: " + (d.get("exception", {}).get("description") or d.get("text", "?")))
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console." + p["type"] + ": " + " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append("log: " + p["entry"].get("text", ""))
        return out

    def close(self):
        try:
            self.send("Browser.close", session=False, timeout=10)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


def open_page(b, url):
    target = b.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
    b.session = b.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)["sessionId"]
    for domain in ("Runtime", "Log", "Page", "DOM"):
        b.send(domain + ".enable")
    b.send("Emulation.setDeviceMetricsOverride", {"width": 1400, "height": 2000, "deviceScaleFactor": 1, "mobile": False})
    b.send("Page.navigate", {"url": url})
    for _ in range(600):  # the module compiles, then init() marks the page ready
        if b.evaluate("document.body && document.body.dataset.ready === '1'"):
            return
        time.sleep(0.1)
    raise TimeoutError("the page never became ready: " + "; ".join(b.errors()))


def planted_errors_caught(b):
    """After a page opened with #plant-error: both its planted exception and console error were collected."""
    b.pump(1.0)
    errs = b.errors()
    print("collected:", errs)
    ok = any("planted error" in e for e in errs) and any("planted console error" in e for e in errs)
    print("planted exception and console error caught" if ok else "planted errors NOT both caught")
    return ok


def set_controls(b, values):
    """Sets the page's inputs as a user would and fires their change events (one update each)."""
    js = []
    for k, v in values.items():
        if isinstance(v, bool):
            js.append(f"(e => {{ e.checked = {str(v).lower()}; e.dispatchEvent(new Event('change')); }})(document.getElementById('{k}'));")
        else:
            js.append(f"(e => {{ e.value = {json.dumps(str(v))}; e.dispatchEvent(new Event('change')); }})(document.getElementById('{k}'));")
    b.evaluate("\n".join(js))


def page_values(b):
    return b.evaluate("""(() => { const o = {}; for (const e of document.querySelectorAll('[data-key]'))
        o[e.dataset.key] = e.dataset.value; return o; })()""")


def cli_json(moecore, q, sweep):
    args = [moecore, "plan", "--json"]
    model = q["model"]
    for d in ("configs/published", "configs/bench"):
        if os.path.exists(os.path.join(ROOT, d, model + ".toml")):
            args += ["--config", os.path.join(ROOT, d, model + ".toml")]
            break
    else:
        raise RuntimeError(f"no config file for model preset {model}")
    for s in q["set"]:
        args += ["--set", s]
    args += ["--cluster", q["cluster"]]
    if sweep:
        args += ["--sweep"]
    else:
        args += ["--layout", q["layout"]]
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip()}
    return json.loads(out.stdout)


def expected(key, plan, sweep):
    """The CLI's value for one of the page's data keys."""
    if key == "peak_bytes":
        return max(s["total_bytes"] for s in plan["stages"])
    if key == "max_bytes_sent":
        return max(r["bytes_sent"] for r in plan["ranks"])
    if key == "overlay.predicted":
        return plan["time"]["tokens_per_s"]
    if key.startswith("sweep."):
        _, pp, ep, field = key.split(".")
        row = next(r for r in sweep["sweep"] if r["pp"] == int(pp[2:]) and r["ep"] == int(ep[2:]))
        return row[field]
    node = plan
    parts = key.split(".")
    i = 0
    while i < len(parts):
        part = parts[i]
        if isinstance(node, list):
            node = node[int(part)]
        elif part in node:
            node = node[part]
        else:  # a name with dots in it ("memory_bytes.fp32 master weights" has none, but be safe)
            rest = ".".join(parts[i:])
            node = node[rest]
            break
        i += 1
    return node


# A figure with 7 or more decimals or in exponent notation, as a whole token: floating-point noise.
# Only whole tokens: a file name the page echoes (tmpe27e7du8.jsonl) is not a number.
NOISE = re.compile(r"(?<![\w.])(?:\d*\.\d{7,}|\d+(?:\.\d+)?[eE][-+]?\d+)(?![\w.])")


def noise_check_works():
    """The noise pattern's own check, run with the planted-error self-check."""
    caught = all(NOISE.search(t) for t in ("x 0.30000000000000004 y", "1e-07", "2.5E+12 tokens"))
    passed = not any(NOISE.search(t) for t in ("tmpe27e7du8.jsonl:", "1,005,300 tokens/s", "v1e3", "12.25 GiB"))
    print("noise pattern catches noise and passes names and rounded figures" if caught and passed
          else "noise pattern check FAILED")
    return caught and passed


def shown_noise(b, label):
    """Numbers the page shows (text, SVG labels, hover titles) must be rounded: a figure with 7 or
    more decimals or in exponent notation is floating-point noise printed as a number."""
    texts = b.evaluate("""(() => [document.body.innerText,
        ...[...document.querySelectorAll('title')].map(e => e.textContent),
        ...[...document.querySelectorAll('[title]')].map(e => e.getAttribute('title'))])()""")
    bad = []
    for t in texts:
        for m in NOISE.finditer(t):
            bad.append(f"{label}: the page shows {t[max(0, m.start() - 40):m.end() + 10]!r}")
    return bad[:5]


def compare(b, moecore, label):
    q = b.evaluate("JSON.stringify(moecore.request(false))")
    q = json.loads(q)
    plan = cli_json(moecore, q, False)
    sweep = cli_json(moecore, q, True)
    values = page_values(b)
    checked, bad = 0, []
    for key, shown in values.items():
        if key in ("error", "metrics.steps"):
            continue
        want = expected(key, plan, sweep)
        got = json.loads(shown) if shown in ("true", "false") else float(shown)
        checked += 1
        if got != want:
            bad.append(f"{key}: page {shown}, moecore plan --json {want!r}")
    print(f"{label}: {checked} values on the page equal moecore plan --json (layout {q['layout']}, cluster {q['cluster']})")
    if checked < 30:
        bad.append(f"only {checked} values found on the page")
    return bad + shown_noise(b, label)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--page", required=True)
    ap.add_argument("--moecore", required=True)
    ap.add_argument("--screenshot")
    ap.add_argument("--expect-planted-error", action="store_true")
    a = ap.parse_args()
    url = "file://" + os.path.abspath(a.page) + ("#plant-error" if a.expect_planted_error else "")
    b = Browser()
    failures = []
    try:
        open_page(b, url)
        if a.expect_planted_error:
            return 0 if planted_errors_caught(b) and noise_check_works() else 1
        failures += compare(b, a.moecore, "default input")
        # A layout set through the page's controls, with recompute, ZeRO-1 and fp32.
        set_controls(b, {"dp": 4, "ep": 2, "pp": 2, "v": 2, "recompute": True, "zero1": True, "precision": "fp32", "cf": 1.0})
        failures += compare(b, a.moecore, "dp=4 ep=2 pp=2 interleaved v=2, recompute, ZeRO-1, fp32")
        set_controls(b, {"model": "fine_grained", "cluster": "cpu-core", "ranks": 2, "dp": 2, "ep": 2, "pp": 1, "v": "",
                         "micro": 4, "batch": 8, "recompute": False, "zero1": False, "cf": 0})
        failures += compare(b, a.moecore, "fine_grained on cpu-core x2")
        # An error reaches the page with the command line's message.
        set_controls(b, {"dp": 2, "ep": 4})
        q = json.loads(b.evaluate("JSON.stringify(moecore.request(false))"))
        cli = cli_json(a.moecore, q, False)
        shown = b.evaluate("document.getElementById('error').dataset.value || ''")
        if not shown or cli.get("error", "").replace("moecore: error: ", "") != shown:
            failures.append(f"error: page {shown!r}, moecore {cli.get('error')!r}")
        else:
            print("bad layout: the page shows the command line's error:", shown[:80])
        set_controls(b, {"dp": 2, "ep": 2})
        # A metrics.jsonl through the file input (two steps, one line that is not a record).
        # A fixed name: the page shows it, and a random one could look like a number.
        metrics_dir = tempfile.mkdtemp()
        metrics = os.path.join(metrics_dir, "metrics.jsonl")
        with open(metrics, "w") as f:
            f.write('{"step": 1, "tokens_per_s": 1500.5}\n{"step": 2, "tokens_per_s": 1612.25}\nnot json\n')
        node = b.send("DOM.querySelector", {"nodeId": b.send("DOM.getDocument")["root"]["nodeId"], "selector": "#metrics"})["nodeId"]
        b.send("DOM.setFileInputFiles", {"files": [metrics], "nodeId": node})
        for _ in range(50):
            if b.evaluate("document.getElementById('metrics-note').dataset.value || ''") == "2":
                break
            time.sleep(0.1)
        note = b.evaluate("document.getElementById('metrics-note').textContent")
        points = b.evaluate("(document.querySelector('#overlay polyline') || {getAttribute: () => ''}).getAttribute('points')")
        if "2 steps read, 1 line(s) skipped" not in note or len(points.split()) != 2:
            failures.append(f"metrics.jsonl: note {note!r}, polyline {points!r}")
        else:
            print("metrics.jsonl overlay:", note)
        os.unlink(metrics)
        os.rmdir(metrics_dir)
        # The 1.2T model on 512 B300 (random routing: the capacity drops' normal approximation, whose
        # exp and erfc come from the browser build's libm), and a layout sweep of 512 ranks.
        set_controls(b, {"model": "olmo3_v7_1t", "cluster": "b300", "ranks": 512, "dp": 64, "ep": 8, "pp": 8, "v": 2, "micro": 1,
                         "batch": 8192, "precision": "bf16", "recompute": True, "zero1": True, "cf": 1.1875})
        failures += compare(b, a.moecore, "Olmo-core 3's 1.2T on 512 B300")
        if a.screenshot:
            b.evaluate("moecore.clearMetrics()")
            set_controls(b, {"model": "olmo3_v1_e32", "cluster": "b300", "ranks": 8, "dp": 4, "ep": 4, "pp": 2, "v": "",
                             "micro": 2, "batch": 512, "precision": "bf16", "recompute": False, "cf": 1.25})
            failures += compare(b, a.moecore, "screenshot layout")
            import base64
            png = b.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
            with open(a.screenshot, "wb") as out:
                out.write(base64.b64decode(png))
            print("screenshot:", a.screenshot)
        b.pump(0.5)
        failures += [f"browser reported {e}" for e in b.errors()]
    finally:
        b.close()
    for f in failures:
        print("FAIL:", f)
    print("browser test:", "FAILED" if failures else "passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

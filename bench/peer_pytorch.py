#!/usr/bin/env python3
"""Side-by-side training throughput: moecore vs PyTorch + transformers' OlmoeForCausalLM.

Same model and batch as the moecore bench config (default configs/bench/olmoe_compat.toml, read
with tomllib), 2 threads on both sides, full optimizer steps (forward, backward, clipping,
AdamW) after a warm-up. PyTorch variants: eager fp32, eager with bf16 autocast, and
torch.compile of both (a variant that fails is reported with its error and skipped). Runs
alternate A/B/A/B: each round runs every PyTorch variant (in this process) and moecore
(`moecore bench`, a subprocess) in fp32 and bf16, so noise on the shared machine hits both.

MFU uses moecore's formula (`moecore config`: 6 x active matmul parameters, router and LM head
included, embedding excluded, + 12 x L x H x hd x (S+1)/2) against the peak `moecore bench`
measured in the same round on the same 2 threads (its "MFU: ... of N GFLOP/s (measured: ...)"
line: register-only FMA loops, kernels/cpu/fma_peak.h), named in the table with its source; both
sides run the same model, so the ratio of MFUs of the same precision equals the ratio of
throughputs. That peak is the best measured on this machine (a cache that only goes up); a
second MFU column divides each round's rate by the peak the bench measured again right after its
steps in that round (its "MFU against the peak measured right after the timed steps" line): a
shared VM's speed moves by the hour, and this column says how close each side came to the
machine as it was.

Two throughputs per run, both from the run's best step (noise on a shared machine only ever adds
time): wall (tokens / step seconds) and CPU (2 x tokens / CPU seconds of the whole process, both
threads): the wall rate a quiet machine would show, and barely moved by other processes taking
the cores. OMP_WAIT_POLICY=passive on both sides so waiting threads sleep instead of spinning
(spinning would count as CPU time). --wait default leaves both OpenMP runtimes their own policy
(spin a while, then sleep), which is how `moecore train` and a PyTorch script run: the wall rates
to quote (moecore's fine_grained bf16 step is ~10% faster so than under passive, which wakes a
sleeping thread at each of its hundreds of parallel regions); its CPU-time rates count spinning
and mean nothing.

Peak memory: moecore's peak RSS from its bench; each PyTorch variant's in a process of its own
(this script with --rss-of VARIANT: build it, warm-up, one step, then the process's peak RSS), so
one variant's memory does not hide another's.

Each phase of moecore's best round against its kernels alone: `moecore bench --alone` times each
phase's GEMMs and attention kernels at the step's shapes after its steps, and the script prints
that run's phase table (issue #30's per-phase table, from the same run).

Expert load: each run's router, per MoE layer, in its last round's timed steps (the busiest
expert's tokens over the mean: moecore's bench prints it, PyTorch's from the router logits after
each step's timing). Random ids at the bench configs' learning rate push both routers towards
collapse within a few steps, and a collapsed router's grouped GEMMs are top_k dense ones: the
column says which regime each side was timed in. The PyTorch variants train on across the rounds
(a later round's steps are later steps); each moecore bench starts afresh.

Run with a Python that has torch and transformers:  python3 bench/peer_pytorch.py
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time
import tomllib

# precision -> (GFLOP/s, "source: how"), the highest moecore bench reported (set by run_moecore).
PEAKS = {}
# precision -> per round, the peak moecore bench measured right after its steps (this machine's
# speed in that round: a shared VM's moves by the hour; NaN where the bench did not print it).
NOW_PEAKS = {}
# run name -> peak RSS in MiB (moecore: its bench's; PyTorch: a process per variant).
RSS = {}
# run name -> per MoE layer, the busiest expert's tokens over the mean in its latest round's timed
# steps (median of the steps): the load its grouped GEMMs were timed on. Random ids at the
# configs' learning rate drive both routers towards collapse (every token on the same top_k
# experts), where the grouped GEMMs run as top_k dense ones.
LOADS = {}
# precision -> (tokens/s, moecore bench's phase table with its kernels-alone columns) of the best round.
PHASES = {}


def flops_per_token(m, seq_len):
    """moecore's ModelConfig::train_flops_per_token for the fields this config uses."""
    d, L, H = m["d_model"], m["n_layers"], m["n_heads"]
    kv = m.get("n_kv_heads", H)
    hd = d // H
    attn = d * H * hd + 2 * d * kv * hd + H * hd * d
    moe = d * m["num_experts"] + m["top_k"] * 3 * d * m["expert_hidden"]
    active = L * (attn + moe) + d * m["vocab_size"]
    return 6.0 * active + 12.0 * L * H * hd * (seq_len + 1) / 2.0


def moecore_flops_per_token(binary, config):
    out = subprocess.run([binary, "config", "--config", config], check=True, capture_output=True,
                         text=True).stdout
    return float(re.search(r"training FLOPs per token \(causal attention\): ([0-9.e+]+)", out).group(1))


def run_moecore(binary, config, precision, warmup, steps):
    # --alone: after its steps the bench also times each phase's kernels alone at the step's shapes
    # (nothing it reports about the steps moves); its phase table of the best round is printed below.
    cmd = [binary, "bench", "--config", config, "--warmup", str(warmup), "--steps", str(steps), "--alone",
           "--set", "train.threads=2", "--set", f"train.precision={precision}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    tokens = int(re.search(r"^precision \w+, (\d+) tokens/step", out, re.M).group(1))
    wall = min(float(x) for x in re.search(r"^step times \(s\):(.*)$", out, re.M).group(1).split())
    table = re.search(r"^phase breakdown.*?^kernels alone[^\n]*$", out, re.M | re.S)
    if table and tokens / wall > PHASES.get(precision, (0.0, ""))[0]:
        PHASES[precision] = (tokens / wall, table.group(0))
    cpu = min(float(x) for x in re.search(r"^cpu times \(s\):(.*)$", out, re.M).group(1).split())
    peak = re.search(r"MFU: [0-9.]+% of ([0-9.]+) GFLOP/s \((.*)\)$", out, re.M)
    gflops, source = float(peak.group(1)), peak.group(2)
    RSS[f"moecore-{precision}"] = max(RSS.get(f"moecore-{precision}", 0.0),
                                      float(re.search(r"^peak RSS: ([0-9.]+) MiB", out, re.M).group(1)))
    if gflops > PEAKS.get(precision, (0.0, ""))[0]:  # the least disturbed measurement of the rounds
        PEAKS[precision] = (gflops, source)
    # The peak measured again right after the run's steps: the machine's speed in this round.
    now = re.search(r"^MFU against the peak measured right after the timed steps: [0-9.]+% of ([0-9.]+) GFLOP/s", out,
                    re.M)
    NOW_PEAKS.setdefault(precision, []).append(float(now.group(1)) if now else float("nan"))
    load = re.search(r"^expert load \(.*?\):([0-9. ]+)\(", out, re.M)
    if load:
        LOADS[f"moecore-{precision}"] = [float(x) for x in load.group(1).split()]
    return (tokens / wall, 2 * tokens / cpu), " ".join(cmd)


class TorchVariant:
    def __init__(self, name, cfg, compile_, bf16, experts_impl, seed):
        import torch
        from transformers import OlmoeConfig, OlmoeForCausalLM

        self.name, self.bf16, self.error = name, bf16, None
        m, t, o = cfg["model"], cfg["train"], cfg["optim"]
        self.B, self.S, self.V = t["batch_size"], t["seq_len"], m["vocab_size"]
        self.E, self.K = m["num_experts"], m["top_k"]
        torch.manual_seed(seed)
        hf = OlmoeConfig(vocab_size=m["vocab_size"], hidden_size=m["d_model"],
                         intermediate_size=m["expert_hidden"], num_hidden_layers=m["n_layers"],
                         num_attention_heads=m["n_heads"], num_key_value_heads=m.get("n_kv_heads", m["n_heads"]),
                         num_experts=m["num_experts"], num_experts_per_tok=m["top_k"],
                         norm_topk_prob=m.get("norm_topk_prob", False), rms_norm_eps=m.get("norm_eps", 1e-5),
                         rope_theta=m.get("rope_theta", 10000.0), max_position_embeddings=max(4096, self.S),
                         router_aux_loss_coef=cfg["loss"]["lbl_coef"], output_router_logits=True,
                         tie_word_embeddings=False, initializer_range=m.get("init_std", 0.02),
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
        hf._experts_implementation = experts_impl
        self.model = OlmoeForCausalLM(hf)
        self.model.train()
        try:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=o["lr"], weight_decay=o["weight_decay"],
                                         fused=True)
        except (RuntimeError, TypeError):  # fused AdamW unavailable: the foreach one
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=o["lr"], weight_decay=o["weight_decay"])
        self.clip = o.get("max_grad_norm", 0.0)
        self.fwd = torch.compile(self.model) if compile_ else self.model
        self.gen = torch.Generator().manual_seed(seed)

    def step(self):
        import torch

        ids = torch.randint(0, self.V, (self.B, self.S), generator=self.gen)
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            out = self.fwd(input_ids=ids, labels=ids)  # loss shifted inside; + lbl_coef * aux loss
        self.router_logits = out.router_logits  # per layer (tokens, experts): the load, after the timing
        out.loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()

    def loads(self):
        """Per MoE layer of the last step: the busiest expert's tokens (top-k slots) over the mean."""
        import torch

        out = []
        for logits in self.router_logits:
            top = logits.detach().float().topk(self.K, dim=-1).indices.flatten()
            counts = torch.bincount(top, minlength=self.E).float()
            out.append((counts.max() / counts.mean()).item())
        return out

    def run(self, steps):
        wall, cpu, loads = [], [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            self.step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            loads.append(self.loads())
        LOADS[self.name] = [statistics.median(layer) for layer in zip(*loads)]
        tokens = self.B * self.S
        return tokens / min(wall), 2 * tokens / min(cpu)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--config", default=os.path.join(here, "..", "configs", "bench", "olmoe_compat.toml"))
    ap.add_argument("--moecore", default=os.path.join(here, "..", "build", "moecore"))
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before the first round")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (median)")
    ap.add_argument("--variants", default="eager-fp32,eager-bf16,compile-fp32,compile-bf16")
    ap.add_argument("--experts", default="grouped_mm",
                    help="transformers experts_implementation (eager, grouped_mm, batched_mm)")
    ap.add_argument("--wait", choices=["passive", "default"], default="passive",
                    help="OpenMP wait policy of both sides: passive (CPU-time rates count work only) "
                         "or each runtime's default (the wall rates a user sees)")
    ap.add_argument("--rss-of", default="", help="internal: print one PyTorch variant's peak RSS and exit")
    args = ap.parse_args()

    # Before torch loads its OpenMP runtime; moecore's bench and the RSS processes inherit it.
    if args.wait == "default":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    import torch
    import transformers

    torch.set_num_threads(2)
    with open(args.config, "rb") as f:
        cfg = tomllib.load(f)
    if args.rss_of:
        mode, prec = args.rss_of.split("-")
        v = TorchVariant(args.rss_of, cfg, mode == "compile", prec == "bf16", args.experts, cfg["train"]["seed"])
        for _ in range(args.warmup + 1):
            v.step()
        # VmHWM, not getrusage's ru_maxrss: that one keeps the forking parent's high-water mark
        # across exec (Linux), so every variant would report this script's own peak.
        with open("/proc/self/status") as f:
            hwm = int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1))
        print(f"peak_rss_mib {hwm / 1024.0:.1f}")
        return 0
    S = cfg["train"]["seq_len"]
    fpt = flops_per_token(cfg["model"], S)
    ref = moecore_flops_per_token(args.moecore, args.config)
    assert abs(fpt - ref) <= 1e-5 * ref, f"FLOP formula mismatch: {fpt} vs moecore config {ref}"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads "
          f"{torch.get_num_threads()}, config {args.config}, "
          f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset (each runtime its default)')}")
    print(f"{cfg['train']['batch_size']} x {S} tokens/step, {fpt / 1e6:.2f} MFLOP/token (moecore formula), "
          f"experts_implementation={args.experts}, warm-up {args.warmup}, {args.steps} timed steps x "
          f"{args.rounds} rounds", flush=True)

    variants, failed = [], {}
    for name in args.variants.split(","):
        mode, prec = name.split("-")
        try:
            v = TorchVariant(name, cfg, mode == "compile", prec == "bf16", args.experts, cfg["train"]["seed"])
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                v.step()
            print(f"  {name}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
            variants.append(v)
        except Exception as e:  # report and go on with the others
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            print(f"  {name}: FAILED ({failed[name]})", flush=True)

    results = {}
    cmds = {}
    for r in range(args.rounds):
        for v in list(variants):
            try:
                results.setdefault(v.name, []).append(v.run(args.steps))
            except Exception as e:  # e.g. a recompilation failing later: report, drop the variant
                failed[v.name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                print(f"  {v.name}: FAILED in round {r + 1} ({failed[v.name]})", flush=True)
                variants.remove(v)
                results.pop(v.name, None)
                continue
            print(f"  round {r + 1} torch {v.name}: {results[v.name][-1][0]:.0f} tokens/s wall, "
                  f"{results[v.name][-1][1]:.0f} by CPU time", flush=True)
        for prec in ("fp32", "bf16"):
            tps, cmds[prec] = run_moecore(args.moecore, args.config, prec, args.warmup, args.steps)
            results.setdefault(f"moecore-{prec}", []).append(tps)
            print(f"  round {r + 1} moecore {prec}: {tps[0]:.0f} tokens/s wall, {tps[1]:.0f} by CPU time",
                  flush=True)

    for v in variants:  # each variant's memory in a process of its own
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-of", v.name, "--config", args.config,
                              "--moecore", args.moecore, "--warmup", str(args.warmup), "--experts", args.experts],
                             capture_output=True, text=True)
        m = re.search(r"^peak_rss_mib ([0-9.]+)", out.stdout, re.M)
        RSS[v.name] = float(m.group(1)) if m else float("nan")

    def mfu(tps, prec):
        return 100.0 * tps * fpt / 1e9 / PEAKS[prec][0]

    def mfu_now(rounds, prec):
        # Each round's wall rate against the peak measured in that round, the best of the rounds.
        now = NOW_PEAKS.get(prec, [])
        return max((100.0 * x[0] * fpt / 1e9 / now[i] for i, x in enumerate(rounds) if i < len(now)),
                   default=float("nan"))

    for prec, (gflops, source) in sorted(PEAKS.items()):
        print(f"{prec} peak: {gflops:.1f} GFLOP/s ({source})")

    print("\nBest step per run; per round: wall / CPU-time tokens/s. Columns: best over the rounds.")
    for prec, now in sorted(NOW_PEAKS.items()):
        print(f"{prec} peak measured after each round's moecore steps: {', '.join(f'{g:.1f}' for g in now)} GFLOP/s")
    mc = cfg["model"]
    print(f"expert load: per MoE layer, the busiest expert's tokens over the mean in the last round's timed steps "
          f"(median of the steps); 1 is even, {mc['num_experts'] / mc['top_k']:.0f} every token on the same "
          f"{mc['top_k']} of {mc['num_experts']} experts")
    print("| side | variant | rounds (wall / cpu tok/s) | tokens/s (wall) | MFU (wall) | MFU (wall) of the round's peak "
          "| tokens/s (cpu) | MFU (cpu) | peak RSS (MiB) | expert load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    best = {k: (max(x[0] for x in v), max(x[1] for x in v)) for k, v in results.items()}
    for k, v in results.items():
        prec = k.split("-")[1]
        side = "moecore" if k.startswith("moecore") else "PyTorch"
        w, c = best[k]
        print(f"| {side} | {k} | {', '.join(f'{x[0]:.0f} / {x[1]:.0f}' for x in v)} | {w:.0f} | "
              f"{mfu(w, prec):.1f}% of {PEAKS[prec][0]:.0f} | {mfu_now(v, prec):.1f}% | {c:.0f} | {mfu(c, prec):.1f}% | "
              f"{RSS.get(k, float('nan')):.0f} | {' '.join(f'{x:.1f}' for x in LOADS.get(k, [])) or 'n/a'} |")
    for name, err in failed.items():
        print(f"| PyTorch | {name} | failed: {err} | | | | | | | |")
    for col, label in ((0, "wall"), (1, "cpu")):
        torch_fp32 = {k: x[col] for k, x in best.items() if not k.startswith("moecore") and k.endswith("fp32")}
        torch_all = {k: x[col] for k, x in best.items() if not k.startswith("moecore")}
        if not torch_fp32:
            continue
        b32 = max(torch_fp32, key=torch_fp32.get)
        ball = max(torch_all, key=torch_all.get)
        print(f"\n[{label}] best PyTorch fp32: {b32} {torch_fp32[b32]:.0f} tokens/s; best PyTorch overall: "
              f"{ball} {torch_all[ball]:.0f} tokens/s")
        for prec, target in (("fp32", 3.0), ("bf16", 5.0)):
            m = best[f"moecore-{prec}"][col]
            print(f"[{label}] moecore {prec} / best PyTorch fp32 = {m / torch_fp32[b32]:.2f}x (target >= "
                  f"{target:.0f}x); / best PyTorch overall = {m / torch_all[ball]:.2f}x")
    for prec, (tps, table) in sorted(PHASES.items()):
        print(f"\nmoecore {prec}, its best round ({tps:.0f} tokens/s): each phase against its kernels alone "
              f"(the same run)\n{table}")
    print("\nmoecore commands:\n  " + "\n  ".join(cmds.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

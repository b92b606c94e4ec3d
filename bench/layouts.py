#!/usr/bin/env python3
"""Parallel layouts side by side (issue 15): tokens/s and per-rank memory of GPT-2 124M
(or another preset) trained at 4 ranks in each layout anneal has, one after another on
the same machine and the same synthetic tokens.

    python3 bench/layouts.py [--bin build/anneal] [--model 124M] [--np 4] [--batch 8]
                             [--seq 128] [--accum 4] [--steps 4] [--threads 1] [--json FILE]

Layouts: data parallel (ZeRO 0), ZeRO-2, ZeRO-3 (with --recompute block, as it needs),
tensor parallel 2 x data 2, pipeline 2 x data 2, pipeline 4, tensor 4, tensor 2 x
pipeline 2. Each run is
`mpirun -np N --oversubscribe` with --threads per rank; the figures are the median
tokens/s of the steps after the first (the log's step records), the per-rank parameter,
gradient and optimizer MiB of the run's "memory" record (the largest rank), and the peak
RSS of rank 0. With more ranks than cores the ranks share the cores (oversubscribed):
the tokens/s then compare layouts on this machine only, not their scaling.
Only the Python standard library is used."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYOUTS = [
    ("dp 4 (ZeRO 0)", []),
    ("dp 4, ZeRO-2", ["--zero", "2"]),
    ("dp 4, ZeRO-3", ["--zero", "3", "--recompute", "block"]),
    ("tp 2 x dp 2", ["--tp", "2"]),
    ("pp 2 x dp 2", ["--pp", "2"]),
    ("pp 4", ["--pp", "4"]),
    ("tp 4", ["--tp", "4"]),
    ("tp 2 x pp 2", ["--tp", "2", "--pp", "2"]),
]


def run_layout(a, name, extra, work):
    out = os.path.join(work, name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", ""))
    cmd = ["mpirun", "-np", str(a.np), "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS",
           a.bin, "train", "--synthetic", "--model", a.model, "--batch", str(a.batch), "--seq", str(a.seq),
           "--accum", str(a.accum), "--steps", str(a.steps), "--threads", str(a.threads), "--eval-batches", "0",
           "--ckpt-every", "0", "--log-every", "1", "--out", out] + extra
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-3:]
        return {"layout": name, "error": " | ".join(tail)}
    tps, mem, rss = [], None, None
    with open(os.path.join(out, "log.jsonl")) as f:
        for line in f:
            o = json.loads(line)
            if o.get("type") == "step" and o.get("step", 0) > 1:
                tps.append(o["tokens_per_s"])
            elif o.get("type") == "memory" and mem is None and o.get("ranks"):
                mem = o["ranks"]
            elif o.get("type") == "summary" and "peak_rss_bytes" in o:
                rss = o["peak_rss_bytes"] / 1048576.0
    res = {"layout": name, "flags": " ".join(extra), "tok_s": statistics.median(tps) if tps else float("nan")}
    if mem:
        for k in ("param_mib", "grad_mib", "optim_mib"):
            res[k] = max(rk.get(k, 0.0) for rk in mem)
    if rss is not None:
        res["rss0_mib"] = rss
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "anneal"))
    ap.add_argument("--model", default="124M")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", help="comma list of layout numbers (1-based) to run")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args()
    pick = [int(x) - 1 for x in a.only.split(",")] if a.only else range(len(LAYOUTS))
    print(f"layouts: {a.model}, {a.np} ranks x {a.threads} thread(s), batch {a.batch} x seq {a.seq}, accum {a.accum}, "
          f"{a.steps} steps (tokens/s: median of steps 2..); {os.cpu_count()} CPUs here")
    print(f"{'layout':<16} {'tok/s':>9} {'param MiB':>10} {'grad MiB':>9} {'optim MiB':>10} {'rank-0 RSS':>11}  (MiB: largest rank)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="anneal_layouts_") as work:
        for i in pick:
            name, extra = LAYOUTS[i]
            r = run_layout(a, name, extra, work)
            rows.append(r)
            if "error" in r:
                print(f"{name:<16} failed: {r['error']}")
                continue
            f = lambda k: f"{r[k]:.1f}" if k in r else "-"
            print(f"{name:<16} {r['tok_s']:>9.1f} {f('param_mib'):>10} {f('grad_mib'):>9} {f('optim_mib'):>10} "
                  f"{f('rss0_mib'):>11}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

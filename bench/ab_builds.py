#!/usr/bin/env python3
"""Two anneal builds side by side: the same training runs with each binary, alternated
round by round so that the machine's noise hits both, and the ratio of their median
step times. For a change that must not cost speed (a refactor), run it on a quiet
machine:

    python3 bench/ab_builds.py OLD_BIN NEW_BIN [--rounds 3] [--steps 6] [--configs 124M:bf16,d6:bf16]

Each run is `anneal train --synthetic` with B=8, T=256 on the given preset and dtype;
its first step is excluded. Prints per configuration: median ms/step, CPU ms/step and
the largest peak RSS of each binary, and new/old (below 1 is faster / smaller)."""
import argparse
import json
import os
import statistics
import subprocess
import tempfile


def run(binary, preset, dtype, steps, threads, workdir):
    out = os.path.join(workdir, "run")
    subprocess.run(["rm", "-rf", out], check=True)
    cmd = [binary, "train", "--synthetic", "--model", preset, "--batch", "8", "--seq", "256",
           "--steps", str(steps), "--threads", str(threads), "--eval-batches", "0", "--dtype", dtype,
           "--out", out, "--log-every", "1000", "--ckpt-every", "0"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(l) for l in open(os.path.join(out, "log.jsonl"))]
    steps = [r for r in rows if r.get("type") == "step"][1:]
    rss = max([r.get("peak_rss_bytes", 0) for r in rows if r.get("type") == "summary"] or [0])
    return [r["ms"] for r in steps], [r.get("cpu_ms", 0.0) for r in steps], rss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="124M:bf16,d6:bf16,d6:fp32")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for conf in a.configs.split(","):
            preset, dtype = conf.split(":")
            ms = {"old": [], "new": []}
            cpu = {"old": [], "new": []}
            rss = {"old": 0, "new": 0}
            for r in range(a.rounds):
                for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    w, c, m = run(getattr(a, which), preset, dtype, a.steps, a.threads, d)
                    ms[which] += w
                    cpu[which] += c
                    rss[which] = max(rss[which], m)
            mo, mn = statistics.median(ms["old"]), statistics.median(ms["new"])
            co, cn = statistics.median(cpu["old"]), statistics.median(cpu["new"])
            print(f"{preset} {dtype} B8 T256: old {mo:.0f} ms/step (CPU {co:.0f}), new {mn:.0f} ms/step "
                  f"(CPU {cn:.0f}), new/old {mn / mo:.3f} wall, {cn / co:.3f} CPU "
                  f"({len(ms['old'])} steps each); peak RSS old {rss['old'] / 2**30:.2f} GiB, "
                  f"new {rss['new'] / 2**30:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()

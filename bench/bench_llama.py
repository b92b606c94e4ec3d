#!/usr/bin/env python3
"""Side-by-side Llama training-step benchmark: anneal against transformers (issue 12).

Config (default "125M": anneal's llama-125M preset, 12 layers, 768 wide, GQA 12/4,
SwiGLU 2048, 32000 ids, untied head; B=8 T=256): `anneal train --synthetic --model
llama-125M --dtype bf16` against transformers' LlamaForCausalLM under torch bf16
autocast (bench/torch_llama.py in the Python of scripts/pyenv.sh: transformers 4.39 on
Debian's torch 1.13), each as its own process, alternating round robin over several
rounds so the noise of a shared machine hits both alike (`--dtypes bf16,fp32` adds the
fp32 pair). Each process trains `--warmup` + `--steps` steps on the same synthetic
Markov-chain tokens; the warm-up steps are not timed.

It prints, per variant, ms/step median and range over all timed steps of all rounds,
CPU ms/step, tokens/s, MFU = FLOPs/token x tokens/s / peak (FLOPs/token as anneal's
Llama counts them: 6 x the matrix weights (q, k, v, o, gate, up, down, lm head) +
12 L T C; the peak measured here by `anneal bench peak`), peak RSS (VmHWM once step
max(2, last-1) is done), the anneal/transformers ratios and the issue's goal
(anneal bf16 >= 2x transformers bf16 tokens/s). The machinery (process runner, peak
measurement, tables) is bench_train.py's.

    python3 bench/bench_llama.py              # the full run
    python3 bench/bench_llama.py --quick      # smoke run: llama-tiny, 1 round, 1 + 2 steps
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train as bt  # noqa: E402

ROOT = bt.ROOT

# name: anneal preset and its shape (as src/models/llama.c), batch and sequence
CONFIGS = {
    "125M": dict(preset="llama-125M", L=12, H=12, Hkv=4, C=768, F=2048, V=32000, ctx=1024, B=8, T=256),
    "tiny": dict(preset="llama-tiny", L=2, H=4, Hkv=2, C=64, F=176, V=512, ctx=256, B=8, T=64),
}


def matmul_weights(c):
    """Weights of every matrix product: per layer q, k, v, o, gate, up, down; the head."""
    C, D = c["C"], c["C"] // c["H"]
    per_layer = C * c["H"] * D + 2 * C * c["Hkv"] * D + c["H"] * D * C + 3 * C * c["F"]
    return c["L"] * per_layer + C * c["V"]


def params_of(c):
    """All parameters: the matrices, the embedding, 2 norms per layer and the final one."""
    return matmul_weights(c) + c["V"] * c["C"] + (2 * c["L"] + 1) * c["C"]


def flops_per_token(c):
    """As anneal's Llama flops_per_token (src/models/llama.c)."""
    return 6.0 * matmul_weights(c) + 12.0 * c["L"] * c["T"] * c["C"]


class LlamaVariant(bt.Variant):
    """bench_train's Variant with the Llama commands."""

    def command(self, a, c, work, peaks, feats, tag):
        steps = a.warmup + a.steps
        if self.impl == "anneal":
            out = os.path.join(work, tag)
            cmd = [a.anneal, "train", "--synthetic", "--model", c["preset"], "--batch", str(c["B"]), "--seq",
                   str(c["T"]), "--steps", str(steps), "--threads", str(a.threads), "--eval-batches", "0",
                   "--ckpt-every", "0", "--keep", "1", "--log-every", "1000000", "--out", out, "--dtype", self.dtype]
            if feats["pin"] and a.pin:
                cmd += feats["pin"]
            if self.dtype in peaks:
                cmd += ["--peak-gflops", "%.1f" % peaks[self.dtype][0]]
            return cmd, dict(os.environ, OMP_NUM_THREADS=str(a.threads)), os.path.join(out, "log.jsonl")
        logp = os.path.join(work, tag + ".jsonl")
        cmd = [self.python, os.path.join(ROOT, "bench", "torch_llama.py"), "--layers", str(c["L"]), "--heads",
               str(c["H"]), "--kv-heads", str(c["Hkv"]), "--embd", str(c["C"]), "--ff", str(c["F"]), "--vocab",
               str(c["V"]), "--ctx", str(c["ctx"]), "--batch", str(c["B"]), "--seq", str(c["T"]), "--steps",
               str(steps), "--threads", str(a.threads), "--dtype", self.dtype, "--log", logp]
        return cmd, bt.torch_env(a.threads), logp


TRANSFORMERS_PROBE = "import torch, transformers; print(torch.__version__, transformers.__version__)"


def transformers_python(exe):
    """(torch version, transformers version) of `exe`, or None."""
    if not exe or not os.path.exists(exe):
        return None
    import subprocess
    r = subprocess.run([exe, "-c", TRANSFORMERS_PROBE], capture_output=True, text=True, env=bt.torch_env(1))
    if r.returncode != 0:
        return None
    tv, hv = r.stdout.strip().split()[-2:]
    return tv, hv


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--configs", default="125M", help="comma list of " + ", ".join(CONFIGS))
    ap.add_argument("--dtypes", default="bf16", help="comma list of bf16, fp32")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin rounds (each variant once per round)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each process")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke run: --configs tiny (unless given) --rounds 1 --steps 2")
    ap.add_argument("--anneal", default=os.environ.get("ANNEAL_BIN", os.path.join(ROOT, "build", "anneal")))
    ap.add_argument("--torch", default="auto", choices=["auto", "off"],
                    help="transformers in --torch-python (auto: when it imports)")
    ap.add_argument("--torch-python", default=os.path.join(ROOT, ".venv", "bin", "python"),
                    help="Python with transformers (scripts/pyenv.sh makes .venv)")
    ap.add_argument("--pin", type=int, default=1, help="pass --pin-threads to anneal when it has it (1/0)")
    ap.add_argument("--peak-seconds", type=float, default=1.0, help="per peak measurement")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    ap.add_argument("--keep-runs", action="store_true", help="keep anneal's run directories (in the work dir)")
    a = ap.parse_args(sys.argv[1:])
    given = {x.split("=")[0] for x in sys.argv[1:]}
    if a.quick:
        if "--configs" not in given:
            a.configs = "tiny"
        if "--rounds" not in given:
            a.rounds = 1
        if "--steps" not in given:
            a.steps = 2
        if "--peak-seconds" not in given:
            a.peak_seconds = 0.25
    a.configs = [x for x in a.configs.split(",") if x]
    a.dtypes = [x for x in a.dtypes.split(",") if x]
    for x in a.configs:
        if x not in CONFIGS:
            sys.exit("bench_llama.py: --configs: unknown config %s (known: %s)" % (x, ", ".join(CONFIGS)))
    for x in a.dtypes:
        if x not in ("bf16", "fp32"):
            sys.exit("bench_llama.py: --dtypes: unknown dtype %s (bf16, fp32)" % x)
    if a.rounds < 1 or a.steps < 1 or a.warmup < 0 or a.threads < 1:
        sys.exit("bench_llama.py: --rounds, --steps, --threads must be >= 1 and --warmup >= 0")
    if not os.access(a.anneal, os.X_OK):
        sys.exit("bench_llama.py: --anneal %s: not an executable (build first: make build)" % a.anneal)
    feats = bt.anneal_features(a.anneal)
    if not feats["dtype"]:
        sys.exit("bench_llama.py: this anneal has no --dtype")
    tf = transformers_python(a.torch_python) if a.torch == "auto" else None

    bt.log("anneal vs transformers: Llama training step (forward, backward, clip, AdamW), synthetic tokens")
    bt.log("anneal: %s; --pin-threads %s" % (a.anneal, ("on" if a.pin else "off") if feats["pin"] else "absent"))
    if tf:
        bt.log("transformers %s on torch %s at %s (eager attention)" % (tf[1], tf[0], a.torch_python))
    else:
        bt.log("transformers: %s" % ("off (--torch off)" if a.torch == "off" else
                                     "not found at %s (bash scripts/pyenv.sh makes it)" % a.torch_python))
    bt.log("plan: configs %s; dtypes %s; %d round(s) round robin; each process %d warm-up + %d timed step(s); "
           "%d threads" % (",".join(a.configs), ",".join(a.dtypes), a.rounds, a.warmup, a.steps, a.threads))

    plan = {}
    for cfg in a.configs:
        vs = []
        for dt in a.dtypes:
            vs.append(LlamaVariant("anneal %s" % dt, "anneal", dt))
            if tf:
                vs.append(LlamaVariant("transformers %s %s" % (tf[1], "bf16 autocast" if dt == "bf16" else dt),
                                       "torch", dt, python=a.torch_python, version=tf[0]))
        plan[cfg] = vs

    work = tempfile.mkdtemp(prefix="anneal-bench-llama-")
    peaks_all = {}
    t_start = time.time()
    try:
        for r in range(a.rounds):
            for dt, (gf, isa) in bt.measure_peaks(a.anneal, a.threads, a.peak_seconds, feats).items():
                peaks_all.setdefault(dt, []).append((gf, isa))
                bt.log("round %d: peak %s %.1f GFLOP/s (%s)" % (r + 1, dt, gf, isa))
            peaks = {dt: max(v) for dt, v in peaks_all.items()}
            for cfg in a.configs:
                todo = list(plan[cfg])
                k = r % len(todo)  # rotate the order each round
                todo = todo[k:] + todo[:k]
                bt.log("round %d/%d, %s (%.0f s so far)" % (r + 1, a.rounds, cfg, time.time() - t_start))
                for i, v in enumerate(todo):
                    v.run(a, CONFIGS[cfg], work, peaks, feats, "%s-r%d-%d" % (cfg, r, i))
    finally:
        if not a.keep_runs:
            shutil.rmtree(work, ignore_errors=True)
    peaks = {dt: max(v) for dt, v in peaks_all.items()}

    out = ["", "## Results (%.0f s)" % (time.time() - t_start), ""]
    out.append("Peak (`anneal bench peak`, %d threads): %s" % (
        a.threads, "; ".join("%s %.1f GFLOP/s (%s)" % (dt, g, isa) for dt, (g, isa) in sorted(peaks.items())) or "n/a"))
    goals = []
    for cfg in a.configs:
        c = CONFIGS[cfg]
        fpt = flops_per_token(c)
        out += ["", "### %s (%s): L=%d H=%d/%d C=%d F=%d V=%d, B=%d T=%d, %d threads; N=%.2fM, %.3f GFLOP/token" % (
            cfg, c["preset"], c["L"], c["H"], c["Hkv"], c["C"], c["F"], c["V"], c["B"], c["T"], a.threads,
            params_of(c) / 1e6, fpt / 1e9), ""]
        rows = []
        for v in plan[cfg]:
            if not v.ok():
                rows.append([v.name, "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "; ".join(v.failures) or "not run"])
                continue
            tok = v.tok_s(c)
            peak = peaks.get(v.dtype)
            mfu = "%.1f%% of %s" % (100 * fpt * tok / (peak[0] * 1e9), v.dtype) if peak else "n/a"
            cpu = "%.0f" % statistics.median(v.cpu_ms) if v.cpu_ms else "n/a"
            rows.append([v.name, "%.1f" % v.median_ms(), "%.1f-%.1f" % (min(v.ms), max(v.ms)), cpu, "%.1f" % tok, mfu,
                         bt.fmt_bytes(v.peak_rss()), "%d steps, %d runs, load %.1f" % (
                             len(v.ms), len(v.rss), statistics.median(v.load))])
        out.append(bt.table(rows, ["variant", "ms/step median", "range", "CPU ms/step", "tok/s", "MFU", "peak RSS",
                                   "samples"]))
        rrows = []
        for dt in a.dtypes:
            av = next((v for v in plan[cfg] if v.impl == "anneal" and v.dtype == dt), None)
            tv = next((v for v in plan[cfg] if v.impl == "torch" and v.dtype == dt), None)
            if not av or not tv:
                continue
            rt = av.tok_s(c) / tv.tok_s(c) if av.ok() and tv.ok() else None
            rr = av.peak_rss() / tv.peak_rss() if av.ok() and tv.ok() else None
            rrows.append(["%s / %s" % (av.name, tv.name), bt.fmt_ratio(rt), bt.fmt_ratio(rr)])
            if dt == "bf16" and cfg == "125M":
                goals.append(bt.goal_line(None if rt is None else rt >= 2.0,
                                          "125M: anneal bf16 >= 2x transformers bf16 autocast tokens/s: %s" %
                                          bt.fmt_ratio(rt)))
        if rrows:
            out += ["", bt.table(rrows, ["anneal / transformers", "tokens/s", "peak RSS"])]
    out += ["", "### Goal of issue 12 (this run)", ""] + (goals or ["- (none: the goal names the 125M config in bf16)"])
    bt.log("\n".join(out))
    failed = [v.name for cfg in a.configs for v in plan[cfg] if v.failures]
    if failed:
        bt.log("\nfailed runs: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

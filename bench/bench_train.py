#!/usr/bin/env python3
"""Side-by-side GPT-2 training-step benchmark: anneal against PyTorch (issue 5).

For each config (default: GPT-2 124M and L=6 C=384 "d6", both B=8 T=256) it runs
anneal fp32, anneal bf16 (when `anneal train` has --dtype), PyTorch fp32 and PyTorch
bf16 autocast (Debian's python3-torch at /usr/bin/python3, and PyPI torch 2.x from
build/bench-venv when that exists: `make bench-torch`), each as its own process,
alternating round robin over several rounds so the noise of a shared machine hits
every variant alike. Each process trains `--warmup` + `--steps` steps on the same
synthetic Markov-chain tokens; the warm-up steps are not timed.

It prints, per config and variant, ms/step median and range over all timed steps of
all rounds, the median process CPU time per step (all threads: other processes holding
the cores do not inflate it, so it shows whether a slow wall time was the machine's),
tokens/s, MFU = (6N + 12·L·T·C) FLOPs/token × tokens/s / peak, where the
peak is measured here by `anneal bench peak` (fp32 FMA and bf16 dot-product
microbenchmarks, best of the measurements taken before each round), peak RSS (VmHWM
of the process once step max(2, last-1) is done: the training's peak over at least
one steady-state step, before anneal's final checkpoint), the anneal/PyTorch ratios,
the issue's goals marked met / not met, and a recompute table (ms/step and peak
memory per --recompute mode).
OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are unset for the PyTorch processes only.

Only the Python standard library is used here (PyTorch runs in its own processes).

    python3 bench/bench_train.py              # the full run (~20-30 min on 2 cores)
    python3 bench/bench_train.py --quick      # smoke run: d6 only, 1 round, 1 + 2 steps
    python3 bench/bench_train.py --configs tiny --torch off --quick   # no PyTorch at all
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: anneal preset and its shape (the same as src/models/gpt2.c), batch and sequence
CONFIGS = {
    "124M": dict(preset="124M", L=12, H=12, C=768, V=50257, ctx=1024, B=8, T=256),
    "d6": dict(preset="d6", L=6, H=6, C=384, V=50257, ctx=1024, B=8, T=256),
    "tiny": dict(preset="tiny", L=2, H=4, C=64, V=512, ctx=256, B=8, T=64),
}
OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def log(msg):
    print(msg, flush=True)


def params_of(c):
    """Parameter count N of a GPT-2 (tied lm head), as anneal_gpt2_num_params."""
    L, C, V, ctx = c["L"], c["C"], c["V"], c["ctx"]
    return V * C + ctx * C + L * (12 * C * C + 13 * C) + 2 * C


def flops_per_token(c):
    """6N + 12·L·T·C, as anneal_gpt2_flops_per_token."""
    return 6.0 * params_of(c) + 12.0 * c["L"] * c["T"] * c["C"]


def fmt_bytes(b):
    if b is None:
        return "n/a"
    return "%.2f GiB" % (b / 2**30) if b >= 2**30 else "%.0f MiB" % (b / 2**20)


def fmt_ratio(x):
    return "n/a" if x is None else "%.2fx" % x


# ------------------------------------------------------------------ discovery


def anneal_features(binary):
    """What this anneal build offers: --dtype, --recompute modes, --pin-threads, bench peak."""
    h = subprocess.run([binary, "train", "--help"], capture_output=True, text=True).stdout
    f = {"dtype": False, "dtypes": [], "recompute": [], "pin": None, "bench_peak": False}
    m = re.search(r"^\s*--dtype\s+(\S+)\s+(.*)$", h, re.M)
    if m:
        f["dtype"] = True
        f["dtypes"] = [x for x in ("fp32", "bf16", "fp16") if x in m.group(0)]
    m = re.search(r"^\s*--recompute\s+(\S+)\s+(.*)$", h, re.M)
    if m:
        modes = [x for x in ("none", "attn", "block") if re.search(r"\b%s\b" % x, m.group(0))]
        f["recompute"] = modes if len(modes) >= 2 else ["off", "on"]
    m = re.search(r"^\s*--pin-threads(\s+\S+)?", h, re.M)
    if m:
        f["pin"] = ["--pin-threads"] + (["on"] if m.group(1) and "on" in m.group(1) else [])
    r = subprocess.run([binary, "bench", "peak", "--help"], capture_output=True, text=True)
    f["bench_peak"] = r.returncode == 0 and "--dtype" in r.stdout
    return f


TORCH_PROBE = """
import torch, torch.nn.functional as F
torch.ones(8, 8) @ torch.ones(8, 8)
maps = open("/proc/self/maps").read()
blas = ("MKL" if torch.backends.mkl.is_available() else "OpenBLAS" if "openblas" in maps
        else "reference BLAS (slow: apt-get install libopenblas0-pthread)" if "/blas/libblas" in maps else "?")
print(torch.__version__, hasattr(F, "scaled_dot_product_attention"), blas)
"""


def torch_python(exe):
    """(version, sdpa, fp32 BLAS) of the torch that `exe` (a path, or a name on PATH)
    imports, or None."""
    exe = shutil.which(exe) if exe else None
    if not exe:
        return None
    r = subprocess.run([exe, "-c", TORCH_PROBE], capture_output=True, text=True, env=torch_env(1))
    if r.returncode != 0:
        return None
    v, sdpa, blas = r.stdout.strip().split(" ", 2)
    return v, sdpa == "True", blas


def torch_env(threads):
    e = {k: v for k, v in os.environ.items() if k not in OPENBLAS_VARS}
    e["OMP_NUM_THREADS"] = str(threads)
    return e


def measure_peaks(binary, threads, seconds, feats):
    """{"fp32": (gflops, isa), "bf16": (gflops, isa)} from `anneal bench peak`."""
    out = {}
    if not feats["bench_peak"]:
        return out
    for dt in ("fp32", "bf16"):
        r = subprocess.run([binary, "bench", "peak", "--dtype", dt, "--threads", str(threads), "--seconds",
                            str(seconds), "--json"], capture_output=True, text=True)
        if r.returncode == 0:
            j = json.loads(r.stdout.strip().splitlines()[-1])
            out[dt] = (j["gflops"], j["isa"])
    return out


# ------------------------------------------------------------------ one process


def vm_hwm(pid):
    """Peak resident set (VmHWM) of a live process in bytes, or None."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_process(cmd, env, logpath, rss_at_step, errpath, timeout):
    """Runs cmd, following its JSON-lines log. Returns (rc, records, rss_train, rss_exit):
    rss_train is VmHWM read as soon as the step record number rss_at_step appears (the
    training peak, before anything the process does after its steps), rss_exit the
    whole process's ru_maxrss."""
    with open(errpath, "w") as err:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
    recs, pos, rss_train, t0 = [], 0, None, time.time()

    def read_new():
        nonlocal pos
        if not os.path.exists(logpath):
            return
        with open(logpath) as f:
            f.seek(pos)
            while True:
                line = f.readline()
                if not line.endswith("\n"):
                    break
                pos += len(line.encode())
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    pass

    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        read_new()
        if rss_train is None and any(r.get("type") == "step" and r.get("step", 0) >= rss_at_step for r in recs):
            rss_train = vm_hwm(p.pid)
        if time.time() - t0 > timeout:
            p.kill()
        time.sleep(0.05)
    p.returncode = os.waitstatus_to_exitcode(status)
    read_new()
    return p.returncode, recs, rss_train, ru.ru_maxrss * 1024


class Variant:
    """One thing to time: an anneal build setting or a PyTorch interpreter + dtype."""

    def __init__(self, name, impl, dtype, python=None, version=None, recompute=None, note=""):
        self.name, self.impl, self.dtype, self.python, self.version = name, impl, dtype, python, version
        self.recompute, self.note = recompute, note
        self.ms, self.rss, self.rss_exit, self.tensor_peak, self.failures = [], [], [], [], []
        self.cpu_ms = []  # process CPU time per step (all threads): not inflated by other processes
        self.load = []  # 1-minute load average at the end of each run

    def command(self, a, c, work, peaks, feats, tag):
        steps = a.warmup + a.steps
        if self.impl == "anneal":
            out = os.path.join(work, tag)
            cmd = [a.anneal, "train", "--synthetic", "--model", c["preset"], "--batch", str(c["B"]), "--seq",
                   str(c["T"]), "--steps", str(steps), "--threads", str(a.threads), "--eval-batches", "0",
                   "--ckpt-every", "0", "--keep", "1", "--log-every", "1000000", "--out", out]
            if self.dtype != "fp32" or feats["dtype"]:
                cmd += ["--dtype", self.dtype]
            if self.recompute:
                cmd += ["--recompute", self.recompute]
            if feats["pin"] and a.pin:
                cmd += feats["pin"]
            if self.dtype in peaks:
                cmd += ["--peak-gflops", "%.1f" % peaks[self.dtype][0]]
            env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
            return cmd, env, os.path.join(out, "log.jsonl")
        logp = os.path.join(work, tag + ".jsonl")
        cmd = [self.python, os.path.join(ROOT, "bench", "torch_gpt2.py"), "--layers", str(c["L"]), "--heads",
               str(c["H"]), "--embd", str(c["C"]), "--vocab", str(c["V"]), "--ctx", str(c["ctx"]), "--batch",
               str(c["B"]), "--seq", str(c["T"]), "--steps", str(steps), "--threads", str(a.threads),
               "--dtype", self.dtype, "--log", logp]
        return cmd, torch_env(a.threads), logp

    def run(self, a, c, work, peaks, feats, tag):
        cmd, env, logp = self.command(a, c, work, peaks, feats, tag)
        steps = a.warmup + a.steps
        errp = os.path.join(work, tag + ".err")
        # VmHWM once step max(2, steps-1) is done: covers a steady-state step, and is read
        # before anneal's final checkpoint (which would add its snapshot to the peak)
        rss_at = max(min(2, steps), steps - 1)
        rc, recs, rss, rss_exit = run_process(cmd, env, logp, rss_at, errp, a.timeout)
        self.load.append(os.getloadavg()[0])
        ms = [r["ms"] for r in recs if r.get("type") == "step" and r.get("step", 0) > a.warmup]
        if rc != 0 or len(ms) != a.steps:
            with open(errp) as f:
                tail = f.read().strip().splitlines()[-3:]
            self.failures.append("exit %d: %s" % (rc, " / ".join(tail)))
            log("    %s: FAILED (%s)" % (self.name, self.failures[-1]))
            return
        self.ms += ms
        self.cpu_ms += [r["cpu_ms"] for r in recs if r.get("type") == "step" and r.get("step", 0) > a.warmup
                        and "cpu_ms" in r]
        self.rss.append(rss if rss is not None else rss_exit)
        self.rss_exit.append(rss_exit)
        for r in recs:
            if r.get("type") == "summary" and "peak_tensor_bytes" in r:
                self.tensor_peak.append(r["peak_tensor_bytes"])
        log("    %-34s median %8.1f ms/step  peak RSS %-9s  load %.1f" % (
            self.name, statistics.median(ms), fmt_bytes(self.rss[-1]), self.load[-1]))
        if self.impl == "anneal" and a.keep_runs is False:
            shutil.rmtree(os.path.join(work, tag), ignore_errors=True)

    # figures over all rounds
    def ok(self):
        return bool(self.ms)

    def median_ms(self):
        return statistics.median(self.ms) if self.ms else None

    def tok_s(self, c):
        return c["B"] * c["T"] / (self.median_ms() / 1e3) if self.ms else None

    def peak_rss(self):
        return max(self.rss) if self.rss else None


# ------------------------------------------------------------------ report


def table(rows, header):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def parallel_fraction(wall, cpu, threads):
    """Amdahl's p from wall = (1 - p) cpu + p cpu / threads, clamped to [0, 1] (as
    anneal_parallel_fraction in src/obs/parallel_fraction.c); None when undefined."""
    if threads < 2 or not wall > 0 or not cpu > 0:
        return None
    return min(1.0, max(0.0, (1.0 - wall / cpu) / (1.0 - 1.0 / threads)))


def report_config(name, c, variants, peaks, a):
    fpt = flops_per_token(c)
    lines = ["", "### %s: L=%d H=%d C=%d V=%d, B=%d T=%d, %d threads; N=%.2fM, 6N+12LTC = %.3f GFLOP/token" % (
        name, c["L"], c["H"], c["C"], c["V"], c["B"], c["T"], a.threads, params_of(c) / 1e6, fpt / 1e9), ""]
    rows = []
    for v in variants:
        if v.recompute:
            continue
        if not v.ok():
            rows.append([v.name, "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a",
                         v.note or "; ".join(v.failures) or "not run"])
            continue
        tok = v.tok_s(c)
        peak = peaks.get(v.dtype)
        mfu = "%.1f%% of %s" % (100 * fpt * tok / (peak[0] * 1e9), v.dtype) if peak else "n/a"
        cpu = "%.0f" % statistics.median(v.cpu_ms) if v.cpu_ms else "n/a"
        par = "-"
        if v.impl == "anneal" and v.cpu_ms and a.threads >= 2:
            p = parallel_fraction(v.median_ms(), statistics.median(v.cpu_ms), a.threads)
            par = "%.3f" % p if p is not None else "-"
        rows.append([v.name, "%.1f" % v.median_ms(), "%.1f-%.1f" % (min(v.ms), max(v.ms)), cpu, par, "%.1f" % tok, mfu,
                     fmt_bytes(v.peak_rss()), "%d steps, %d runs, load %.1f%s" % (
                         len(v.ms), len(v.rss), statistics.median(v.load), "; " + v.note if v.note else "")])
    lines.append(table(rows, ["variant", "ms/step median", "range", "CPU ms/step", "parallel", "tok/s", "MFU",
                              "peak RSS", "samples"]))
    lines.append("")
    lines.append("parallel: Amdahl's p of anneal's step, from its CPU time over its wall time (`anneal bench step` "
                 "prints the same); PyTorch's OpenMP threads spin while they wait, so its CPU time says nothing of it.")
    # ratios anneal / each PyTorch, same dtype
    by = {(v.impl, v.version, v.dtype): v for v in variants if not v.recompute}
    rrows, ratios = [], {}
    for tv in [v for v in variants if v.impl == "torch"]:
        av = by.get(("anneal", None, tv.dtype))
        if not av:
            continue
        rt = av.tok_s(c) / tv.tok_s(c) if av.ok() and tv.ok() else None
        rr = av.peak_rss() / tv.peak_rss() if av.ok() and tv.ok() else None
        ratios[(tv.version, tv.dtype)] = (rt, rr)
        rrows.append(["%s / %s" % (av.name, tv.name), fmt_ratio(rt), fmt_ratio(rr)])
    if rrows:
        lines += ["", table(rrows, ["anneal / PyTorch", "tokens/s", "peak RSS"])]
    return "\n".join(lines), ratios


def goal_line(ok, text):
    mark = "n/a (not measured)" if ok is None else ("met" if ok else "NOT met")
    return "- [%s] %s" % (mark, text)


def report_goals(results, debian_version, a):
    """The issue's goals, against Debian's PyTorch (the issue's baseline)."""
    lines = ["", "### Goals of issue 5 (against PyTorch %s, this run)" % (debian_version or "(absent)"), ""]

    def rat(cfg, dtype):
        r = results.get(cfg, {}).get((debian_version, dtype))
        return r if r else (None, None)

    for cfg in a.configs:
        if cfg not in ("124M", "d6"):
            continue
        rt, rr = rat(cfg, "bf16")
        lines.append(goal_line(None if rt is None else rt >= 2.0,
                               "%s: anneal bf16 >= 2x PyTorch bf16 autocast tokens/s: %s" % (cfg, fmt_ratio(rt))))
        rt32, rr32 = rat(cfg, "fp32")
        lines.append(goal_line(None if rt32 is None else rt32 >= 1.5,
                               "%s: anneal fp32 >= 1.5x PyTorch fp32 tokens/s: %s" % (cfg, fmt_ratio(rt32))))
        if cfg == "124M":
            lines.append(goal_line(None if rr is None else rr <= 0.7,
                                   "124M: anneal bf16 peak RSS <= 0.7x PyTorch bf16's: %s" % fmt_ratio(rr)))
            lines.append(goal_line(None if rr32 is None else rr32 <= 0.7,
                                   "124M: anneal fp32 peak RSS <= 0.7x PyTorch fp32's: %s" % fmt_ratio(rr32)))
    if not any(cfg in ("124M", "d6") for cfg in a.configs):
        lines.append("- (none: the goals name the 124M and d6 configs)")
    if "124M" in results and "mfu_bf16_124M" in results:
        m = results["mfu_bf16_124M"]
        lines.append(goal_line(None if m is None else m >= 0.6,
                               "124M: anneal bf16 >= 60%% MFU of the bf16 ceiling: %s" %
                               ("n/a" if m is None else "%.1f%%" % (100 * m))))
    return "\n".join(lines)


def report_recompute(name, c, variants, modes):
    rows = []
    base = None
    for v in variants:
        if not v.ok():
            rows.append([v.recompute or "(default)", "n/a", "n/a", "n/a", "n/a", "; ".join(v.failures) or "not run"])
            continue
        if base is None:
            base = v
        tp = max(v.tensor_peak) if v.tensor_peak else None
        rows.append([v.recompute or "(default)", "%.1f" % v.median_ms(), fmt_bytes(v.peak_rss()), fmt_bytes(tp),
                     "%+.0f%%" % (100 * (v.median_ms() / base.median_ms() - 1)),
                     "%+.0f%%" % (100 * (v.peak_rss() / base.peak_rss() - 1))])
    return "\n".join(["", "### Recompute (%s, anneal %s): time paid, memory saved" % (name, variants[0].dtype), "",
                      table(rows, ["--recompute", "ms/step median", "peak RSS", "peak tensors", "time vs first",
                                   "RSS vs first"])])


# ------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--configs", default="124M,d6", help="comma list of " + ", ".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=3, help="round-robin rounds (each variant once per round)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each process")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=0, help="batch of every config (0: each config's own, 8)")
    ap.add_argument("--quick", action="store_true", help="smoke run: --configs d6 (unless given) --rounds 1 --steps 2")
    ap.add_argument("--anneal", default=os.environ.get("ANNEAL_BIN", os.path.join(ROOT, "build", "anneal")))
    ap.add_argument("--torch", default="auto", choices=["auto", "off"],
                    help="Debian PyTorch at /usr/bin/python3 (auto: when it imports)")
    ap.add_argument("--torch-python", default="/usr/bin/python3")
    ap.add_argument("--torch2", default="auto", choices=["auto", "off"],
                    help="PyPI torch 2.x in build/bench-venv (auto: when present; make bench-torch)")
    ap.add_argument("--torch2-python", default=os.path.join(ROOT, "build", "bench-venv", "bin", "python"))
    ap.add_argument("--recompute", default="auto", choices=["auto", "off"],
                    help="recompute table (auto: when anneal train has --recompute)")
    ap.add_argument("--recompute-configs", default=None, help="configs for the recompute table (default: the first)")
    ap.add_argument("--recompute-rounds", type=int, default=1, help="rounds that include the recompute runs")
    ap.add_argument("--pin", type=int, default=1, help="pass --pin-threads to anneal when it has it (1/0)")
    ap.add_argument("--peak-seconds", type=float, default=1.0, help="per peak measurement")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    ap.add_argument("--json", default=None, help="write every measurement to this file")
    ap.add_argument("--keep-runs", action="store_true", help="keep anneal's run directories (in the work dir)")
    a = ap.parse_args(sys.argv[1:])
    given = {x.split("=")[0] for x in sys.argv[1:]}
    if a.quick:
        if "--configs" not in given:
            a.configs = "d6"
        if "--rounds" not in given:
            a.rounds = 1
        if "--steps" not in given:
            a.steps = 2
        if "--peak-seconds" not in given:
            a.peak_seconds = 0.25
    a.configs = [x for x in a.configs.split(",") if x]
    for x in a.configs:
        if x not in CONFIGS:
            sys.exit("bench_train.py: --configs: unknown config %s (known: %s)" % (x, ", ".join(CONFIGS)))
    if a.rounds < 1 or a.steps < 1 or a.warmup < 0 or a.threads < 1:
        sys.exit("bench_train.py: --rounds, --steps, --threads must be >= 1 and --warmup >= 0")
    if a.batch < 0:
        sys.exit("bench_train.py: --batch must be >= 0")
    if a.batch:
        for c in CONFIGS.values():
            c["B"] = a.batch
    if not os.access(a.anneal, os.X_OK):
        sys.exit("bench_train.py: --anneal %s: not an executable (build first: make build)" % a.anneal)
    rc_cfgs = a.configs[:1] if a.recompute_configs is None else [x for x in a.recompute_configs.split(",") if x]

    feats = anneal_features(a.anneal)
    t1 = torch_python(a.torch_python) if a.torch == "auto" else None
    t2 = torch_python(a.torch2_python) if a.torch2 == "auto" else None
    if t2 and t1 and t2[0] == t1[0]:
        t2 = None

    log("anneal vs PyTorch: GPT-2 training step (forward, backward, clip, AdamW), synthetic tokens")
    log("anneal: %s; --dtype %s; --recompute %s; --pin-threads %s" % (
        a.anneal, "/".join(feats["dtypes"]) if feats["dtype"] else "absent (fp32 only)",
        "/".join(feats["recompute"]) or "absent", ("on" if a.pin else "off") if feats["pin"] else "absent"))
    if a.torch == "off":
        log("PyTorch (Debian): off (--torch off)")
    elif t1:
        log("PyTorch (Debian): %s at %s, %s attention, fp32 GEMM: %s" % (
            t1[0], a.torch_python, "sdpa" if t1[1] else "eager", t1[2]))
    else:
        log("PyTorch (Debian): not found at %s (apt-get install python3-torch, or make bench-torch)" % a.torch_python)
    if a.torch2 == "off":
        log("PyTorch 2.x (PyPI): off (--torch2 off)")
    elif t2:
        log("PyTorch 2.x (PyPI): %s at %s, %s attention, fp32 GEMM: %s" % (
            t2[0], a.torch2_python, "sdpa" if t2[1] else "eager", t2[2]))
    else:
        log("PyTorch 2.x (PyPI): not found at %s (make bench-torch makes it)" % a.torch2_python)
    log("env: %s unset for the PyTorch processes only (here: %s); OMP_NUM_THREADS=%d for all" % (
        " and ".join(OPENBLAS_VARS), ", ".join("%s=%s" % (k, os.environ.get(k, "(unset)")) for k in OPENBLAS_VARS),
        a.threads))
    log("plan: configs %s; %d round(s) round robin; each process %d warm-up + %d timed step(s); %d threads" % (
        ",".join(a.configs), a.rounds, a.warmup, a.steps, a.threads))
    log("note: a shared machine (other jobs on the same cores) makes the figures noisy; ranges show it")

    # variants per config
    plan = {}
    for cfg in a.configs:
        vs = [Variant("anneal fp32", "anneal", "fp32")]
        if "bf16" in feats["dtypes"]:
            vs.append(Variant("anneal bf16", "anneal", "bf16"))
        else:
            vs.append(Variant("anneal bf16", "anneal", "bf16", note="skipped: anneal train has no --dtype bf16"))
        for t, tag in ((t1, "torch"), (t2, "torch2")):
            if t:
                vs.append(Variant("PyTorch %s fp32" % t[0], "torch", "fp32",
                                  python=a.torch_python if tag == "torch" else a.torch2_python, version=t[0]))
                vs.append(Variant("PyTorch %s bf16 autocast" % t[0], "torch", "bf16",
                                  python=a.torch_python if tag == "torch" else a.torch2_python, version=t[0]))
        rcv = []
        if a.recompute == "auto" and feats["recompute"] and cfg in rc_cfgs:
            dt = "bf16" if "bf16" in feats["dtypes"] else "fp32"
            rcv = [Variant("anneal %s recompute %s" % (dt, m), "anneal", dt, recompute=m) for m in feats["recompute"]]
        plan[cfg] = (vs, rcv)

    work = tempfile.mkdtemp(prefix="anneal-bench-")
    peaks_all = {}
    t_start = time.time()
    try:
        for r in range(a.rounds):
            for dt, (gf, isa) in measure_peaks(a.anneal, a.threads, a.peak_seconds, feats).items():
                peaks_all.setdefault(dt, []).append((gf, isa))
                log("round %d: peak %s %.1f GFLOP/s (%s)" % (r + 1, dt, gf, isa))
            peaks = {dt: max(v) for dt, v in peaks_all.items()}
            for cfg in a.configs:
                vs, rcv = plan[cfg]
                todo = [v for v in vs if not v.note] + (rcv if r < a.recompute_rounds else [])
                k = r % len(todo)  # rotate the order each round
                todo = todo[k:] + todo[:k]
                log("round %d/%d, %s (%.0f s so far)" % (r + 1, a.rounds, cfg, time.time() - t_start))
                for i, v in enumerate(todo):
                    v.run(a, CONFIGS[cfg], work, peaks, feats, "%s-r%d-%d" % (cfg, r, i))
    finally:
        if not a.keep_runs:
            shutil.rmtree(work, ignore_errors=True)
    if not peaks_all and not feats["bench_peak"]:
        log("note: this anneal has no `bench peak`: MFU not reported")
    peaks = {dt: max(v) for dt, v in peaks_all.items()}

    out = ["", "## Results (%.0f s)" % (time.time() - t_start), ""]
    out.append("Peak (best of %d measurement(s), `anneal bench peak`, %d threads): %s" % (
        max((len(v) for v in peaks_all.values()), default=0), a.threads,
        "; ".join("%s %.1f GFLOP/s (%s)" % (dt, g, isa) for dt, (g, isa) in sorted(peaks.items())) or "n/a"))
    out.append("Step times: median and range over every timed step of every round; tok/s = B*T / median; "
               "peak RSS: the largest VmHWM over the runs, read when step max(2, last-1) was done; "
               "load: median 1-minute load average after the runs (above %d threads, other jobs shared the cores)."
               % a.threads)
    results = {}
    for cfg in a.configs:
        vs, rcv = plan[cfg]
        text, ratios = report_config(cfg, CONFIGS[cfg], vs, peaks, a)
        results[cfg] = ratios
        out.append(text)
        ab = [v for v in vs if v.impl == "anneal" and v.dtype == "bf16" and v.ok()]
        if cfg == "124M":
            results["mfu_bf16_124M"] = (flops_per_token(CONFIGS[cfg]) * ab[0].tok_s(CONFIGS[cfg]) /
                                        (peaks["bf16"][0] * 1e9)) if ab and "bf16" in peaks else None
        if rcv:
            out.append(report_recompute(cfg, CONFIGS[cfg], rcv, feats["recompute"]))
    loads = [x for cfg in a.configs for v in plan[cfg][0] + plan[cfg][1] for x in v.load]
    if loads and statistics.median(loads) > 2 * a.threads:  # the benchmark itself adds up to ~threads
        out.append("\nWARNING: the machine was busy (median load average %.1f for %d benchmark threads): "
                   "every figure is slowed by other jobs, PyTorch's (OpenMP + BLAS thread pools, many short "
                   "parallel regions) far more than anneal's, so the ratios overstate anneal; MFU is against a peak "
                   "measured on the same busy cores. Rerun on a quiet machine for figures to quote." % (statistics.median(loads), a.threads))
    out.append(report_goals(results, t1[0] if t1 else None, a))
    if t2:
        lines = ["", "Against PyTorch %s (PyPI, information; the issue's goals name Debian's):" % t2[0]]
        for cfg in a.configs:
            for dt in ("bf16", "fp32"):
                rt, rr = results.get(cfg, {}).get((t2[0], dt), (None, None))
                lines.append("- %s %s: tokens/s %s, peak RSS %s" % (cfg, dt, fmt_ratio(rt), fmt_ratio(rr)))
        out.append("\n".join(lines))
    log("\n".join(out))

    if a.json:
        dump = {"configs": {}, "peaks": {dt: [list(x) for x in v] for dt, v in peaks_all.items()},
                "torch": t1 and t1[0], "torch2": t2 and t2[0], "features": feats, "args": vars(a)}
        for cfg in a.configs:
            vs, rcv = plan[cfg]
            dump["configs"][cfg] = [{"name": v.name, "impl": v.impl, "dtype": v.dtype, "version": v.version,
                                     "recompute": v.recompute, "ms": v.ms, "peak_rss_bytes": v.rss,
                                     "exit_rss_bytes": v.rss_exit, "peak_tensor_bytes": v.tensor_peak,
                                     "loadavg": v.load,
                                     "failures": v.failures, "note": v.note} for v in vs + rcv]
        with open(a.json, "w") as f:
            json.dump(dump, f, indent=1)
    failed = [v.name for cfg in a.configs for v in plan[cfg][0] + plan[cfg][1] if v.failures]
    if failed:
        log("\nfailed runs: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Soak test (issue 16; not in CI): trains a tiny model on real text for DURATION with
# a checkpoint every CKPT_EVERY steps (--keep KEEP), evaluation and samples, sampling
# the process's RSS and open file descriptors from /proc every few seconds and counting
# the checkpoint directories; then stops it (SIGTERM) and trains the same number of
# steps again without intermediate checkpoints. Passes when, after the warm-up (the
# first 10% of the run), RSS stays flat (last quarter's mean within RSS_TOL_MB of the
# second quarter's, default 8 MiB), the descriptors stay flat (max - min <= 2), the
# checkpoint count never exceeds KEEP + 1 (the one being written), and every step's loss
# equals the run without checkpoints bit for bit (the JSON log's shortest round-trip
# digits). Prints a summary.
#   bench/soak.sh [DURATION, seconds, default 3600]
# Environment: BUILD (default build), CKPT_EVERY (5), KEEP (3), EVAL_EVERY (20),
# SAMPLE_EVERY (50), WORK (a mkdtemp directory, removed unless KEEP_WORK=1).
set -uo pipefail
cd "$(dirname "$0")/.."
duration=${1:-3600}
build=${BUILD:-build}
bin=$PWD/$build/anneal
ckpt_every=${CKPT_EVERY:-5} keep=${KEEP:-3} eval_every=${EVAL_EVERY:-20} sample_every=${SAMPLE_EVERY:-50}
rss_tol_mb=${RSS_TOL_MB:-8}
[ -x "$bin" ] || { echo "soak: $bin missing (make build)"; exit 2; }
work=${WORK:-$(mktemp -d /tmp/anneal_soak_XXXXXX)}
[ "${KEEP_WORK:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT

# data: the first books of the KJV (bible-kjv) or, without it, generated text
if command -v bible >/dev/null 2>&1 && bible gen1:1-deu34:12 >"$work/text.txt" 2>/dev/null && [ -s "$work/text.txt" ]; then
  :
else
  python3 -c "
import random; r = random.Random(1); w = 'the lord said unto moses and behold land of egypt light darkness waters'.split()
print('\n'.join(' '.join(r.choice(w) for _ in range(12)) for _ in range(40000)))" >"$work/text.txt"
fi
"$bin" tokenizer train --vocab-size 512 --out "$work/tok" --input "$work/text.txt" >/dev/null || exit 1
"$bin" prepare --tokenizer "$work/tok" --out "$work/data" --input "$work/text.txt" --val-fraction 0.05 >/dev/null || exit 1

# a constant schedule: the run stopped by SIGTERM and the reference of its length see the same rates
common=(--data "$work/data" --model tiny --batch 4 --seq 64 --threads 1 --seed 11 --schedule constant --warmup 10 --eval-every "$eval_every"
        --eval-batches 4 --sample-every "$sample_every" --sample-tokens 32 --log-every 1)
"$bin" train "${common[@]}" --steps 100000000 --ckpt-every "$ckpt_every" --keep "$keep" --out "$work/run" \
  >"$work/run.out" 2>&1 &
pid=$!
samples=$work/samples.tsv # seconds rss_kb fds ckpts
start=$(date +%s)
max_ckpts=0
while kill -0 "$pid" 2>/dev/null; do
  now=$(date +%s)
  [ $((now - start)) -ge "$duration" ] && break
  rss=$(awk '/^VmRSS/ {print $2}' /proc/$pid/status 2>/dev/null)
  fds=$(ls /proc/$pid/fd 2>/dev/null | wc -l)
  ck=$(ls -d "$work"/run/ckpt_* 2>/dev/null | wc -l)
  [ "$ck" -gt "$max_ckpts" ] && max_ckpts=$ck
  [ -n "$rss" ] && printf "%d\t%d\t%d\t%d\n" $((now - start)) "$rss" "$fds" "$ck" >>"$samples"
  sleep "${SOAK_INTERVAL:-2}"
done
kill -TERM "$pid" 2>/dev/null
wait "$pid"
rc=$?
steps=$(grep -c '"type":"step"' "$work/run/log.jsonl" 2>/dev/null)
steps=${steps:-0}
ck=$(ls -d "$work"/run/ckpt_* 2>/dev/null | wc -l)
[ "$ck" -gt "$max_ckpts" ] && max_ckpts=$ck

# the same steps without the intermediate checkpoints
"$bin" train "${common[@]}" --steps "$steps" --ckpt-every 0 --out "$work/ref" >"$work/ref.out" 2>&1
rrc=$?

python3 - "$samples" "$work/run/log.jsonl" "$work/ref/log.jsonl" "$duration" "$keep" "$max_ckpts" "$rss_tol_mb" \
  "$rc" "$rrc" <<'PY'
import json, sys
samples, run_log, ref_log, duration, keep, max_ck, tol, rc, rrc = sys.argv[1:]
keep, max_ck, tol = int(keep), int(max_ck), float(tol)
rows = [tuple(map(int, l.split())) for l in open(samples) if l.strip()]
def losses(p):
    out = {}
    for l in open(p):
        try: o = json.loads(l)
        except ValueError: continue
        if o.get("type") == "step": out[o["step"]] = o.get("loss")
    return out
a, b = losses(run_log), losses(ref_log)
same = sum(1 for k in a if k in b and a[k] == b[k])
T = rows[-1][0] if rows else 0
warm = [r for r in rows if r[0] >= 0.1 * T]
q = len(warm) // 4
mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
q2 = mean([r[1] for r in warm[q:2 * q]]) / 1024
q4 = mean([r[1] for r in warm[3 * q:]]) / 1024
fds = [r[2] for r in warm] or [0]
ok_rss = q and abs(q4 - q2) <= tol
ok_fd = max(fds) - min(fds) <= 2
ok_ck = max_ck <= keep + 1
ok_loss = len(a) > 0 and same == len(a) == len(b)
print("soak: %d s, %d steps, %d samples (every ~%.0f s)" % (T, len(a), len(rows), T / max(len(rows) - 1, 1)))
print("  RSS after warm-up: %.1f MiB (2nd quarter) -> %.1f MiB (last quarter), max %.1f MiB: %s" %
      (q2, q4, max((r[1] for r in warm), default=0) / 1024, "flat" if ok_rss else "GROWS"))
print("  open descriptors after warm-up: %d..%d: %s" % (min(fds), max(fds), "flat" if ok_fd else "GROW"))
print("  checkpoints on disk: at most %d (--keep %d): %s" % (max_ck, keep, "bounded" if ok_ck else "UNBOUNDED"))
print("  losses vs the run without checkpoints: %d of %d steps identical: %s" %
      (same, len(a), "bit-exact" if ok_loss else "DIFFER"))
print("  exit codes: soak run %s (SIGTERM stop), reference %s" % (rc, rrc))
ok = ok_rss and ok_fd and ok_ck and ok_loss and rrc == "0"
print("soak: " + ("PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
PY

"""Load test of `anneal serve` on loopback (issue 13).

1. N concurrent streaming clients (default 64) for S seconds (default 60): request latency
   and time-to-first-token p50/p99, total generated tokens/s, errors.
2. M malformed requests (default 1,000: broken JSON, wrong types, absurd values, oversized
   bodies, unknown fields) from 8 threads: every one must get a 4xx, none a 5xx or a
   dropped connection; the server must still answer afterwards.
3. RSS of the server before phase 1 (after a warm-up), after phase 1 and after phase 2
   (a leak shows as growth from the first repeat of the same work to the next).
4. Aggregate tokens/s of 16 concurrent streams vs 1 stream (goal: >= 6x), each for
   --compare-seconds, with the server's engine counters over each phase (/metrics: decode
   steps, rows per step, prefills, wall ms per step by phase).
The streaming clients use http.client on kept-alive connections and parse only the
chunks they need (~0.1 ms of client CPU per token, against ~0.8 with httpx): on a
2-core machine the client shares the server's cores.

Usage (the lead's full run, GPT-2 124M with random weights):
  .venv/bin/python bench/serve_load.py --bin build/anneal --model 124M --tokenizer gpt2
A quick check that it runs:
  .venv/bin/python bench/serve_load.py --bin build/anneal --model tiny --tokenizer gpt2 \
      --seconds 3 --malformed 100 --compare-seconds 3 --streams 8
Extra flags for the server go after --: ... -- --threads 2 --kv-dtype bf16
Prints a report and, with --json FILE, writes the figures."""
import argparse
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def cpu_s(pid):
    """User + system CPU seconds process pid has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    return int(m.group(1)) / 1024 if m else float("nan")


class Server:
    def __init__(self, args):
        cmd = [args.bin, "serve", "--port", "0", "--model-name", "bench", "--slots", str(args.slots),
               "--queue", str(args.queue), "--max-connections", str(args.streams + 64)]
        cmd += ["--ckpt", args.ckpt] if args.ckpt else ["--model", args.model]
        if args.tokenizer:
            cmd += ["--tokenizer", args.tokenizer]
        cmd += args.server_args
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        seen = ""
        for line in self.proc.stderr:  # notes (a preset's random weights) come before the address
            seen += line
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                break
        else:
            raise SystemExit(f"anneal serve did not start: {seen}")
        print(seen.strip(), flush=True)
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()
        self.base = f"http://127.0.0.1:{m.group(1)}"

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


class Conn:
    """A keep-alive HTTP/1.1 connection to the server (stdlib http.client): the clients
    share the server's 2 cores on a small machine, and httpx's per-line streaming cost
    (~0.8 ms of client CPU per token) would take from the server's tokens/s with 16
    streams far more than with one."""

    def __init__(self, base):
        host, port = base.rsplit("//", 1)[1].split(":")
        self.host, self.port, self.c = host, int(port), None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.c:
            self.c.close()
            self.c = None

    def post(self, path, body):
        """The response (status, readable body) to a JSON POST; one reconnect if the
        kept-alive connection was closed by the server."""
        for attempt in (0, 1):
            if self.c is None:
                self.c = http.client.HTTPConnection(self.host, self.port, timeout=300)
            try:
                self.c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                return self.c.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt:
                    raise


def stream_once(client, base, prompt, max_tokens, seed):
    """One streamed completion on client (a Conn): (latency s, ttft s, completion tokens)
    or raises. Chunks are parsed as JSON only until the first text and for the usage
    chunk at the end (a substring test skips the rest)."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                       "seed": seed, "stream": True, "stream_options": {"include_usage": True}}).encode()
    t0 = time.perf_counter()
    ttft, tokens = None, None
    r = client.post("/v1/completions", body)
    if r.status != 200:
        raise RuntimeError(f"status {r.status}: {r.read()[:200]!r}")
    while True:
        line = r.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        if ttft is None or b'"usage"' in data or b'"error"' in data:
            ch = json.loads(data)
            if "error" in ch:
                raise RuntimeError(str(ch["error"]))
            if ch.get("choices") and ch["choices"][0]["text"] and ttft is None:
                ttft = time.perf_counter() - t0
            if ch.get("usage"):
                tokens = ch["usage"]["completion_tokens"]
    r.read()  # the end of the chunked body: the connection is reused
    if tokens is None:
        raise RuntimeError("no usage chunk")
    return time.perf_counter() - t0, ttft if ttft is not None else time.perf_counter() - t0, tokens


def load(base, streams, seconds, max_tokens):
    end = time.perf_counter() + seconds
    lat, ttft, errors = [], [], []
    tokens = [0] * streams
    lock = threading.Lock()

    def worker(i):
        k = 0
        with Conn(base) as client:
            while time.perf_counter() < end:
                try:
                    l, t, n = stream_once(client, base, f"Client {i} request {k}: once upon a time", max_tokens,
                                          i * 100003 + k)
                    with lock:
                        lat.append(l)
                        ttft.append(t)
                    tokens[i] += n
                except Exception as ex:  # noqa: BLE001 (every failure is counted)
                    client.close()
                    with lock:
                        errors.append(repr(ex)[:200])
                k += 1

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(streams)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    return {"streams": streams, "seconds": round(wall, 2), "requests": len(lat), "errors": len(errors),
            "error_samples": errors[:5], "tokens": sum(tokens), "tokens_per_s": sum(tokens) / wall,
            "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99), "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99)}


PHASES = ["prefill", "decode", "sample", "text", "mixed"]


def engine_counters(base):
    """The server's engine counters (/metrics): steps, rows, prefills, seconds by phase."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        for key, name in [("steps", "anneal_serve_decode_steps_total "), ("rows", "anneal_serve_decode_rows_total "),
                          ("prefills", "anneal_serve_prefills_total "),
                          ("prefill_rows", "anneal_serve_prefill_rows_total ")] + \
                         [(ph, f'anneal_serve_engine_seconds_total{{phase="{ph}"}} ') for ph in PHASES]:
            if line.startswith(name):
                out[key] = float(line[len(name):])
    return out


def engine_delta(a, b):
    """What the engine did between two engine_counters: rows per step, ms per step by phase."""
    d = {k: b.get(k, 0) - a.get(k, 0) for k in b}
    steps = d.get("steps", 0) or 1
    return {"steps": int(d.get("steps", 0)), "rows_per_step": d.get("rows", 0) / steps,
            "prefills": int(d.get("prefills", 0)), "prefill_rows": int(d.get("prefill_rows", 0)),
            "ms_per_step": {ph: 1e3 * d.get(ph, 0) / steps for ph in PHASES}}


def malformed_bodies(n, max_body):
    rng = random.Random(13)
    kinds = [
        lambda: b'{"prompt": "x", ',
        lambda: b'not json at all',
        lambda: b'[1, 2, 3]',
        lambda: b'{"prompt": 5}',
        lambda: b'{"prompt": "x", "temperature": -1}',
        lambda: b'{"prompt": "x", "top_p": 7}',
        lambda: b'{"prompt": "x", "max_tokens": 1000000000000}',
        lambda: json.dumps({"prompt": "x", "stop": ["s"] * 10000}).encode(),
        lambda: b'{"prompt": "x", "n": 3}',
        lambda: b'{"prompt": "x", "bogus": true}',
        lambda: b'{"prompt": "x", "model": "gpt-4"}',
        lambda: json.dumps({"prompt": "y" * (max_body + 10)}).encode(),
        lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))),
        lambda: b'{"prompt": "\\ud800", "max_tokens": "5"}',
        lambda: b'{"messages": [{"role": "x"}]}',
    ]
    return [kinds[i % len(kinds)]() for i in range(n)]


def malformed(base, n, max_body):
    bodies = malformed_bodies(n, max_body)
    statuses, bad = {}, []
    lock = threading.Lock()

    def worker(part):
        with httpx.Client() as client:
            for i in part:
                path = "/v1/chat/completions" if i % 7 == 0 else "/v1/completions"
                try:
                    r = client.post(base + path, content=bodies[i], headers={"Content-Type": "application/json"},
                                    timeout=60)
                    code = r.status_code
                    ok = 400 <= code < 500 and "error" in r.json()
                except Exception as ex:  # noqa: BLE001
                    code, ok = repr(ex)[:80], False
                with lock:
                    statuses[code] = statuses.get(code, 0) + 1
                    if not ok:
                        bad.append((i, code))

    ts = [threading.Thread(target=worker, args=(range(k, n, 8),)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {"requests": n, "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
            "not_4xx_with_error_json": len(bad), "samples": bad[:5]}


def engine_baseline(args):
    """`anneal bench decode` at batch 1 and 16 with the server's model, --kv-dtype and
    --threads: decode steps alone, in this run."""
    flags = []
    for name in ("--kv-dtype", "--threads", "--dtype"):
        if name in args.server_args:
            flags += [name, args.server_args[args.server_args.index(name) + 1]]
    out = {}
    for batch in (1, 16):
        cmd = [args.bin, "bench", "decode", "--prompt-len", "16", "--gen", "32", "--batch", str(batch), "--json"]
        cmd += (["--ckpt", args.ckpt] if args.ckpt else ["--model", args.model]) + flags
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[str(batch)] = json.loads(r.stdout)
    out["ratio"] = out["16"]["decode_tok_s"] / out["1"]["decode_tok_s"]
    out["load_average"] = os.getloadavg()[0]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/anneal")
    ap.add_argument("--model", default="124M", help="--model of anneal serve (preset or directory)")
    ap.add_argument("--ckpt", help="--ckpt of anneal serve instead of --model")
    ap.add_argument("--tokenizer", default="gpt2")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--malformed", type=int, default=1000)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--queue", type=int, default=256)
    ap.add_argument("--max-body", type=int, default=1 << 20)
    ap.add_argument("--compare-seconds", type=float, default=20)
    ap.add_argument("--engine-baseline", action="store_true",
                    help="after the server stops, time `anneal bench decode` at batch 1 and 16 on the same model "
                         "(no HTTP, no sampling, no prefills): the decode engine's own 16-vs-1 ratio")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("server_args", nargs="*", help="after --: more flags for anneal serve")
    args = ap.parse_args()
    s = Server(args)
    out = {"server": s.base}
    try:
        with Conn(s.base) as c:
            stream_once(c, s.base, "warm up", 8, 1)
        out["rss_mib_start"] = rss_mib(s.proc.pid)
        out["load"] = load(s.base, args.streams, args.seconds, args.max_tokens)
        out["rss_mib_after_load"] = rss_mib(s.proc.pid)
        out["malformed"] = malformed(s.base, args.malformed, args.max_body)
        out["rss_mib_after_malformed"] = rss_mib(s.proc.pid)
        out["load_again"] = load(s.base, args.streams, min(args.seconds, 10), args.max_tokens)
        out["malformed_again"] = malformed(s.base, args.malformed, args.max_body)
        out["rss_mib_after_repeat"] = rss_mib(s.proc.pid)
        e0, c0 = engine_counters(s.base), cpu_s(s.proc.pid)
        one = load(s.base, 1, args.compare_seconds, args.max_tokens)
        e1, c1 = engine_counters(s.base), cpu_s(s.proc.pid)
        sixteen = load(s.base, 16, args.compare_seconds, args.max_tokens)
        e2, c2 = engine_counters(s.base), cpu_s(s.proc.pid)
        out["engine_one"], out["engine_sixteen"] = engine_delta(e0, e1), engine_delta(e1, e2)
        out["load_average"] = os.getloadavg()
        # tokens per CPU-second of the server: on a loaded machine, the work a token costs
        out["one_stream_tokens_per_cpu_s"] = one["tokens"] / (c1 - c0) if c1 > c0 else float("nan")
        out["sixteen_streams_tokens_per_cpu_s"] = sixteen["tokens"] / (c2 - c1) if c2 > c1 else float("nan")
        out["server_cpu_cores_busy"] = [(c1 - c0) / one["seconds"], (c2 - c1) / sixteen["seconds"]]
        out["one_stream_tokens_per_s"] = one["tokens_per_s"]
        out["sixteen_streams_tokens_per_s"] = sixteen["tokens_per_s"]
        out["sixteen_vs_one"] = sixteen["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] else float("nan")
        out["alive_after"] = httpx.get(s.base + "/health", timeout=10).status_code == 200
    finally:
        out["exit_code_on_sigterm"] = s.stop()
    if args.engine_baseline:
        out["engine_baseline"] = engine_baseline(args)
    L = out["load"]
    print(f"load: {L['streams']} streams for {L['seconds']} s: {L['requests']} requests, {L['errors']} errors, "
          f"{L['tokens_per_s']:.1f} tokens/s; latency p50 {L['latency_p50_s']:.3f} s p99 {L['latency_p99_s']:.3f} s; "
          f"TTFT p50 {L['ttft_p50_s']:.3f} s p99 {L['ttft_p99_s']:.3f} s")
    M = out["malformed"]
    print(f"malformed: {M['requests']} requests: statuses {M['statuses']}; not 4xx+error JSON: "
          f"{M['not_4xx_with_error_json']}")
    print(f"RSS MiB: start {out['rss_mib_start']:.1f}, after load {out['rss_mib_after_load']:.1f}, after malformed "
          f"{out['rss_mib_after_malformed']:.1f}, after a repeat of both {out['rss_mib_after_repeat']:.1f}")
    print(f"aggregate tokens/s: 1 stream {out['one_stream_tokens_per_s']:.1f}, 16 streams "
          f"{out['sixteen_streams_tokens_per_s']:.1f}: {out['sixteen_vs_one']:.2f}x (goal >= 6x)")
    print(f"per server CPU-second: 1 stream {out['one_stream_tokens_per_cpu_s']:.1f} tokens, 16 streams "
          f"{out['sixteen_streams_tokens_per_cpu_s']:.1f} tokens; server cores busy "
          f"{out['server_cpu_cores_busy'][0]:.2f} / {out['server_cpu_cores_busy'][1]:.2f} of {os.cpu_count()}")
    for name in ["one", "sixteen"]:
        E = out[f"engine_{name}"]
        print(f"engine, {name} stream(s): {E['steps']} steps of {E['rows_per_step']:.2f} rows, {E['prefills']} prefills "
              f"({E['prefill_rows']} prompt rows); ms per step: "
              + ", ".join(f"{ph} {E['ms_per_step'][ph]:.2f}" for ph in PHASES))
    print(f"load average after: {out['load_average'][0]:.2f}")
    if args.engine_baseline:
        B = out["engine_baseline"]
        print(f"engine baseline (anneal bench decode, same model and flags): batch 1 {B['1']['decode_tok_s']:.1f} tok/s "
              f"({B['1']['decode_cpu_ms_per_step']:.1f} CPU ms/step), batch 16 {B['16']['decode_tok_s']:.1f} tok/s "
              f"({B['16']['decode_cpu_ms_per_step']:.1f} CPU ms/step): {B['ratio']:.2f}x; serve 1 stream / batch 1: "
              f"{out['one_stream_tokens_per_s'] / B['1']['decode_tok_s']:.2f}; load average {B['load_average']:.2f}")
    print(f"alive after: {out['alive_after']}; exit code on SIGTERM: {out['exit_code_on_sigterm']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    failed = (L["errors"] or M["not_4xx_with_error_json"] or out["malformed_again"]["not_4xx_with_error_json"]
              or out["load_again"]["errors"] or not out["alive_after"] or out["exit_code_on_sigterm"] != 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

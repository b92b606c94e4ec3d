"""Checks `anneal serve` with the real `openai` client (run by tests/serve/test_serve_openai.c).

Usage: openai_check.py --bin ANNEAL --ckpt RUN --tokenizer TOK [--sanitized]

Every check prints "ok NAME" or "FAIL NAME: why"; the exit code is the number of
failures (0: all passed). Servers run on ephemeral loopback ports and are stopped with
SIGTERM at the end (the graceful stop is one of the checks)."""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai

FAILS = []


def check(name, cond, why=""):
    if cond:
        print(f"ok   {name}", flush=True)
    else:
        print(f"FAIL {name}: {why}", flush=True)
        FAILS.append(name)
    return cond


def make_client(base):
    # our own httpx client: openai 1.54.4 passes `proxies`, which httpx 0.28 no longer takes
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                         http_client=httpx.Client(timeout=60))


class Server:
    """`anneal serve` on 127.0.0.1 with --port 0; the port read from its first line."""

    def __init__(self, args, extra):
        cmd = [args.bin, "serve", "--ckpt", args.ckpt, "--tokenizer", args.tokenizer, "--port", "0",
               "--threads", "1", "--model-name", "tiny"] + extra
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.lines = []
        for line in self.proc.stderr:  # notes may come before the address
            self.lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                break
        else:
            raise RuntimeError(f"anneal serve did not start: {''.join(self.lines)}")
        self.port = int(m.group(1))
        self.base = f"http://127.0.0.1:{self.port}"
        self.drain = threading.Thread(target=self._drain, daemon=True)
        self.drain.start()
        try:
            self.client = make_client(self.base)
        except BaseException:
            self.proc.kill()
            raise

    def _drain(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def metrics(self):
        return httpx.get(self.base + "/metrics", timeout=10).text

    def gauge(self, name):
        m = re.search(r"^" + name + r" (\S+)$", self.metrics(), re.M)
        return float(m.group(1)) if m else None

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def generate(args, prompt, max_tokens, temperature=0.0, top_p=1.0, seed=1337, chat=False):
    """What `anneal generate` prints for the same request (top-k off, as the server)."""
    cmd = [args.bin, "generate", "--ckpt", args.ckpt, "--tokenizer", args.tokenizer, "--prompt", prompt,
           "--max-tokens", str(max_tokens), "--temperature", str(temperature), "--top-p", str(top_p),
           "--top-k", "0", "--seed", str(seed), "--threads", "1"] + (["--chat"] if chat else [])
    r = subprocess.run(cmd, capture_output=True)
    if r.returncode != 0:
        raise RuntimeError(f"anneal generate failed: {r.stderr.decode()}")
    return r.stdout.decode("utf-8", errors="replace")


def stream_text(stream, chat):
    text, finish, usage, chunks = "", None, None, 0
    for ch in stream:
        chunks += 1
        if ch.usage is not None:
            usage = ch.usage
        if not ch.choices:
            continue
        c = ch.choices[0]
        text += (c.delta.content or "") if chat else c.text
        if c.finish_reason:
            finish = c.finish_reason
    return text, finish, usage, chunks


def check_generation(args, s):
    c = s.client
    prompts = ["Hello world", "In the beginning", "The quick brown fox"]
    # greedy completions equal `anneal generate`
    for p in prompts:
        r = c.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0)
        want = generate(args, p, 24)
        got = p + r.choices[0].text + "\n"
        check(f"completion greedy = generate ({p!r})", got == want, f"serve {got!r} vs generate {want!r}")
        if r.choices[0].finish_reason == "length":
            check(f"usage ({p!r})", r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0 and
                  r.usage.total_tokens == r.usage.prompt_tokens + 24, str(r.usage))
    # seeded sampling equals generate's draw with the same seed
    r = c.completions.create(model="tiny", prompt="Once upon", max_tokens=20, temperature=0.9, top_p=0.9, seed=7)
    want = generate(args, "Once upon", 20, temperature=0.9, top_p=0.9, seed=7)
    check("completion seeded sampling = generate", "Once upon" + r.choices[0].text + "\n" == want,
          f"{r.choices[0].text!r} vs {want!r}")
    r2 = c.completions.create(model="tiny", prompt="Once upon", max_tokens=20, temperature=0.9, top_p=0.9, seed=7)
    check("same seed, same text", r2.choices[0].text == r.choices[0].text)
    # streaming = non-streaming
    r = c.completions.create(model="tiny", prompt="Hello world", max_tokens=24, temperature=0)
    text, finish, usage, n = stream_text(c.completions.create(model="tiny", prompt="Hello world", max_tokens=24,
                                                              temperature=0, stream=True,
                                                              stream_options={"include_usage": True}), False)
    check("completion stream = whole", text == r.choices[0].text and finish == r.choices[0].finish_reason,
          f"{text!r}/{finish} vs {r.choices[0].text!r}/{r.choices[0].finish_reason}")
    check("completion stream usage chunk", usage is not None and usage.completion_tokens == r.usage.completion_tokens,
          str(usage))
    check("completion stream: text, finish and usage chunks", n >= 3, f"{n} chunks")
    print(f"     (greedy text {r.choices[0].text!r}, {r.usage.completion_tokens} tokens, {n} chunks)")
    # chat, whole and streamed, equals generate --chat
    msg = [{"role": "user", "content": "What is the answer?"}]
    r = c.chat.completions.create(model="tiny", messages=msg, max_tokens=20, temperature=0)
    want = generate(args, "What is the answer?", 20, chat=True)
    got = r.choices[0].message.content
    check("chat greedy = generate --chat", got + "\n" == want, f"{got!r} vs {want!r}")
    check("chat shape", r.object == "chat.completion" and r.choices[0].message.role == "assistant" and
          r.choices[0].finish_reason in ("stop", "length"), str(r))
    text, finish, usage, n = stream_text(c.chat.completions.create(model="tiny", messages=msg, max_tokens=20,
                                                                   temperature=0, stream=True), True)
    check("chat stream = whole", text == got and finish == r.choices[0].finish_reason, f"{text!r} vs {got!r}")
    # stop strings: the text ends before the first occurrence, which is not returned
    full = c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=40, temperature=0).choices[0].text
    stop = full[10:13] if len(full) >= 14 else None
    if check("greedy text long enough for the stop check", stop is not None and stop.strip() != "", repr(full)):
        cut = full[:full.index(stop)]
        r = c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=40, temperature=0,
                                 stop=["\u2603never", stop])
        check("stop string cuts the text", r.choices[0].text == cut and r.choices[0].finish_reason == "stop",
              f"{r.choices[0].text!r} vs {cut!r} ({r.choices[0].finish_reason})")
        text, finish, _, _ = stream_text(c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=40,
                                                              temperature=0, stop=stop, stream=True), False)
        check("stop string cuts the stream", text == cut and finish == "stop", f"{text!r} vs {cut!r} ({finish})")
    # models, health
    ms = c.models.list()
    check("/v1/models", [m.id for m in ms.data] == ["tiny"], str(ms))
    h = httpx.get(s.base + "/health")
    check("/health", h.status_code == 200 and h.json()["status"] == "ok", h.text)


def check_concurrent(args, s):
    c = s.client
    jobs = [dict(prompt=f"Number {i} says", max_tokens=16 + i, temperature=0.8, seed=100 + i) for i in range(8)]
    alone = [c.completions.create(model="tiny", **j).choices[0].text for j in jobs]
    together = [None] * len(jobs)

    def run(i):
        if i % 2:
            together[i] = stream_text(c.completions.create(model="tiny", stream=True, **jobs[i]), False)[0]
        else:
            together[i] = c.completions.create(model="tiny", **jobs[i]).choices[0].text

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    check("concurrent = one at a time", together == alone,
          "; ".join(f"{i}: {a!r} vs {b!r}" for i, (a, b) in enumerate(zip(together, alone)) if a != b))


def raw(s, path, body, headers=None):
    return httpx.post(s.base + path, content=body, headers=headers or {"Content-Type": "application/json"}, timeout=30)


def check_errors(args, s):
    c = s.client
    cases = [  # (name, path, body, status, param)
        ("malformed JSON", "/v1/completions", b'{"prompt": "x", ', 400, None),
        ("not an object", "/v1/completions", b'[1, 2]', 400, None),
        ("trailing bytes", "/v1/completions", b'{"prompt": "x"} {}', 400, None),
        ("empty body", "/v1/completions", b'', 400, None),
        ("prompt missing", "/v1/completions", b'{"model": "tiny"}', 400, "prompt"),
        ("prompt wrong type", "/v1/completions", b'{"prompt": 5}', 400, "prompt"),
        ("temperature wrong type", "/v1/completions", b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
        ("temperature -1", "/v1/completions", b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
        ("top_p 7", "/v1/completions", b'{"prompt": "x", "top_p": 7}', 400, "top_p"),
        ("max_tokens 10^12", "/v1/completions", b'{"prompt": "x", "max_tokens": 1000000000000}', 400, "max_tokens"),
        ("max_tokens 0", "/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        ("max_tokens 2.5", "/v1/completions", b'{"prompt": "x", "max_tokens": 2.5}', 400, "max_tokens"),
        ("stop list of 10,000", "/v1/completions",
         json.dumps({"prompt": "x", "stop": ["a"] * 10000}).encode(), 400, "stop"),
        ("stop wrong type", "/v1/completions", b'{"prompt": "x", "stop": 3}', 400, "stop"),
        ("n = 2", "/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n"),
        ("unknown model", "/v1/completions", b'{"prompt": "x", "model": "gpt-4"}', 400, "model"),
        ("unknown field", "/v1/completions", b'{"prompt": "x", "bogus": 1}', 400, "bogus"),
        ("logprobs", "/v1/completions", b'{"prompt": "x", "logprobs": 5}', 400, "logprobs"),
        ("presence_penalty", "/v1/completions", b'{"prompt": "x", "presence_penalty": 1.5}', 400, "presence_penalty"),
        ("several prompts", "/v1/completions", b'{"prompt": ["a", "b"]}', 400, "prompt"),
        ("token id out of range", "/v1/completions", b'{"prompt": [1, 99999999]}', 400, "prompt"),
        ("messages missing", "/v1/chat/completions", b'{"model": "tiny"}', 400, "messages"),
        ("bad role", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400,
         "messages[0].role"),
        ("content wrong type", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}', 400,
         "messages[0].content"),
        ("tools", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', 400, "tools"),
        ("context exceeded", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 300}).encode(), 400,
         "max_tokens"),
        ("prompt longer than the context", "/v1/completions",
         json.dumps({"prompt": "word " * 2000, "max_tokens": 1}).encode(), 400, "prompt"),
        ("body over --max-body", "/v1/completions", json.dumps({"prompt": "x" * 100000}).encode(), 413, None),
    ]
    for name, path, body, status, param in cases:
        r = raw(s, path, body)
        try:
            e = r.json()["error"]
            shape = isinstance(e["message"], str) and e["message"] and "type" in e and "param" in e and "code" in e
        except Exception:
            e, shape = None, False
        check(f"{name} -> {status}", r.status_code == status and shape and (param is None or e["param"] == param),
              f"{r.status_code} {r.text[:300]}")
    r = httpx.get(s.base + "/v1/completions")
    check("GET /v1/completions -> 405", r.status_code == 405, str(r.status_code))
    r = httpx.get(s.base + "/nope")
    check("unknown path -> 404", r.status_code == 404 and "error" in r.json(), str(r.status_code))
    # the client raises its own exception types for these
    try:
        c.completions.create(model="tiny", prompt="x", temperature=-1)
        check("client sees BadRequestError", False, "no exception")
    except openai.BadRequestError as ex:
        check("client sees BadRequestError", ex.status_code == 400 and "temperature" in str(ex), str(ex))
    try:
        c.completions.create(model="gpt-4", prompt="x")
        check("client: unknown model", False, "no exception")
    except openai.BadRequestError as ex:
        check("client: unknown model", "gpt-4" in str(ex), str(ex))
    # a server still serving after all that
    r = c.completions.create(model="tiny", prompt="still alive", max_tokens=3, temperature=0)
    check("serves after bad requests", len(r.choices) == 1)


def check_metrics(args, s):
    text = s.metrics()
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    check("promtool check metrics", p.returncode == 0, p.stdout + p.stderr)
    for name in ["anneal_serve_requests_total{endpoint=\"/v1/completions\",status=\"200\"}",
                 "anneal_serve_requests_total{endpoint=\"/v1/completions\",status=\"400\"}",
                 "anneal_serve_completion_tokens_total", "anneal_serve_prompt_tokens_total",
                 "anneal_serve_queue_depth", "anneal_serve_running",
                 "anneal_serve_time_to_first_token_seconds_bucket",
                 "anneal_serve_time_per_output_token_seconds_count"]:
        check(f"/metrics has {name}", name in text, text[:2000])
    # the engine's counters: every generated token came from a prefill or a decode row
    # (nothing runs now), a step holds at most --slots rows, each phase is timed
    def value(name):
        m = re.search(r"^" + re.escape(name) + r" (\S+)$", text, re.M)
        return float(m.group(1)) if m else None
    steps, rows = value("anneal_serve_decode_steps_total"), value("anneal_serve_decode_rows_total")
    prefills, done = value("anneal_serve_prefills_total"), value("anneal_serve_completion_tokens_total")
    check("engine counters: tokens = prefills + decode rows",
          None not in (steps, rows, prefills, done) and steps > 0 and done == prefills + rows,
          f"steps {steps} rows {rows} prefills {prefills} completion tokens {done}")
    check("engine counters: rows per step within --slots 4", steps and steps <= rows <= 4 * steps, f"{rows} / {steps}")
    pre_rows, prompt = value("anneal_serve_prefill_rows_total"), value("anneal_serve_prompt_tokens_total")
    check("engine counters: prefill rows <= prompt tokens", pre_rows is not None and 0 < pre_rows <= prompt,
          f"{pre_rows} vs {prompt}")
    check("engine threads: the default (OMP_NUM_THREADS or all cores)", (value("anneal_serve_threads") or 0) >= 1,
          str(value("anneal_serve_threads")))
    for ph in ["prefill", "decode", "sample", "text", "mixed"]:
        v = value(f'anneal_serve_engine_seconds_total{{phase="{ph}"}}')
        check(f"engine seconds of {ph}", v is not None and v >= 0 and (ph in ("text", "mixed") or v > 0), str(v))


def check_load(args, s, seconds):
    """A bounded load test: 8 clients stream for a few seconds; no errors, tokens counted."""
    end = time.time() + seconds
    counts, errors = [0] * 8, []

    def client(i):
        c = make_client(s.base)
        k = 0
        while time.time() < end:
            try:
                _, finish, usage, _ = stream_text(c.completions.create(
                    model="tiny", prompt=f"load {i} {k}", max_tokens=16, temperature=1.0, seed=k, stream=True,
                    stream_options={"include_usage": True}), False)
                if finish not in ("stop", "length") or usage is None:
                    errors.append(f"client {i}: finish {finish}")
                counts[i] += 1
            except Exception as ex:  # noqa: BLE001 (any failure is the finding)
                errors.append(f"client {i}: {ex!r}")
            k += 1

    ts = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    check(f"load: {sum(counts)} streamed requests in {seconds} s from 8 clients, no errors",
          not errors and all(counts), "; ".join(errors[:5]) + f" counts {counts}")
    check("load: nothing left running", s.gauge("anneal_serve_running") == 0 and s.gauge("anneal_serve_queue_depth") == 0)


def check_limits(args):
    """One slot, a queue of one, slow steps: 429, deadline, disconnect, graceful stop."""
    s = Server(args, ["--slots", "1", "--queue", "1", "--step-delay-ms", "40", "--request-timeout", "2",
                      "--grace", "0.5", "--threads", "1"])
    c = s.client
    try:
        # --threads reaches the engine thread (a new pthread starts from OpenMP's default:
        # OMP_NUM_THREADS=2 under ctest)
        check("--threads 1: the engine runs 1 OpenMP thread", s.gauge("anneal_serve_threads") == 1,
              str(s.gauge("anneal_serve_threads")))
        # A holds the slot (streaming), B waits in the queue, C finds the queue full
        a = c.completions.create(model="tiny", prompt="A", max_tokens=200, temperature=1.0, seed=1, stream=True)
        it = iter(a)
        next(it)
        b_result = {}

        def run_b():
            t0 = time.time()
            try:
                r = c.completions.create(model="tiny", prompt="B", max_tokens=5, temperature=0)
                b_result["ok"] = r.choices[0].finish_reason
            except Exception as ex:  # noqa: BLE001
                b_result["err"] = repr(ex)
            b_result["t"] = time.time()
            b_result["t0"] = t0

        tb = threading.Thread(target=run_b)
        tb.start()
        for _ in range(100):
            if s.gauge("anneal_serve_queue_depth") == 1:
                break
            time.sleep(0.02)
        check("queue holds B", s.gauge("anneal_serve_queue_depth") == 1 and s.gauge("anneal_serve_running") == 1)
        try:
            c.completions.create(model="tiny", prompt="C", max_tokens=5)
            check("queue full -> 429", False, "no exception")
        except openai.RateLimitError as ex:
            check("queue full -> 429", ex.status_code == 429, str(ex))
        # A's client leaves: its slot goes to B at the next step (A had ~8 s of tokens left)
        next(it)
        a.response.close()
        t_close = time.time()
        tb.join(timeout=10)
        check("disconnect frees the slot: B ran", b_result.get("ok") in ("stop", "length"), str(b_result))
        check("disconnect frees the slot promptly", b_result.get("t", 1e9) - t_close < 1.5,
              f"B done {b_result.get('t', 0) - t_close:.2f} s after A left")
        # the deadline (--request-timeout 2) ends a long request with finish_reason length
        t0 = time.time()
        r = c.completions.create(model="tiny", prompt="D", max_tokens=200, temperature=1.0, seed=3)
        dt = time.time() - t0
        check("deadline ends the request", r.choices[0].finish_reason == "length" and r.usage.completion_tokens < 200
              and 1.5 < dt < 4, f"{dt:.2f} s, {r.usage.completion_tokens} tokens, {r.choices[0].finish_reason}")
        # a disconnect of a non-streaming request frees the slot too
        sock = socket.create_connection(("127.0.0.1", s.port))
        body = json.dumps({"prompt": "E", "max_tokens": 200, "temperature": 1.0, "seed": 4}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)
        running = s.gauge("anneal_serve_running")
        sock.close()
        for _ in range(50):
            if s.gauge("anneal_serve_running") == 0:
                break
            time.sleep(0.02)
        check("non-streaming disconnect frees the slot", running == 1 and s.gauge("anneal_serve_running") == 0,
              f"running {running} then {s.gauge('anneal_serve_running')}")
        # graceful stop: SIGTERM while a stream runs; it ends (cut within --grace) and the server exits 0
        st = c.completions.create(model="tiny", prompt="F", max_tokens=200, temperature=1.0, seed=5, stream=True)
        it = iter(st)
        next(it)
        t0 = time.time()
        s.proc.send_signal(signal.SIGTERM)
        _, finish, _, _ = stream_text(it, False)
        rc = s.proc.wait(timeout=10)
        dt = time.time() - t0
        check("SIGTERM: the stream ends with a finish_reason", finish == "length", str(finish))
        check("SIGTERM: exit 0 within the grace bound", rc == 0 and dt < 3, f"exit {rc} after {dt:.2f} s")
    finally:
        s.stop()


def check_chunked(args):
    """--prefill-chunk 3: prompts of many tokens are prefilled 3 rows per pass, beside the
    running streams; the text is still that of `anneal generate`."""
    s = Server(args, ["--slots", "3", "--prefill-chunk", "3"])
    try:
        c = s.client
        p = "In the beginning God created the heaven and the earth, and the earth was without form"
        r = c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
        want = generate(args, p, 12)
        check("chunked prefill: completion greedy = generate", p + r.choices[0].text + "\n" == want,
              f"{r.choices[0].text!r} vs {want!r}")
        jobs = [dict(prompt=f"Number {i} says that the quick brown fox jumps over {i} lazy dogs", max_tokens=10 + i,
                     temperature=0.8, seed=200 + i) for i in range(5)]
        alone = [c.completions.create(model="tiny", **j).choices[0].text for j in jobs]
        together = [None] * len(jobs)

        def run(i):
            together[i] = c.completions.create(model="tiny", **jobs[i]).choices[0].text

        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        check("chunked prefill: concurrent = one at a time", together == alone,
              "; ".join(f"{i}: {a!r} vs {b!r}" for i, (a, b) in enumerate(zip(together, alone)) if a != b))
        m = s.metrics()

        def value(name):
            x = re.search(r"^" + name + r" (\S+)$", m, re.M)
            return float(x.group(1)) if x else None
        rows, prompt = value("anneal_serve_prefill_rows_total"), value("anneal_serve_prompt_tokens_total")
        check("chunked prefill: every prompt row went through the model", rows is not None and rows == prompt,
              f"{rows} vs {prompt}")
        check("chunked prefill: a prefill per request", value("anneal_serve_prefills_total") == 1 + 2 * len(jobs),
              str(value("anneal_serve_prefills_total")))
        rc = s.stop()
        check("chunked prefill: SIGTERM exit 0", rc == 0, f"exit {rc}")
    finally:
        s.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--sanitized", action="store_true")
    args = ap.parse_args()
    s = Server(args, ["--slots", "4", "--queue", "64", "--max-body", "65536"])
    try:
        check_generation(args, s)
        check_concurrent(args, s)
        check_errors(args, s)
        check_load(args, s, 2 if args.sanitized else 3)
        check_metrics(args, s)
        rc = s.stop()
        check("SIGTERM: exit 0", rc == 0, f"exit {rc}: {''.join(s.lines[-5:])}")
    finally:
        s.stop()
    check_limits(args)
    check_chunked(args)
    print(f"{len(FAILS)} failure(s)" + (": " + ", ".join(FAILS) if FAILS else ""), flush=True)
    return len(FAILS)


if __name__ == "__main__":
    sys.exit(min(main(), 100))

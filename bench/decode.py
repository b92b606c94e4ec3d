#!/usr/bin/env python3
"""Decode speed side by side, in one run, on the same weights: anneal (`anneal bench
decode`), transformers generate-style decoding (KV cache, greedy, torch threads = anneal
threads) on the Hugging Face directory anneal exports, and llama.cpp (llama-cpp-python)
on the GGUF anneal exports (`anneal export --format gguf`; skipped, saying so, when this
build has no gguf exporter).

    .venv/bin/python bench/decode.py --ckpt RUN [--prompt-len 512] [--gen 128] [--threads 2]
                                     [--dtype fp32|bf16] [--kv-dtype f32|bf16|int8] [--batch 1]
    .venv/bin/python bench/decode.py --tiny      # a 2-step synthetic tiny run: checks the script works

Each engine runs in a process of its own (so peak RSS is its own): a random prompt of
--prompt-len ids per sequence (prefill timed: prompt tok/s), then --gen greedy decode
steps, each timed; decode figures are the median step's (tokens/s = batch / median).
Prints per engine prompt tok/s, decode tok/s, ms/token, peak RSS, and the ratios
anneal / other (above 1: anneal is faster). llama.cpp runs batch 1 only (one sequence).
The lead runs the real benchmark on a quiet machine; numbers from a shared one are noise."""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompt_ids(vocab, n, seed):
    """n pseudo-random ids in [0, vocab) (an LCG, the same in every engine)."""
    out, s = [], seed
    for _ in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((s >> 33) % vocab)
    return out


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker_hf(a):
    """transformers: prefill of batch x prompt, then gen greedy steps with past_key_values."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.hf, torch_dtype=dtype)
    model.eval()
    V = model.config.vocab_size
    ids = torch.tensor([prompt_ids(V, a.prompt_len, 7 + b) for b in range(a.batch)], dtype=torch.long)
    steps = []
    with torch.inference_mode():
        model(input_ids=ids[:, :8], use_cache=True)  # warm-up (first-call allocations)
        rounds = []
        for _ in range(a.prompt_rounds):  # the median of --prompt-rounds prefills
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            rounds.append(time.perf_counter() - t0)
        prefill = statistics.median(rounds)
        past = out.past_key_values
        nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
        for _ in range(a.gen):
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
            steps.append(time.perf_counter() - t0)
    med = statistics.median(steps)
    return {"engine": f"transformers ({a.dtype})", "prompt_tok_s": a.batch * a.prompt_len / prefill,
            "decode_tok_s": a.batch / med, "ms_per_step": med * 1e3, "peak_rss_mib": peak_rss_mib()}


def worker_llama(a):
    """llama.cpp through llama-cpp-python on the GGUF: batch 1."""
    import numpy as np
    from llama_cpp import Llama
    llm = Llama(model_path=a.gguf, n_ctx=a.prompt_len + a.gen + 8, n_batch=min(a.prompt_len, 2048),
                n_threads=a.threads, n_threads_batch=a.threads, logits_all=False, verbose=False)
    V = llm.n_vocab()
    ids = prompt_ids(V, a.prompt_len, 7)
    llm.eval(ids[:8])  # warm-up, then start over
    rounds = []
    for _ in range(a.prompt_rounds):  # the median of --prompt-rounds prefills, the cache emptied between
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        rounds.append(time.perf_counter() - t0)
    prefill = statistics.median(rounds)
    def last_logits():  # the last evaluated row (llama-cpp-python keeps scores only with logits_all)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(V,))

    steps = []
    for _ in range(a.gen):
        nxt = int(np.argmax(last_logits()))
        t0 = time.perf_counter()
        llm.eval([nxt])
        steps.append(time.perf_counter() - t0)
    med = statistics.median(steps)
    return {"engine": f"llama.cpp ({os.path.basename(a.gguf)})", "prompt_tok_s": a.prompt_len / prefill, "decode_tok_s": 1.0 / med,
            "ms_per_step": med * 1e3, "peak_rss_mib": peak_rss_mib()}


def run_anneal(a, model_dir):
    cmd = [a.bin, "bench", "decode", "--model", model_dir, "--prompt-len", str(a.prompt_len), "--gen", str(a.gen),
           "--threads", str(a.threads), "--dtype", a.dtype, "--kv-dtype", a.kv_dtype, "--batch", str(a.batch),
           "--prompt-rounds", str(a.prompt_rounds), "--json"]
    r = subprocess.run(cmd, check=True, capture_output=True, text=True)
    j = json.loads(r.stdout.strip().splitlines()[-1])
    w = f"int8 {a.quant}, {a.head} head, {a.dtype}" if a.quant != "none" else a.dtype
    return {"engine": f"anneal ({w}, {a.kv_dtype} KV)", "prompt_tok_s": j["prompt_tok_s"],
            "decode_tok_s": j["decode_tok_s"], "ms_per_step": j["decode_ms_per_step"],
            "peak_rss_mib": j["peak_rss_mib"], "gb_s": j["gb_s"], "bandwidth_gb_s": j["bandwidth_gb_s"]}


def run_worker(a, kind, **extra):
    """This script as a worker process (its own RSS); its JSON result or an error string."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--prompt-len", str(a.prompt_len),
           "--gen", str(a.gen), "--threads", str(a.threads), "--dtype", a.dtype, "--batch", str(a.batch),
           "--prompt-rounds", str(a.prompt_rounds)]
    for k, v in extra.items():
        cmd += [f"--{k}", v]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None, (r.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(r.stdout.strip().splitlines()[-1]), None


def make_tiny_run(a, d):
    run = os.path.join(d, "run")
    subprocess.run([a.bin, "train", "--synthetic", "--model", "tiny", "--batch", "2", "--seq", "32", "--steps", "2",
                    "--threads", str(a.threads), "--eval-batches", "0", "--out", run, "--log-every", "1000"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="anneal checkpoint or run directory")
    ap.add_argument("--model", help="instead of --ckpt: a preset (random weights, e.g. 124M) or a model directory")
    ap.add_argument("--tokenizer", default="none",
                    help="tokenizer written with the exported weights (llama.cpp needs one: gpt2 for GPT-2 124M)")
    ap.add_argument("--quant", default="none", choices=["none", "weight-only", "dynamic"],
                    help="anneal runs the model quantized to int8 this way (`anneal quantize`) and llama.cpp "
                         "its Q8_0 GGUF")
    ap.add_argument("--tiny", action="store_true", help="make a tiny synthetic run and benchmark it (a check)")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "anneal"))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-rounds", type=int, default=3,
                    help="prefill the prompt this many times on every engine; prompt tok/s is the median")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--kv-dtype", default="f32", choices=["f32", "bf16", "int8"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers row (minutes on 2 cores)")
    ap.add_argument("--head", default="int8", choices=["int8", "f32"], help="--head of anneal quantize (with --quant)")
    ap.add_argument("--worker", choices=["hf", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker_hf(a) if a.worker == "hf" else worker_llama(a)))
        return 0
    if (a.ckpt is not None) + (a.model is not None) + bool(a.tiny) != 1:
        ap.error("give one of --ckpt RUN, --model PRESET|DIR or --tiny")
    if a.tiny:
        a.prompt_len, a.gen = min(a.prompt_len, 64), min(a.gen, 16)
    rows, notes = [], []
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="anneal_decode_") as d:
        src = ["--model", a.model] if a.model else ["--ckpt", make_tiny_run(a, d) if a.tiny else a.ckpt]
        hf = os.path.join(d, "hf")
        subprocess.run([a.bin, "export", *src, "--format", "hf", "--out", hf, "--tokenizer", a.tokenizer],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        mine = hf
        if a.quant != "none":
            mine = os.path.join(d, "q")
            subprocess.run([a.bin, "quantize", "--model", hf, "--out", mine, "--mode", a.quant, "--head", a.head],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows.append(run_anneal(a, mine))
        r, err = (None, "--no-transformers") if a.no_transformers else run_worker(a, "hf", hf=hf)
        if r:
            rows.append(r)
        else:
            notes.append(f"transformers: skipped: {err}")
        # llama.cpp's counterpart of anneal's weights: Q8_0 for int8, F16 for bf16, else F32
        gtype = "q8_0" if a.quant != "none" else "f16" if a.dtype == "bf16" else "f32"
        gguf = os.path.join(d, f"{gtype}.gguf")
        g = subprocess.run([a.bin, "export", "--model", hf, "--format", "gguf", "--gguf-type", gtype, "--out", gguf],
                           capture_output=True, text=True)
        if g.returncode != 0 or not os.path.exists(gguf):
            notes.append("llama.cpp: skipped: no gguf exporter in this build"
                         f" ({(g.stderr.strip().splitlines() or ['?'])[-1]})")
        elif a.batch != 1:
            notes.append("llama.cpp: skipped: batch 1 only")
        else:
            r, err = run_worker(a, "llama", gguf=gguf)
            if r:
                rows.append(r)
            else:
                notes.append(f"llama.cpp: skipped: {err}")
    load1 = os.getloadavg()
    print(f"decode benchmark: prompt {a.prompt_len} x batch {a.batch} (median of {a.prompt_rounds} prefills), "
          f"{a.gen} steps, {a.threads} threads; "
          f"load average {load0[0]:.2f} before, {load1[0]:.2f} after (above ~1 the figures are noise)")
    print(f"{'engine':34s} {'prompt tok/s':>13s} {'decode tok/s':>13s} {'ms/token':>9s} {'peak RSS MiB':>13s}")
    for r in rows:
        print(f"{r['engine']:34s} {r['prompt_tok_s']:13.1f} {r['decode_tok_s']:13.1f} "
              f"{r['ms_per_step'] / a.batch:9.3f} {r['peak_rss_mib']:13.1f}")
    base = rows[0]
    print(f"anneal streamed {base['gb_s']:.2f} GB/s per decode step (measured bandwidth {base['bandwidth_gb_s']:.2f} GB/s)")
    for r in rows[1:]:
        print(f"anneal / {r['engine']}: prompt {base['prompt_tok_s'] / r['prompt_tok_s']:.2f}x, "
              f"decode {base['decode_tok_s'] / r['decode_tok_s']:.2f}x")
    for n in notes:
        print(n)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "notes": notes, "prompt_len": a.prompt_len, "gen": a.gen,
                       "threads": a.threads, "batch": a.batch, "load_before": load0[0], "load_after": load1[0]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

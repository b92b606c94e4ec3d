#!/usr/bin/env python3
"""int8 speed, batch 1: anneal (weight-only and dynamic int8, and f32) against PyTorch's
torch.ao.quantization.quantize_dynamic on the same GPT-2 weights, in one run.

  .venv/bin/python bench/quant_speed.py [--model PRESET|DIR] [--prompt 512] [--decode 64]
                                        [--threads 2] [--rounds 3]

The weights: --model names a preset (random weights from seed 1337; default 124M) or a
model/checkpoint directory; `anneal export --format hf` writes them as a Hugging Face
directory, which transformers loads (GPT2LMHeadModel) and `anneal quantize` quantizes.
Hugging Face GPT-2 keeps its block projections in Conv1D modules, which quantize_dynamic
does not touch (it quantizes nn.Linear only), so they are turned into the equivalent
nn.Linear first (weight transposed); the lm head is int8 on both sides (anneal quantize's
default `--head int8`; lm_head is in quantize_dynamic's set). Both run the prompt as one batched forward with the KV cache,
then --decode tokens one at a time (greedy), with --threads threads; best of --rounds.
anneal goes through the slots API `anneal generate` uses (bench/bench_quant.c: prefill,
then the decode engine), with an f32 KV cache like PyTorch's unless --kv-dtype says.
Prints tokens/s and the ratios anneal / PyTorch.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"quant_speed: {' '.join(cmd)}: {r.stderr.strip()}")
    return r.stdout


def build_bench():
    """bench/bench_quant.c built by CMake against the library of build/ (with whatever
    that build links: CUDA, MPI), so the command line stays right for every build."""
    build = os.path.join(ROOT, "build")
    sh(["cmake", "--build", build, "--target", "bench_quant"])
    return os.path.join(build, "bench_quant")


def anneal_speed(bench, model_dir, a):
    line = sh([bench, model_dir, str(a.prompt), str(a.decode), str(a.threads), str(a.rounds), a.kv_dtype])
    f = line.split()
    return float(f[1]), float(f[3])


def conv1d_to_linear(model):
    from transformers.pytorch_utils import Conv1D
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, Conv1D):
                lin = torch.nn.Linear(child.weight.shape[0], child.weight.shape[1])
                lin.weight.data = child.weight.data.t().contiguous()
                lin.bias.data = child.bias.data.clone()
                setattr(mod, cname, lin)
    return model


@torch.no_grad()
def torch_speed(model, vocab, a):
    g = torch.Generator().manual_seed(42)
    ids = torch.randint(0, vocab, (1, a.prompt), generator=g)
    best_p = best_d = float("inf")
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        t1 = time.perf_counter()
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(a.decode):
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t2 = time.perf_counter()
        best_p, best_d = min(best_p, t1 - t0), min(best_d, t2 - t1)
    return a.prompt / best_p, a.decode / best_d


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="124M")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-dtype", default="f32", choices=["f32", "bf16", "int8"],
                   help="anneal's KV cache (PyTorch's is f32, the default here too)")
    p.add_argument("--bin", default=os.environ.get("ANNEAL_BIN", os.path.join(ROOT, "build", "anneal")))
    p.add_argument("--bench", default=None,
                   help="a built bench_quant (default: cmake --build build --target bench_quant)")
    a = p.parse_args()
    from transformers import GPT2LMHeadModel
    torch.set_num_threads(a.threads)
    for eng in ("x86", "fbgemm"):  # PyTorch's x86 int8 kernels (FBGEMM), as quantize_dynamic is used in practice
        if eng in torch.backends.quantized.supported_engines:
            torch.backends.quantized.engine = eng
            break
    work = tempfile.mkdtemp(prefix="quant_speed_")
    try:
        f32 = os.path.join(work, "f32")
        src = ["--model", a.model]
        sh([a.bin, "export", *src, "--format", "hf", "--out", f32])
        qdirs = {}
        for mode in ("weight-only", "dynamic"):
            qdirs[mode] = os.path.join(work, mode)
            sh([a.bin, "quantize", "--model", f32, "--out", qdirs[mode], "--mode", mode])
        bench = a.bench or build_bench()
        rows = {}
        rows["anneal f32"] = anneal_speed(bench, f32, a)
        for mode, d in qdirs.items():
            rows[f"anneal int8 {mode}"] = anneal_speed(bench, d, a)
        model = GPT2LMHeadModel.from_pretrained(f32).float().eval()
        vocab = model.config.vocab_size
        rows["torch f32"] = torch_speed(model, vocab, a)
        model = conv1d_to_linear(model)
        spec = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}  # lm_head too, as anneal's
        qmodel = torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8)
        rows["torch quantize_dynamic int8"] = torch_speed(qmodel, vocab, a)
        print(f"model {a.model}, batch 1, prompt {a.prompt} tokens, decode {a.decode} tokens, {a.threads} threads, "
              f"best of {a.rounds}; anneal KV cache {a.kv_dtype}; torch {torch.__version__} ({torch.backends.quantized.engine})")
        print(f"{'':32} {'prompt tok/s':>14} {'decode tok/s':>14}")
        for k, (pp, dd) in rows.items():
            print(f"{k:32} {pp:14.1f} {dd:14.2f}")
        tq = rows["torch quantize_dynamic int8"]
        for mode in qdirs:
            r = rows[f"anneal int8 {mode}"]
            print(f"anneal int8 {mode} / torch quantize_dynamic: prompt {r[0] / tq[0]:.2f}x, decode {r[1] / tq[1]:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

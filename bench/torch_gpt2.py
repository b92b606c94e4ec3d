#!/usr/bin/env python3
"""PyTorch reference for anneal's GPT-2 training step, for bench/bench_train.py.

The same model and step as `anneal train --synthetic`:
  - architecture: HF GPT-2 layout (pre-LN, tanh GELU "gelu_new", tied lm head, Conv1D
    linears computed as HF does: addmm(bias, x, W) with W (in, out)), causal attention
    as in HF's eager path (scores, mask, softmax, @v); with --sdpa on (default where
    torch has it, i.e. 2.x) F.scaled_dot_product_attention(is_causal=True) instead;
  - init: N(0, 0.02) for matmul weights and embeddings, N(0, 0.02/sqrt(2L)) for the
    two residual projections, zero biases, LayerNorm 1/0;
  - AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matmul weights only),
    global-norm gradient clipping at 1.0;
  - data: anneal's synthetic Markov-chain tokens (same Philox stream and chain,
    src/train/source.c), so the loss path sees the same ids;
  - precision: fp32 eager, or bf16 autocast (torch.autocast("cpu", dtype=torch.bfloat16);
    weights, optimizer and loss in fp32, logits upcast for the loss as HF does).

Writes JSON lines (to --log, flushed per line, and to stdout):
  {"type":"start", "torch":..., "params":..., "dtype":..., "attention":..., "threads":...}
  {"type":"step", "step":i, "ms":..., "cpu_ms":..., "loss":..., "tokens_per_s":...}   one per step
  (cpu_ms: the process CPU time of the step, all threads)
  {"type":"summary", "peak_rss_bytes":..., "median_ms":...}  ru_maxrss of this process
Batches are made before each step's clock starts (anneal's step time includes its
batch, a few microseconds in C; the pure-Python Philox here would take ~50 ms).

    /usr/bin/python3 bench/torch_gpt2.py --layers 12 --heads 12 --embd 768 --batch 8 --seq 256 --steps 4 --dtype bf16
"""
import argparse
import json
import math
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

M32 = 0xFFFFFFFF


def philox4x32(key, counter_hi, counter_lo):
    """anneal_philox4x32 (src/core/rng.c): Philox-4x32-10 of a 128-bit counter."""
    c0, c1 = counter_lo & M32, (counter_lo >> 32) & M32
    c2, c3 = counter_hi & M32, (counter_hi >> 32) & M32
    k0, k1 = key & M32, (key >> 32) & M32
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c3 ^ k1) & M32, p0 & M32
        k0 = (k0 + 0x9E3779B9) & M32
        k1 = (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


class SyntheticTokens:
    """anneal's synthetic source (src/train/source.c): row g starts at a random token,
    then follows a fixed sparse Markov chain (4 successors per token, fixed by seed)."""

    def __init__(self, B, T, vocab, seed, stream=0):
        self.B, self.T, self.V, self.seed = B, T, vocab, seed
        self.key = (seed + stream * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        self.succ = {}
        self.served = 0

    def successor(self, t, j):
        s = self.succ.get(t)
        if s is None:
            s = self.succ[t] = philox4x32(self.seed ^ 0x5EED, 7, t)
        return s[j & 3] % self.V

    def row(self, g):
        tok = philox4x32(self.key, 11, g)[0] % self.V
        seq = []
        for t in range(self.T + 1):
            seq.append(tok)
            r = philox4x32(self.key, 12, (g * (self.T + 1) + t) & 0xFFFFFFFFFFFFFFFF)
            tok = self.successor(tok, r[0])
        return seq

    def next(self):
        rows = [self.row(self.served * self.B + b) for b in range(self.B)]
        self.served += 1
        t = torch.tensor(rows, dtype=torch.long)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Conv1D(nn.Module):
    """HF GPT-2's Conv1D: y = x @ W + b with W stored (in, out)."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        shape = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(shape)


class Block(nn.Module):
    def __init__(self, C, H, ctx, sdpa):
        super().__init__()
        self.H, self.sdpa = H, sdpa
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.attn_proj = Conv1D(C, 3 * C), Conv1D(C, C)
        self.c_fc, self.mlp_proj = Conv1D(C, 4 * C), Conv1D(4 * C, C)
        if not sdpa:
            self.register_buffer("mask", torch.ones(ctx, ctx, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        H, D = self.H, C // self.H
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
            att = att.masked_fill(~self.mask[:T, :T], torch.finfo(att.dtype).min).softmax(-1).to(v.dtype)
            y = att @ v
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(gelu_new(self.c_fc(self.ln_2(x))))


class GPT2(nn.Module):
    def __init__(self, L, H, C, V, ctx, sdpa):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(ctx, C)
        self.h = nn.ModuleList([Block(C, H, ctx, sdpa) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)
        std, proj = 0.02, 0.02 / math.sqrt(2 * L)
        with torch.no_grad():
            for n, p in self.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, proj if (n.endswith("attn_proj.weight") or n.endswith("mlp_proj.weight")) else std)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied lm head
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="steps in all, warm-up included")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--sdpa", choices=["auto", "on", "off"], default="auto",
                    help="F.scaled_dot_product_attention (auto: where torch has it)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--log", default=None, help="also append the JSON lines to this file")
    a = ap.parse_args()
    has_sdpa = hasattr(F, "scaled_dot_product_attention")
    if a.sdpa == "on" and not has_sdpa:
        sys.exit("torch_gpt2.py: --sdpa on: torch %s has no scaled_dot_product_attention" % torch.__version__)
    sdpa = has_sdpa if a.sdpa == "auto" else a.sdpa == "on"
    log = open(a.log, "a") if a.log else None

    def emit(rec):
        line = json.dumps(rec)
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    m = GPT2(a.layers, a.heads, a.embd, a.vocab, a.ctx, sdpa)
    decay = [p for n, p in m.named_parameters() if p.dim() == 2 and not n.startswith(("wte", "wpe"))]
    rest = [p for n, p in m.named_parameters() if not (p.dim() == 2 and not n.startswith(("wte", "wpe")))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    n_params = sum(p.numel() for p in m.parameters())
    emit({"type": "start", "torch": torch.__version__, "params": n_params, "dtype": a.dtype,
          "attention": "sdpa" if sdpa else "eager", "threads": torch.get_num_threads(),
          "batch": a.batch, "seq": a.seq, "steps": a.steps})
    data = SyntheticTokens(a.batch, a.seq, a.vocab, a.seed)
    bf16 = a.dtype == "bf16"
    times = []
    for step in range(1, a.steps + 1):
        idx, tgt = data.next()
        t0 = time.perf_counter()
        c0 = time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = m(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)  # frees the gradients before the next forward
        lv = loss.item()
        ms = (time.perf_counter() - t0) * 1e3
        cpu_ms = (time.process_time() - c0) * 1e3
        times.append(ms)
        emit({"type": "step", "step": step, "ms": ms, "cpu_ms": cpu_ms, "loss": lv, "tokens_per_s": a.batch * a.seq / (ms / 1e3)})
    timed = sorted(times[1:] if len(times) > 1 else times)
    emit({"type": "summary", "median_ms": timed[len(timed) // 2],
          "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    if log:
        log.close()


if __name__ == "__main__":
    main()

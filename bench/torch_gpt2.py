#!/usr/bin/env python3
"""PyTorch reference for anneal's GPT-2 training step: the same architecture (HF GPT-2
layout, pre-LN, tanh GELU, tied lm head), GPT-2 init, AdamW (betas 0.9/0.95, weight decay
0.1 on matmul weights) and global-norm clipping at 1.0, fp32 eager. Prints one JSON line
with per-step times (ms), the median, tokens/s and peak RSS.

    /usr/bin/python3 bench/torch_gpt2.py --layers 12 --heads 12 --embd 768 --batch 4 --seq 64 --steps 6
"""
import argparse
import json
import math
import resource
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn_w = nn.Parameter(torch.empty(C, 3 * C))
        self.c_attn_b = nn.Parameter(torch.zeros(3 * C))
        self.attn_proj_w = nn.Parameter(torch.empty(C, C))
        self.attn_proj_b = nn.Parameter(torch.zeros(C))
        self.c_fc_w = nn.Parameter(torch.empty(C, 4 * C))
        self.c_fc_b = nn.Parameter(torch.zeros(4 * C))
        self.mlp_proj_w = nn.Parameter(torch.empty(4 * C, C))
        self.mlp_proj_b = nn.Parameter(torch.zeros(C))

    def forward(self, x):
        B, T, C = x.shape
        H, D = self.H, C // self.H
        q, k, v = (self.ln_1(x) @ self.c_attn_w + self.c_attn_b).split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + y @ self.attn_proj_w + self.attn_proj_b
        h = gelu_new(self.ln_2(x) @ self.c_fc_w + self.c_fc_b)
        return x + h @ self.mlp_proj_w + self.mlp_proj_b


class GPT2(nn.Module):
    def __init__(self, L, H, C, V, ctx):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(ctx, C)
        self.h = nn.ModuleList([Block(C, H) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)
        std, proj = 0.02, 0.02 / math.sqrt(2 * L)
        with torch.no_grad():
            for n, p in self.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, proj if ("attn_proj" in n or "mlp_proj" in n) else std)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    m = GPT2(a.layers, a.heads, a.embd, a.vocab, a.ctx)
    decay = [p for n, p in m.named_parameters() if p.dim() == 2 and not n.startswith(("wte", "wpe"))]
    rest = [p for n, p in m.named_parameters() if not (p.dim() == 2 and not n.startswith(("wte", "wpe")))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    idx = torch.randint(0, a.vocab, (a.batch, a.seq))
    tgt = torch.randint(0, a.vocab, (a.batch, a.seq))
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = m(idx, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    timed = sorted(times[1:]) if len(times) > 1 else times
    med = timed[len(timed) // 2]
    print(json.dumps({"impl": "torch", "version": torch.__version__, "ms": times, "median_ms": med,
                      "tokens_per_s": a.batch * a.seq / (med / 1e3),
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}))


if __name__ == "__main__":
    main()

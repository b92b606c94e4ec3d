#!/usr/bin/env python3
"""transformers reference for anneal's Llama training step, for bench/bench_llama.py.

The same model and step as `anneal train --synthetic --model llama-...`:
  - architecture: transformers' LlamaForCausalLM (the eager attention path: torch 1.13
    has no scaled_dot_product_attention), built from a LlamaConfig with the preset's
    sizes (GQA num_key_value_heads, SwiGLU intermediate_size, untied head, rms_norm_eps
    1e-5, rope_theta 10000), transformers' own init (N(0, 0.02), norms 1);
  - loss: cross-entropy of the logits (upcast to f32) against the next ids, as anneal's;
  - AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrix weights but the
    embedding), global-norm gradient clipping at 1.0;
  - data: anneal's synthetic Markov-chain tokens (torch_gpt2.SyntheticTokens);
  - precision: fp32, or bf16 autocast (torch.autocast("cpu", dtype=torch.bfloat16);
    weights, optimizer and loss in fp32).

Writes the JSON lines of torch_gpt2.py (start, one step record per step with ms,
cpu_ms, loss, tokens_per_s, summary with peak_rss_bytes) to stdout and --log.

    .venv/bin/python bench/torch_llama.py --layers 12 --heads 12 --kv-heads 4 --embd 768 --ff 2048 \\
        --vocab 32000 --batch 8 --seq 256 --steps 4 --dtype bf16
"""
import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt2 import SyntheticTokens  # noqa: E402  (anneal's synthetic source)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--ff", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="steps in all, warm-up included")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--log", default=None, help="also append the JSON lines to this file")
    a = ap.parse_args()
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    log = open(a.log, "a") if a.log else None

    def emit(rec):
        line = json.dumps(rec)
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.embd, intermediate_size=a.ff, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.ctx,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, use_cache=False,
                      attn_implementation="eager")
    m = LlamaForCausalLM(cfg)
    m.train()
    named = list(m.named_parameters())
    decay = [p for n, p in named if p.dim() == 2 and "embed_tokens" not in n]
    rest = [p for n, p in named if not (p.dim() == 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    n_params = sum(p.numel() for p in m.parameters())
    emit({"type": "start", "torch": torch.__version__, "transformers": transformers.__version__, "params": n_params,
          "dtype": a.dtype, "attention": "eager", "threads": torch.get_num_threads(), "batch": a.batch, "seq": a.seq,
          "steps": a.steps})
    data = SyntheticTokens(a.batch, a.seq, a.vocab, a.seed)
    bf16 = a.dtype == "bf16"
    times = []
    for step in range(1, a.steps + 1):
        idx, tgt = data.next()
        t0 = time.perf_counter()
        c0 = time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = m(input_ids=idx).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.item()
        del logits, loss
        ms = (time.perf_counter() - t0) * 1e3
        cpu_ms = (time.process_time() - c0) * 1e3
        times.append(ms)
        emit({"type": "step", "step": step, "ms": ms, "cpu_ms": cpu_ms, "loss": lv,
              "tokens_per_s": a.batch * a.seq / (ms / 1e3)})
    timed = sorted(times[1:] if len(times) > 1 else times)
    emit({"type": "summary", "median_ms": timed[len(timed) // 2],
          "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    if log:
        log.close()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Generates tests/optim/optim_fixture.safetensors: 5 steps of torch.optim.AdamW
(betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on `w`, 0 on `b`) preceded each step
by torch.nn.utils.clip_grad_norm_(params, 1.0), on given gradients. Step 2 (0-based)
gives `b` no gradient, so PyTorch skips it there and its own step count (bias
correction) lags `w`'s from then on. tests/optim/test_optimizer.c replays it.

Run (CPU, single thread; Debian's PyTorch 1.13), from the repository root:
    /usr/bin/python3 tests/optim/gen_optim_fixture.py [output path]

Tensors (all F32):
  init.w (4, 6), init.b (6)          parameters before the first step
  grad.<k>.w, grad.<k>.b             gradients given at step k, before clipping
                                     (grad.2.b is absent: no gradient at step 2)
  lrs (5)                            learning rate of each step
  norms (5)                          norm returned by clip_grad_norm_ (before clipping)
  after.<k>.w, after.<k>.b           parameters after step k
  exp_avg.w, exp_avg_sq.w, exp_avg.b, exp_avg_sq.b   optimizer state after step 4
Metadata: steps_w, steps_b (per-parameter step counts at the end), torch_version, ...
"""
import json
import os
import struct
import sys

import torch

STEPS = 5
LRS = [1e-2, 2e-2, 3e-2, 2e-2, 1e-2]
# Gradient scale per step: the global norm of 30 N(0, 1) values is about 5.5, so
# steps 0, 2, 4 are clipped and steps 1, 3 are not.
SCALES = [3.0, 0.1, 2.0, 0.05, 1.5]
SKIP_B_AT = 2
BETAS, EPS, WD, CLIP = (0.9, 0.95), 1e-8, 0.1, 1.0
SEED = 20240601


def write_safetensors(path, tensors, metadata):
    """Minimal safetensors writer: tensors is a list of (name, float32 torch tensor)."""
    header = {"__metadata__": metadata}
    blobs, off = [], 0
    for name, t in tensors:
        b = t.detach().contiguous().to(torch.float32).numpy().tobytes(order="C")
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "optim_fixture.safetensors")
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    w = torch.nn.Parameter(torch.randn(4, 6))
    b = torch.nn.Parameter(torch.randn(6) * 0.5)
    tensors = [("init.w", w.detach().clone()), ("init.b", b.detach().clone())]
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": WD}, {"params": [b], "weight_decay": 0.0}],
                            lr=LRS[0], betas=BETAS, eps=EPS)
    norms = []
    for k in range(STEPS):
        gw = torch.randn(4, 6) * SCALES[k]
        gb = torch.randn(6) * SCALES[k]
        w.grad = gw.clone()
        tensors.append((f"grad.{k}.w", gw))
        if k == SKIP_B_AT:
            b.grad = None
        else:
            b.grad = gb.clone()
            tensors.append((f"grad.{k}.b", gb))
        norms.append(float(torch.nn.utils.clip_grad_norm_([w, b], CLIP)))
        for g in opt.param_groups:
            g["lr"] = LRS[k]
        opt.step()
        tensors.append((f"after.{k}.w", w.detach().clone()))
        tensors.append((f"after.{k}.b", b.detach().clone()))
    for name, p in (("w", w), ("b", b)):
        st = opt.state[p]
        tensors.append((f"exp_avg.{name}", st["exp_avg"]))
        tensors.append((f"exp_avg_sq.{name}", st["exp_avg_sq"]))
    tensors.append(("lrs", torch.tensor(LRS, dtype=torch.float32)))
    tensors.append(("norms", torch.tensor(norms, dtype=torch.float32)))
    steps = {n: int(opt.state[p]["step"]) for n, p in (("w", w), ("b", b))}
    meta = {
        "steps_w": str(steps["w"]), "steps_b": str(steps["b"]),
        "beta1": str(BETAS[0]), "beta2": str(BETAS[1]), "eps": str(EPS), "weight_decay": str(WD),
        "clip": str(CLIP), "skip_b_at": str(SKIP_B_AT), "seed": str(SEED),
        "torch_version": torch.__version__,
        "description": "torch.optim.AdamW + clip_grad_norm_ replay (see gen_optim_fixture.py)",
    }
    write_safetensors(out, tensors, meta)
    print(f"wrote {out}: {len(tensors)} tensors, norms {['%.4f' % n for n in norms]}, steps {steps}")


if __name__ == "__main__":
    main()

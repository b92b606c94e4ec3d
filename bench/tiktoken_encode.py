#!/usr/bin/env python3
"""Encodes a text file with tiktoken on one thread (encode_ordinary), using an Encoding
built from local GPT-2 files (encoder.json + vocab.bpe, GPT-2's pattern, <|endoftext|> =
50256), writes the ids as one space-separated line, and prints the throughput.

    python tiktoken_encode.py --encoder data/gpt2/encoder.json --vocab data/gpt2/vocab.bpe \
        --text kjv.txt --out tiktoken.ids [--repeat 3]
"""
import argparse
import os
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # encode_ordinary is single-threaded anyway

import tiktoken
from tiktoken_ext.openai_public import data_gym_to_mergeable_bpe_ranks

# GPT-2's pre-tokenisation pattern, as tiktoken's own "gpt2" encoding spells it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--encoder", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=a.vocab, encoder_json_file=a.encoder)
    enc = tiktoken.Encoding("gpt2-local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256})
    with open(a.text, "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8")
    best, first, ids = None, None, None
    for _ in range(max(1, a.repeat)):
        t0 = time.perf_counter()
        ids = enc.encode_ordinary(text)
        dt = time.perf_counter() - t0
        first = dt if first is None else first
        best = dt if best is None else min(best, dt)
    with open(a.out, "w") as f:
        f.write(" ".join(map(str, ids)) + "\n")
    print("tiktoken %s: %d bytes -> %d ids, one thread: first %.4f s (%.1f MB/s), best of %d %.4f s (%.1f MB/s)"
          % (tiktoken.__version__, len(raw), len(ids), first, len(raw) / first / 1e6, a.repeat, best,
             len(raw) / best / 1e6))
    print("TIKTOKEN_MBPS %.3f" % (len(raw) / best / 1e6))


if __name__ == "__main__":
    main()

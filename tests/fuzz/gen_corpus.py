#!/usr/bin/env python3
"""Writes the fuzz harnesses' seed corpus, tests/fuzz/corpus/<name>/ (issue 16): small
valid inputs of each parser (and a few near misses) so that fuzzing starts inside the
formats. Plain Python, deterministic; the tokenizer, config and checkpoint seeds are cut
from the committed fixtures (tests/fixtures). Run from anywhere:
    python3 tests/fuzz/gen_corpus.py
Inputs standing for several files join them with SEP (tests/fuzz/fuzz_util.h FUZZ_SEP)."""
import json
import os
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")
FIX = os.path.join(ROOT, "tests", "fixtures")
SEP = b"\n-----\n"


def put(name, fname, data):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    assert len(data) < 64 * 1024, (name, fname, len(data))
    with open(os.path.join(d, fname), "wb") as f:
        f.write(data)


def read(*p):
    with open(os.path.join(FIX, *p), "rb") as f:
        return f.read()


def fnv(b):
    h = 0xCBF29CE484222325
    for c in b:
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def shard(ids, vocab, eot, fp=0x1234):
    tb = 2 if vocab <= 65536 else 4
    body = b"".join(struct.pack("<H" if tb == 2 else "<I", i) for i in ids)
    h = b"ANNLTOK1" + struct.pack("<IIIIiIQQQ", 1, 64, tb, vocab, eot, 0, len(ids), fp, fnv(body))
    return h + struct.pack("<Q", fnv(h)) + body


def safetensors(tensors, meta=None):
    """tensors: [(name, dtype, shape, bytes)]"""
    hdr, off, data = {}, 0, b""
    if meta is not None:
        hdr["__metadata__"] = meta
    for name, dt, shape, b in tensors:
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(b)]}
        off += len(b)
        data += b
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def f32(*v):
    return struct.pack("<%df" % len(v), *v)


def main():
    # token shards
    put("shard", "u16.bin", shard([1, 2, 3, 0, 4, 5], 8, 0))
    put("shard", "u32.bin", shard([70000, 1, 69999], 70001, -1))
    put("shard", "empty.bin", shard([], 50257, 50256))
    # safetensors
    put("safetensors", "f32.safetensors", safetensors([("a", "F32", [2, 2], f32(1, 2, 3, 4))], {"format": "pt"}))
    put("safetensors", "mixed.safetensors",
        safetensors([("w", "BF16", [3], b"\x80\x3f\x00\x40\x40\x40"), ("i", "I64", [1], struct.pack("<q", 7)),
                     ("h", "F16", [2], b"\x00\x3c\x00\x40"), ("u", "U8", [0], b"")]))
    put("safetensors", "gpt2_tiny_head.safetensors", read("hf_gpt2_tiny", "reference.safetensors")[:4096])
    # sharded HF index
    idx = {"metadata": {"total_size": 24},
           "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    s1 = safetensors([("a", "F32", [2], f32(1, 2))], {"format": "pt"})
    s2 = safetensors([("b", "F32", [4], f32(1, 2, 3, 4))], {"format": "pt"})
    put("hf_index", "two_shards", json.dumps(idx).encode() + SEP + s1 + SEP + s2)
    bad = dict(idx, weight_map={"a": "../outside.safetensors", "b": "model-00002-of-00002.safetensors"})
    put("hf_index", "escape", json.dumps(bad).encode() + SEP + s1 + SEP + s2)
    # GPT-2 tokenizer files: bytes as GPT-2's printable characters, a few merges
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_char = {b: chr(c) for b, c in zip(bs, cs)}
    enc = {byte_char[b]: i for i, b in enumerate(range(256))}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")]
    for a, b in merges:
        enc[a + b] = len(enc)
    enc["<|endoftext|>"] = len(enc)
    bpe = "#version: 0.2\n" + "".join("%s %s\n" % m for m in merges)
    put("tokenizer_gpt2", "tiny", json.dumps(enc, ensure_ascii=False).encode() + SEP + bpe.encode() + SEP +
        "hello world<|endoftext|> héllo \x00".encode())
    # Hugging Face tokenizers (the committed fixtures) + a text
    for d in ("gpt2_bl", "llama2_sp", "llama3_bl", "qwen2_nfc", "zephyr_bl"):
        tj = read("hf_tokenizers", d, "tokenizer.json")
        tc = read("hf_tokenizers", d, "tokenizer_config.json")
        put("tokenizer_hf", d, tj + SEP + tc + SEP + "Hello, world! ▁ <s> 12 345".encode())
    # config.json of each architecture
    put("hf_config", "gpt2.json", read("hf_gpt2_tiny", "config.json"))
    for d in ("llama_gqa", "llama_mqa_tied", "mistral", "qwen2"):
        put("hf_config", d + ".json", read("hf_llama", d, "config.json"))
    put("hf_config", "rope_scaling.json", json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32}}))
    # the training settings file
    state = json.loads(read("golden_ckpt", "ckpt_00000006", "state.json"))
    put("train_config", "golden.json", json.dumps(state["config"], indent=1))
    put("train_config", "small.json", json.dumps({"model": "tiny", "lr": 0.001, "steps": 5, "dtype": "bf16",
                                                 "schedule": "linear", "out": "run", "lora-r": 4}))
    # checkpoint: state.json SEP config.json SEP latest
    ck = ("golden_ckpt", "ckpt_00000006")
    put("checkpoint", "golden", read(*ck, "state.json") + SEP + read(*ck, "config.json") + SEP +
        read("golden_ckpt", "latest"))
    put("checkpoint", "state_only", read(*ck, "state.json"))
    # PEFT adapters for the harness's model (GPT-2, 1 layer, 16 channels): c_attn, r = 2
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": ["c_attn"],
           "bias": "none", "fan_in_fan_out": True, "base_model_name_or_path": None, "task_type": "CAUSAL_LM"}
    pre = "base_model.model.transformer.h.0.attn.c_attn."
    ad = safetensors([(pre + "lora_A.weight", "F32", [2, 16], f32(*([0.01] * 32))),
                      (pre + "lora_B.weight", "F32", [48, 2], f32(*([0.0] * 96)))], {"format": "pt"})
    put("peft", "c_attn_r2", json.dumps(cfg).encode() + SEP + ad)
    # a training log
    log = [{"type": "start", "time": "2026-01-01T00:00:00Z", "version": "0.1.0", "tokens_per_step": 128,
            "total_steps": 4, "model": {"n_layer": 2, "n_embd": 32, "params": 1000},
            "config": {"batch": 4, "seq": 32, "lr": 0.003, "data": "/nonexistent"}},
           {"type": "step", "step": 1, "loss": 5.5, "lr": 0.001, "tokens": 128, "ms": 3.0, "tokens_per_s": 4e4,
            "mfu": 0.01, "memory_bytes": 1e6},
           {"type": "eval", "step": 2, "val_loss": 5.0},
           {"type": "step", "step": 2, "loss": 5.0, "lr": 0.002, "tokens": 256, "ms": 3.1, "tokens_per_s": 4e4},
           {"type": "checkpoint", "step": 2, "path": "ckpt_00000002"},
           {"type": "summary", "seconds": 1.5, "skipped_steps": 0, "peak_rss_bytes": 1e8,
            "peak_allocator_bytes": 1e7, "interrupted": False}]
    put("log", "run.jsonl", "\n".join(json.dumps(r) for r in log) + "\n{\"type\":\"st")


if __name__ == "__main__":
    main()

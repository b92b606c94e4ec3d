"""Runs ONNX files that `anneal export --format onnx` wrote, with the real clients (onnx's
checker, onnxruntime), for tests/io/test_onnx_export.c.

    onnx_run.py SPEC.json

SPEC: {"model": PATH, "runs": [{"ids": FILE, "shape": [B, T], "out": FILE}, ...],
       "decode": {"model": PATH, "ids": FILE, "shape": [B, T0], "steps": N,
                  "out_logits": FILE, "out_tokens": FILE}}   (decode optional)
ids files are int64 row-major; outputs are raw little-endian f32 / int64 files.

Checks (exit 1 with a message on failure): onnx.checker.check_model(path,
full_check=True) (the path form, which reads external data beside the file) accepts
every model; the inputs and outputs are named as Hugging Face Optimum names them
(input_ids -> logits; past_key_values.N.key/.value -> present.N.key/.value) with
symbolic batch and sequence dims. Each run's logits go to its out file; the decode loop
feeds the prompt with an empty past, then N greedy steps of one token each (argmax of
the last row, fed back with the presents as the next past), writing the last-row logits
of the prompt and of every step ((N + 1), B, V) and the N tokens (N, B)."""
import json
import sys

import numpy as np
import onnx
import onnxruntime as ort


def fail(msg):
    print("onnx_run.py: " + msg, file=sys.stderr)
    sys.exit(1)


def check(path):
    onnx.checker.check_model(path, full_check=True)
    m = onnx.load(path, load_external_data=False)
    if m.opset_import[0].version < 17:
        fail(f"{path}: opset {m.opset_import[0].version}")
    return m


def session(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def dims(v):
    return [d.dim_param if d.dim_param else d.dim_value for d in v.type.tensor_type.shape.dim]


def main():
    spec = json.load(open(sys.argv[1]))
    m = check(spec["model"])
    ins = [i.name for i in m.graph.input]
    outs = [o.name for o in m.graph.output]
    if ins != ["input_ids"] or outs != ["logits"]:
        fail(f"{spec['model']}: inputs {ins}, outputs {outs}")
    if dims(m.graph.input[0]) != ["batch", "sequence"]:
        fail(f"input_ids dims {dims(m.graph.input[0])}")
    s = session(spec["model"])
    for r in spec["runs"]:
        ids = np.fromfile(r["ids"], dtype=np.int64).reshape(r["shape"])
        (logits,) = s.run(["logits"], {"input_ids": ids})
        if logits.shape[:2] != ids.shape or logits.dtype != np.float32:
            fail(f"logits {logits.shape} {logits.dtype} for ids {ids.shape}")
        logits.tofile(r["out"])
    d = spec.get("decode")
    if d:
        km = check(d["model"])
        names = [i.name for i in km.graph.input]
        L = (len(names) - 1) // 2
        want_in = ["input_ids"] + [f"past_key_values.{l}.{kv}" for l in range(L) for kv in ("key", "value")]
        want_out = ["logits"] + [f"present.{l}.{kv}" for l in range(L) for kv in ("key", "value")]
        got_out = [o.name for o in km.graph.output]
        if names != want_in or got_out != want_out or L < 1:
            fail(f"{d['model']}: inputs {names}, outputs {got_out}")
        kdims = dims(km.graph.input[1])
        if kdims[0] != "batch" or kdims[2] != "past_sequence":
            fail(f"past key dims {kdims}")
        H, D = kdims[1], kdims[3]
        ks = session(d["model"])
        ids = np.fromfile(d["ids"], dtype=np.int64).reshape(d["shape"])
        B = ids.shape[0]
        feed = {f"past_key_values.{l}.{kv}": np.zeros((B, H, 0, D), np.float32)
                for l in range(L) for kv in ("key", "value")}
        rows, toks = [], []
        for step in range(d["steps"] + 1):
            feed["input_ids"] = ids
            res = ks.run(want_out, feed)
            rows.append(res[0][:, -1, :])
            for l in range(L):
                feed[f"past_key_values.{l}.key"] = res[1 + 2 * l]
                feed[f"past_key_values.{l}.value"] = res[2 + 2 * l]
            if step == d["steps"]:
                break
            nxt = res[0][:, -1, :].argmax(axis=-1).astype(np.int64)
            toks.append(nxt)
            ids = nxt.reshape(B, 1)
        np.stack(rows).astype(np.float32).tofile(d["out_logits"])
        np.stack(toks).astype(np.int64).tofile(d["out_tokens"])


if __name__ == "__main__":
    main()

"""Reads a TensorBoard log directory with TensorBoard's own EventAccumulator and prints
every scalar and text summary as JSON: {"scalars": {tag: [[step, value], ...]},
"texts": {tag: [[step, text], ...]}}. Used by tests/obs/test_tensorboard.c."""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ea = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
ea.Reload()
tags = ea.Tags()
out = {"scalars": {}, "texts": {}}
for t in tags["scalars"]:
    out["scalars"][t] = [[e.step, e.value] for e in ea.Scalars(t)]
for t in tags["tensors"]:
    out["texts"][t] = [[e.step, b"".join(e.tensor_proto.string_val).decode("utf-8")] for e in ea.Tensors(t)]
print(json.dumps(out))

#!/usr/bin/python3
# Checks a model written back by nn::OnnxModel::save (tests/dist/onnx_model_test.cpp,
# SavedModelHoldsTheCurrentParametersAndLoadsBack: every parameter of the conv3d fixture scaled
# by 1.5) with python3-onnx: the checker accepts it; it has the original's nodes, inputs, outputs
# and initializer names, shapes and element types; the parameters hold 1.5 times the original
# values and BatchNorm's running statistics (buffers) are unchanged.
# Usage: onnx_export_check.py ORIGINAL.onnx SAVED.onnx
import sys

import numpy as np
import onnx
from onnx import numpy_helper

original, saved = onnx.load(sys.argv[1]), onnx.load(sys.argv[2])
failures = 0


def report(ok, what):
    global failures
    failures += not ok
    print(f"{'ok' if ok else 'FAIL'}: {what}")


try:
    onnx.checker.check_model(saved, full_check=True)
    report(True, "onnx.checker accepts the saved model")
except Exception as error:  # the checker's own exception types vary between versions
    report(False, f"onnx.checker: {error}")
report([n.SerializeToString() for n in original.graph.node] ==
       [n.SerializeToString() for n in saved.graph.node], "the nodes are the original's")
report([i.name for i in original.graph.input] == [i.name for i in saved.graph.input] and
       [o.name for o in original.graph.output] == [o.name for o in saved.graph.output],
       "the inputs and outputs are the original's")
before = {t.name: t for t in original.graph.initializer}
after = {t.name: t for t in saved.graph.initializer}
report(list(before) == list(after), f"the initializers are the original's ({len(after)})")
for name, tensor in after.items():
    old, new = numpy_helper.to_array(before[name]), numpy_helper.to_array(tensor)
    buffer = "running_" in name
    expected = old if buffer else 1.5 * old
    report(tensor.data_type == before[name].data_type and new.shape == old.shape and
           np.array_equal(new, expected),
           f"{name}: {'unchanged (a buffer)' if buffer else '1.5 x the original'}")
print(f"{failures} failure(s)")
raise SystemExit(1 if failures else 0)

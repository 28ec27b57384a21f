#!/usr/bin/python3
# Acceptance check of `tessera ops --json` for the pooling ops and of the generic `tessera run-op
# max_pool` / `run-op avg_pool`: every PyTorch fixture case (tests/fixtures/pool) is written into
# an input HDF5 file (x, gy), run forward and --backward with its attributes as --attr NAME=VALUE
# on 4 ranks (local ranks, or under a launcher given in TESSERA_LAUNCH, e.g. "mpiexec -n 4": a 2x2
# mesh over the last two spatial dims, or 4 ranks over a 1-d signal, uneven with an empty shard)
# and on 1 rank; y, gx and max_pool's indices equal PyTorch's values and each other. Bad attributes exit with code 2,
# print one line naming the op and the attribute, and leave no output.
# Usage: run_op_pool_check.py TESSERA_BINARY FIXTURE_DIR SCRATCH_DIR
import json
import os
import subprocess
import sys

from run_op_check_support import Checks, check_errors, check_fixture_case, setup

tessera, fixture_dir, scratch, launch, manifest = setup()
tally = Checks()
report = tally.report


def attrs_of(case):
    attrs = [f"kernel_size={','.join(map(str, case['kernel_size']))}",
             f"stride={','.join(map(str, case['stride']))}",
             f"padding={','.join(map(str, case['padding']))}",
             f"ceil_mode={int(case['ceil_mode'])}"]
    if case["op"] == "max_pool":
        attrs.append(f"dilation={','.join(map(str, case['dilation']))}")
    else:
        attrs += [f"count_include_pad={int(case['count_include_pad'])}",
                  f"divisor_override={case['divisor_override']}"]
    return sum((["--attr", a] for a in attrs), [])


# --- tessera ops --json lists both with their signatures ------------------------------------------
listing = subprocess.run([tessera, "ops", "--json"], capture_output=True, text=True, timeout=60)
ops = {op["name"]: op for op in json.loads(listing.stdout)["ops"]} if listing.returncode == 0 else {}
for op, outputs, attrs in [
        ("max_pool", ["y", "indices"], ["kernel_size", "stride", "padding", "dilation", "ceil_mode"]),
        ("avg_pool", ["y"], ["kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
                             "divisor_override"])]:
    entry = ops.get(op, {})
    report(entry.get("devices") == ["cpu", "cuda"] and entry.get("differentiable") is True
           and [i["name"] for i in entry.get("inputs", [])] == ["x"]
           and entry.get("outputs") == outputs
           and [a["name"] for a in entry.get("attrs", [])] == attrs
           and entry["attrs"][0]["required"] is True,
           f"ops --json lists {op}: x -> {', '.join(outputs)}, attributes {attrs}, kernel_size "
           f"required, cpu and cuda")

for case in manifest["cases"]:
    check_fixture_case(tessera, launch, fixture_dir, scratch, tally, case["op"], case,
                       attrs_of(case))

# --- errors: exit 2, one line naming the op and the attribute, nothing written ----------------
case = next(c for c in manifest["cases"] if c["name"] == "max2d_basic")
path_in = os.path.join(scratch, "max2d_basic.in.h5")
errors = [
    ("max_pool", ["--attr", "kernel_size=3", "--attr", "padding=2"], "[max_pool] attribute 'padding'"),
    ("max_pool", ["--attr", "kernel_size=0"], "[max_pool] attribute 'kernel_size'"),
    ("max_pool", ["--attr", "kernel_size=2", "--attr", "stride=1,2,3"], "[max_pool] attribute 'stride'"),
    ("max_pool", [], "[max_pool] missing required attribute 'kernel_size'"),
    ("max_pool", ["--attr", "kernel_size=2", "--attr", "ceil_mode=2"], "[max_pool] attribute 'ceil_mode'"),
    ("avg_pool", ["--attr", "kernel_size=2", "--attr", "dilation=2"], "[avg_pool] unknown attribute 'dilation'"),
    ("avg_pool", ["--attr", "kernel_size=2", "--attr", "divisor_override=-1"],
     "[avg_pool] attribute 'divisor_override'"),
]
check_errors(tessera, launch, scratch, tally, path_in,
             ["--mesh", "2x2", "--shard-dims", "2,3"], errors)

# A gradient for the integer indices output: exit 2, one line naming the dataset.
import h5py  # noqa: E402
import numpy as np  # noqa: E402

path_gi = os.path.join(scratch, "max2d_basic.gindices.h5")
with h5py.File(path_in, "r") as source, h5py.File(path_gi, "w") as f:
    for key in source.keys():
        f[key] = source[key][...]
    f["gindices"] = np.ones(case["y_shape"])
check_errors(tessera, launch, scratch, tally, path_gi,
             ["--mesh", "2x2", "--shard-dims", "2,3", "--backward"],
             [("max_pool", ["--attr", "kernel_size=2"],
               "[max_pool] the input file has a dataset 'gindices', but output 'indices' is i64")])

print("run-op pool check:", "FAILED" if tally.failures else "passed")
sys.exit(1 if tally.failures else 0)

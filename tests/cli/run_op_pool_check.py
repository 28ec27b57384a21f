#!/usr/bin/python3
# Acceptance check of `tessera ops --json` for the pooling ops and of the generic `tessera run-op
# max_pool` / `run-op avg_pool`: every PyTorch fixture case (tests/fixtures/pool) is written into
# an input HDF5 file (x, gy), run forward and --backward with its attributes as --attr NAME=VALUE
# on 4 ranks (local ranks, or under a launcher given in TESSERA_LAUNCH, e.g. "mpiexec -n 4": a 2x2
# mesh over the last two spatial dims, or 4 ranks over a 1-d signal, uneven with an empty shard)
# and on 1 rank; y and gx equal PyTorch's values and each other. Bad attributes exit with code 2,
# print one line naming the op and the attribute, and leave no output.
# Usage: run_op_pool_check.py TESSERA_BINARY FIXTURE_DIR SCRATCH_DIR
import json
import os
import subprocess
import sys

import h5py
import numpy as np

from run_op_check_support import Checks, error_lines, load_array, run_op, setup, uneven_split

tessera, fixture_dir, scratch, launch, manifest = setup()
tally = Checks()
report = tally.report


def run(op, args, expect_code, single=False):
    return run_op(tessera, launch, op, args, expect_code, single)


split = uneven_split


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
for op, attrs in [("max_pool", ["kernel_size", "stride", "padding", "dilation", "ceil_mode"]),
                  ("avg_pool", ["kernel_size", "stride", "padding", "ceil_mode",
                                "count_include_pad", "divisor_override"])]:
    entry = ops.get(op, {})
    report(entry.get("devices") == ["cpu", "cuda"] and entry.get("differentiable") is True
           and [i["name"] for i in entry.get("inputs", [])] == ["x"] and entry.get("outputs") == ["y"]
           and [a["name"] for a in entry.get("attrs", [])] == attrs
           and entry["attrs"][0]["required"] is True,
           f"ops --json lists {op}: x -> y, attributes {attrs}, kernel_size required, cpu and cuda")

for case in manifest["cases"]:
    name, op, x_shape = case["name"], case["op"], case["x_shape"]
    path_in = os.path.join(scratch, f"{name}.in.h5")
    with h5py.File(path_in, "w") as f:
        f["x"] = load_array(fixture_dir, case, "x", x_shape)
        f["gy"] = load_array(fixture_dir, case, "gy", case["y_shape"])
    if case["dims"] >= 2:
        dims = [len(x_shape) - 2, len(x_shape) - 1]
        layout = ["--mesh", "2x2", "--shard-dims", ",".join(map(str, dims)), "--extents",
                  ";".join(",".join(map(str, split(x_shape[d], 2))) for d in dims)]
    else:
        layout = ["--mesh", "4", "--shard-dims", "2", "--extents",
                  ",".join(map(str, split(x_shape[2], 4)))]
    results = {}
    for label, args, single in [("4 ranks", layout, False), ("1 rank", [], True)]:
        path_out = os.path.join(scratch, f"{name}.{label.replace(' ', '')}.out.h5")
        if run(op, ["--in", path_in, "--out", path_out, "--backward"] + attrs_of(case) + args, 0,
               single) is None:
            tally.failures += 1
            continue
        with h5py.File(path_out, "r") as f:
            results[label] = {key: f[key][...] for key in f.keys()}
    if len(results) != 2:
        continue
    for key, shape in [("y", case["y_shape"]), ("gx", x_shape)]:
        expected = load_array(fixture_dir, case, key, shape)
        sharded, single = results["4 ranks"].get(key), results["1 rank"].get(key)
        if sharded is None or single is None:
            report(False, f"{name}: no dataset {key}")
            continue
        error = np.max(np.abs(sharded - expected), initial=0.0)
        same = np.max(np.abs(sharded - single), initial=0.0)
        report(sharded.shape == expected.shape and error < 1e-10 and same < 1e-12,
               f"{name} {key}: vs PyTorch {error:.3g}, 4 ranks vs 1 rank {same:.3g}")

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
for op, args, needle in errors:
    path_out = os.path.join(scratch, "bad.out.h5")
    if os.path.exists(path_out):
        os.remove(path_out)
    result = run(op, ["--in", path_in, "--out", path_out, "--mesh", "2x2", "--shard-dims", "2,3"]
                 + args, 2)
    if result is None:
        tally.failures += 1
        continue
    ok, lines = error_lines(result)
    named = bool(lines) and needle in lines[0]
    report(ok and named and not os.path.exists(path_out), f"{op} {' '.join(args)}: {lines} (expects '{needle}')")

print("run-op pool check:", "FAILED" if tally.failures else "passed")
sys.exit(1 if tally.failures else 0)

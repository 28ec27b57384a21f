#!/usr/bin/python3
# Acceptance check of `tessera ops --json` for the normalizations and of the generic `tessera
# run-op group_norm / batch_norm / instance_norm / layer_norm`: every PyTorch fixture case
# (tests/fixtures/norm) is written into an input HDF5 file (x, its optional inputs, gy), run
# forward and --backward with its attributes as --attr NAME=VALUE on 4 ranks (local ranks, or
# under a launcher given in TESSERA_LAUNCH, e.g. "mpiexec -n 4": a 2x2 mesh over the channel and
# last dims, or 4 ranks over the last dim, uneven with an empty shard) and on 1 rank; y, the
# running statistics and gx, gw, gb equal PyTorch's values and each other; the mean and rstd
# outputs equal numpy's from x in f64 (reported as "vs PyTorch") and each other. Bad attributes
# exit with code 2, print one line naming the op and the attribute, and leave no output.
# Usage: run_op_norm_check.py TESSERA_BINARY FIXTURE_DIR SCRATCH_DIR
import json
import os
import subprocess
import sys

import h5py
import numpy as np

from run_op_check_support import (Checks, check_errors, compare_results, load_array, run_op,
                                  setup, uneven_split)

tessera, fixture_dir, scratch, launch, manifest = setup()
tally = Checks()
report = tally.report


def run(op, args, expect_code, single=False):
    return run_op(tessera, launch, op, args, expect_code, single)


split = uneven_split


def attrs_of(case):
    return sum((["--attr", f"{name}={value}"] for name, value in case["attrs"].items()), [])


# --- tessera ops --json lists the four with their signatures --------------------------------------
listing = subprocess.run([tessera, "ops", "--json"], capture_output=True, text=True, timeout=60)
ops = {op["name"]: op for op in json.loads(listing.stdout)["ops"]} if listing.returncode == 0 else {}
for op, inputs, outputs, attrs in [
        ("group_norm", ["x", "w", "b"], ["y", "mean", "rstd"], ["groups", "eps"]),
        ("batch_norm", ["x", "running_mean", "running_var", "w", "b"],
         ["y", "running_mean", "running_var"], ["training", "momentum", "eps"]),
        ("instance_norm", ["x", "w", "b"], ["y", "mean", "rstd"], ["eps"]),
        ("layer_norm", ["x", "w", "b"], ["y", "mean", "rstd"], ["normalized_ndim", "eps"])]:
    entry = ops.get(op, {})
    report(entry.get("devices") == ["cpu", "cuda"] and entry.get("differentiable") is True
           and [i["name"] for i in entry.get("inputs", [])] == inputs
           and [i["optional"] for i in entry.get("inputs", [])] == [False] + [True] * (len(inputs) - 1)
           and entry.get("outputs") == outputs
           and [a["name"] for a in entry.get("attrs", [])] == attrs,
           f"ops --json lists {op}: {inputs} -> {outputs}, attributes {attrs}, cpu and cuda")

OPTIONAL = ["running_mean", "running_var", "w", "b"]
for index, case in enumerate(manifest["cases"]):
    name, op, x_shape, params = case["name"], case["op"], case["x_shape"], case["param_shape"]
    path_in = os.path.join(scratch, f"{name}.in.h5")
    with h5py.File(path_in, "w") as f:
        f["x"] = load_array(fixture_dir, case, "x", x_shape)
        f["gy"] = load_array(fixture_dir, case, "gy", x_shape)
        for key in OPTIONAL:
            if key in case["files"]:
                f[key] = load_array(fixture_dir, case, key, params)
    last = len(x_shape) - 1
    if index % 2 == 0:
        layout = ["--mesh", "2x2", "--shard-dims", f"1,{last}", "--extents",
                  ";".join(",".join(map(str, split(x_shape[d], 2))) for d in [1, last])]
    else:
        layout = ["--mesh", "4", "--shard-dims", str(last), "--extents",
                  ",".join(map(str, split(x_shape[last], 4)))]
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
    checks = [("y", "y", x_shape), ("gx", "gx", x_shape)]
    if case["has_w"]:
        checks.append(("gw", "gw", params))
    if case["has_b"]:
        checks.append(("gb", "gb", params))
    if op == "batch_norm":
        checks += [("running_mean", "running_mean_out", params),
                   ("running_var", "running_var_out", params)]
    expected = [(key, load_array(fixture_dir, case, fixture_key, shape))
                for key, fixture_key, shape in checks]
    if op != "batch_norm":
        # The mean and rstd outputs: each slot's mean and 1 / sqrt(biased variance + eps), from x
        # in f64 ([N, groups], [N, C], or x's shape with the normalized dims 1).
        x = load_array(fixture_dir, case, "x", x_shape).astype(np.float64)
        if op == "layer_norm":
            kept = len(x_shape) - case["attrs"]["normalized_ndim"]
            shape = x_shape[:kept] + [1] * (len(x_shape) - kept)
            rows = x.reshape(int(np.prod(x_shape[:kept])), -1)
        else:
            slots = case["attrs"]["groups"] if op == "group_norm" else x_shape[1]
            shape = [x_shape[0], slots]
            rows = x.reshape(x_shape[0] * slots, -1)
        mean = rows.mean(axis=1)
        rstd = 1 / np.sqrt(((rows - mean[:, None]) ** 2).mean(axis=1) + case["attrs"]["eps"])
        expected += [("mean", mean.reshape(shape)), ("rstd", rstd.reshape(shape))]
    compare_results(tally, name, results, expected)

# --- errors: exit 2, one line naming the op and the attribute, nothing written ----------------
path_in = os.path.join(scratch, "group1d_affine.in.h5")  # x [2, 6, 9], w, b [6]
errors = [
    ("group_norm", ["--attr", "groups=4"], "[group_norm] attribute 'groups'"),
    ("group_norm", ["--attr", "groups=0"], "[group_norm] attribute 'groups'"),
    ("group_norm", [], "[group_norm] missing required attribute 'groups'"),
    ("group_norm", ["--attr", "groups=2", "--attr", "eps=-1"], "[group_norm] attribute 'eps'"),
    ("layer_norm", ["--attr", "normalized_ndim=4"], "[layer_norm] attribute 'normalized_ndim'"),
    ("instance_norm", ["--attr", "groups=2"], "[instance_norm] unknown attribute 'groups'"),
    ("batch_norm", ["--attr", "training=2"], "[batch_norm] attribute 'training'"),
]
check_errors(tessera, launch, scratch, tally, path_in, ["--mesh", "2x2", "--shard-dims", "1,2"],
             errors)

print("run-op norm check:", "FAILED" if tally.failures else "passed")
sys.exit(1 if tally.failures else 0)

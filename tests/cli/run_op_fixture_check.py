#!/usr/bin/python3
# Acceptance check of the generic `tessera run-op OP` on the generic PyTorch fixtures
# (tests/fixtures/ops, made by tests/fixtures/make_op_fixtures.py, or tests/fixtures/conv_transpose,
# made by tests/fixtures/make_conv_transpose_fixtures.py): every case's inputs are
# written into an input HDF5 file under the op's input names with gy, run forward and --backward
# with its attributes as --attr NAME=VALUE on 4 ranks (local ranks, or under a launcher given in
# TESSERA_LAUNCH, e.g. "mpiexec -n 4": the first input sharded over 4 ranks with an empty shard,
# or over a 2x2 mesh of two of its dims, uneven) and on 1 rank; the outputs and the gradients
# (g + the input's name) equal PyTorch's values and each other, and inputs without a gradient get
# zeros. Bad attributes exit with code 2, print one line naming the op and the attribute, and
# leave no output.
# Usage: run_op_fixture_check.py TESSERA_BINARY FIXTURE_DIR SCRATCH_DIR
import os
import sys

import h5py
import numpy as np

from run_op_check_support import (Checks, check_errors, compare_results, run_op, setup,
                                  uneven_split)

tessera, fixture_dir, scratch, launch, manifest = setup()
tally = Checks()
report = tally.report


def load(file, shape):
    return np.fromfile(os.path.join(fixture_dir, file), dtype="<f8").reshape(shape)


def attr_text(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def attrs_of(case):
    return sum((["--attr", f"{name}={attr_text(value)}"] for name, value in case["attrs"].items()),
               [])


def layout_of(shape, index, shard_dim=None):
    """4 ranks over one dim of extent >= 3 (with an empty shard), or on odd cases a 2x2 mesh
    over two dims of extent >= 2 (uneven); no options when the shape has no such dims. A case's
    shard_dim is sharded over the 4 ranks."""
    if shard_dim is not None:
        return ["--mesh", "4", "--shard-dims", str(shard_dim), "--extents",
                ",".join(map(str, uneven_split(shape[shard_dim], 4)))]
    wide = [d for d, n in enumerate(shape) if n >= 2]
    if index % 2 == 1 and len(wide) >= 2:
        dims = [wide[0], wide[-1]]
        return ["--mesh", "2x2", "--shard-dims", ",".join(map(str, dims)), "--extents",
                ";".join(",".join(map(str, uneven_split(shape[d], 2))) for d in dims)]
    long = [d for d, n in enumerate(shape) if n >= 3]
    if long:
        d = long[-1]
        return ["--mesh", "4", "--shard-dims", str(d), "--extents",
                ",".join(map(str, uneven_split(shape[d], 4)))]
    return []


for index, case in enumerate(manifest["cases"]):
    name, op = case["name"], case["op"]
    path_in = os.path.join(scratch, f"{name}.in.h5")
    with h5py.File(path_in, "w") as f:
        for entry in case["inputs"]:
            f[entry["name"]] = load(entry["file"], entry["shape"])
        for entry in case["outputs"]:
            f["g" + entry["name"]] = load(entry["gy"], entry["shape"])
    results = {}
    first = case["inputs"][0]["shape"]
    for label, args, single in [("4 ranks", layout_of(first, index, case.get("shard_dim")), False),
                                ("1 rank", [], True)]:
        path_out = os.path.join(scratch, f"{name}.{label.replace(' ', '')}.out.h5")
        if run_op(tessera, launch, op, ["--in", path_in, "--out", path_out, "--backward"]
                  + attrs_of(case) + args, 0, single) is None:
            tally.failures += 1
            continue
        with h5py.File(path_out, "r") as f:
            results[label] = {key: f[key][...] for key in f.keys()}
    if len(results) != 2:
        continue
    expected = [(entry["name"], load(entry["file"], entry["shape"])) for entry in case["outputs"]]
    expected += [("g" + entry["name"], load(entry["grad"], entry["shape"]))
                 for entry in case["inputs"] if "grad" in entry]
    compare_results(tally, name, results, expected)
    for entry in case["inputs"]:
        if "grad" not in entry:  # written as zeros (no gradient reaches it), or not at all
            key = "g" + entry["name"]
            report(all(key not in r or not np.any(r[key]) for r in results.values()),
                   f"{name}: no gradient for {entry['name']}")

# --- errors: exit 2, one line naming the op and the attribute, nothing written ----------------
# Per fixture folder: an input file the run above wrote, and the bad attributes of its ops.
ERRORS = {
    "ops": ("clamp_both", [
        ("clamp", [], "[clamp] neither min nor max is set"),
        ("clamp", ["--attr", "min=low"], "[clamp] attribute 'min'"),
        ("softplus", ["--attr", "beta=0"], "[softplus] beta = 0"),
        ("leaky_relu", ["--attr", "slope=0.1"], "[leaky_relu] unknown attribute 'slope'"),
        ("sigmoid", ["--attr", "beta=1"], "[sigmoid] unknown attribute 'beta'"),
    ]),
    "conv_transpose": ("ct2d_basic", [  # x [2, 3, 6, 5], w [3, 2, 3, 3], stride 1
        ("conv_transpose", ["--attr", "output_padding=1"], "[conv_transpose] 'output_padding'"),
        ("conv_transpose", ["--attr", "stride=0"], "[conv_transpose] 'stride'"),
        ("conv_transpose", ["--attr", "stride=1,1,1"], "[conv_transpose] 'stride'"),
        ("conv_transpose", ["--attr", "groups=2"], "[conv_transpose] 'groups'"),
        ("conv_transpose", ["--attr", "padding=9"], "[conv_transpose] input extent"),
        ("conv_transpose", ["--attr", "kernel=3"], "[conv_transpose] unknown attribute 'kernel'"),
    ]),
}
error_case, errors = ERRORS[os.path.basename(os.path.normpath(fixture_dir))]
check_errors(tessera, launch, scratch, tally, os.path.join(scratch, f"{error_case}.in.h5"),
             ["--mesh", "2x2", "--shard-dims", "1,3"], errors)

print("run-op fixture check:", "FAILED" if tally.failures else "passed")
sys.exit(1 if tally.failures else 0)

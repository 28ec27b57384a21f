#!/usr/bin/python3
# Acceptance check of `tessera run-op conv`: writes a PyTorch fixture case (tests/fixtures/conv)
# into an input HDF5 file, runs the CLI sharded over local ranks (or under a launcher given in
# TESSERA_LAUNCH, e.g. "mpiexec -n 4"), and compares y, gx, gw, gb with PyTorch's values; then
# checks that bad arguments exit with code 2 and print one error line.
# Usage: run_op_conv_check.py TESSERA_BINARY FIXTURE_DIR SCRATCH_DIR
import os
import sys

import h5py
import numpy as np

from run_op_check_support import error_lines, load_array, run_cli, setup

tessera, fixture_dir, scratch, launch, manifest = setup()
failures = 0


def load(case, key, shape):
    return load_array(fixture_dir, case, key, shape)


def run(args, expect_code):
    return run_cli(launch + [tessera, "run-op", "conv"] + args, expect_code)


def check_case(name, mesh, shard_dims, extents):
    global failures
    case = next(c for c in manifest["cases"] if c["name"] == name)
    x, w = load(case, "x", case["x_shape"]), load(case, "w", case["w_shape"])
    gy = load(case, "gy", case["y_shape"])
    path_in = os.path.join(scratch, f"{name}.in.h5")
    path_out = os.path.join(scratch, f"{name}.out.h5")
    with h5py.File(path_in, "w") as f:
        f["x"], f["w"], f["gy"] = x, w, gy
        if case["has_bias"]:
            f["b"] = load(case, "b", [case["w_shape"][0]])
    padding = case["padding"]
    args = ["--in", path_in, "--out", path_out, "--backward",
            "--stride", ",".join(map(str, case["stride"])),
            "--dilation", ",".join(map(str, case["dilation"])),
            "--padding", ",".join(str(p[0]) for p in padding),
            "--groups", str(case["groups"]), "--padding-mode", case["padding_mode"],
            "--mesh", mesh, "--shard-dims", shard_dims, "--extents", extents]
    assert all(p[0] == p[1] for p in padding), "the CLI takes symmetric padding"
    if run(args, 0) is None:
        failures += 1
        return
    with h5py.File(path_out, "r") as f:
        for key, shape in [("y", case["y_shape"]), ("gx", case["x_shape"]), ("gw", case["w_shape"])] + (
                [("gb", [case["w_shape"][0]])] if case["has_bias"] else []):
            error = np.max(np.abs(f[key][...] - load(case, key, shape)))
            status = "ok" if error < 1e-10 else "FAIL"
            failures += status != "ok"
            print(f"{status}: {name} {key} max abs error {error:.3g} (mesh {mesh}, extents {extents})")


check_case("conv2d_basic", "2x2", "2,3", "3,4;2,6")
check_case("conv2d_circular", "2x2", "2,3", "1,5;2,5")
check_case("conv1d_stride2_even_kernel", "4", "2", "5,0,4,3")
check_case("conv3d_basic", "2x2", "3,4", "1,5;3,4")

# Bad arguments: exit code 2 and a one-line error on every rank (printed once).
base = os.path.join(scratch, "conv2d_basic.in.h5")
for args, what in [(["--mesh", "2x2", "--shard-dims", "2,3", "--extents", "3,3;4,4"], "extents that don't sum"),
                   (["--groups", "2"], "channels not divisible by groups"),
                   (["--dilation", "40"], "kernel larger than the padded input"),
                   (["--in", os.path.join(scratch, "missing.h5")], "missing file")]:
    if "--mesh" not in args:  # the same mesh as the launcher's world (4 ranks)
        args = args + ["--mesh", "2x2", "--shard-dims", "2,3"]
    full = ["--in", base, "--out", os.path.join(scratch, "bad.h5")] + args
    if "--in" in args:
        full = args + ["--out", os.path.join(scratch, "bad.h5")]
    result = run(full, 2)
    if result is None:
        failures += 1
        continue
    ok, lines = error_lines(result)
    failures += not ok
    print(f"{'ok' if ok else 'FAIL'}: {what}: {lines}")

print(f"{failures} failed")
sys.exit(1 if failures else 0)

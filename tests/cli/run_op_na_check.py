#!/usr/bin/python3
# Acceptance check of `tessera run-op na`: writes a PyTorch fixture case (tests/fixtures/na)
# into an input HDF5 file, runs the CLI sharded over 4 local ranks (or under a launcher given in
# TESSERA_LAUNCH, e.g. "mpiexec -n 4"), and compares o, lse, gq, gk, gv, grpb with PyTorch's
# values; then checks that bad arguments exit with code 2 and print one error line.
# Usage: run_op_na_check.py TESSERA_BINARY FIXTURE_DIR SCRATCH_DIR
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
    return run_cli(launch + [tessera, "run-op", "na"] + args, expect_code)


def write_input(case):
    shape = case["q_shape"]
    path_in = os.path.join(scratch, f"{case['name']}.in.h5")
    with h5py.File(path_in, "w") as f:
        for key in ["q", "k", "v", "go"]:
            f[key] = load(case, key, shape)
        if case["has_rpb"]:
            f["rpb"] = load(case, "rpb", case["rpb_shape"])
    return path_in


def check_case(name, mesh, shard_dims, extents, dtype="f64", tolerance=1e-10):
    global failures
    case = next(c for c in manifest["cases"] if c["name"] == name)
    shape = case["q_shape"]
    path_in = write_input(case)
    path_out = os.path.join(scratch, f"{name}.{dtype}.out.h5")
    args = ["--in", path_in, "--out", path_out, "--backward", "--dtype", dtype,
            "--kernel-size", ",".join(map(str, case["kernel_size"])),
            "--dilation", ",".join(map(str, case["dilation"])),
            "--causal", ",".join(map(str, case["causal"])),
            "--scale", repr(case["scale"]),
            "--mesh", mesh, "--shard-dims", shard_dims, "--extents", extents]
    if run(args, 0) is None:
        failures += 1
        return
    expected = [("o", shape), ("lse", shape[:-1]), ("gq", shape), ("gk", shape), ("gv", shape)]
    if case["has_rpb"]:
        expected.append(("grpb", case["rpb_shape"]))
    with h5py.File(path_out, "r") as f:
        for key, key_shape in expected:
            error = np.max(np.abs(f[key][...].astype(np.float64) - load(case, key, key_shape)))
            # fp32: 1e-4 forward and dK/dV, 1e-2 dQ (and d rpb).
            limit = tolerance * (100 if key in ("gq", "grpb") and dtype == "f32" else 1)
            status = "ok" if error < limit else "FAIL"
            failures += status != "ok"
            print(f"{status}: {name} {key} ({dtype}) max abs error {error:.3g} "
                  f"(mesh {mesh}, extents {extents})")


check_case("na2d_rpb_dilation", "2x2", "1,2", "3,5;4,5")
check_case("na1d_causal_even", "4", "1", "5,0,1,4")
check_case("na3d_mixed", "2x2", "2,3", "1,3;4,2")
check_case("na2d_causal_mixed", "2x2", "0,1", "1,1;2,6")
check_case("na2d_basic", "2x2", "1,2", "4,3;2,6", dtype="f32", tolerance=1e-4)

# Bad arguments: exit code 2 and a one-line error on every rank (printed once).
rpb_case = next(c for c in manifest["cases"] if c["name"] == "na2d_rpb_dilation")
base = os.path.join(scratch, "na2d_rpb_dilation.in.h5")
common = ["--mesh", "2x2", "--shard-dims", "1,2"]
for args, what in [(["--kernel-size", "3,5", "--extents", "3,3;4,4"], "extents that don't sum"),
                   (["--kernel-size", "9,5"], "kernel larger than the extent"),
                   (["--kernel-size", "3,5", "--causal", "1,0"], "rpb with a causal axis"),
                   (["--kernel-size", "3,4"], "rpb with an even kernel"),
                   (["--kernel-size", "3,5,3"], "three kernel sizes for na2d"),
                   (["--kernel-size", "3,5", "--device", "cuda:99"], "no such CUDA device"),
                   (["--kernel-size", "3,5", "--dtype", "i32"], "integer dtype"),
                   (["--kernel-size", "3,5", "--in", os.path.join(scratch, "missing.h5")],
                    "missing file")]:
    full = ["--in", base, "--out", os.path.join(scratch, "bad.h5")] + common + args
    if "--in" in args:
        full = args + common + ["--out", os.path.join(scratch, "bad.h5")]
    result = run(full, 2)
    if result is None:
        failures += 1
        continue
    ok, lines = error_lines(result)
    failures += not ok
    print(f"{'ok' if ok else 'FAIL'}: {what}: {lines}")

print(f"{failures} failed")
sys.exit(1 if failures else 0)

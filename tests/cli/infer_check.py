#!/usr/bin/python3
# Acceptance check of `tessera infer` on the ONNX fixtures (tests/fixtures/onnx, made by
# tests/fixtures/make_onnx_fixtures.py): every exported network (opsets 13 and 17) on its exported
# grid and on a larger one, its input written to an HDF5 file as dataset x, run in f64 on 1 rank
# and on 4 ranks (local ranks, or under the launcher in TESSERA_LAUNCH, e.g. "mpiexec -n 4"): a
# 2x2 mesh over two dims with uneven extents. OUT.h5 holds exactly the dataset y, equal to
# PyTorch's within 1e-10 (f32: 1e-5 relative). Bad options exit 2 with one "tessera: error:
# [infer] ..." line. 100 truncated or byte-flipped copies of a model (seeded) each exit 2 with one
# error line, or 0 when the damage is harmless; never a crash, never a hang.
# Usage: infer_check.py TESSERA_BINARY FIXTURE_DIR SCRATCH_DIR
import os
import random
import subprocess

import h5py
import numpy as np

from run_op_check_support import Checks, error_lines, run_cli, setup, single_error_line

tessera, fixture_dir, scratch, launch, manifest = setup()
tally = Checks()
report = tally.report


def load(file, shape):
    return np.fromfile(os.path.join(fixture_dir, file), dtype="<f8").reshape(shape)


def infer(args, expect_code, single=False):
    prefix = [] if single else launch
    extra = ["--ranks", "1"] if single else []
    return run_cli(prefix + [tessera, "infer"] + args + extra, expect_code)


def uneven(length):
    first = max(length // 3, 1)
    return [first, length - first]


# Forward against PyTorch: every case and grid, 1 rank and 4 ranks.
for case in manifest["cases"]:
    model = os.path.join(fixture_dir, case["model"])
    for g, grid in enumerate(case["grids"]):
        x_shape, y_shape = grid["inputs"][0]["shape"], grid["outputs"][0]["shape"]
        name = f"{case['name']}.grid{g}"
        path_in = os.path.join(scratch, f"{name}.in.h5")
        with h5py.File(path_in, "w") as f:
            f["x"] = load(grid["inputs"][0]["file"], x_shape)
        expected = load(grid["outputs"][0]["file"], y_shape)
        dims = case["shard_dims"]
        layouts = [("1 rank", ["--mesh", "1"], True),
                   ("2x2 uneven", ["--mesh", "2x2", "--shard-dims", ",".join(map(str, dims)),
                                   "--extents", ";".join(",".join(map(str, uneven(x_shape[d])))
                                                         for d in dims)], False)]
        for label, layout, single in layouts:
            path_out = os.path.join(scratch, f"{name}.{label.replace(' ', '_')}.out.h5")
            result = infer(["--model", model, "--in", path_in, "--out", path_out,
                            "--dtype", "f64"] + layout, 0, single)
            if result is None:
                tally.failures += 1
                continue
            with h5py.File(path_out, "r") as f:
                datasets = sorted(f.keys())
                y = f["y"][...] if "y" in f else None
            report(datasets == ["y"] and y is not None and y.shape == expected.shape and
                   np.abs(y - expected).max() < 1e-10,
                   f"{name} on {label}: y equals PyTorch within 1e-10 (datasets {datasets})")

# f32 (the default dtype) on 4 ranks: within 1e-5 of PyTorch's f64, relative to its scale.
case = manifest["cases"][0]
grid = case["grids"][1]
path_in = os.path.join(scratch, f"{case['name']}.grid1.in.h5")
path_out = os.path.join(scratch, "f32.out.h5")
if infer(["--model", os.path.join(fixture_dir, case["model"]), "--in", path_in, "--out", path_out,
          "--mesh", "2x2"], 0) is None:
    tally.failures += 1
else:
    expected = load(grid["outputs"][0]["file"], grid["outputs"][0]["shape"])
    with h5py.File(path_out, "r") as f:
        y = f["y"][...]
    report(y.dtype == np.float32 and
           np.abs(y - expected).max() < 1e-5 * max(1.0, np.abs(expected).max()),
           f"{case['name']} in f32 on 2x2: within 1e-5 of PyTorch")

# Bad options and inputs: one error line tagged [infer] (or [onnx] for the model), exit 2.
model = os.path.join(fixture_dir, manifest["cases"][0]["model"])
good_in = os.path.join(scratch, f"{manifest['cases'][0]['name']}.grid0.in.h5")
out = os.path.join(scratch, "bad.out.h5")
no_x = os.path.join(scratch, "no_x.h5")
with h5py.File(no_x, "w") as f:
    f["z"] = np.zeros((1, 2, 4, 4))
bad_cases = [
    (["--model", model, "--in", good_in, "--out", out, "--dtype", "f16"], "[infer] --dtype f16"),
    (["--model", model, "--in", good_in, "--out", good_in], "[infer]"),
    (["--model", model, "--in", no_x, "--out", out], "[infer]"),
    (["--model", model, "--in", os.path.join(scratch, "missing.h5"), "--out", out], "[infer]"),
    (["--model", model, "--in", good_in, "--out", out, "--mesh", "2x2", "--shard-dims", "9,2"],
     "[infer] --shard-dims"),
    (["--model", os.path.join(scratch, "missing.onnx"), "--in", good_in, "--out", out],
     "[onnx] cannot open model file"),
    (["--model", good_in, "--in", good_in, "--out", out], "[onnx]"),
]
for args, expected_text in bad_cases:
    if os.path.exists(out):
        os.remove(out)
    result = infer(args, 2, single="--mesh" not in args)
    if result is None:
        tally.failures += 1
        continue
    ok, lines = error_lines(result) if "--mesh" in args else single_error_line(result.stderr, False)
    report(ok and expected_text in lines[0] and not os.path.exists(out),
           f"{' '.join(args[-2:])}: one error line containing '{expected_text}' ({lines[:1]})")

# Damaged models: truncations and byte flips of a fixture, seeded.
random.seed(19)
original = open(os.path.join(fixture_dir, "conv3d.opset13.onnx"), "rb").read()
conv3d_in = os.path.join(scratch, "conv3d_opset13.grid0.in.h5")
outcomes = {"refused": 0, "harmless": 0}
for trial in range(100):
    damaged = bytearray(original)
    if trial % 2 == 0:
        damaged = damaged[:random.randrange(len(original))]
    else:
        for _ in range(random.randint(1, 8)):
            damaged[random.randrange(len(damaged))] ^= 1 << random.randrange(8)
    path = os.path.join(scratch, "damaged.onnx")
    with open(path, "wb") as f:
        f.write(damaged)
    out = os.path.join(scratch, "damaged.out.h5")
    try:
        result = subprocess.run([tessera, "infer", "--model", path, "--in", conv3d_in, "--out", out,
                                 "--dtype", "f64", "--ranks", "1"],
                                capture_output=True, text=True, errors="replace", timeout=120)
    except subprocess.TimeoutExpired:
        report(False, f"damaged model {trial}: hangs")
        continue
    if result.returncode == 0:
        outcomes["harmless"] += 1
        continue
    ok, lines = single_error_line(result.stderr, False)
    outcomes["refused"] += ok and result.returncode == 2
    if not (ok and result.returncode == 2):
        report(False, f"damaged model {trial}: exit {result.returncode}, stderr {lines[:3]}")
report(outcomes["refused"] + outcomes["harmless"] == 100 and outcomes["refused"] >= 50,
       f"100 damaged models: {outcomes['refused']} refused with one error line (exit 2), "
       f"{outcomes['harmless']} harmless (exit 0), none crashed or hung")

print(f"{tally.failures} failure(s)")
raise SystemExit(1 if tally.failures else 0)

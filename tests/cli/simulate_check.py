#!/usr/bin/python3
# Acceptance check of `tessera simulate gray-scott`: one rank, a 2x2 mesh with uneven extents and
# a 3-d mesh (under TESSERA_LAUNCH, e.g. "mpiexec -n 4", or local ranks) write bit-identical
# RUN.h5:/snapshots [T, 2, X, Y, Z] with the parameters as attributes; a run cut off after two
# snapshots and continued with --restart equals the uninterrupted run; --json reports the
# figures; every bad option exits 2 with one line.
# Usage: simulate_check.py TESSERA_BINARY SCRATCH_DIR
import json
import os
import shlex
import subprocess
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_op_check_support import single_error_line  # noqa: E402

tessera, scratch = sys.argv[1], sys.argv[2]
launch = shlex.split(os.environ.get("TESSERA_LAUNCH", ""))
os.makedirs(scratch, exist_ok=True)
failures = 0


def check(ok, what):
    global failures
    failures += not ok
    print(f"{'ok' if ok else 'FAIL'}: {what}")


def simulate(out, *args, launcher=(), extra_env=None):
    env = dict(os.environ, **(extra_env or {}))
    command = list(launcher) + [tessera, "simulate", "gray-scott", "--size", "9,7,6", "--steps", "12",
                                "--every", "4", "--seed", "5", "--out", out] + list(args)
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def snapshots(path):
    with h5py.File(path) as f:
        return f["snapshots"][...], dict(f["snapshots"].attrs)


def text(value):
    return value.decode() if isinstance(value, bytes) else str(value)


one = os.path.join(scratch, "one.h5")
result = simulate(one, "--dtype", "f64")
check(result.returncode == 0, f"one rank runs: {result.stderr.strip()}")
reference, attributes = snapshots(one)
check(reference.shape == (4, 2, 9, 7, 6) and reference.dtype == np.float64, f"shape {reference.shape}")
check(text(attributes.get("written")) == "4" and text(attributes.get("Du")) == "0.16" and
      text(attributes.get("every")) == "4", "attributes: written, Du, every")
check(not np.array_equal(reference[0], reference[-1]), "the state evolves")

for name, mesh in [("2x2", ["--mesh", "2x2", "--shard-dims", "0,2", "--extents", "7,2;1,5"]),
                   ("1x2x2", ["--mesh", "1x2x2", "--shard-dims", "0,1,2", "--extents", "9;3,4;5,1"]),
                   ("4", ["--mesh", "4", "--shard-dims", "1", "--extents", "1,3,0,3"])]:
    out = os.path.join(scratch, f"mesh_{name}.h5")
    result = simulate(out, "--dtype", "f64", *mesh, launcher=launch)
    data = snapshots(out)[0] if result.returncode == 0 else None
    check(data is not None and np.array_equal(data, reference),
          f"mesh {name} equals one rank bit for bit {result.stderr.strip()}")

# Cut off after two snapshots, then --restart on another mesh.
cut = os.path.join(scratch, "cut.h5")
simulate(cut, "--dtype", "f64")
with h5py.File(cut, "r+") as f:
    f["snapshots"][2:] = 0
    f["snapshots"].attrs["written"] = np.bytes_("2")
result = simulate(cut, "--dtype", "f64", "--restart", "--mesh", "2x2", "--shard-dims", "1,2", launcher=launch)
check(result.returncode == 0 and np.array_equal(snapshots(cut)[0], reference),
      f"restart equals the uninterrupted run {result.stderr.strip()}")

result = simulate(os.path.join(scratch, "json.h5"), "--json")
report = json.loads(result.stdout) if result.returncode == 0 else {}
check(all(key in report for key in ("step_seconds", "cells_per_second", "bytes_written_per_second",
                                    "bandwidth_bound_cells_per_second", "bytes_per_cell_per_step")),
      f"--json keys {sorted(report)}")

bad = [(["--size", "2,7,6"], "at least 3"),
       (["--size", "9,7"], "the grid has 3"),
       (["--every", "0"], "--every"),
       (["--steps", "-1"], "--steps"),
       (["--dtype", "f16"], "f32 or f64"),
       (["--feed", "nan"], "--feed"),
       (["--mesh", "2x2", "--ranks", "3"], "--mesh 2x2"),
       (["--mesh", "2", "--extents", "4,4"], "extents"),
       (["--mesh", "2", "--shard-dims", "3"], "--shard-dims"),
       (["--device", "cuda"], "cuda"),
       (["--restart", "--out", os.path.join(scratch, "missing.h5")], "does not exist"),
       (["--restart", "--out", one, "--du", "0.2"], "Du = 0.16, the options say 0.2"),
       (["--restart", "--out", one, "--dtype", "f32"], "dtype")]
for args, needle in bad:
    options = {"--size": "9,7,6", "--steps": "12", "--every": "4", "--seed": "5", "--dtype": "f64",
               "--out": os.path.join(scratch, "bad.h5")}
    rest = []
    for arg in args:  # "--option value" pairs replace the defaults; flags are kept as they are
        if rest and rest[-1] in options:
            options[rest.pop()] = arg
        else:
            rest.append(arg)
    command = [tessera, "simulate", "gray-scott"] + [x for pair in options.items() for x in pair] + rest
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    ok, lines = single_error_line(result.stderr, False)
    check(result.returncode == 2 and ok and needle in lines[0],
          f"{' '.join(args)}: exit {result.returncode}, {lines}")

print(f"{failures} failed")
sys.exit(1 if failures else 0)

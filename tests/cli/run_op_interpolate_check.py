#!/usr/bin/python3
# Acceptance check of `tessera ops --json` for interpolate and of the generic `tessera run-op
# interpolate`: every PyTorch fixture case (tests/fixtures/interpolate) is written into an input
# HDF5 file (x, gy), run forward and --backward with its attributes as --attr NAME=VALUE on 4
# ranks (local ranks, or under a launcher given in TESSERA_LAUNCH, e.g. "mpiexec -n 4": a 2x2 mesh
# over the last two spatial dims, or 4 ranks over a 1-d signal, uneven with an empty shard) and on
# 1 rank; y and gx equal PyTorch's values and each other. Bad attributes exit with code 2, print
# one line naming the op and the attribute, and leave no output.
# Usage: run_op_interpolate_check.py TESSERA_BINARY FIXTURE_DIR SCRATCH_DIR
import json
import os
import subprocess
import sys

from run_op_check_support import Checks, check_errors, check_fixture_case, setup

tessera, fixture_dir, scratch, launch, manifest = setup()
tally = Checks()


def attrs_of(case):
    attrs = [f"mode={case['mode']}"]
    if case["size"]:
        attrs.append(f"size={','.join(map(str, case['size']))}")
    else:
        attrs.append(f"scale_factor={','.join(map(repr, case['scale_factor']))}")
        attrs.append(f"recompute_scale_factor={int(case['recompute_scale_factor'])}")
    if case["align_corners"] is not None:
        attrs.append(f"align_corners={int(case['align_corners'])}")
    return sum((["--attr", a] for a in attrs), [])


# --- tessera ops --json lists it with its signature ----------------------------------------------
listing = subprocess.run([tessera, "ops", "--json"], capture_output=True, text=True, timeout=60)
ops = {op["name"]: op for op in json.loads(listing.stdout)["ops"]} if listing.returncode == 0 else {}
entry = ops.get("interpolate", {})
attrs = ["size", "scale_factor", "mode", "align_corners", "recompute_scale_factor"]
tally.report(entry.get("devices") == ["cpu", "cuda"] and entry.get("differentiable") is True
             and [i["name"] for i in entry.get("inputs", [])] == ["x"]
             and entry.get("outputs") == ["y"]
             and [a["name"] for a in entry.get("attrs", [])] == attrs
             and entry["attrs"][1]["type"] == "float list"
             and entry["attrs"][2]["default"] == "nearest",
             f"ops --json lists interpolate: x -> y, attributes {attrs}, cpu and cuda")

for case in manifest["cases"]:
    check_fixture_case(tessera, launch, fixture_dir, scratch, tally, "interpolate", case,
                       attrs_of(case))

# --- errors: exit 2, one line naming the op and the attribute, nothing written ----------------
path_in = os.path.join(scratch, "bilinear_size.in.h5")  # [2, 2, 6, 7], written above
errors = [
    ("interpolate", ["--attr", "size=4,4", "--attr", "scale_factor=2"], "[interpolate] expected exactly one"),
    ("interpolate", ["--attr", "mode=bilinear"], "[interpolate] expected exactly one"),
    ("interpolate", ["--attr", "size=4", "--attr", "mode=linear"], "[interpolate] attribute 'mode'"),
    ("interpolate", ["--attr", "size=4", "--attr", "mode=cubic"], "[interpolate] attribute 'mode'"),
    ("interpolate", ["--attr", "size=4", "--attr", "align_corners=1"], "[interpolate] attribute 'align_corners'"),
    ("interpolate", ["--attr", "size=0"], "[interpolate] attribute 'size'"),
    ("interpolate", ["--attr", "scale_factor=1.5,x"], "[interpolate] attribute 'scale_factor'"),
    ("interpolate", ["--attr", "scale_factor=-1"], "[interpolate] attribute 'scale_factor'"),
    ("interpolate", ["--attr", "size=4", "--attr", "recompute_scale_factor=1"],
     "[interpolate] attribute 'recompute_scale_factor'"),
]
check_errors(tessera, launch, scratch, tally, path_in, ["--mesh", "2x2", "--shard-dims", "2,3"],
             errors)

print("run-op interpolate check:", "FAILED" if tally.failures else "passed")
sys.exit(1 if tally.failures else 0)

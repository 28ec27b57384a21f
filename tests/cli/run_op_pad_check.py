#!/usr/bin/python3
# Acceptance check of `tessera ops --json` for pad and of the generic `tessera run-op pad`: every
# PyTorch fixture case (tests/fixtures/pad) is written into an input HDF5 file (x, gy), run
# forward and --backward with its attributes as --attr NAME=VALUE on 4 ranks (local ranks, or
# under a launcher given in TESSERA_LAUNCH, e.g. "mpiexec -n 4": a 2x2 mesh over the last two
# dims, or 4 ranks over a 1-d signal, uneven with an empty shard) and on 1 rank; y and gx equal
# PyTorch's values and each other. Bad attributes exit with code 2, print one line naming the op
# and the attribute, and leave no output.
# Usage: run_op_pad_check.py TESSERA_BINARY FIXTURE_DIR SCRATCH_DIR
import json
import os
import subprocess
import sys

from run_op_check_support import Checks, check_errors, check_fixture_case, setup

tessera, fixture_dir, scratch, launch, manifest = setup()
tally = Checks()


def attrs_of(case):
    attrs = [f"pad={','.join(map(str, case['pad']))}", f"mode={case['mode']}",
             f"value={case['value']!r}"]
    return sum((["--attr", a] for a in attrs), [])


# --- tessera ops --json lists it with its signature ----------------------------------------------
listing = subprocess.run([tessera, "ops", "--json"], capture_output=True, text=True, timeout=60)
ops = {op["name"]: op for op in json.loads(listing.stdout)["ops"]} if listing.returncode == 0 else {}
entry = ops.get("pad", {})
attrs = ["pad", "mode", "value"]
tally.report(entry.get("devices") == ["cpu", "cuda"] and entry.get("differentiable") is True
             and [i["name"] for i in entry.get("inputs", [])] == ["x"]
             and entry.get("outputs") == ["y"]
             and [a["name"] for a in entry.get("attrs", [])] == attrs
             and entry["attrs"][0]["required"] is True,
             f"ops --json lists pad: x -> y, attributes {attrs}, pad required, cpu and cuda")

for case in manifest["cases"]:
    check_fixture_case(tessera, launch, fixture_dir, scratch, tally, "pad", case, attrs_of(case))

# --- errors: exit 2, one line naming the op and the attribute, nothing written ----------------
path_in = os.path.join(scratch, "reflect2d.in.h5")  # [2, 2, 6, 7], written above
errors = [
    ("pad", [], "[pad] missing required attribute 'pad'"),
    ("pad", ["--attr", "pad=1,2,3"], "[pad] attribute 'pad'"),
    ("pad", ["--attr", "pad=-4,-4"], "[pad] attribute 'pad' = [-4, -4] with mode 'constant': padding (-4, -4) of dim 3 (extent 7) leaves -1 cells"),
    ("pad", ["--attr", "pad=1,1", "--attr", "mode=wrap"], "[pad] attribute 'mode'"),
    ("pad", ["--attr", "pad=1,1", "--attr", "mode=reflect"], "[pad] attribute 'pad' = [1, 1] with mode 'reflect': padding 1 dim(s) needs"),
    ("pad", ["--attr", "pad=7,0,0,0", "--attr", "mode=reflect"], "with mode 'reflect': padding (7, 0) of dim 3"),
    ("pad", ["--attr", "pad=0,0,7,0", "--attr", "mode=circular"], "with mode 'circular': padding (7, 0) of dim 2"),
    ("pad", ["--attr", "pad=1,1", "--attr", "value=x"], "[pad] attribute 'value'"),
]
check_errors(tessera, launch, scratch, tally, path_in, ["--mesh", "2x2", "--shard-dims", "2,3"],
             errors)

print("run-op pad check:", "FAILED" if tally.failures else "passed")
sys.exit(1 if tally.failures else 0)

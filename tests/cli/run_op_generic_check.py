#!/usr/bin/python3
# Acceptance check of `tessera ops --json` and of the generic `tessera run-op OP`: the built-in
# ops are listed with their signatures and devices; gelu, scale, add and mul with a broadcast
# operand, sum with a dims attribute and mse_loss, run forward and --backward on a 2x2 mesh of
# local ranks (or under a launcher given in TESSERA_LAUNCH, e.g. "mpiexec -n 4") with uneven
# extents, equal the 1-rank run and NumPy; bad attributes, missing inputs and bad shapes exit
# with code 2, print one line naming the op and the attribute or input, and leave no output.
# Usage: run_op_generic_check.py TESSERA_BINARY SCRATCH_DIR
import json
import math
import os
import shlex
import subprocess
import sys

import h5py
import numpy as np

from run_op_check_support import error_lines, run_cli

tessera, scratch = sys.argv[1], sys.argv[2]
launch = shlex.split(os.environ.get("TESSERA_LAUNCH", ""))
os.makedirs(scratch, exist_ok=True)
failures = 0
rng = np.random.default_rng(12)


def report(ok, what):
    global failures
    failures += not ok
    print(f"{'ok' if ok else 'FAIL'}: {what}")


# --- tessera ops --json ------------------------------------------------------------------------
listing = subprocess.run([tessera, "ops", "--json"], capture_output=True, text=True, timeout=60)
report(listing.returncode == 0, f"tessera ops --json exits 0 {listing.stderr.strip()}")
ops = {op["name"]: op for op in json.loads(listing.stdout)["ops"]} if listing.returncode == 0 else {}
expected_devices = {"conv": ["cpu", "cuda"], "na": ["cpu", "cuda"], "gelu": ["cpu", "cuda"],
                    "add": ["cpu", "cuda"], "sum": ["cpu", "cuda"], "mse_loss": ["cpu", "cuda"]}
for name, devices in expected_devices.items():
    op = ops.get(name, {})
    report(op.get("devices") == devices and op.get("differentiable") is True and op.get("summary"),
           f"ops --json lists {name} on {devices}, differentiable: {op.get('devices')}, {op.get('differentiable')}")
conv = ops.get("conv", {})
report([i["name"] for i in conv.get("inputs", [])] == ["x", "w", "b"]
       and conv["inputs"][2]["optional"] and conv.get("outputs") == ["y"]
       and {"name": "groups", "type": "int", "required": False, "default": 1}.items()
       <= next(a for a in conv["attrs"] if a["name"] == "groups").items(),
       "conv's signature: x, w, optional b -> y; groups: int = 1")
na_scale = next((a for a in ops.get("na", {}).get("attrs", []) if a["name"] == "scale"), {})
report(na_scale.get("required") is True and na_scale.get("default") is None,
       "na's scale is required")
keepdim = next((a for a in ops.get("sum", {}).get("attrs", []) if a["name"] == "keepdim"), {})
report(keepdim.get("type") == "bool" and keepdim.get("default") is False, "sum's keepdim: bool = 0")
table = subprocess.run([tessera, "ops"], capture_output=True, text=True, timeout=60)
report(table.returncode == 0 and all(f"\n{name} " in table.stdout for name in expected_devices),
       "tessera ops prints a table of the ops")


# --- generic run-op: sharded equals one rank -----------------------------------------------------
def run(op, args, expect_code, ranks=None):
    prefix = launch if ranks is None else []
    extra = [] if ranks is None else ["--ranks", str(ranks)]
    return run_cli(prefix + [tessera, "run-op", op] + args + extra, expect_code)


def gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def gelu_grad(x):
    return 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2))) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)


x = rng.standard_normal((5, 7, 6))
y_grad = rng.standard_normal((5, 7, 6))
b_row = rng.standard_normal((6,))
b_col = rng.standard_normal((7, 1)) + 2.0
target = rng.standard_normal((5, 7, 6))
sum_grad = rng.standard_normal((5, 1, 1))
cases = [
    # name, op, inputs, attrs, expected outputs and gradients (NumPy)
    ("gelu", "gelu", {"x": x, "gy": y_grad}, [],
     {"y": gelu(x), "gx": gelu_grad(x) * y_grad}),
    ("scale", "scale", {"x": x, "gy": y_grad}, ["factor=0.5"],
     {"y": 0.5 * x, "gx": 0.5 * y_grad}),
    ("add_broadcast", "add", {"a": x, "b": b_row, "gy": y_grad}, [],
     {"y": x + b_row, "ga": y_grad, "gb": y_grad.sum(axis=(0, 1))}),
    ("mul_broadcast", "mul", {"a": x, "b": b_col, "gy": y_grad}, [],
     {"y": x * b_col, "ga": y_grad * b_col, "gb": (y_grad * x).sum(axis=(0, 2))[:, None]}),
    ("sum_dims", "sum", {"x": x, "gy": sum_grad}, ["dims=1,2", "keepdim=1"],
     {"y": x.sum(axis=(1, 2), keepdims=True), "gx": np.broadcast_to(sum_grad, x.shape)}),
    ("mse_loss", "mse_loss", {"a": x, "b": target, "gy": np.array(0.75)}, [],
     {"y": np.array(np.mean((x - target) ** 2)),
      "ga": 0.75 * 2 * (x - target) / x.size, "gb": -0.75 * 2 * (x - target) / x.size}),
]
for name, op, datasets, attrs, expected in cases:
    path_in = os.path.join(scratch, f"{name}.in.h5")
    with h5py.File(path_in, "w") as f:
        for key, value in datasets.items():
            f[key] = value
    attr_args = sum((["--attr", a] for a in attrs), [])
    results = {}
    for label, layout, ranks in [("2x2", ["--mesh", "2x2", "--shard-dims", "1,2",
                                          "--extents", "3,4;1,5"], None),
                                 ("1 rank", ["--mesh", "1"], 1)]:
        path_out = os.path.join(scratch, f"{name}.{label.replace(' ', '')}.out.h5")
        if run(op, ["--in", path_in, "--out", path_out, "--backward"] + attr_args + layout, 0,
               ranks) is None:
            failures += 1
            continue
        with h5py.File(path_out, "r") as f:
            results[label] = {key: f[key][...] for key in f.keys()}
    if len(results) != 2:
        continue
    sharded, single = results["2x2"], results["1 rank"]
    report(set(sharded) == set(expected) == set(single),
           f"{name}: datasets {sorted(sharded)} (expected {sorted(expected)})")
    for key, value in expected.items():
        if key not in sharded or key not in single:
            continue
        same = np.max(np.abs(sharded[key] - single[key]), initial=0.0)
        error = np.max(np.abs(sharded[key] - value), initial=0.0)
        report(sharded[key].shape == np.shape(value) and same < 1e-12 and error < 1e-10,
               f"{name} {key}: 2x2 uneven vs 1 rank {same:.3g}, vs NumPy {error:.3g}")

# --- errors: exit 2, one line naming the op and what is wrong, nothing written ------------------
gelu_in = os.path.join(scratch, "gelu.in.h5")
bad_shapes = os.path.join(scratch, "bad_shapes.in.h5")
with h5py.File(bad_shapes, "w") as f:
    f["a"], f["b"], f["gy"] = x, rng.standard_normal((4,)), y_grad
only_x = os.path.join(scratch, "only_x.in.h5")
with h5py.File(only_x, "w") as f:
    f["x"], f["a"] = x, x
wrong_gy = os.path.join(scratch, "wrong_gy.in.h5")
with h5py.File(wrong_gy, "w") as f:
    f["x"], f["gy"] = x, sum_grad
errors = [
    ("gelu", gelu_in, ["--attr", "factor=2"], "[gelu] unknown attribute 'factor'"),
    ("sum", gelu_in, ["--attr", "dims=a"], "[sum] attribute 'dims' = 'a'"),
    ("sum", gelu_in, ["--attr", "keepdim=2"], "[sum] attribute 'keepdim' = '2'"),
    ("sum", gelu_in, ["--attr", "keepdim"], "[sum] attribute 'keepdim'"),
    ("scale", gelu_in, [], "[scale] missing required attribute 'factor'"),
    ("add", only_x, [], "[add] input 'b'"),
    ("mse_loss", only_x, [], "[mse_loss] input 'b'"),
    ("add", bad_shapes, [], "[add]"),
    ("gelu", only_x, ["--backward"], "[gelu] --backward needs the gradient of an output"),
    ("gelu", wrong_gy, ["--backward"], "[gelu] gy has shape"),
    ("gelu", os.path.join(scratch, "missing.h5"), [], "[gelu] input file"),
]
for op, path_in, args, needle in errors:
    path_out = os.path.join(scratch, "bad.out.h5")
    if os.path.exists(path_out):
        os.remove(path_out)
    result = run(op, ["--in", path_in, "--out", path_out, "--mesh", "2x2", "--shard-dims", "1,2",
                      "--extents", "3,4;1,5"] + args, 2)
    if result is None:
        failures += 1
        continue
    ok, lines = error_lines(result)
    named = bool(lines) and needle in lines[0]
    left = os.path.exists(path_out) or any(p.startswith("bad.out.h5") for p in os.listdir(scratch))
    report(ok and named and not left, f"{op} {' '.join(args)}: {lines} (expects '{needle}')")
result = run("gelu", ["--in", gelu_in, "--out", gelu_in, "--mesh", "2x2"], 2)
report(result is not None and error_lines(result)[0], "gelu --out naming --in: one error line")

print("run-op generic check:", "FAILED" if failures else "passed")
sys.exit(1 if failures else 0)

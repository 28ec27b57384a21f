# What the `tessera run-op` acceptance checks share: their command line (TESSERA_BINARY
# FIXTURE_DIR SCRATCH_DIR, launcher in TESSERA_LAUNCH), fixture arrays, and running the CLI.
import json
import os
import shlex
import subprocess
import sys

import h5py
import numpy as np


def setup():
    """(tessera, fixture_dir, scratch, launch, manifest) from argv and the environment."""
    tessera, fixture_dir, scratch = sys.argv[1], sys.argv[2], sys.argv[3]
    launch = shlex.split(os.environ.get("TESSERA_LAUNCH", ""))
    os.makedirs(scratch, exist_ok=True)
    manifest = json.load(open(os.path.join(fixture_dir, "manifest.json")))
    return tessera, fixture_dir, scratch, launch, manifest


def load_array(fixture_dir, case, key, shape):
    """One float64 fixture array of a manifest case."""
    return np.fromfile(os.path.join(fixture_dir, case["files"][key]), dtype="<f8").reshape(shape)


def run_cli(command, expect_code):
    """Runs `command`; the result when it exits `expect_code`, otherwise None (after printing)."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != expect_code:
        print(f"FAIL: {' '.join(command)} exited {result.returncode}, expected {expect_code}\n"
              f"{result.stdout}{result.stderr}")
        return None
    return result


def single_error_line(stderr, launched):
    """(ok, lines): ok when the non-empty stderr lines are one "tessera: error: [op] ..." line,
    followed (only under a launcher, `launched`) by the launcher's own text, such as Open MPI's
    "Primary job terminated normally, but 1 process returned a non-zero exit code" block."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("tessera")]
    ok = (len(ours) == 1 and bool(lines) and lines[0] == ours[0]
          and ours[0].startswith("tessera: error: [") and (launched or len(lines) == 1))
    return ok, lines


def error_lines(result):
    """(ok, lines): the non-empty stderr lines, ok when there is exactly one tessera error line
    (then only launcher text, when TESSERA_LAUNCH names a launcher)."""
    return single_error_line(result.stderr, bool(os.environ.get("TESSERA_LAUNCH", "").strip()))


class Checks:
    """Counts failed checks; report() prints each check's result."""

    def __init__(self):
        self.failures = 0

    def report(self, ok, what):
        self.failures += not ok
        print(f"{'ok' if ok else 'FAIL'}: {what}")


def run_op(tessera, launch, op, args, expect_code, single=False):
    """`tessera run-op OP ARGS` under the launcher, or alone on 1 rank with `single`."""
    prefix = [] if single else launch
    extra = ["--ranks", "1", "--mesh", "1"] if single else []
    return run_cli(prefix + [tessera, "run-op", op] + args + extra, expect_code)


def uneven_split(length, parts):
    """Uneven extents of `length` over 2 parts, or over 4 parts with an empty one."""
    if parts == 2:
        first = max(length // 3, 1)
        return [first, length - first]
    return [1, 0, length - 3, 2]


def fixture_layout(x_shape, dims):
    """The 4-rank layout of a fixture case: a 2x2 mesh over the last two spatial dims (uneven), or
    4 ranks over a 1-d signal with an empty shard."""
    if dims >= 2:
        shard = [len(x_shape) - 2, len(x_shape) - 1]
        return ["--mesh", "2x2", "--shard-dims", ",".join(map(str, shard)), "--extents",
                ";".join(",".join(map(str, uneven_split(x_shape[d], 2))) for d in shard)]
    return ["--mesh", "4", "--shard-dims", "2", "--extents",
            ",".join(map(str, uneven_split(x_shape[2], 4)))]


def check_fixture_case(tessera, launch, fixture_dir, scratch, tally, op, case, attr_args):
    """Runs one fixture case (x, gy into an input file) forward and --backward with `attr_args` on
    4 ranks (fixture_layout) and on 1 rank; y, gx (and any other output the fixture holds, as
    max_pool's indices) must equal the fixture's within 1e-10 and each other within 1e-12."""
    name, x_shape = case["name"], case["x_shape"]
    path_in = os.path.join(scratch, f"{name}.in.h5")
    with h5py.File(path_in, "w") as f:
        f["x"] = load_array(fixture_dir, case, "x", x_shape)
        f["gy"] = load_array(fixture_dir, case, "gy", case["y_shape"])
    results = {}
    for label, args, single in [("4 ranks", fixture_layout(x_shape, case["dims"]), False),
                                ("1 rank", [], True)]:
        path_out = os.path.join(scratch, f"{name}.{label.replace(' ', '')}.out.h5")
        if run_op(tessera, launch, op,
                  ["--in", path_in, "--out", path_out, "--backward"] + attr_args + args, 0,
                  single) is None:
            tally.failures += 1
            continue
        with h5py.File(path_out, "r") as f:
            results[label] = {key: f[key][...] for key in f.keys()}
    if len(results) != 2:
        return
    # Every output the fixture holds (y, and max_pool's indices) and gx.
    keys = [("y", case["y_shape"]), ("gx", x_shape)]
    if "indices" in case["files"]:
        keys.append(("indices", case["y_shape"]))
    compare_results(tally, name, results,
                    [(key, load_array(fixture_dir, case, key, shape)) for key, shape in keys])


def compare_results(tally, name, results, expected):
    """Each (dataset, array) of `expected` equals the "4 ranks" result within 1e-10 and the
    "1 rank" result equals the 4-rank one within 1e-12 (`results`: label -> {dataset: array})."""
    for key, array in expected:
        sharded, single = results["4 ranks"].get(key), results["1 rank"].get(key)
        if sharded is None or single is None:
            tally.report(False, f"{name}: no dataset {key}")
            continue
        error = np.max(np.abs(sharded - array), initial=0.0)
        same = np.max(np.abs(sharded - single), initial=0.0)
        tally.report(sharded.shape == array.shape and error < 1e-10 and same < 1e-12,
                     f"{name} {key}: vs PyTorch {error:.3g}, 4 ranks vs 1 rank {same:.3g}")


def check_errors(tessera, launch, scratch, tally, path_in, layout, errors):
    """Each (op, args, needle) of `errors` run on `path_in` with `layout` exits 2, prints one line
    holding `needle`, and writes no output."""
    for op, args, needle in errors:
        path_out = os.path.join(scratch, "bad.out.h5")
        if os.path.exists(path_out):
            os.remove(path_out)
        result = run_op(tessera, launch, op, ["--in", path_in, "--out", path_out] + layout + args, 2)
        if result is None:
            tally.failures += 1
            continue
        ok, lines = error_lines(result)
        named = bool(lines) and needle in lines[0]
        tally.report(ok and named and not os.path.exists(path_out),
                     f"{op} {' '.join(args)}: {lines} (expects '{needle}')")

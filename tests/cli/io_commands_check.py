#!/usr/bin/python3
# Acceptance check of `tessera inspect`, `tessera scatter`, `tessera convert` and `tessera compare` on
# the h5py-written sample file (tests/fixtures/h5py): inspect --json reports every dataset's shape and
# type; scatter in both modes verifies bit for bit on uneven (and empty) shards; convert writes
# another dtype and storage that h5py reads back as numpy's conversion, and a range of rows;
# compare gives numpy's error figures; bad input exits 2 with one line.
# Launcher for scatter in TESSERA_LAUNCH (e.g. "mpiexec -n 4"), local ranks otherwise.
# Usage: io_commands_check.py TESSERA_BINARY FIXTURE_DIR
import json
import os
import shlex
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_op_check_support import single_error_line  # noqa: E402

tessera, fixtures = sys.argv[1], sys.argv[2]
launch = shlex.split(os.environ.get("TESSERA_LAUNCH", ""))
sample = os.path.join(fixtures, "h5py", "sample.h5")
expected = json.load(open(os.path.join(fixtures, "h5py", "expected.json")))
failures = 0


def check(ok, what):
    global failures
    failures += not ok
    print(f"{'ok' if ok else 'FAIL'}: {what}")


result = subprocess.run([tessera, "inspect", sample, "--json"], capture_output=True, text=True, timeout=60)
listing = {d["path"]: d for d in json.loads(result.stdout)["datasets"]} if result.returncode == 0 else {}
check(result.returncode == 0 and len(listing) >= 6, "inspect --json lists the datasets")
check(listing.get("/f32_3d", {}).get("shape") == [3, 4, 5] and listing["/f32_3d"]["type"] == "f32",
      "inspect reports shape and type")

for mode in ("root", "sharded"):
    for target, args in [("/f64_chunked_gzip", ["--mesh", "2x2", "--shard-dims", "0,1", "--extents", "15,5;0,30"]),
                         ("/f32_3d", ["--mesh", "4", "--shard-dims", "2", "--extents", "2,0,2,1"])]:
        command = launch + [tessera, "scatter", f"{sample}:{target}", "--mode", mode, "--verify"] + args
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        check(result.returncode == 0 and "bit for bit: yes" in result.stdout,
              f"scatter {target} --mode {mode} {' '.join(args)}")
        if result.returncode != 0:
            print(result.stdout + result.stderr)

for args, what in [([f"{sample}:/f32_3d", "--mesh", "2x2", "--shard-dims", "0,1", "--extents", "1,1;2,2"],
                    "extents that don't sum"),
                   ([f"{sample}:/missing", "--mesh", "2x2", "--shard-dims", "0,1"], "missing dataset"),
                   ([f"{sample}:/group", "--mesh", "2x2", "--shard-dims", "0,1"], "a group, not a dataset")]:
    result = subprocess.run(launch + [tessera, "scatter"] + args, capture_output=True, text=True, timeout=300)
    ok, lines = single_error_line(result.stderr, bool(launch))
    check(result.returncode == 2 and ok, f"{what}: exit {result.returncode}, {lines}")

# The committed sample data is what the documented generator makes.
import tempfile

import h5py
import numpy as np

# convert: another dtype and storage, through a mesh, in both modes; h5py reads the result.
with tempfile.TemporaryDirectory() as scratch:
    out = os.path.join(scratch, "converted.h5")
    for mode, extra, dtype, numpy_type in [
            ("root", ["--chunks", "4,8", "--gzip", "5"], "f32", np.float32),
            ("sharded", ["--chunks", "auto", "--checksum"], "f64", np.float64),
            ("sharded", [], "i32", np.int32)]:
        command = launch + [tessera, "convert", f"{sample}:/f64_chunked_gzip", f"{out}:/c_{mode}_{dtype}",
                            "--dtype", dtype, "--mode", mode, "--mesh", "2x2", "--shard-dims", "0,1",
                            "--verify"] + extra
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        ok = result.returncode == 0 and "bit for bit: yes" in result.stdout
        if ok:
            with h5py.File(out) as f, h5py.File(sample) as g:
                written = f[f"c_{mode}_{dtype}"]
                ok = (written.dtype == numpy_type and
                      np.array_equal(written[...], g["f64_chunked_gzip"][...].astype(numpy_type)) and
                      (written.chunks == (4, 8) and written.compression == "gzip"
                       if "--gzip" in extra else True) and
                      (written.fletcher32 if "--checksum" in extra else True))
        check(ok, f"convert --mode {mode} --dtype {dtype} {' '.join(extra)}")
        if not ok:
            print(result.stdout + result.stderr)
    result = subprocess.run(launch + [tessera, "convert", f"{out}:/c_root_f32", out + ":/c_root_f32"],
                            capture_output=True, text=True, timeout=300)
    ok, lines = single_error_line(result.stderr, bool(launch))
    check(result.returncode == 2 and ok and "both the input and the output" in lines[0],
          f"convert onto itself: exit {result.returncode}, {lines}")
    check(not [name for name in os.listdir(scratch) if ".tmp-" in name], "convert leaves no temporary file")

    # A range of rows (Python's slice notation on the first dim), each rank reading its own box.
    with h5py.File(sample) as g:
        source = g["f32_3d"][...]
    for rows, picked in [("1:", source[1:]), (":-1", source[:-1]), ("-2:-1", source[-2:-1])]:
        result = subprocess.run(launch + [tessera, "convert", f"{sample}:/f32_3d[{rows}]", f"{out}:/rows",
                                          "--mesh", "2x2", "--shard-dims", "0,2", "--verify"],
                                capture_output=True, text=True, timeout=300)
        ok = result.returncode == 0 and "bit for bit: yes" in result.stdout
        if ok:
            with h5py.File(out) as f:
                ok = np.array_equal(f["rows"][...], picked)
        check(ok, f"convert /f32_3d[{rows}] writes those rows")
        if not ok:
            print(result.stdout + result.stderr)

    # compare: the differences of two datasets, sharded, against numpy's.
    with h5py.File(out, "a") as f:
        f["shifted"] = (source[1:] + np.float32(0.25) * np.arange(source[1:].size, dtype=np.float32).reshape(
            source[1:].shape) / source.size).astype(np.float32)
        shifted = f["shifted"][...].astype(np.float64)
    reference = source[1:].astype(np.float64)
    difference = shifted - reference
    for args in (["--mesh", "2x2", "--shard-dims", "0,1", "--extents", "2,0;1,3"], ["--mesh", "4", "--shard-dims", "2", "--extents", "2,0,2,1"]):
        result = subprocess.run(launch + [tessera, "compare", f"{sample}:/f32_3d[1:]", f"{out}:/shifted", "--json"] + args,
                                capture_output=True, text=True, timeout=300)
        ok = result.returncode == 0
        if ok:
            figures = json.loads(result.stdout)
            ok = (figures["shape"] == [2, 4, 5] and figures["elements"] == reference.size and
                  abs(figures["max_abs_error"] - np.abs(difference).max()) <= 1e-15 and
                  abs(figures["rms_error"] - np.sqrt(np.mean(difference ** 2))) <= 1e-12 and
                  abs(figures["relative_l2_error"] - np.linalg.norm(difference) / np.linalg.norm(reference)) <= 1e-12)
        check(ok, f"compare --json {' '.join(args)} gives numpy's max abs, rms and relative L2 error")
        if not ok:
            print(result.stdout + result.stderr)
    for first, second, message in [(f"{sample}:/f32_3d[2:1]", f"{out}:/shifted", "selects no rows"),
                                   (f"{sample}:/f32_3d[a:]", f"{out}:/shifted", "is not an integer"),
                                   (f"{sample}:/f32_3d", f"{out}:/shifted", "has shape")]:
        result = subprocess.run(launch + [tessera, "compare", first, second, "--mesh", "2x2", "--shard-dims", "1,2"],
                                capture_output=True, text=True, timeout=300)
        ok, lines = single_error_line(result.stderr, bool(launch))
        check(result.returncode == 2 and ok and message in lines[0], f"compare {first}: exit {result.returncode}, {lines}")

data_dir = os.path.join(os.path.dirname(os.path.dirname(fixtures)), "data")
with tempfile.TemporaryDirectory() as scratch:
    made = os.path.join(scratch, "gray_scott.h5")
    result = subprocess.run([tessera, "generate", "gray-scott", "--out", made], capture_output=True, text=True,
                            timeout=300)
    same = False
    if result.returncode == 0:
        with h5py.File(made) as a, h5py.File(os.path.join(data_dir, "gray_scott.h5")) as b:
            same = a["snapshots"].shape == b["snapshots"].shape and np.allclose(
                a["snapshots"][...], b["snapshots"][...], rtol=1e-5, atol=1e-6)
    check(same, "tessera generate gray-scott reproduces data/gray_scott.h5")

print(f"{failures} failed")
sys.exit(1 if failures else 0)

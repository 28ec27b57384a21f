#!/usr/bin/python3
# Fuzz-style check of the CLI's handling of damaged HDF5 files. Two valid files (one in HDF5's
# newest format, whose metadata carries checksums, one in h5py's default oldest-compatible format)
# hold a contiguous and a chunked+gzip+fletcher32 field plus a small conv problem. Each is
# truncated at many offsets and corrupted (bytes flipped) at many others; every damaged copy goes
# through `tessera inspect`, `tessera scatter --verify` on 2 local ranks and `tessera run-op conv`:
#   - the command never crashes (no signal) and never hangs (each run has a time limit);
#   - it exits 0, or exits 2 with exactly one line on stderr, "tessera: error: [...] ...";
#   - a truncated file always exits 2 from scatter (its data is gone);
#   - scatter's exit 0 comes with "bit for bit: yes" (what was read is what the file holds);
#   - run-op conv leaves no output file behind when it fails (and no temporary file ever).
# Usage: io_fuzz_check.py TESSERA_BINARY
import os
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np

tessera = sys.argv[1]
failures = 0
runs = 0
outcomes = {}
environment = dict(os.environ, TESSERA_BACKEND="local", TESSERA_COMM_TIMEOUT="30")


def check(ok, what):
    global failures
    failures += not ok
    if not ok:
        print(f"FAIL: {what}")


def make_file(path, libver):
    rng = np.random.default_rng(5)
    with h5py.File(path, "w", libver=libver) as f:
        f.create_dataset("u", data=rng.standard_normal((12, 10)).astype(np.float32))
        f.create_dataset("v", data=rng.standard_normal((16, 8)), chunks=(4, 4), compression="gzip",
                         fletcher32=True)
        f.create_dataset("x", data=rng.standard_normal((1, 2, 9)))
        f.create_dataset("w", data=rng.standard_normal((2, 2, 3)))
        f["u"].attrs["units"] = "m/s"


def run(command):
    """Runs one command; returns (returncode, stdout, stderr), returncode None on a hang."""
    global runs
    runs += 1
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)
    except subprocess.TimeoutExpired:
        return None, "", ""
    return result.returncode, result.stdout, result.stderr


def check_outcome(code, stderr, what):
    outcomes[code] = outcomes.get(code, 0) + 1
    check(code is not None, f"{what}: hung")
    if code is None:
        return
    check(code >= 0, f"{what}: killed by signal {-code}")
    check(code in (0, 2), f"{what}: exit {code}")
    if code == 2:
        lines = [line for line in stderr.splitlines() if line.strip()]
        check(len(lines) == 1 and lines[0].startswith("tessera: error: ["),
              f"{what}: expected one error line, found {lines}")


def exercise(path, truncated, what, scratch):
    code, _, stderr = run([tessera, "inspect", path])
    check_outcome(code, stderr, f"{what}: inspect")
    for dataset in ("u", "v"):
        code, stdout, stderr = run([tessera, "scatter", f"{path}:/{dataset}", "--mesh", "2",
                                    "--shard-dims", "0", "--ranks", "2", "--verify"])
        check_outcome(code, stderr, f"{what}: scatter /{dataset}")
        if truncated:
            check(code == 2, f"{what}: scatter /{dataset} of a truncated file exited {code}")
        if code == 0:
            check("bit for bit: yes" in stdout, f"{what}: scatter /{dataset} --verify: {stdout}")
    out = os.path.join(scratch, "out.h5")
    code, _, stderr = run([tessera, "run-op", "conv", "--in", path, "--out", out, "--mesh", "2",
                           "--shard-dims", "2", "--ranks", "2"])
    check_outcome(code, stderr, f"{what}: run-op conv")
    if code == 2:
        check(not os.path.exists(out), f"{what}: run-op conv failed but left {out}")
    leftovers = [name for name in os.listdir(scratch) if ".tmp" in name]
    check(not leftovers, f"{what}: temporary files left: {leftovers}")
    if os.path.exists(out):
        os.remove(out)


with tempfile.TemporaryDirectory() as scratch:
    cases = 0
    for libver in ("latest", "earliest"):
        original = os.path.join(scratch, f"valid_{libver}.h5")
        make_file(original, libver)
        size = os.path.getsize(original)
        exercise(original, False, f"{libver} intact", scratch)
        check(failures == 0, f"the intact {libver} file must pass")
        damaged = os.path.join(scratch, "damaged.h5")
        truncations = sorted({0, 1, 4, 8, 16, 40, 64, 100, 200, 400, 800, size - 1} |
                             {size * i // 20 for i in range(1, 20)})
        for offset in truncations:
            if not 0 <= offset < size:
                continue
            shutil.copyfile(original, damaged)
            os.truncate(damaged, offset)
            exercise(damaged, True, f"{libver} truncated to {offset} of {size} bytes", scratch)
            cases += 1
        data = open(original, "rb").read()
        for offset in sorted({0, 8, 12, 24, 44, 48, 96, 160, 256} | {size * i // 30 for i in range(1, 30)}):
            if offset + 4 > size:
                continue
            flipped = bytearray(data)
            for k in range(4):
                flipped[offset + k] ^= 0xA5
            open(damaged, "wb").write(flipped)
            exercise(damaged, False, f"{libver} corrupted at {offset}..{offset + 3} of {size}", scratch)
            cases += 1
    print(f"{cases} damaged files, {runs} runs, exit codes {outcomes}, {failures} failed")
sys.exit(1 if failures else 0)

#!/usr/bin/python3
# Hardening check of the CLI on bad command lines: huge sizes (shapes, paddings, a damaged file's
# dataspace) end in one clear error before anything is allocated; --out naming the --in file (by
# path or by inode) is refused and leaves the input untouched; outputs that cannot be written say
# why; numeric options are validated (negative, zero, over the local-rank limit, non-finite);
# convert refuses NaN/Inf/out-of-range floats into an integer dtype; CLI11's own errors get the
# one-line "tessera: error:" form. Every case: exit code 2, exactly one stderr line
# "tessera: error: [op] ...", which contains the expected words, and no output file left behind.
# Usage: hardening_check.py TESSERA_BINARY SCRATCH_DIR (local backend)
import hashlib
import os
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_op_check_support import single_error_line  # noqa: E402

tessera, scratch = sys.argv[1], sys.argv[2]
shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
environment = dict(os.environ, TESSERA_BACKEND="local", TESSERA_COMM_TIMEOUT="60")
failures = 0


def check(ok, what):
    global failures
    failures += not ok
    print(f"{'ok' if ok else 'FAIL'}: {what}")


def path(name):
    return os.path.join(scratch, name)


def digest(name):
    with open(name, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run(args, timeout=300):
    try:
        return subprocess.run([tessera] + args, capture_output=True, text=True, timeout=timeout,
                              env=environment)
    except subprocess.TimeoutExpired:
        return None


def expect_error(args, words, what, leaves_no=()):
    """`tessera args` exits 2 with one error line containing every one of `words`, and creates
    none of the files `leaves_no`."""
    start = time.monotonic()
    result = run(args)
    if result is None:
        check(False, f"{what}: timed out")
        return
    if time.monotonic() - start > 5:
        print(f"note: {what} took {time.monotonic() - start:.1f} s")
    ok, lines = single_error_line(result.stderr, False)
    text = lines[0] if lines else ""
    missing = [word for word in words if word not in text]
    left = [name for name in leaves_no if os.path.exists(name)]
    check(result.returncode == 2 and ok and not missing and not left,
          f"{what}: exit {result.returncode}, {lines}"
          + (f" (missing {missing})" if missing else "") + (f" (left {left})" if left else ""))


# ---- inputs -----------------------------------------------------------------------------------
rng = np.random.default_rng(3)
conv_in = path("conv.h5")
with h5py.File(conv_in, "w") as f:
    f["x"] = rng.standard_normal((1, 2, 9, 8))
    f["w"] = rng.standard_normal((3, 2, 3, 3))
na_in = path("na.h5")
with h5py.File(na_in, "w") as f:
    for name in ("q", "k", "v"):
        f[name] = rng.standard_normal((1, 8, 2, 4))
scalar_in = path("scalar.h5")
with h5py.File(scalar_in, "w") as f:
    f["x"] = np.float64(1.0)
    f["w"] = rng.standard_normal((3, 2, 3))
# A damaged file's dataspace: shape (1, 182130867240962, 9) with no data behind it (chunked,
# nothing allocated), as a corrupted header can declare.
huge_in = path("huge.h5")
with h5py.File(huge_in, "w") as f:
    f.create_dataset("x", shape=(1, 182130867240962, 9), dtype="f8", chunks=(1, 1024, 9))
    f["w"] = rng.standard_normal((2, 1, 3))
floats = path("floats.h5")
with h5py.File(floats, "w") as f:
    f["nan"] = np.array([[1.0, np.nan], [2.0, 3.0]])
    f["inf"] = np.array([[1.0, -np.inf], [2.0, 3.0]])
    f["big"] = np.array([[1.0, 3e9], [2.0, 3.0]])
    f["fine"] = np.array([[1.0, -2.0], [2147483647.0, -2147483648.0]])

# ---- memory safety: sizes past every limit end in one error, nothing allocated ---------------
for shape in ("16,288230376151711745,1", "2147483648,2147483648,1", "4294967296,4294967296,4"):
    expect_error(["demo", "--shape", shape], ["[demo]", "limit"],
                 f"demo --shape {shape}")
expect_error(["demo", "--shape", "100000,100000,100000"], ["[demo] out of memory", "limit"],
             "demo --shape too large for memory")
expect_error(["demo", "--shape", "0,0,0"], ["[demo]", "--shape 0,0,0", "at least 5"],
             "demo --shape 0,0,0 says what is expected")
out = path("padding_out.h5")
expect_error(["run-op", "conv", "--in", conv_in, "--out", out, "--padding", "536870908"],
             [], "run-op conv --padding 536870908", [out])
expect_error(["run-op", "conv", "--in", conv_in, "--out", out, "--padding", "536870908",
              "--mesh", "2", "--shard-dims", "2"], [], "run-op conv --padding 536870908 on 2 ranks",
             [out])
expect_error(["run-op", "conv", "--in", conv_in, "--out", out, "--dilation", "4611686018427387904"],
             ["limit"], "run-op conv --dilation 2^62", [out])
expect_error(["scatter", f"{huge_in}:/x", "--mesh", "2", "--shard-dims", "1"],
             ["out of memory"], "scatter of a dataset declaring shape (1, 182130867240962, 9)")
expect_error(["run-op", "conv", "--in", huge_in, "--out", out],
             ["fits in memory", "182130867240962"], "run-op conv reading a huge declared dataset",
             [out])

# ---- no silent loss of the user's files -------------------------------------------------------
before = digest(conv_in)
expect_error(["run-op", "conv", "--in", conv_in, "--out", conv_in], ["is the input file"],
             "run-op conv --out = --in")
os.makedirs(path("sub"), exist_ok=True)
expect_error(["run-op", "conv", "--in", conv_in, "--out", os.path.join(scratch, "sub", "..", "conv.h5")],
             ["is the input file"], "run-op conv --out = --in spelled differently")
os.link(conv_in, path("conv_link.h5"))
expect_error(["run-op", "conv", "--in", conv_in, "--out", path("conv_link.h5")],
             ["is the input file"], "run-op conv --out a hard link of --in (same inode)")
check(digest(conv_in) == before, "the conv input is unchanged")
before = digest(na_in)
expect_error(["run-op", "na", "--in", na_in, "--out", na_in, "--kernel-size", "3"],
             ["is the input file"], "run-op na --out = --in")
check(digest(na_in) == before, "the na input is unchanged")
expect_error(["run-op", "conv", "--in", conv_in, "--out", path("sub")], ["is a directory"],
             "run-op conv --out a directory")
expect_error(["run-op", "conv", "--in", conv_in, "--out", path("missing/y.h5")],
             ["does not exist"], "run-op conv --out in a missing directory")
# A directory this process may not write into (root passes permission bits, so use one that
# refuses even root when there is one).
unwritable = next((d for d in ("/proc/sys", "/sys/kernel") if os.path.isdir(d) and not os.access(d, os.W_OK)), None)
if unwritable:
    expect_error(["run-op", "conv", "--in", conv_in, "--out", os.path.join(unwritable, "y.h5")],
                 ["[run-op]", "is not writable"], "run-op conv --out in an unwritable directory")
    expect_error(["convert", f"{conv_in}:/x", os.path.join(unwritable, "y.h5")],
                 ["[convert]", "is not writable"], "convert into an unwritable directory")
expect_error(["convert", f"{conv_in}:/x", path("sub")], ["[convert]", "is a directory"],
             "convert to a directory")
expect_error(["convert", f"{conv_in}:/x", path("missing/y.h5")], ["[convert]", "does not exist"],
             "convert into a missing directory")

# ---- convert of floats into an integer dtype --------------------------------------------------
for dataset in ("nan", "inf", "big"):
    target = path(f"{dataset}_i32.h5")
    expect_error(["convert", f"{floats}:/{dataset}", target, "--dtype", "i32", "--verify"],
                 ["[convert]", "cannot represent", "i32"], f"convert /{dataset} to i32", [target])
    target = path(f"{dataset}_u8.h5")
    expect_error(["convert", f"{floats}:/{dataset}", target, "--dtype", "u8", "--mesh", "2",
                  "--shard-dims", "0", "--mode", "sharded"],
                 ["[convert]", "cannot represent"], f"convert /{dataset} to u8 on 2 ranks", [target])
target = path("fine_i32.h5")
result = run(["convert", f"{floats}:/fine", target, "--dtype", "i32", "--verify"])
ok = result is not None and result.returncode == 0 and "bit for bit: yes" in result.stdout
if ok:
    with h5py.File(target) as f:
        ok = f["fine"].dtype == np.int32 and f["fine"][...].tolist() == [[1, -2], [2147483647, -2147483648]]
check(ok, "convert of finite in-range floats to i32 still works")

# ---- numeric options ----------------------------------------------------------------------------
conv_args = ["run-op", "conv", "--in", conv_in, "--out", out]
for ranks in ("0", "-3", "1000"):
    expect_error(conv_args + ["--ranks", ranks], ["[cli]", "--ranks"], f"run-op conv --ranks {ranks}")
expect_error(conv_args + ["--mesh", "1000"], ["at most 256 local ranks"], "run-op conv --mesh 1000")
expect_error(conv_args + ["--groups", "0"], ["[cli]", "--groups"], "run-op conv --groups 0")
expect_error(["demo", "--ranks", "1000"], ["[cli]", "--ranks"], "demo --ranks 1000")
expect_error(["demo", "--ranks", "-1"], ["[cli]", "--ranks"], "demo --ranks -1")
na_args = ["run-op", "na", "--in", na_in, "--out", out, "--kernel-size", "3"]
for scale in ("nan", "inf", "-inf"):
    expect_error(na_args + ["--scale", scale], ["[cli]", "--scale", "finite"],
                 f"run-op na --scale {scale}")
expect_error(na_args + ["--ranks", "0"], ["[cli]", "--ranks"], "run-op na --ranks 0")
expect_error(["bench", "comm", "--max-bytes", "-1"], ["[cli]", "--max-bytes"],
             "bench comm --max-bytes -1")
expect_error(["bench", "comm", "--min-bytes", "-5"], ["[cli]", "--min-bytes"],
             "bench comm --min-bytes -5")
expect_error(["bench", "comm", "--min-bytes", "2048", "--max-bytes", "1024"],
             ["[bench]", "--min-bytes 2048 is larger than --max-bytes 1024"],
             "bench comm min > max bytes")
expect_error(["bench", "comm", "--ranks", "1000"], ["[cli]", "--ranks"], "bench comm --ranks 1000")
expect_error(["bench", "comm", "--iterations", "-1"], ["[cli]", "--iterations"],
             "bench comm --iterations -1")
for bench in ("conv", "na"):
    expect_error(["bench", bench, "--iterations", "0"], ["[cli]", "--iterations"],
                 f"bench {bench} --iterations 0")
    expect_error(["bench", bench, "--threads", "-1"], ["[cli]", "--threads"],
                 f"bench {bench} --threads -1")
    expect_error(["bench", bench, "--ranks", "0"], ["--ranks", "1 to 256"], f"bench {bench} --ranks 0")
expect_error(["bench", "conv", "--kernel", "0"], ["[cli]", "--kernel"], "bench conv --kernel 0")
expect_error(["bench", "na", "--heads", "0"], ["[cli]", "--heads"], "bench na --heads 0")
# An instruction set for the cpu kernels that is not one of the names.
environment["TESSERA_CPU_ISA"] = "sse9"
expect_error(["bench", "na", "--size", "8", "--kernel", "3", "--ranks", "1", "--reference-size", "0"],
             ["[ops]", "TESSERA_CPU_ISA=sse9"], "TESSERA_CPU_ISA=sse9 bench na")
del environment["TESSERA_CPU_ISA"]
expect_error(["bench", "io", "--bytes", "-1"], ["[cli]", "--bytes"], "bench io --bytes -1")
expect_error(["bench", "io", "--ranks", "1,1000"], ["--ranks", "1 to 256"], "bench io --ranks 1,1000")
expect_error(["convert", f"{floats}:/fine", path("gz.h5"), "--chunks", "1,2", "--gzip", "10"],
             ["[cli]", "--gzip"], "convert --gzip 10")
expect_error(["generate", "gray-scott", "--out", path("gs.h5"), "--size", "-1"],
             ["[cli]", "--size"], "generate gray-scott --size -1", [path("gs.h5")])

# ---- messages that say what the user gave and what is expected --------------------------------
expect_error(["run-op", "conv", "--in", scalar_in, "--out", out], ["x has shape []", "spatial"],
             "run-op conv on a 0-d x (no internal dim -1)")
result = run(["run-op", "conv", "--in", scalar_in, "--out", out])
check(result is not None and "dim -1" not in result.stderr, "no 'dim -1' in the 0-d input error")
expect_error(["demo", "--bogus"], ["[cli]", "--bogus"], "an unknown option (CLI11's error)")
expect_error(["run-op", "conv", "--out", out], ["[cli]", "--in"], "a missing required option")
expect_error(["run-op", "conv", "--in", conv_in, "--out", out, "--groups", "two"], ["[cli]", "--groups"],
             "a non-number for an integer option")
expect_error([], ["[cli]"], "no subcommand")
result = run(["--help"])
check(result is not None and result.returncode == 0 and "Usage" in result.stdout, "--help exits 0")

check(not [name for name in os.listdir(scratch) if ".tmp-" in name], "no temporary file left")
print(f"{failures} failed")
sys.exit(1 if failures else 0)

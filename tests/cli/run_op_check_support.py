# What the `tessera run-op` acceptance checks share: their command line (TESSERA_BINARY
# FIXTURE_DIR SCRATCH_DIR, launcher in TESSERA_LAUNCH), fixture arrays, and running the CLI.
import json
import os
import shlex
import subprocess
import sys

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

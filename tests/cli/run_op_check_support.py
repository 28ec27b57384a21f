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


def error_lines(result):
    """(ok, lines): the non-empty stderr lines, ok when there is exactly one tessera error line."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return len(lines) == 1 and lines[0].startswith("tessera: error: ["), lines

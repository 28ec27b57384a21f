#!/usr/bin/python3
# Acceptance check of `tessera estimate`: a traced 2-rank simulate run is predicted on a shipped
# cluster (text and --json with step_seconds and the breakdown); --calibrate writes a machine file
# that the same trace replays on; a command estimated on simulated ranks predicts what its real
# run's trace predicts, and --scaling makes strong and weak tables and a plot; bad input (unknown cluster, malformed or missing trace or
# machine file, missing options) exits 2 with one line.
# Usage: estimate_check.py TESSERA_BINARY SCRATCH_DIR [--no-calibrate]
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_op_check_support import single_error_line  # noqa: E402

tessera, scratch = sys.argv[1], sys.argv[2]
calibrate = "--no-calibrate" not in sys.argv[3:]
os.makedirs(scratch, exist_ok=True)
failures = 0


def check(ok, what):
    global failures
    failures += not ok
    print(f"{'ok' if ok else 'FAIL'}: {what}")


def run(*args, timeout=300, env=None):
    return subprocess.run([tessera] + list(args), capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


trace = os.path.join(scratch, "sim.json")
result = run("simulate", "gray-scott", "--size", "16,12,10", "--mesh", "2", "--steps", "4",
             "--every", "4", "--out", os.path.join(scratch, "sim.h5"), "--trace", trace,
             env={"TESSERA_BACKEND": "local"})
check(result.returncode == 0 and os.path.exists(trace), f"a traced simulate run: {result.stderr.strip()}")

result = run("estimate", "--cluster", "h100-ib", "--trace-in", trace, "--json")
check(result.returncode == 0, f"estimate --json runs: {result.stderr.strip()}")
if result.returncode == 0:
    summary = json.loads(result.stdout)
    check(summary["ranks"] == 2 and summary["steps"] == 4, f"2 ranks, 4 steps: {summary['ranks']}, {summary['steps']}")
    check(summary["step_seconds"] > 0 and summary["compute_seconds"] > 0, "step and compute seconds > 0")
    check(summary["comm_seconds"] > 0 and summary["exposed_comm_seconds"] >= 0, "comm seconds")
    check(summary["backend"] == "nccl" and summary["machine"] == "h100-ib", "the cluster's backend")
result = run("estimate", "--cluster", "h200-ib", "--trace-in", trace)
check(result.returncode == 0 and "step time" in result.stdout, "the text summary")

if calibrate:
    machine = os.path.join(scratch, "machine.json")
    result = run("estimate", "--calibrate", "--out", machine, timeout=900)
    check(result.returncode == 0 and os.path.exists(machine), f"--calibrate: {result.stderr.strip()[-300:]}")
    if os.path.exists(machine):
        with open(machine) as f:
            document = json.load(f)
        check(document["links"]["local"]["intra"]["beta"] > 0 and
              document["compute"]["families"]["conv"]["flops"] > 0 and
              document["compute"]["families"]["stencil"]["bytes"] > 0,
              "the machine file has links and per-family throughputs")
        result = run("estimate", "--cluster", machine, "--trace-in", trace, "--json")
        check(result.returncode == 0 and json.loads(result.stdout)["backend"] == "local",
              f"the calibrated machine replays a local trace: {result.stderr.strip()}")

# Estimate mode: the command run on simulated ranks without data predicts what its real traced
# run predicts (the same events; the model reads their flops, bytes and messages, not the
# measured times), writes no file, and reports the peak tensor bytes per rank.
command = ["simulate", "gray-scott", "--size", "16,12,10", "--mesh", "2x2", "--steps", "4",
           "--every", "4"]
real_trace = os.path.join(scratch, "sim4.json")
result = run(*command, "--out", os.path.join(scratch, "sim4.h5"), "--trace", real_trace,
             env={"TESSERA_BACKEND": "local"})
check(result.returncode == 0, f"a traced 4-rank simulate run: {result.stderr.strip()}")
real = run("estimate", "--cluster", "h100-ib", "--trace-in", real_trace, "--json")
never = os.path.join(scratch, "never.h5")
estimated = run("estimate", "--cluster", "h100-ib", "--ranks", "4", "--json", "--", *command,
                "--out", never)
check(estimated.returncode == 0, f"estimate -- simulate runs: {estimated.stderr.strip()[-300:]}")
if real.returncode == 0 and estimated.returncode == 0:
    a, b = json.loads(real.stdout), json.loads(estimated.stdout)
    check(b["ranks"] == 4 and b["steps"] == 4 and b["peak_bytes_per_rank"] > 0 and not os.path.exists(never),
          "4 ranks, 4 steps, peak bytes reported, no file written")
    check(abs(a["step_seconds"] - b["step_seconds"]) <= 1e-9 * a["step_seconds"] and
          abs(a["comm_seconds"] - b["comm_seconds"]) <= 1e-9 * max(a["comm_seconds"], 1e-30),
          f"estimate mode predicts what the real run's trace predicts ({b['step_seconds']} s, "
          f"{a['step_seconds']} s)")

# Estimate mode of a training step and of inference: the 3-d U-Net of the Gray-Scott example
# (conv, group_norm, gelu, max_pool, conv_transpose, concat, mse_loss, Adam, the gradient
# all-reduce) at P = 4 (dp 2 x domain 2; infer on a 2x2 domain mesh) on a tiny generated file:
# the estimate reads the files' metadata and the model only, predicts what the real traced run
# predicts (the same events), and writes nothing.
import h5py  # noqa: E402
import numpy as np  # noqa: E402

unet = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                    "gray_scott_surrogate", "unet3d.onnx")
unet_dir = os.path.join(scratch, "unet")
os.makedirs(unet_dir, exist_ok=True)
pairs = os.path.join(unet_dir, "pairs.h5")
rng = np.random.default_rng(1)
with h5py.File(pairs, "w") as f:
    f["x"] = rng.standard_normal((5, 2, 12, 12, 12)).astype(np.float32)
    f["y"] = rng.standard_normal((5, 2, 12, 12, 12)).astype(np.float32)
for name, command in [
        ("train", ["train", "--model", unet, "--data", pairs, "--input", "/x", "--target", "/y",
                   "--steps", "3", "--batch", "4", "--loss", "mse", "--optimizer", "adam",
                   "--lr", "5e-4", "--crop", "8,8,8", "--shuffle", "1", "--seed", "1", "--dp", "2",
                   "--mesh", "2", "--shard-dims", "2"]),
        ("infer", ["infer", "--model", unet, "--in", pairs, "--mesh", "2x2", "--shard-dims", "2,3"])]:
    out = ["--out", os.path.join(unet_dir, "forecast.h5")] if name == "infer" else []
    real_trace = os.path.join(scratch, f"unet_{name}.json")
    result = run(*command, *out, "--trace", real_trace, env={"TESSERA_BACKEND": "local"})
    check(result.returncode == 0, f"a traced 4-rank {name} run of the U-Net: {result.stderr.strip()[-300:]}")
    real = run("estimate", "--cluster", "h100-ib", "--trace-in", real_trace, "--json")
    before = {entry: os.stat(os.path.join(unet_dir, entry)).st_mtime_ns for entry in os.listdir(unet_dir)}
    out = ["--out", os.path.join(unet_dir, "never.h5")] if name == "infer" else []
    estimated = run("estimate", "--cluster", "h100-ib", "--ranks", "4", "--json", "--", *command, *out)
    check(estimated.returncode == 0, f"estimate -- {name} runs: {estimated.stderr.strip()[-300:]}")
    after = {entry: os.stat(os.path.join(unet_dir, entry)).st_mtime_ns for entry in os.listdir(unet_dir)}
    check(before == after, f"estimate -- {name} writes no file ({sorted(set(after) - set(before))})")
    if real.returncode == 0 and estimated.returncode == 0:
        a, b = json.loads(real.stdout), json.loads(estimated.stdout)
        check(b["ranks"] == 4 and b["steps"] == a["steps"] and b["peak_bytes_per_rank"] > 0,
              f"{name}: 4 ranks, {a['steps']} steps, peak bytes reported")
        check(abs(a["step_seconds"] - b["step_seconds"]) <= 1e-9 * a["step_seconds"] and
              abs(a["comm_seconds"] - b["comm_seconds"]) <= 1e-9 * max(a["comm_seconds"], 1e-30),
              f"{name}: estimate mode predicts what the real run's trace predicts "
              f"({b['step_seconds']} s, {a['step_seconds']} s)")
plot = os.path.join(scratch, "scaling.png")
result = run("estimate", "--cluster", "h200-ib", "--scaling", "1,2,4", "--json", "--plot", plot, "--",
             "simulate", "gray-scott", "--size", "{weak:8,8,6}", "--mesh", "{mesh2}", "--shard-dims", "0,1",
             "--steps", "2", "--every", "2", "--out", never)
check(result.returncode == 0, f"--scaling runs: {result.stderr.strip()[-300:]}")
if result.returncode == 0:
    table = json.loads(result.stdout)
    check([row["ranks"] for row in table["strong"]] == [1, 2, 4] and
          [row["ranks"] for row in table["weak"]] == [1, 2, 4] and
          table["weak"][2]["command"][3] == "16,16,6" and table["strong"][2]["command"][3] == "8,8,6" and
          table["strong"][2]["command"][5] == "2x2" and
          all(row["step_seconds"] > 0 for row in table["strong"] + table["weak"]) and
          os.path.getsize(plot) > 1000,
          "--scaling: strong rows keep {weak:8,8,6}, weak rows grow its first two with the mesh, {mesh2} = 2x2, a plot")

not_json = os.path.join(scratch, "not.json")
with open(not_json, "w") as f:
    f.write("{\"traceEvents\": [")
no_events = os.path.join(scratch, "no_events.json")
with open(no_events, "w") as f:
    json.dump({"events": []}, f)
bad_machine = os.path.join(scratch, "bad_machine.json")
with open(bad_machine, "w") as f:
    json.dump({"ranks_per_node": 8, "links": {}}, f)
for what, args in [
        ("unknown cluster", ["--cluster", "no-such-cluster", "--trace-in", trace]),
        ("a trace that is not JSON", ["--cluster", "h100-ib", "--trace-in", not_json]),
        ("a trace without traceEvents", ["--cluster", "h100-ib", "--trace-in", no_events]),
        ("a missing trace", ["--cluster", "h100-ib", "--trace-in", os.path.join(scratch, "none.json")]),
        ("a malformed machine file", ["--cluster", bad_machine, "--trace-in", trace]),
        ("a machine file that is not JSON", ["--cluster", not_json, "--trace-in", trace]),
        ("no --cluster", ["--trace-in", trace]),
        ("neither --trace-in nor --calibrate", ["--cluster", "h100-ib"]),
        ("--calibrate without --out", ["--calibrate"]),
        ("--scaling without estimate mode", ["--cluster", "h100-ib", "--trace-in", trace, "--scaling", "1,8"]),
        ("a COMMAND without --ranks", ["--cluster", "h100-ib", "--", *command, "--out", never]),
        ("a COMMAND on another rank count", ["--cluster", "h100-ib", "--ranks", "8", "--", *command, "--out", never]),
        ("a COMMAND without --cluster", ["--ranks", "4", "--", *command, "--out", never]),
        ("--plot without --scaling", ["--cluster", "h100-ib", "--ranks", "4", "--plot", plot, "--", *command,
                                      "--out", never])]:
    result = run("estimate", *args)
    ok, lines = single_error_line(result.stderr, False)
    check(result.returncode == 2 and ok and "[estimate]" in lines[0], f"{what}: exit {result.returncode}, {lines}")

print(f"{failures} failure(s)")
sys.exit(1 if failures else 0)

#!/usr/bin/python3
# Acceptance check of `tessera estimate`: a traced 2-rank simulate run is predicted on a shipped
# cluster (text and --json with step_seconds and the breakdown); --calibrate writes a machine file
# that the same trace replays on; a command estimated on simulated ranks predicts what its real
# run's trace predicts, and --scaling makes strong and weak tables and a plot; bad input (unknown cluster, malformed or missing trace or
# machine file, missing options) exits 2 with one line. Commands recorded on 4 simulated ranks
# (run-op of several op families, the demo, pipelined and tensor-parallel training) record exactly the
# events of their real traced 4-rank runs and write no file; commands estimate mode does not run
# are refused in one line.
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
# scripts/trace-summary.py reads the same trace: 2 ranks of 4 steps, each step's interior and
# boundary ops once and its self times within the step.
summary_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                              "trace-summary.py")
result = subprocess.run([sys.executable, summary_script, trace, "--json"], capture_output=True,
                        text=True, timeout=120)
check(result.returncode == 0, f"trace-summary.py runs: {result.stderr.strip()}")
if result.returncode == 0:
    rows = json.loads(result.stdout)
    check([(r["ranks"], r["rank"], r["steps"]) for r in rows] == [(2, 0, 4), (2, 1, 4)],
          f"trace-summary: 2 ranks of 4 steps: {[(r['ranks'], r['rank'], r['steps']) for r in rows]}")
    ops = {(e["cat"], e["name"]): e["calls"] for r in rows for e in r["top"]}
    check(ops.get(("op", "gray_scott interior")) == 1 and ops.get(("op", "gray_scott boundary")) == 1,
          f"trace-summary: one interior and one boundary pass a step: {ops}")
    check(all(0 < r["self_ms_per_step"] <= r["mean_step_ms"] * 1.0001 for r in rows),
          "trace-summary: the self times of a step's events fit in the step")
result = subprocess.run([sys.executable, summary_script, os.path.join(scratch, "missing.json")],
                        capture_output=True, text=True, timeout=60)
check(result.returncode != 0 and "cannot read" in result.stderr,
      f"trace-summary: a missing trace is one error: {result.stderr.strip()}")

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


# Events, per rank and in order, without what differs between runs: times, thread ids and the
# backend the rank's label names (the real run's "local", the recording's "simulated").
def events_by_rank(file):
    ranks = {}
    with open(file) as f:
        for event in json.load(f)["traceEvents"]:
            event = {k: v for k, v in event.items() if k not in ("ts", "dur", "tid")}
            args = event.get("args")
            if isinstance(args, dict) and "backend" in args:
                args = {k: v for k, v in args.items() if k != "backend"}
                args["labels"] = args.get("labels", "").split(" ", 1)[-1]
                event["args"] = args
            ranks.setdefault(event["pid"], []).append(json.dumps(event, sort_keys=True))
    return ranks


def first_difference(real_file, recorded_file):
    """None when both files hold the same events per rank, else where they first differ."""
    real, recorded = events_by_rank(real_file), events_by_rank(recorded_file)
    if sorted(real) != sorted(recorded):
        return f"ranks {sorted(real)} and {sorted(recorded)}"
    for rank in sorted(real):
        for i, (a, b) in enumerate(zip(real[rank], recorded[rank])):
            if a != b:
                return f"rank {rank}, event {i}: {a} != {b}"
        if len(real[rank]) != len(recorded[rank]):
            return f"rank {rank}: {len(real[rank])} events and {len(recorded[rank])}"
    return None


def expect_recorded_as_real(name, command, outputs_dir, out_name):
    """The command traced for real on 4 local ranks and recorded by estimate-record at P = 4 give
    the same events; the recording writes no file (outputs_dir is unchanged, --out not made)."""
    real_trace = os.path.join(scratch, f"{name}_real.json")
    recorded = os.path.join(scratch, f"{name}_recorded.json")
    real_out = os.path.join(outputs_dir, out_name) if out_name else None
    never_out = os.path.join(outputs_dir, "never_" + out_name) if out_name else None
    result = run(*command, *(["--out", real_out] if out_name else []),
                 env={"TESSERA_BACKEND": "local", "TESSERA_TRACE": real_trace})
    check(result.returncode == 0, f"{name}: a traced 4-rank run: {result.stderr.strip()[-300:]}")
    before = {entry: os.stat(os.path.join(outputs_dir, entry)).st_mtime_ns
              for entry in os.listdir(outputs_dir)}
    result = run("estimate-record", "--ranks", "4", "--out", recorded, "--", *command,
                 *(["--out", never_out] if out_name else []))
    check(result.returncode == 0, f"{name}: estimate-record runs: {result.stderr.strip()[-300:]}")
    after = {entry: os.stat(os.path.join(outputs_dir, entry)).st_mtime_ns
             for entry in os.listdir(outputs_dir)}
    check(before == after, f"{name}: estimate mode writes no file ({sorted(set(after) - set(before))})")
    if os.path.exists(real_trace) and os.path.exists(recorded):
        difference = first_difference(real_trace, recorded)
        check(difference is None, f"{name}: the recorded events are the real run's ({difference or 'equal'})")


# run-op of several op families: the inputs are read with io::scatter, which in estimate mode
# reads the file's metadata only and posts the slabs as payloads; softmax over a sharded dim and
# attention over a sharded sequence run their communicating kernels on shape-only pieces.
ops_dir = os.path.join(scratch, "run_op")
os.makedirs(ops_dir, exist_ok=True)


def op_input(name, **arrays):
    file = os.path.join(ops_dir, name + ".h5")
    with h5py.File(file, "w") as f:
        for dataset, values in arrays.items():
            f[dataset] = values
    return file


x = rng.standard_normal((2, 3, 13, 11))
qkv = {name: rng.standard_normal((2, 13, 2, 4)) for name in ("q", "k", "v", "go")}
na_qkv = {name: rng.standard_normal((1, 13, 11, 2, 4)) for name in ("q", "k", "v", "go")}
na_qkv["rpb"] = rng.standard_normal((2, 9, 5))
grid = ["--mesh", "2x2", "--shard-dims", "2,3"]
for label, inputs, args in [
        ("max_pool", op_input("pool", x=x, gy=rng.standard_normal((2, 3, 6, 5))),
         ["--attr", "kernel_size=2,2", *grid, "--backward"]),
        ("interpolate", op_input("interpolate", x=x, gy=rng.standard_normal((2, 3, 26, 22))),
         ["--attr", "scale_factor=2,2", "--attr", "mode=bilinear", *grid, "--backward"]),
        ("softmax", op_input("softmax", x=x, gy=x), ["--attr", "dim=3", *grid, "--backward"]),
        ("layer_norm", op_input("layer_norm", x=x, w=rng.standard_normal((13, 11)),
                                b=rng.standard_normal((13, 11)), gy=x),
         ["--attr", "normalized_ndim=2", *grid, "--backward"]),
        # causal: the rows move to the zigzag assignment and back (all_to_all_v) around the ring
        ("attention causal", op_input("attention", **qkv),
         ["--attr", "causal=1", "--mesh", "4", "--shard-dims", "1", "--backward"]),
        ("attention", op_input("attention", **qkv), ["--mesh", "4", "--shard-dims", "1", "--backward"]),
        # f32: the cpu ring passes its blocks as f64
        ("attention causal f32", op_input("attention", **qkv),
         ["--attr", "causal=1", "--mesh", "4", "--shard-dims", "1", "--backward", "--dtype", "f32"]),
        ("na", op_input("na", **na_qkv),
         ["--kernel-size", "5,3", "--mesh", "2x2", "--shard-dims", "1,2", "--backward"]),
        ("pad", op_input("pad", x=x, gy=rng.standard_normal((2, 3, 17, 13))),
         ["--attr", "pad=1,1,2,2", "--attr", "mode=reflect", *grid, "--backward"]),
        ("conv", op_input("conv", x=x, w=rng.standard_normal((4, 3, 3, 3)), b=rng.standard_normal(4),
                          gy=rng.standard_normal((2, 4, 13, 11))),
         ["--padding", "1", *grid, "--backward"])]:
    op = label.split()[0]
    expect_recorded_as_real(f"run-op {label}", ["run-op", op, "--in", inputs, *args], ops_dir,
                            label.replace(" ", "_") + "_out.h5")

# The demo (layout tour, conv network step, neighborhood attention forward and backward, training,
# each against one rank) on its 2x2 mesh.
expect_recorded_as_real("demo", ["demo", "--shape", "16,14,12"], ops_dir, None)

# Pipelined training (stage transfers over the simulated communicator) and tensor parallelism,
# on the training fixtures of train_mp_check.py: pp 2 x dp 2, pp 2 x domain 2, pp 2 x tp 2.
fixtures = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "onnx")
train_dir = os.path.join(scratch, "train_mp")
os.makedirs(train_dir, exist_ok=True)
for model, manifest_name in [("cnn", "training.json"), ("mlp", "trainmlp.json")]:
    with open(os.path.join(fixtures, manifest_name)) as f:
        manifest = json.load(f)
    with h5py.File(os.path.join(train_dir, f"{model}.h5"), "w") as f:
        for key in ("x", "y"):
            f[key] = np.fromfile(os.path.join(fixtures, manifest[key]["file"]),
                                 dtype="<f8").reshape(manifest[key]["shape"])


def train_command(model, args):
    file = "traincnn.onnx" if model == "cnn" else "trainmlp.onnx"
    return ["train", "--model", os.path.join(fixtures, file), "--data",
            os.path.join(train_dir, f"{model}.h5"), "--input", "x", "--target", "y", "--dtype",
            "f64", "--steps", "2", "--batch", "4", "--optimizer", "sgd", "--lr", "0.05",
            "--momentum", "0.9", *args]


for name, model, args in [
        ("train pp 2 x dp 2 (1f1b)", "cnn", ["--pp", "2", "--dp", "2", "--micro-batches", "2"]),
        ("train pp 2 x domain 2 (gpipe)", "cnn", ["--pp", "2", "--mesh", "2", "--shard-dims", "2",
                                                  "--schedule", "gpipe", "--micro-batches", "2"]),
        ("train pp 2 x tp 2", "mlp", ["--pp", "2", "--tp", "2"])]:
    expect_recorded_as_real(name, train_command(model, args), train_dir, None)

# A run-op at P = 1024 (a softmax over a dim sharded by a 32x32 mesh) records on a file that holds
# only metadata (a dataset created without writing it).
big = os.path.join(ops_dir, "big.h5")
with h5py.File(big, "w") as f:
    f.create_dataset("x", (2, 4, 512, 512), "f4")
result = run("estimate", "--cluster", "h100-ib", "--ranks", "1024", "--json", "--", "run-op", "softmax",
             "--in", big, "--out", os.path.join(ops_dir, "never_big.h5"), "--attr", "dim=3",
             "--mesh", "32x32", "--shard-dims", "2,3", "--dtype", "f32")
check(result.returncode == 0 and json.loads(result.stdout)["ranks"] == 1024 and
      not os.path.exists(os.path.join(ops_dir, "never_big.h5")),
      f"run-op softmax at P = 1024: {result.stderr.strip()[-300:]}")

# Commands estimate mode does not run are refused in one line naming why.
for words in (["info"], ["bench", "comm"], ["scatter", f"{big}:/x", "--mesh", "2x2"], ["plot", "losses"]):
    for estimator in (["estimate", "--cluster", "h100-ib", "--ranks", "4"],
                      ["estimate-record", "--ranks", "4", "--out", os.path.join(scratch, "refused.json")]):
        result = run(*estimator, "--", *words)
        ok, lines = single_error_line(result.stderr, False)
        check(result.returncode == 2 and ok and "cannot be estimated" in lines[0] and
              f"'{words[0]}'" in lines[0], f"{estimator[0]} -- {words[0]}: exit {result.returncode}, {lines}")

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

#!/usr/bin/python3
# Acceptance check of `tessera train --model` on the training fixture (tests/fixtures/onnx/
# training.json, made by tests/fixtures/make_onnx_fixtures.py): a conv net exported from PyTorch
# trained for 10 steps in f64 with SGD (momentum), Adam, AdamW (mse) and Adam (l1) equals
# PyTorch's own training within 1e-8 (each step's loss and, through --save-model, the final
# weights by initializer name) on 1 rank, dp=2 DDP, domain 2 with uneven extents, dp=2 x domain 2
# FSDP and dp=4 hybrid sharding; the saved model loads back (its loss on the first batch is the
# trained net's); --resume continues bit for bit; --shuffle 1 gives the same losses on every
# layout; --json ends with the summary; bad input is one error line, exit 2, nothing written.
# Multi-rank runs use local ranks, or the launcher in TESSERA_LAUNCH with "{n}" standing for the
# rank count (e.g. "mpiexec -n {n}"); under a launcher each layout runs one of the optimizers.
# Usage: train_check.py TESSERA_BINARY FIXTURE_DIR SCRATCH_DIR
import json
import os
import shlex
import shutil
import subprocess
import sys

import h5py
import numpy as np
import onnx
from onnx import numpy_helper

from run_op_check_support import Checks, run_cli, single_error_line

tessera, fixture_dir, scratch = sys.argv[1], sys.argv[2], sys.argv[3]
launch_template = os.environ.get("TESSERA_LAUNCH", "").strip()
os.makedirs(scratch, exist_ok=True)
fixture = json.load(open(os.path.join(fixture_dir, "training.json")))
model = os.path.join(fixture_dir, fixture["model"])
tally = Checks()
report = tally.report


def load(entry):
    return np.fromfile(os.path.join(fixture_dir, entry["file"]), dtype="<f8").reshape(entry["shape"])


data = os.path.join(scratch, "data.h5")
with h5py.File(data, "w") as f:
    f["x"] = load(fixture["x"])
    f["y"] = load(fixture["y"])


def launcher(ranks):
    if ranks == 1 or not launch_template:
        return []
    return shlex.split(launch_template.replace("{n}", str(ranks)))


def train(args, ranks, expect_code=0):
    """`tessera train` on `ranks` ranks (local ranks, or under the launcher)."""
    return run_cli(launcher(ranks) + [tessera, "train", "--model", model, "--data", data,
                                      "--input", "x", "--target", "y", "--dtype", "f64"] + args,
                   expect_code)


def run_args(run, steps=None):
    args = ["--steps", str(steps or fixture["steps"]), "--batch", str(fixture["batch"]),
            "--optimizer", run["optimizer"], "--loss", run["loss"], "--lr",
            repr(run["options"]["lr"])]
    if "momentum" in run["options"]:
        args += ["--momentum", repr(run["options"]["momentum"])]
    if "weight_decay" in run["options"]:
        args += ["--weight-decay", repr(run["options"]["weight_decay"])]
    return args


def losses_of(file):
    return [(entry["step"], entry["loss"]) for entry in json.load(open(file))]


def initializers(file):
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(file).graph.initializer}


# (label, ranks, options): the data is [6, 2, 10, 9]; domain meshes shard dim 2 (10) unevenly.
layouts = [
    ("1 rank", 1, ["--ranks", "1"]),
    ("dp=2 DDP", 2, ["--dp", "2"]),
    ("domain 2 uneven", 2, ["--mesh", "2", "--shard-dims", "2", "--extents", "3,7"]),
    ("dp=2 x domain 2 FSDP", 4, ["--dp", "2", "--mesh", "2", "--shard-dims", "2", "--extents",
                                 "4,6", "--parallel", "fsdp"]),
    ("dp=4 hybrid (dp-shard 2)", 4, ["--dp", "4", "--parallel", "hybrid", "--dp-shard", "2"]),
]
runs = fixture["runs"]
original_names = sorted(initializers(model))
uninterrupted = {}
for index, (label, ranks, layout) in enumerate(layouts):
    chosen = runs if (ranks == 1 or not launch_template) else [runs[index % len(runs)]]
    for run in chosen:
        name = f"{run['name']} on {label}"
        stem = os.path.join(scratch, f"{run['name']}.{index}")
        result = train(run_args(run) + layout + ["--losses-out", stem + ".losses.json",
                                                 "--save-model", stem + ".onnx"], ranks)
        if result is None:
            tally.failures += 1
            continue
        losses = losses_of(stem + ".losses.json")
        expected = [(entry["step"], entry["loss"]) for entry in run["losses"]]
        loss_error = max(abs(a[1] - b[1]) for a, b in zip(losses, expected))
        report([s for s, _ in losses] == [s for s, _ in expected] and loss_error < 1e-8,
               f"{name}: 10 losses equal PyTorch's within 1e-8 (max error {loss_error:.2e})")
        saved = initializers(stem + ".onnx")
        onnx.checker.check_model(onnx.load(stem + ".onnx"))
        weight_error = max(
            float(np.abs(saved[key].ravel() - np.array(value["values"])).max())
            for key, value in run["weights"].items()) if sorted(saved) == original_names else 1.0
        report(sorted(saved) == original_names and weight_error < 1e-8,
               f"{name}: --save-model holds the initializers {original_names} equal to PyTorch's "
               f"final weights within 1e-8 (max error {weight_error:.2e})")
        if ranks == 1:
            uninterrupted[run["name"]] = losses

# The saved model loads back through our own import: its loss on step 0's batch (the loss before
# the first update) is the trained net's loss there, as PyTorch computed it.
for run in runs:
    saved = os.path.join(scratch, f"{run['name']}.0.onnx")
    reload_losses = os.path.join(scratch, f"{run['name']}.reload.json")
    result = run_cli([tessera, "train", "--model", saved, "--data", data, "--input", "x",
                      "--target", "y", "--dtype", "f64", "--ranks", "1", "--steps", "1",
                      "--batch", str(fixture["batch"]), "--loss", run["loss"], "--lr", "0.1",
                      "--losses-out", reload_losses], 0) if os.path.exists(saved) else None
    if result is None:
        tally.failures += 1
        continue
    reloaded = losses_of(reload_losses)[0][1]
    report(abs(reloaded - run["loss_after"]) < 1e-8,
           f"{run['name']}: the saved model reloaded has PyTorch's trained loss "
           f"({reloaded:.17g} vs {run['loss_after']:.17g})")

# --resume: 6 steps with checkpoints every 4 (and at the end), then --resume to 10 steps: the
# losses of steps 7..10 equal the uninterrupted run's bit for bit (same layout), on 1 rank and on
# the FSDP layout; the FSDP run's resumed losses equal PyTorch's within 1e-8.
for label, ranks, layout, run in [("1 rank", 1, layouts[0][2], runs[1]),
                                  ("dp=2 x domain 2 FSDP", 4, layouts[3][2], runs[2])]:
    directory = os.path.join(scratch, f"checkpoints.{ranks}")
    shutil.rmtree(directory, ignore_errors=True)
    first = os.path.join(scratch, f"resume.first.{ranks}.json")
    second = os.path.join(scratch, f"resume.second.{ranks}.json")
    whole = os.path.join(scratch, f"resume.whole.{ranks}.json")
    ok = (train(run_args(run, steps=6) + layout + ["--checkpoint", directory, "--every", "4",
                                                   "--losses-out", first], ranks) is not None
          and train(run_args(run) + layout + ["--checkpoint", directory, "--resume",
                                              "--losses-out", second], ranks) is not None
          and train(run_args(run) + layout + ["--losses-out", whole], ranks) is not None)
    if not ok:
        tally.failures += 1
        continue
    files = sorted(os.listdir(directory))
    resumed, complete = losses_of(second), losses_of(whole)
    expected = [entry["loss"] for entry in run["losses"]]
    report(files == ["step_00000004.h5", "step_00000006.h5", "step_00000010.h5"]
           and losses_of(first) == complete[:6] and resumed == complete[6:]
           and max(abs(a - b) for (_, a), b in zip(complete, expected)) < 1e-8,
           f"--resume on {label}: checkpoints {files}; steps 7..10 resumed from step 6 equal the "
           f"uninterrupted run bit for bit")

# --shuffle 1: the BatchReader's seeded order, the same losses on every layout (within 1e-12
# relative), and not the file order's.
shuffled = {}
for label, ranks, layout in [layouts[0], layouts[3]]:
    out = os.path.join(scratch, f"shuffle.{ranks}.json")
    if train(run_args(runs[0]) + layout + ["--shuffle", "1", "--seed", "5", "--losses-out", out],
             ranks) is None:
        tally.failures += 1
        continue
    shuffled[label] = [loss for _, loss in losses_of(out)]
if len(shuffled) == 2:
    a, b = shuffled.values()
    report(max(abs(x - y) / abs(x) for x, y in zip(a, b)) < 1e-12 and
           a != [entry["loss"] for entry in runs[0]["losses"]],
           "--shuffle 1 --seed 5: 1 rank and dp=2 x domain 2 FSDP give the same losses, not the "
           "file order's")

# --json: the last stdout line is the summary.
result = train(run_args(runs[0], steps=3) + ["--ranks", "1", "--json"], 1)
if result is None:
    tally.failures += 1
else:
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    keys = {"step_seconds", "samples_per_second", "peak_bytes_per_rank", "final_loss", "steps"}
    report(keys <= set(summary) and summary["steps"] == 3 and summary["step_seconds"] > 0 and
           abs(summary["final_loss"] - runs[0]["losses"][2]["loss"]) < 1e-8,
           f"--json: one summary line with {sorted(keys)}")

# --crop: a crop of the whole grid is the data itself (file order: the same losses bit for bit);
# random crops give the same losses on every layout (within 1e-12 relative), and not those of
# the whole grid.
whole, plain = os.path.join(scratch, "crop.whole.json"), os.path.join(scratch, "crop.none.json")
train(run_args(runs[0]) + ["--ranks", "1", "--losses-out", whole, "--crop", "10,9"], 1)
train(run_args(runs[0]) + ["--ranks", "1", "--losses-out", plain], 1)
report(os.path.exists(whole) and os.path.exists(plain) and losses_of(whole) == losses_of(plain),
       "--crop 10,9 (the whole grid) trains exactly as without --crop")
cropped = {}
for label, ranks, layout in [layouts[0], ("dp=2 x domain 2 FSDP", 4,
                                          ["--dp", "2", "--mesh", "2", "--shard-dims", "3",
                                           "--extents", "1,4", "--parallel", "fsdp"])]:
    out = os.path.join(scratch, f"crop.{ranks}.json")
    if train(run_args(runs[1]) + layout + ["--crop", "6,5", "--shuffle", "1", "--seed", "3",
                                           "--losses-out", out], ranks) is None:
        tally.failures += 1
        continue
    cropped[label] = [loss for _, loss in losses_of(out)]
if len(cropped) == 2:
    a, b = cropped.values()
    report(max(abs(x - y) / abs(x) for x, y in zip(a, b)) < 1e-12 and
           a != [entry["loss"] for entry in runs[1]["losses"]],
           "--crop 6,5 --shuffle 1: 1 rank and dp=2 x domain 2 FSDP (uneven) give the same losses")

# --dtype bf16: the network and its data in bf16 (the cpu convs through f32), f32 master weights;
# 10 steps of SGD with momentum stay within 1% of PyTorch's f64 losses, on 1 rank and on dp=2.
for label, ranks, layout in [layouts[0], layouts[1]]:
    out = os.path.join(scratch, f"bf16.{ranks}.json")
    args = [a for a in run_args(runs[0]) if a != "f64"]
    result = run_cli(launcher(ranks) + [tessera, "train", "--model", model, "--data", data, "--input", "x",
                                        "--target", "y", "--dtype", "bf16", "--losses-out", out] + args + layout, 0)
    ok = result is not None and os.path.exists(out)
    if ok:
        got = [loss for _, loss in losses_of(out)]
        want = [entry["loss"] for entry in runs[0]["losses"]]
        error = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        ok = len(got) == len(want) and error < 1e-2
    report(ok, f"--dtype bf16 on {label}: 10 losses within 1% of PyTorch's f64 ones"
           + (f" (max relative error {error:.2g})" if ok else ""))

# --plot DIR: loss.png (800x500), redrawn as the run goes.
if "PLplot" in subprocess.run([tessera, "info"], capture_output=True, text=True).stdout:
    plots = os.path.join(scratch, "plots")
    shutil.rmtree(plots, ignore_errors=True)
    result = train(run_args(runs[0], steps=3) + ["--ranks", "1", "--plot", plots], 1)
    png = os.path.join(plots, "loss.png")
    header = open(png, "rb").read(24) if os.path.exists(png) else b""
    report(result is not None and header[:8] == b"\x89PNG\r\n\x1a\n" and
           int.from_bytes(header[16:20], "big") == 800 and int.from_bytes(header[20:24], "big") == 500,
           "--plot DIR writes DIR/loss.png (800x500)")
else:
    print("skip: --plot (built without PLplot)")

# Bad input: one error line naming the option, exit 2, nothing written.
bad = os.path.join(scratch, "bad.h5")
with h5py.File(bad, "w") as f:
    f["x"] = load(fixture["x"])
    f["x3"] = np.zeros((6, 3, 10, 9))
    f["y_small"] = np.zeros((6, 2, 8, 9))
    f["y_few"] = np.zeros((4, 2, 10, 9))
losses_out = os.path.join(scratch, "bad.losses.json")
model_out = os.path.join(scratch, "bad.onnx")
bad_directory = os.path.join(scratch, "bad.checkpoints")
base = {"--input": "x", "--target": "x", "--steps": "2", "--batch": "4", "--lr": "0.1",
        "--losses-out": losses_out, "--save-model": model_out, "--checkpoint": bad_directory,
        "--every": "1"}
bad_cases = [
    (["--input", "nope"], 1, "[train] --input 'nope'"),
    (["--input", "x3"], 1, "[train] --input 'x3' has 3 channels"),
    (["--target", "y_small"], 1, "[train] the model's output"),
    (["--target", "y_few"], 1, "[train] --target 'y_few' has 4 samples"),
    (["--loss", "huber"], 1, "[train] --loss huber"),
    (["--optimizer", "lion"], 1, "[train] --optimizer lion"),
    (["--parallel", "fsdp"], 1, "[train] --parallel fsdp"),
    (["--dp", "2", "--batch", "1"], 2, "[train] --batch 1 is smaller than --dp 2"),
    (["--dp", "4", "--parallel", "hybrid", "--dp-shard", "3"], 4, "[train] --parallel hybrid"),
    (["--lr", "abc"], 1, "[cli] Could not convert: --lr = abc"),
    (["--lr", "nan"], 1, "[train] --lr nan"),
    (["--crop", "6,12"], 1, "[train] --crop 6,12: extent 12 of spatial dim 1"),
    (["--crop", "6"], 1, "[train] --crop 6 gives 1 extents for the 2 spatial dims"),
]
for args, ranks, expected_text in bad_cases:
    for path in (losses_out, model_out):
        if os.path.exists(path):
            os.remove(path)
    shutil.rmtree(bad_directory, ignore_errors=True)
    options = dict(base)
    options.update(zip(args[::2], args[1::2]))
    command = launcher(ranks) + [tessera, "train", "--model", model, "--data", bad, "--dtype",
                                 "f64"] + [text for pair in options.items() for text in pair]
    result = run_cli(command, 2)
    if result is None:
        tally.failures += 1
        continue
    launched = bool(launcher(ranks))
    ok, lines = single_error_line(result.stderr, launched)
    written = [path for path in (losses_out, model_out) if os.path.exists(path)]
    if os.path.isdir(bad_directory):
        written += os.listdir(bad_directory)
    report(ok and expected_text in lines[0] and not written,
           f"{' '.join(args)} on {ranks} rank(s): one error line containing '{expected_text}', "
           f"nothing written ({lines[:1]}, written {written})")

print(f"{tally.failures} failure(s)")
raise SystemExit(1 if tally.failures else 0)

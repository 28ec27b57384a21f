#!/usr/bin/python3
# Acceptance check of `tessera train --pp/--tp` (model parallelism of an exported network) on the
# training fixtures made by tests/fixtures/make_onnx_fixtures.py: the conv net traincnn.onnx
# (Conv -> GELU -> Conv), the MLP trainmlp.onnx (four Linear layers on [B, S, C], GELU between),
# traincnnt.onnx (ConvTranspose -> GELU -> Conv -> strided Conv -> GELU -> strided
# ConvTranspose, on traincnn's data) and the attention block attention.opset17.onnx (fused q/k/v
# Linear, 2 heads, output projection, then an MLP; also rewritten here with three separate q, k
# and v MatMuls). Each layout trains 10 steps in f64 (SGD with momentum) and must give the 1-rank
# run's losses within 1e-10 relative, and through --save-model the 1-rank run's trained
# initializers (same names, within 1e-10 relative): PP with 2 stages under gpipe, 1f1b and
# interleaved, with and without --dp 2; --tp 2 on the three nets (locally also tp 4, tp 2 x an
# uneven domain, pp 2 x tp 2 and tp 2 x dp 2 FSDP on traincnnt) and on the attention block (heads
# split: fused and separate q/k/v); --tp 2 --dp 2 (the attention block too: its mpiexec case);
# --pp 2 --tp 2; --parallel fsdp|hybrid with --pp and --tp. The MLP's 1-rank losses equal
# PyTorch's within 1e-8. bf16 with pp/tp tracks one rank's bf16 run; --resume with --pp continues
# bit for bit; --json reports the pp/tp figures; bench train --tp reports the tp bytes; bad input
# (an op failing inside a stage included) is one error line, exit 2.
# Multi-rank runs use local ranks, or the launcher in TESSERA_LAUNCH with "{n}" standing for the
# rank count (e.g. "mpiexec -n {n}").
# Usage: train_mp_check.py TESSERA_BINARY FIXTURE_DIR SCRATCH_DIR
import json
import os
import shlex
import shutil
import sys

import h5py
import numpy as np
import onnx
from onnx import numpy_helper

from run_op_check_support import Checks, run_cli, single_error_line

tessera, fixture_dir, scratch = sys.argv[1], sys.argv[2], sys.argv[3]
launch_template = os.environ.get("TESSERA_LAUNCH", "").strip()
os.makedirs(scratch, exist_ok=True)
tally = Checks()
report = tally.report
TOLERANCE = 1e-10


def load(entry):
    return np.fromfile(os.path.join(fixture_dir, entry["file"]), dtype="<f8").reshape(entry["shape"])


def prepare(manifest_name, data_name):
    manifest = json.load(open(os.path.join(fixture_dir, manifest_name)))
    data = os.path.join(scratch, data_name)
    with h5py.File(data, "w") as f:
        f["x"] = load(manifest["x"])
        f["y"] = load(manifest["y"])
    return os.path.join(fixture_dir, manifest["model"]), data, manifest


cnn_model, cnn_data, _ = prepare("training.json", "cnn.h5")
cnnt_model, cnnt_data, _ = prepare("trainconvt.json", "cnnt.h5")
mlp_model, mlp_data, mlp_manifest = prepare("trainmlp.json", "mlp.h5")


def launcher(ranks):
    if ranks == 1 or not launch_template:
        return []
    return shlex.split(launch_template.replace("{n}", str(ranks)))


def train(model, data, args, ranks, expect_code=0, dtype="f64", steps=10):
    return run_cli(launcher(ranks) + [tessera, "train", "--model", model, "--data", data,
                                      "--input", "x", "--target", "y", "--dtype", dtype,
                                      "--steps", str(steps), "--batch", "4", "--optimizer", "sgd",
                                      "--lr", "0.05", "--momentum", "0.9"] + args, expect_code)


def losses_of(file):
    return [entry["loss"] for entry in json.load(open(file))]


def initializers(file):
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(file).graph.initializer}


def relative(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def weight_error(saved, reference):
    if sorted(saved) != sorted(reference):
        return float("inf")
    return max(float(np.abs(saved[k] - reference[k]).max() / max(np.abs(reference[k]).max(), 1e-300))
               for k in reference)


nets = {"cnn": (cnn_model, cnn_data), "mlp": (mlp_model, mlp_data),
        "cnnt": (cnnt_model, cnnt_data)}

# The attention block: 8 samples [6, 8] drawn here (seeded), a target the block can approach.
attn_model = os.path.join(fixture_dir, "attention.opset17.onnx")
attn_data = os.path.join(scratch, "attn.h5")
generator = np.random.default_rng(7)
attn_x = generator.standard_normal((8, 6, 8))
with h5py.File(attn_data, "w") as f:
    f["x"] = attn_x
    f["y"] = np.tanh(attn_x[..., ::-1]) + 0.1 * generator.standard_normal(attn_x.shape)


def with_separate_qkv(path):
    """The attention block with its fused q/k/v MatMul [8, 24] + bias Add and three Slices
    replaced by three MatMul [8, 8] + Add pairs whose outputs keep the Slices' names (the same
    function; the Slices' bound arithmetic stays, unused)."""
    model = onnx.load(attn_model)
    graph = model.graph
    fused = next(n for n in graph.node if n.name == "/qkv/MatMul")
    bias_add = next(n for n in graph.node if n.name == "/qkv/Add")
    slices = [n for n in graph.node if n.op_type == "Slice" and n.input[0] == bias_add.output[0]]
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    weight, bias = values[fused.input[1]], values["qkv.bias"]
    nodes = []
    for node in graph.node:
        if node.name in ("/qkv/MatMul", "/qkv/Add"):
            continue
        if node.op_type == "Shape" and node.input[0] == bias_add.output[0]:
            node.input[0] = fused.input[0]  # the bounds arithmetic reads a tensor still there
        if node in slices:
            part = slices.index(node)
            name = "qkv_sep_" + "qkv"[part]
            graph.initializer.append(numpy_helper.from_array(
                np.ascontiguousarray(weight[:, 8 * part:8 * part + 8]), name + ".weight"))
            graph.initializer.append(numpy_helper.from_array(
                np.ascontiguousarray(bias[8 * part:8 * part + 8]), name + ".bias"))
            nodes.append(onnx.helper.make_node("MatMul", [fused.input[0], name + ".weight"],
                                               [name + "_mm"], name=f"/{name}/MatMul"))
            nodes.append(onnx.helper.make_node("Add", [name + "_mm", name + ".bias"],
                                               [node.output[0]], name=f"/{name}/Add"))
            continue
        nodes.append(node)
    for name in (fused.input[1], "qkv.bias"):
        graph.initializer.remove(next(t for t in graph.initializer if t.name == name))
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


nets["attn"] = (attn_model, attn_data)
nets["attn_qkv3"] = (with_separate_qkv(os.path.join(scratch, "attn_qkv3.onnx")), attn_data)
# Targets of another spatial shape than the conv net's output ([6, 2, 10, 9]).
small_target = os.path.join(scratch, "small_target.h5")
with h5py.File(small_target, "w") as f:
    f["x"] = load(json.load(open(os.path.join(fixture_dir, "training.json")))["x"])
    f["y"] = np.zeros((6, 2, 8, 9))


def with_wider_weight(node_index, name):
    """The MLP with the weight of its node_index-th MatMul one row too long: that node's
    MatMul fails with a shape mismatch on the stage that holds it, in the first step."""
    model = onnx.load(mlp_model)
    graph = model.graph
    node = [n for n in graph.node if n.op_type == "MatMul"][node_index]
    for tensor in graph.initializer:
        if tensor.name in node.input:
            value = numpy_helper.to_array(tensor)
            wider = np.zeros((value.shape[0] + 1,) + value.shape[1:], value.dtype)
            tensor.CopyFrom(numpy_helper.from_array(wider, tensor.name))
    path = os.path.join(scratch, name)
    onnx.save(model, path)
    return path


bad_nets = dict(nets, small_target=(cnn_model, small_target),
                bad_last=(with_wider_weight(-1, "bad_last.onnx"), mlp_data),
                bad_first=(with_wider_weight(0, "bad_first.onnx"), mlp_data))
reference = {}
for net, (model, data) in nets.items():
    stem = os.path.join(scratch, f"{net}.1rank")
    if train(model, data, ["--ranks", "1", "--losses-out", stem + ".json", "--save-model",
                           stem + ".onnx"], 1) is None:
        tally.failures += 1
        continue
    reference[net] = (losses_of(stem + ".json"), initializers(stem + ".onnx"))

if "attn" in reference and "attn_qkv3" in reference:
    error = relative(reference["attn_qkv3"][0], reference["attn"][0])
    report(error < 1e-12, f"attention with separate q/k/v on 1 rank: the fused block's losses "
                          f"within 1e-12 ({error:.2e})")

if "mlp" in reference:
    expected = [entry["loss"] for entry in mlp_manifest["losses"]]
    error = max(abs(a - b) for a, b in zip(reference["mlp"][0], expected))
    report(error < 1e-8, f"mlp on 1 rank: 10 losses equal PyTorch's within 1e-8 ({error:.2e})")

# (net, label, ranks, options)
interleaved = ["--schedule", "interleaved", "--chunks", "2", "--micro-batches", "2"]
layouts = [
    ("cnn", "pp 2 gpipe", 2, ["--pp", "2", "--schedule", "gpipe", "--micro-batches", "2"]),
    ("cnn", "pp 2 1f1b", 2, ["--pp", "2", "--schedule", "1f1b", "--micro-batches", "4"]),
    ("cnn", "pp 2 interleaved", 2, ["--pp", "2"] + interleaved),
    ("cnn", "pp 2 gpipe x dp 2", 4, ["--pp", "2", "--dp", "2", "--schedule", "gpipe",
                                      "--micro-batches", "2"]),
    ("cnn", "pp 2 1f1b x dp 2", 4, ["--pp", "2", "--dp", "2", "--micro-batches", "2"]),
    ("cnn", "pp 2 interleaved x dp 2", 4, ["--pp", "2", "--dp", "2", "--schedule",
                                            "interleaved", "--micro-batches", "2"]),
    ("cnn", "pp 2 at --stage-cuts /Mul_output_0", 2, ["--pp", "2", "--stage-cuts",
                                                      "/Mul_output_0"]),
    ("cnn", "tp 2 (filter- then channel-parallel)", 2, ["--tp", "2"]),
    ("cnn", "tp 2 x dp 2", 4, ["--tp", "2", "--dp", "2"]),
    ("cnn", "pp 2 x tp 2", 4, ["--pp", "2", "--tp", "2", "--micro-batches", "2"]),
    ("mlp", "tp 2 (column- then row-parallel)", 2, ["--tp", "2"]),
    # ConvTranspose -> GELU -> Conv and Conv -> GELU -> ConvTranspose, each filter- then
    # channel-parallel.
    ("cnnt", "tp 2 (ConvTranspose filter- and channel-parallel)", 2, ["--tp", "2"]),
    ("mlp", "tp 2 x dp 2", 4, ["--tp", "2", "--dp", "2"]),
    ("mlp", "pp 2 x tp 2", 4, ["--pp", "2", "--tp", "2", "--schedule", "gpipe",
                               "--micro-batches", "2"]),
    ("mlp", "pp 2 interleaved x dp 2", 4, ["--pp", "2", "--dp", "2"] + interleaved),
    # Sharded parameters with model parallelism: FSDP per pipeline stage, and the tp shards of
    # each weight sharded again over dp (hybrid: over --dp-shard of them).
    ("cnn", "pp 2 x dp 2 fsdp", 4, ["--pp", "2", "--dp", "2", "--parallel", "fsdp",
                                     "--micro-batches", "2"]),
    ("mlp", "tp 2 x dp 2 fsdp", 4, ["--tp", "2", "--dp", "2", "--parallel", "fsdp"]),
    # Attention's heads over tp (the fused q/k/v weight split in whole heads of q, k and v).
    ("attn", "tp 2 x dp 2", 4, ["--tp", "2", "--dp", "2"]),
]
if not launch_template:  # 8 local ranks: pp x tp x a domain dim sharded unevenly
    layouts.append(("cnn", "pp 2 x tp 2 x domain 2 uneven", 8,
                    ["--pp", "2", "--tp", "2", "--mesh", "2", "--shard-dims", "2", "--extents",
                     "3,7", "--micro-batches", "2"]))
    layouts.append(("cnnt", "tp 4", 4, ["--tp", "4"]))
    layouts.append(("cnnt", "pp 2 x tp 2", 4, ["--pp", "2", "--tp", "2", "--micro-batches", "2"]))
    layouts.append(("cnnt", "tp 2 x dp 2 fsdp", 4, ["--tp", "2", "--dp", "2", "--parallel",
                                                    "fsdp"]))
    layouts.append(("cnnt", "tp 2 x domain 2 uneven", 4,
                    ["--tp", "2", "--mesh", "2", "--shard-dims", "2", "--extents", "3,7"]))
    layouts.append(("cnn", "tp 2 x dp 2 fsdp", 4,
                    ["--tp", "2", "--dp", "2", "--parallel", "fsdp"]))
    layouts.append(("mlp", "pp 2 x dp 2 x tp 2 fsdp", 8,
                    ["--pp", "2", "--dp", "2", "--tp", "2", "--parallel", "fsdp",
                     "--micro-batches", "2"]))
    layouts.append(("cnn", "pp 2 x dp 4 hybrid (dp-shard 2), 1f1b", 8,
                    ["--pp", "2", "--dp", "4", "--parallel", "hybrid", "--dp-shard", "2",
                     "--micro-batches", "1"]))
    layouts.append(("mlp", "tp 2 x dp 4 hybrid (dp-shard 2)", 8,
                    ["--tp", "2", "--dp", "4", "--parallel", "hybrid", "--dp-shard", "2"]))
    layouts.append(("attn", "tp 2 (heads)", 2, ["--tp", "2"]))
    layouts.append(("attn", "tp 2 x dp 2 fsdp", 4, ["--tp", "2", "--dp", "2", "--parallel",
                                                     "fsdp"]))
    layouts.append(("attn", "pp 2 x tp 2", 4, ["--pp", "2", "--tp", "2", "--micro-batches", "2"]))
    layouts.append(("attn_qkv3", "tp 2 (separate q/k/v)", 2, ["--tp", "2"]))
for index, (net, label, ranks, options) in enumerate(layouts):
    if net not in reference:
        continue
    model, data = nets[net]
    stem = os.path.join(scratch, f"{net}.{index}")
    if train(model, data, options + ["--losses-out", stem + ".json", "--save-model",
                                     stem + ".onnx"], ranks) is None:
        tally.failures += 1
        continue
    losses = losses_of(stem + ".json")
    loss_error = relative(losses, reference[net][0]) if len(losses) == 10 else float("inf")
    report(loss_error < TOLERANCE,
           f"{net} on {label}: 10 losses equal 1 rank's within 1e-10 relative ({loss_error:.2e})")
    onnx.checker.check_model(onnx.load(stem + ".onnx"))
    error = weight_error(initializers(stem + ".onnx"), reference[net][1])
    report(error < TOLERANCE,
           f"{net} on {label}: --save-model writes 1 rank's trained initializers ({error:.2e})")

# --json: the pp/tp figures.
result = train(mlp_model, mlp_data, ["--pp", "2", "--tp", "2", "--micro-batches", "2", "--json"],
               4)
if result is None:
    tally.failures += 1
else:
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    report(summary.get("pp") == 2 and summary.get("tp") == 2 and summary.get("stages") == 2
           and len(summary.get("stage_cuts", [])) == 1 and len(summary.get("tp_patterns", [])) == 2
           and 0 <= summary.get("bubble_fraction", -1) <= 1
           and abs(summary.get("ideal_bubble_fraction", 0) - 1 / 3) < 1e-12
           and summary.get("mesh_dims") == ["pp", "dp", "tp", "domain0"],
           f"--json: pp, tp, stages, stage_cuts, tp_patterns, bubble fractions "
           f"({ {k: summary.get(k) for k in ('stage_cuts', 'bubble_fraction')} })")



# --tp on the net with transposed convolutions: both patterns found, ConvTranspose first in one
# and second in the other, and their weights split.
result = train(cnnt_model, cnnt_data, ["--tp", "2", "--json"], 2, steps=1)
if result is None:
    tally.failures += 1
else:
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    patterns = [(p.get("kind"), p.get("first"), p.get("second"), p.get("width"))
                for p in summary.get("tp_patterns", [])]
    report(patterns == [("conv", "/up/ConvTranspose", "/conv/Conv", 4),
                        ("conv", "/down/Conv", "/back/ConvTranspose", 4)],
           f"cnnt --tp 2 --json: the ConvTranspose patterns ({patterns}, sharded "
           f"{summary.get('tp_sharded_parameters')})")


def summary_of(args, ranks, dtype="f64"):
    result = train(mlp_model, mlp_data, args + ["--json"], ranks, dtype=dtype)
    if result is None:
        tally.failures += 1
        return {}
    return json.loads(result.stdout.strip().splitlines()[-1])


# FSDP over tp shards: rank 0 updates a dp share of its tp shard (the 2-d weights split again on
# their other dim; the 1-d ones tp splits stay whole), fewer values than tp with DDP.
# (Both checks with local ranks only, to keep the mpiexec entry short.)
if not launch_template:
    ddp = summary_of(["--tp", "2", "--dp", "2"], 4)
    fsdp = summary_of(["--tp", "2", "--dp", "2", "--parallel", "fsdp"], 4)
    report(0 < fsdp.get("trained_elements", 0) < ddp.get("trained_elements", 0),
           f"mlp tp 2 x dp 2: fsdp updates fewer values per rank than ddp "
           f"({fsdp.get('trained_elements')} < {ddp.get('trained_elements')})")

# bf16 (f32 master weights) with model parallelism: the pipelined and tensor-parallel runs track
# the 1-rank bf16 run to bf16's precision (not bit for bit: the sums are split differently).
bf16_layouts = [] if launch_template else [
    ("pp 2 x tp 2", ["--pp", "2", "--tp", "2", "--micro-batches", "2"], 4),
    ("tp 2 x dp 2 fsdp", ["--tp", "2", "--dp", "2", "--parallel", "fsdp"], 4)]
bf16_reference = summary_of([], 1, "bf16").get("final_loss") if bf16_layouts else None
for label, args, ranks in bf16_layouts:
    final = summary_of(args, ranks, "bf16").get("final_loss")
    error = abs(final - bf16_reference) / abs(bf16_reference) if final and bf16_reference else 1
    report(error < 2e-3, f"mlp bf16 on {label}: final loss within 2e-3 of 1 rank's ({error:.2e})")

# --checkpoint/--resume with --pp: each pp rank's stages write step_N.ppR.h5 (their parameters
# and optimizer state); 6 steps with checkpoints every 4 (and at the end), then --resume to 10:
# steps 7..10 equal the uninterrupted run's bit for bit.
resume_layouts = [("cnn", "pp 2 x dp 2 fsdp", 4, ["--pp", "2", "--dp", "2", "--parallel", "fsdp",
                                                   "--micro-batches", "2"])]
if not launch_template:
    resume_layouts.append(("mlp", "pp 2 interleaved x dp 2", 4, ["--pp", "2", "--dp", "2"]
                           + interleaved))
for net, label, ranks, options in resume_layouts:
    model, data = nets[net]
    directory = os.path.join(scratch, f"checkpoints.{net}")
    shutil.rmtree(directory, ignore_errors=True)
    first, second, whole = (os.path.join(scratch, f"resume.{net}.{k}.json")
                            for k in ("first", "second", "whole"))
    ok = (train(model, data, options + ["--checkpoint", directory, "--every", "4",
                                        "--losses-out", first], ranks, steps=6) is not None
          and train(model, data, options + ["--checkpoint", directory, "--resume",
                                            "--losses-out", second], ranks) is not None
          and train(model, data, options + ["--losses-out", whole], ranks) is not None)
    if not ok:
        tally.failures += 1
        continue
    files = sorted(os.listdir(directory))
    complete = losses_of(whole)
    report(files == [f"step_{n:08}.pp{r}.h5" for n in (4, 6, 10) for r in (0, 1)]
           and losses_of(first) == complete[:6] and losses_of(second) == complete[6:],
           f"{net} --resume on {label}: checkpoints {files}; steps 7..10 resumed from step 6 "
           f"equal the uninterrupted run bit for bit")

# bench train --pp 2 --tp 2: rank 0 (stage 0: a filter- then a channel-parallel conv) all-reduces
# the channel-parallel conv's output once per step, [4, 8, 6, 6, 6] f32 over the micro-batches (its
# input, the batch, needs no gradient), and reports the time in it against the bound measured
# alone.
if not launch_template:
    result = run_cli([tessera, "bench", "train", "--pp", "2", "--tp", "2", "--mesh", "1x1",
                      "--shape", "4,4,6,6,6", "--hidden", "8", "--layers", "4", "--threads", "1",
                      "--micro-batches", "2", "--schedule", "1f1b", "--steps", "1", "--json"], 0)
    if result is None:
        tally.failures += 1
    else:
        row = json.loads(result.stdout).get("tp_rows", [{}])[0]
        report(row.get("tp_all_reduce_bytes") == 4 * 8 * 6 * 6 * 6 * 4
               and row.get("tp_all_gather_bytes") == 0 and row.get("tp_reduce_scatter_bytes") == 0
               and row.get("tp_ms", 0) > 0 and row.get("tp_bound_ms", 0) > 0
               and row.get("tp_over_bound", 0) > 0,
               f"bench train --pp 2 --tp 2: the tp all-reduce bytes per step are the analytic "
               f"ones, with the time and the bound ({row})")

# --json with --tp on the attention block: the attention pattern (2 heads) and the MLP's, and
# rank 0 holds half of every weight tp splits (the fused q/k/v weight: whole heads of q, k, v).
if not launch_template:
    result = train(attn_model, attn_data, ["--tp", "2", "--json"], 2, steps=1)
    if result is None:
        tally.failures += 1
    else:
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        kinds = [(p["kind"], p["first"], p["second"], p["width"])
                 for p in summary.get("tp_patterns", [])]
        elements = summary.get("tp_sharded_elements", {})
        fused_weight = elements.get("onnx::MatMul_118", {})
        report(kinds == [("attention", "/qkv/MatMul", "/proj/MatMul", 2),
                         ("mlp", "/fc1/MatMul", "/fc2/MatMul", 16)]
               and fused_weight.get("total") == 8 * 24 and len(elements) == 6
               and all(e["local"] * 2 == e["total"] for e in elements.values())
               and summary.get("tp_notes") == [],
               f"attn --tp 2 --json: tp_patterns {kinds}, rank 0 holds half of each of the "
               f"{len(elements)} split weights (q/k/v: {fused_weight})")

# Bad input: one error line naming the option, exit 2, nothing written.
losses_out = os.path.join(scratch, "bad.losses.json")
bad_cases = [
    ("cnn", ["--pp", "5"], 5, "[train] --pp 5: the graph of"),
    ("cnn", ["--pp", "2", "--schedule", "interleaved", "--chunks", "4", "--micro-batches", "2"],
     2, "too few for 8 stages"),
    ("cnn", ["--pp", "2", "--micro-batches", "3"], 2, "[train] --micro-batches 3 does not divide"),
    ("cnn", ["--pp", "2", "--dp", "2", "--micro-batches", "4"], 4,
     "[train] --micro-batches 4 does not divide"),
    ("cnn", ["--pp", "2", "--schedule", "interleaved", "--micro-batches", "1"], 2,
     "[train] --schedule interleaved --pp 2 --micro-batches 1"),
    ("cnn", ["--pp", "2", "--stage-cuts", "/Div_output_0"], 2,
     "[train] --stage-cuts: '/Div_output_0' is not a cut point"),
    ("cnn", ["--tp", "3"], 3, "[train] --tp 3:"),
    # 2 heads over 4 ranks (the MLP's 16 hidden features would divide).
    ("attn", ["--tp", "4"], 4, "[train] --tp 4: the attention of"),
    ("mlp", ["--micro-batches", "2"], 1, "[train] --micro-batches, --schedule"),
    ("small_target", ["--pp", "2", "--micro-batches", "2"], 2,
     "[train] the model's output for a micro-batch"),
    # An op failing inside a stage reaches every stage (no rank waits for the failed one).
    ("bad_last", ["--pp", "2", "--dp", "2", "--micro-batches", "2"], 4,
     "[onnx] node '/fc4/MatMul' (MatMul): [matmul]"),
    ("bad_last", ["--pp", "2", "--schedule", "interleaved", "--micro-batches", "2"], 2,
     "[onnx] node '/fc4/MatMul' (MatMul): [matmul]"),
    ("bad_first", ["--pp", "2", "--schedule", "gpipe", "--micro-batches", "2"], 2,
     "[onnx] node '/fc1/MatMul' (MatMul): [matmul]"),
]
for net, args, ranks, expected_text in bad_cases:
    if os.path.exists(losses_out):
        os.remove(losses_out)
    model, data = bad_nets[net]
    result = train(model, data, args + ["--losses-out", losses_out], ranks, 2)
    if result is None:
        tally.failures += 1
        continue
    ok, lines = single_error_line(result.stderr, bool(launcher(ranks)))
    report(ok and expected_text in lines[0] and not os.path.exists(losses_out),
           f"{net} {' '.join(args)} on {ranks} rank(s): one error line containing "
           f"'{expected_text}' ({lines[:1]})")

print(f"{tally.failures} failure(s)")
raise SystemExit(1 if tally.failures else 0)

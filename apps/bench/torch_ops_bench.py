#!/usr/bin/python3
# PyTorch baseline for `tessera bench ops`: the same ops on the same shapes (x [N, C, X, Y, Z],
# its channels-last permutation for linear, matmul and layer_norm, a [N, S, 4, 2C] sequence for
# attention), f32 on cpu with the given thread count, forward under no_grad and forward+backward
# (the first output's backward from a random gradient, every float input requiring grad). Row
# names match tessera's, so `tessera bench ops --baseline FILE` can show the ratios.
# Usage: torch_ops_bench.py [--shape N,C,X,Y,Z] [--threads T] [--iterations I] [--json]
#        [--cpu-time]
import argparse
import json
import time

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="2,16,48,48,48")
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--iterations", type=int, default=3)
parser.add_argument("--ops", default="")
parser.add_argument("--json", action="store_true")
# This thread's cpu time instead of wall time (with --threads 1: PyTorch then computes on the
# calling thread), like `tessera bench ops --cpu-time`.
parser.add_argument("--cpu-time", action="store_true")
args = parser.parse_args()
if args.cpu_time and args.threads != 1:
    parser.error("--cpu-time needs --threads 1")
torch.set_num_threads(args.threads)
n, c, d, h, w = (int(v) for v in args.shape.split(","))
x_shape = [n, c, d, h, w]
cl_shape = [n, d, h, w, c]
seq_shape = [n, 1024, 4, 2 * c]


def attention(q, k, v):
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, -1), v)


def recipes():
    half = [n, c // 2, d, h, w]
    r = []
    for name in ["relu", "gelu", "silu", "tanh", "exp", "sigmoid", "softplus", "leaky_relu", "erf",
                 "abs", "neg"]:
        fn = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh,
              "exp": torch.exp, "sigmoid": torch.sigmoid, "softplus": F.softplus,
              "leaky_relu": F.leaky_relu, "erf": torch.erf, "abs": torch.abs, "neg": torch.neg}[name]
        r.append((name, [x_shape], fn, False))
    r.append(("sqrt", [x_shape], torch.sqrt, True))
    r.append(("log", [x_shape], torch.log, True))
    r.append(("clamp", [x_shape], lambda x: torch.clamp(x, -0.25, 0.25), False))
    r.append(("add", [x_shape, x_shape], torch.add, False))
    r.append(("mul", [x_shape, x_shape], torch.mul, False))
    r.append(("div", [x_shape, x_shape], torch.div, True))
    r.append(("maximum", [x_shape, x_shape], torch.maximum, False))
    r.append(("pow", [x_shape, x_shape], torch.pow, True))
    r.append(("bias_add", [x_shape, [c]], lambda x, b: x + b[None, :, None, None, None], False))
    r.append(("where", [x_shape, x_shape, x_shape], lambda cond, a, b: torch.where(cond != 0, a, b),
              False))
    r.append(("sum dim 1", [x_shape], lambda x: x.sum(1), False))
    r.append(("mean all", [x_shape], lambda x: x.mean(), False))
    r.append(("softmax dim 1", [x_shape], lambda x: torch.softmax(x, 1), False))
    r.append(("log_softmax dim 1", [x_shape], lambda x: torch.log_softmax(x, 1), False))
    r.append(("softmax last", [x_shape], lambda x: torch.softmax(x, -1), False))
    r.append(("log_softmax last", [x_shape], lambda x: torch.log_softmax(x, -1), False))
    r.append(("max_pool k2", [x_shape], lambda x: F.max_pool3d(x, 2), False))
    r.append(("avg_pool k3 s1 p1", [x_shape], lambda x: F.avg_pool3d(x, 3, 1, 1), False))
    r.append(("group_norm g4", [x_shape, [c], [c]], lambda x, g, b: F.group_norm(x, 4, g, b), False))
    r.append(("batch_norm", [x_shape], lambda x: F.batch_norm(x, None, None, training=True), False))
    r.append(("instance_norm", [x_shape, [c], [c]],
              lambda x, g, b: F.instance_norm(x, weight=g, bias=b), False))
    r.append(("layer_norm last", [cl_shape, [c], [c]], lambda x, g, b: F.layer_norm(x, [c], g, b),
              False))
    r.append(("linear C->C", [cl_shape, [c, c], [c]], F.linear, False))
    r.append(("matmul by CxC", [cl_shape, [c, c]], torch.matmul, False))
    r.append(("conv k3", [x_shape, [c, c, 3, 3, 3], [c]], lambda x, wt, b: F.conv3d(x, wt, b, padding=1),
              False))
    r.append(("conv_transpose k2 s2", [x_shape, [c, c, 2, 2, 2], [c]],
              lambda x, wt, b: F.conv_transpose3d(x, wt, b, stride=2), False))
    r.append(("concat dim 1", [half, half], lambda a, b: torch.cat([a, b], 1), False))
    r.append(("split dim 1", [x_shape], lambda x: torch.split(x, [c // 2, c - c // 2], 1)[0], False))
    r.append(("dropout p0.1", [x_shape], lambda x: F.dropout(x, 0.1), False))
    r.append(("attention", [seq_shape, seq_shape, seq_shape], attention, False))
    return r


def timed(body):
    clock = time.thread_time if args.cpu_time else time.perf_counter
    body()
    start = clock()
    for _ in range(args.iterations):
        body()
    return (clock() - start) / args.iterations


wanted = set(filter(None, args.ops.split(",")))
rows = []
for name, shapes, fn, positive in recipes():
    if wanted and name not in wanted and name.split(" ")[0] not in wanted:
        continue
    inputs = [torch.rand(s) - 0.5 + (1.0 if positive else 0.0) for s in shapes]
    with torch.no_grad():
        forward = timed(lambda: fn(*inputs))
    leaves = [t.clone().requires_grad_() for t in inputs]
    gy = torch.rand_like(fn(*inputs))

    def step():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(gy)

    forward_backward = timed(step)
    rows.append({"op": name, "threads": args.threads, "forward_ms": forward * 1e3,
                 "forward_backward_ms": forward_backward * 1e3})
    if not args.json:
        print(f"{name:20s} {forward * 1e3:10.2f} ms {forward_backward * 1e3:10.2f} ms", flush=True)
if args.json:
    print(json.dumps({"benchmark": "torch_ops", "shape": x_shape, "torch": torch.__version__,
                      "rows": rows}))

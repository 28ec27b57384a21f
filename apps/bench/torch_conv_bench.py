#!/usr/bin/python3
# PyTorch CPU baseline for `tessera bench conv`: times torch.nn.functional.conv2d/3d forward and
# forward+backward (y.backward(gy): grad of input, weight and bias) on the same shapes, f32,
# padding "same", Cout = C, with the given thread count. Uses Debian's python3-torch.
# Usage: torch_conv_bench.py [--threads T] [--iterations I] [--kernel K] [--shape N,C,D,H,W ...] [--json]
import argparse
import json
import time

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--iterations", type=int, default=3)
parser.add_argument("--kernel", type=int, default=3)
parser.add_argument("--shape", action="append", default=None)
parser.add_argument("--json", action="store_true")
args = parser.parse_args()
torch.set_num_threads(args.threads)
shapes = args.shape or ["1,16,512,512", "1,16,128,128,128"]
rows = []
for text in shapes:
    shape = [int(v) for v in text.split(",")]
    spatial = len(shape) - 2
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spatial]
    channels = shape[1]
    x = torch.rand(shape) - 0.5
    w = torch.rand([channels, channels] + [args.kernel] * spatial) - 0.5
    b = torch.rand([channels]) - 0.5

    def timed(body):
        body()
        start = time.perf_counter()
        for _ in range(args.iterations):
            body()
        return (time.perf_counter() - start) / args.iterations

    with torch.no_grad():
        forward = timed(lambda: conv(x, w, b, padding="same"))
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    gy = torch.rand_like(conv(x, w, b, padding="same"))

    def step():
        for t in (xg, wg, bg):
            t.grad = None
        conv(xg, wg, bg, padding="same").backward(gy)

    forward_backward = timed(step)
    flops = 2.0 * shape[0] * channels * channels
    for extent in shape[2:]:
        flops *= extent * args.kernel
    rows.append({"shape": shape, "threads": args.threads, "forward_ms": forward * 1e3,
                 "forward_gflops": flops / forward / 1e9, "forward_backward_ms": forward_backward * 1e3,
                 "forward_backward_gflops": 3 * flops / forward_backward / 1e9})
if args.json:
    print(json.dumps({"benchmark": "torch_conv", "torch": torch.__version__, "rows": rows}, indent=2))
else:
    print(f"# PyTorch {torch.__version__} CPU conv, f32, padding same, {args.threads} thread(s)")
    for row in rows:
        print(f"  {','.join(map(str, row['shape'])):<22} forward {row['forward_ms']:9.2f} ms "
              f"({row['forward_gflops']:6.1f} GFLOP/s)   fwd+bwd {row['forward_backward_ms']:9.2f} ms "
              f"({row['forward_backward_gflops']:6.1f} GFLOP/s)")

#!/usr/bin/python3
# PyTorch baseline for `tessera bench conv`: times torch.nn.functional.conv1d/2d/3d forward and
# forward+backward (y.backward(gy): grad of input, weight and bias) on the same shapes, padding
# "same", Cout = C. On cpu (Debian's python3-torch) with the given thread count, in f32; on cuda
# with cuDNN in benchmark mode (algorithms measured per shape), TF32 off, f32 or --dtype bf16/f16,
# timed with CUDA events. The JSON fields match tessera's (GFLOP/s and the GB/s of the x, w and y
# bytes a pass reads and writes, counted as in apps/bench/bench_conv.cpp).
# Usage: torch_conv_bench.py [--device cpu|cuda] [--dtype f32|bf16|f16] [--threads T]
#        [--iterations I] [--kernel K] [--shape N,C,D,H,W ...] [--json]
import argparse
import json
import time

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu")
parser.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--iterations", type=int, default=3)
parser.add_argument("--kernel", type=int, default=0, help="0: 5 for conv1d, 3 otherwise")
parser.add_argument("--shape", action="append", default=None)
parser.add_argument("--json", action="store_true")
args = parser.parse_args()
cuda = args.device != "cpu"
dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
if cuda:
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
else:
    torch.set_num_threads(args.threads)
default_shapes = (["8,64,1048576", "1,32,2048,2048", "4,64,1024,1024", "1,16,256,256,256",
                   "2,32,128,128,128"] if cuda else ["1,16,512,512", "1,16,128,128,128"])
shapes = args.shape or default_shapes
rows = []


def timed(body):
    body()  # warm-up: cuDNN's algorithm search, allocator
    if not cuda:
        start = time.perf_counter()
        for _ in range(args.iterations):
            body()
        return (time.perf_counter() - start) / args.iterations
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iterations):
        body()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3 / args.iterations


for text in shapes:
    shape = [int(v) for v in text.split(",")]
    spatial = len(shape) - 2
    kernel = args.kernel or (5 if spatial == 1 else 3)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spatial]
    channels = shape[1]
    device = torch.device(args.device)
    x = (torch.rand(shape, device=device) - 0.5).to(dtype)
    w = (torch.rand([channels, channels] + [kernel] * spatial, device=device) - 0.5).to(dtype)
    b = (torch.rand([channels], device=device) - 0.5).to(dtype)

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
        flops *= extent * kernel
    element = torch.finfo(dtype).bits // 8
    x_bytes = x.numel() * element
    w_bytes = w.numel() * element
    forward_bytes = 2 * x_bytes + w_bytes  # x + w + y (y is x's size)
    forward_backward_bytes = 3 * forward_bytes + x_bytes
    rows.append({"shape": shape, "kernel": kernel, "device": args.device, "dtype": args.dtype,
                 "threads": args.threads, "forward_ms": forward * 1e3,
                 "forward_gflops": flops / forward / 1e9,
                 "forward_gbps": forward_bytes / forward / 1e9,
                 "forward_backward_ms": forward_backward * 1e3,
                 "forward_backward_gflops": 3 * flops / forward_backward / 1e9,
                 "forward_backward_gbps": forward_backward_bytes / forward_backward / 1e9})
if args.json:
    print(json.dumps({"benchmark": "torch_conv", "torch": torch.__version__, "rows": rows}, indent=2))
else:
    where = f"cuDNN {torch.backends.cudnn.version()}" if cuda else f"CPU, {args.threads} thread(s)"
    print(f"# PyTorch {torch.__version__} conv on {where}, {args.dtype}, padding same")
    for row in rows:
        print(f"  {','.join(map(str, row['shape'])):<22} forward {row['forward_ms']:9.2f} ms "
              f"({row['forward_gflops']:7.1f} GFLOP/s, {row['forward_gbps']:6.1f} GB/s)   "
              f"fwd+bwd {row['forward_backward_ms']:9.2f} ms "
              f"({row['forward_backward_gflops']:7.1f} GFLOP/s, "
              f"{row['forward_backward_gbps']:6.1f} GB/s)")

#!/usr/bin/env python3
"""The ceilings of the GPU this runs on, measured with PyTorch: device-to-device copy bandwidth
(bytes read + written per second) and the rate of a large bf16 matrix product. The GPU
benchmarks report their distance from these figures (docs/benchmarks.md)."""
import argparse
import json

import torch


def timed(fn, warmup=3, iterations=10):
    """Mean seconds of fn() over `iterations` runs after `warmup`, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iterations):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1000 / iterations


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--copy-bytes", type=int, default=4 << 30)
    parser.add_argument("--matmul-size", type=int, default=8192)
    args = parser.parse_args()
    source = torch.empty(args.copy_bytes // 4, dtype=torch.float32, device="cuda")
    target = torch.empty_like(source)
    copy_seconds = timed(lambda: target.copy_(source))
    n = args.matmul_size
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    matmul_seconds = timed(lambda: a @ b)
    figures = {
        "device": torch.cuda.get_device_name(0),
        "copy_bandwidth_gbs": 2 * args.copy_bytes / copy_seconds / 1e9,
        "bf16_matmul_tflops": 2 * n**3 / matmul_seconds / 1e12,
        "torch": torch.__version__,
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
# PyTorch baseline for `tessera bench na`: neighborhood attention with NATTEN semantics (the window
# formulas of docs/neighborhood-attention.md) on the same shapes, 2-d, heads-last
# [B, X, Y, heads, D], non-causal, dilation 1 by default, timed forward and forward+backward.
#
# Implementations, best available first (--impl picks one):
#   flex  torch.nn.attention.flex_attention with a block mask built from the window formulas
#         (PyTorch >= 2.5 on CUDA; compiled with torch.compile). Not exercised on the 2-core
#         development machine, whose Debian PyTorch is 1.13.
#   blocked  (CPU, any PyTorch; 2-d, dilation 1, size a multiple of --tile): queries in tiles,
#         each tile's logits against the box of keys holding its windows by batched matmul,
#         masked with the window formulas, softmax, matmul with the values; autograd backward.
#   gather  (CPU, any PyTorch): per window offset, the keys and values of every query gathered
#         with index_select and the logits formed with elementwise products: NATTEN's "unfused"
#         scheme written in PyTorch ops, with a hand-written backward that recomputes the gathers
#         (autograd would keep prod(k) gathered copies of k and v alive).
# `--check` first compares the chosen implementation with dense attention under a boolean mask
# built from the same formulas on a small case (forward and gradients).
# Usage: torch_na_bench.py [--threads T] [--iterations I] [--size S] [--heads H] [--dim D]
#                          [--kernel 7,13] [--dilation d] [--impl auto|blocked|gather|flex]
#                          [--tile 8] [--check] [--json]
import argparse
import itertools
import json
import math
import time

import torch


def window_first(index, length, kernel, dilation):
    """First key of each query's non-causal window along one axis (tensor of query indices)."""
    group = index % dilation
    sub_index = torch.div(index, dilation, rounding_mode="floor")
    group_length = torch.div(length - group + dilation - 1, dilation, rounding_mode="floor")
    start = torch.minimum(torch.clamp(sub_index - kernel // 2, min=0), group_length - kernel)
    return start * dilation + group


def window_mask(extents, kernel, dilation):
    """Dense [N, N] boolean mask: query i (row) may attend key j (column)."""
    allowed = None
    grids = torch.meshgrid(*[torch.arange(n) for n in extents], indexing="ij")
    for axis, length in enumerate(extents):
        i = grids[axis].reshape(-1)
        first = window_first(i, length, kernel, dilation)
        j = i
        ok = ((j[None, :] % dilation) == (i[:, None] % dilation)) & (j[None, :] >= first[:, None]) & (
            j[None, :] < first[:, None] + (kernel - 1) * dilation + 1)
        allowed = ok if allowed is None else allowed & ok
    return allowed


def key_indices(extents, kernel, dilation):
    """Per window offset t: the flat key index of every query, [K, N]."""
    firsts = [window_first(torch.arange(n), n, kernel, dilation) for n in extents]
    result = []
    for offset in itertools.product(range(kernel), repeat=len(extents)):
        flat = None
        for axis, n in enumerate(extents):
            idx = firsts[axis] + offset[axis] * dilation
            shape = [1] * len(extents)
            shape[axis] = n
            idx = idx.reshape(shape)
            flat = idx if flat is None else flat * n + idx
        result.append(flat.expand(*extents).reshape(-1))
    return torch.stack(result)


class GatherNA(torch.autograd.Function):
    """q, k, v [B, N, H, D] (spatial axes flattened); indices [K, N]."""

    @staticmethod
    def forward(ctx, q, k, v, indices, scale):
        logits = torch.stack([(q * k.index_select(1, idx)).sum(-1) for idx in indices], -1) * scale
        probs = torch.softmax(logits, -1)  # [B, N, H, K]
        out = torch.zeros_like(q)
        for t, idx in enumerate(indices):
            out += probs[..., t, None] * v.index_select(1, idx)
        ctx.save_for_backward(q, k, v, indices, probs)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, indices, probs = ctx.saved_tensors
        grad_probs = torch.stack([(grad_out * v.index_select(1, idx)).sum(-1) for idx in indices], -1)
        grad_logits = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True)) * ctx.scale
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for t, idx in enumerate(indices):
            dq += grad_logits[..., t, None] * k.index_select(1, idx)
            dk.index_add_(1, idx, grad_logits[..., t, None] * q)
            dv.index_add_(1, idx, probs[..., t, None] * grad_out)
        return dq, dk, dv, None, None


def gather_na(q, k, v, kernel, dilation, scale):
    """q, k, v [B, X.., H, D] -> o of the same shape."""
    extents = list(q.shape[1:-2])
    indices = key_indices(extents, kernel, dilation)
    flat = lambda t: t.reshape(t.shape[0], -1, t.shape[-2], t.shape[-1])
    return GatherNA.apply(flat(q), flat(k), flat(v), indices, scale).reshape(q.shape)


def blocked_na(q, k, v, kernel, scale, tile):
    """2-d, dilation 1: queries in tile x tile blocks; each block attends densely to the box of
    (tile + kernel - 1)^2 keys that holds all its windows (the box shifts inwards at the borders
    like the windows do), with a boolean mask from the window formulas. Batched matmuls, so BLAS
    does the arithmetic; the box computes (tile + k - 1)^2 / k^2 times the necessary logits."""
    batch, nx, ny, heads, dim = q.shape
    width = tile + kernel - 1
    tiles_x, tiles_y = nx // tile, ny // tile

    def box_rows(n, tiles):
        starts = torch.clamp(torch.arange(tiles) * tile - kernel // 2, min=0)
        starts = torch.minimum(starts, torch.tensor(n - width))
        return starts[:, None] + torch.arange(width)[None, :]  # [tiles, width]

    rows_x, rows_y = box_rows(nx, tiles_x), box_rows(ny, tiles_y)
    # Mask [tiles_x, tiles_y, tile*tile, width*width] from the window formulas.
    qx = (torch.arange(tiles_x)[:, None] * tile + torch.arange(tile)[None, :])  # [tx, tile]
    qy = (torch.arange(tiles_y)[:, None] * tile + torch.arange(tile)[None, :])
    fx, fy = window_first(qx, nx, kernel, 1), window_first(qy, ny, kernel, 1)
    ok_x = (rows_x[:, None, :] >= fx[:, :, None]) & (rows_x[:, None, :] < fx[:, :, None] + kernel)
    ok_y = (rows_y[:, None, :] >= fy[:, :, None]) & (rows_y[:, None, :] < fy[:, :, None] + kernel)
    mask = (ok_x[:, None, :, None, :, None] & ok_y[None, :, None, :, None, :]).reshape(
        tiles_x, tiles_y, tile * tile, width * width)

    def boxes(t):  # [B, tx, ty, H, width*width, D]
        g = t[:, rows_x[:, None, :, None], rows_y[None, :, None, :]]  # B tx ty w w H D
        return g.permute(0, 1, 2, 5, 3, 4, 6).reshape(batch, tiles_x, tiles_y, heads, width * width, dim)

    qt = q.reshape(batch, tiles_x, tile, tiles_y, tile, heads, dim).permute(0, 1, 3, 5, 2, 4, 6).reshape(
        batch, tiles_x, tiles_y, heads, tile * tile, dim)
    logits = (qt @ boxes(k).transpose(-1, -2)) * scale
    logits = logits.masked_fill(~mask[None, :, :, None], float("-inf"))
    out = torch.softmax(logits, -1) @ boxes(v)
    return out.reshape(batch, tiles_x, tiles_y, heads, tile, tile, dim).permute(0, 1, 4, 2, 5, 3, 6).reshape(
        q.shape)


def dense_na(q, k, v, kernel, dilation, scale):
    """Masked dense attention, the check's oracle (small cases only)."""
    extents = list(q.shape[1:-2])
    mask = window_mask(extents, kernel, dilation)
    flat = lambda t: t.reshape(t.shape[0], -1, t.shape[-2], t.shape[-1]).transpose(1, 2)  # B H N D
    logits = flat(q) @ flat(k).transpose(-1, -2) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    out = torch.softmax(logits, -1) @ flat(v)
    return out.transpose(1, 2).reshape(q.shape)


def make_flex_na(extents, kernel, dilation, scale, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lengths = list(extents)

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = None
        q_rest, kv_rest = q_idx, kv_idx
        for axis in reversed(range(len(lengths))):
            n = lengths[axis]
            i, j = q_rest % n, kv_rest % n
            q_rest, kv_rest = q_rest // n, kv_rest // n
            group = i % dilation
            sub = i // dilation
            group_length = (n - group + dilation - 1) // dilation
            start = torch.minimum(torch.clamp(sub - kernel // 2, min=0), group_length - kernel)
            first = start * dilation + group
            ok = (j % dilation == group) & (j >= first) & (j <= first + (kernel - 1) * dilation)
            allowed = ok if allowed is None else allowed & ok
        return allowed

    tokens = math.prod(lengths)
    block_mask = create_block_mask(mask_mod, None, None, tokens, tokens, device=device)
    compiled = torch.compile(flex_attention)

    def run(q, k, v):
        flat = lambda t: t.reshape(t.shape[0], -1, t.shape[-2], t.shape[-1]).transpose(1, 2)
        out = compiled(flat(q), flat(k), flat(v), block_mask=block_mask, scale=scale)
        return out.transpose(1, 2).reshape(q.shape)

    return run


def flex_available():
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--kernel", default="7,13")
    parser.add_argument("--dilation", type=int, default=1)
    parser.add_argument("--dtype", default="f32", choices=["f32", "f64", "bf16", "f16"])
    parser.add_argument("--impl", default="auto", choices=["auto", "blocked", "gather", "flex"])
    parser.add_argument("--tile", type=int, default=8, help="query tile of the blocked implementation")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16,
             "f16": torch.float16}[args.dtype]
    if args.impl != "auto":
        impl = args.impl
    elif flex_available():
        impl = "flex"
    else:
        impl = "blocked" if args.dilation == 1 and args.size % args.tile == 0 else "gather"
    device = "cuda" if impl == "flex" else "cpu"
    scale = args.dim ** -0.5
    shape = [args.batch, args.size, args.size, args.heads, args.dim]
    kernels = [int(k) for k in args.kernel.split(",")]

    def implementation(extents, kernel):
        if impl == "flex":
            return make_flex_na(extents, kernel, args.dilation, scale, device)
        if impl == "blocked":
            return lambda q, k, v: blocked_na(q, k, v, kernel, scale, args.tile)
        return lambda q, k, v: gather_na(q, k, v, kernel, args.dilation, scale)

    if args.check:
        torch.manual_seed(0)
        small = [2, 16, 24, 3, 8] if impl == "blocked" else [2, 11, 9, 3, 8]
        for kernel in (3, 4):
            q, k, v = (torch.randn(small, dtype=torch.float64, device=device, requires_grad=True)
                       for _ in range(3))
            grad = torch.randn(small, dtype=torch.float64, device=device)
            outputs = []
            for run in (implementation(small[1:3], kernel),
                        lambda q, k, v: dense_na(q, k, v, kernel, args.dilation, scale)):
                q.grad = k.grad = v.grad = None
                out = run(q, k, v)
                out.backward(grad)
                outputs.append([out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
            error = max((a - b).abs().max().item() for a, b in zip(*outputs))
            print(f"# check ({impl} vs masked dense, k={kernel}, shape {small}): max |diff| {error:.2e}")
            assert error < 1e-9, "check failed"

    def timed(body):
        body()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iterations):
            body()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.iterations

    rows = []
    for kernel in kernels:
        run = implementation(shape[1:3], kernel)
        q, k, v, grad = (torch.rand(shape, dtype=dtype, device=device) - 0.5 for _ in range(4))
        with torch.no_grad():
            forward = timed(lambda: run(q, k, v))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def step():
            for t in (qg, kg, vg):
                t.grad = None
            run(qg, kg, vg).backward(grad)

        forward_backward = timed(step)
        flops = 4.0 * shape[0] * args.heads * args.size * args.size * kernel * kernel * args.dim
        rows.append({"shape": shape, "kernel": kernel, "impl": impl, "device": device,
                     "dtype": args.dtype, "threads": args.threads, "forward_ms": forward * 1e3,
                     "forward_gflops": flops / forward / 1e9,
                     "forward_backward_ms": forward_backward * 1e3,
                     "forward_backward_gflops": 3.5 * flops / forward_backward / 1e9})
    if args.json:
        print(json.dumps({"benchmark": "torch_na", "torch": torch.__version__, "rows": rows}, indent=2))
    else:
        print(f"# PyTorch {torch.__version__} neighborhood attention ({impl}, {device}), {args.dtype}, "
              f"{args.threads} thread(s)")
        for row in rows:
            print(f"  {','.join(map(str, row['shape'])):<18} k={row['kernel']:<3} forward "
                  f"{row['forward_ms']:9.2f} ms ({row['forward_gflops']:6.1f} GFLOP/s)   fwd+bwd "
                  f"{row['forward_backward_ms']:9.2f} ms ({row['forward_backward_gflops']:6.1f} GFLOP/s)")


if __name__ == "__main__":
    main()

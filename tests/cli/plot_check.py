#!/usr/bin/python3
# Acceptance check of `tessera plot` and `tessera simulate --plot`: every plot command writes a
# PNG of the asked size holding more than one colour; `simulate --plot DIR` writes a slice of u
# and v per snapshot and leaves the snapshots bit-identical to a run without it; every bad input
# exits 2 with one error line naming the option, leaving no PNG (nor temporary) behind.
# The PNGs are decoded here with zlib (8-bit RGB/RGBA, the pngcairo device's output).
# Usage: plot_check.py TESSERA_BINARY SCRATCH_DIR
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_op_check_support import single_error_line  # noqa: E402

tessera, scratch = sys.argv[1], sys.argv[2]
shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
failures = 0


def check(ok, what):
    global failures
    failures += not ok
    print(f"{'ok' if ok else 'FAIL'}: {what}")


def run(*args):
    return subprocess.run([tessera] + list(args), capture_output=True, text=True, timeout=300)


def path(name):
    return os.path.join(scratch, name)


def read_png(file):
    """(width, height, number of distinct pixel values) of an 8-bit RGB or RGBA PNG."""
    with open(file, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"unexpected PNG format {header}"
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = previous[i]
            c = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        previous = line
    pixels = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(height, width, channels)
    distinct = len(np.unique(pixels.reshape(-1, channels), axis=0))
    return width, height, distinct


def png_size(file):
    """(width, height) from the IHDR chunk, which a PNG holds first."""
    with open(file, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", head[16:24])


def check_png(file, width, height, what, min_colours=2, decode=True):
    """The PNG's size, and (decoding it: slow in Python, so not for every file) its colours."""
    if not os.path.exists(file):
        check(False, f"{what}: {file} written")
        return
    w, h = png_size(file)
    check((w, h) == (width, height), f"{what}: {w}x{h}, asked {width}x{height}")
    if decode:
        w, h, colours = read_png(file)
        check(colours >= min_colours, f"{what}: {colours} distinct colours (not a single colour)")


def leftovers(directory):
    return [name for name in os.listdir(directory) if ".tmp." in name]


info = run("info")
check(info.returncode == 0 and "PLplot" in info.stdout, "tessera info lists PLplot")
if "not built" in next((line for line in info.stdout.splitlines() if "PLplot" in line), ""):
    # A build without PLplot: every plot is refused with one line and exit 2.
    result = run("plot", "mesh", "--shape", "2", "--out", path("mesh.png"))
    check(result.returncode == 2 and "built without plotting (PLplot)" in result.stderr,
          "without PLplot: plot exits 2 saying so")
    sys.exit(1 if failures else 0)

# simulate --plot: one slice of u and v per snapshot, the snapshots as without it.
base = ["simulate", "gray-scott", "--size", "12,10,8", "--steps", "4", "--every", "2",
        "--seed", "3"]
plain = run(*base, "--out", path("plain.h5"))
plotted = run(*base, "--out", path("plotted.h5"), "--plot", path("frames"))
check(plain.returncode == 0 and plotted.returncode == 0,
      f"simulate with and without --plot ran ({plain.stderr.strip()} {plotted.stderr.strip()})")
with h5py.File(path("plain.h5")) as a, h5py.File(path("plotted.h5")) as b:
    same = np.array_equal(a["snapshots"][...].view(np.uint32), b["snapshots"][...].view(np.uint32))
check(same, "simulate --plot leaves the snapshots bit-identical")
frames = sorted(os.listdir(path("frames"))) if os.path.isdir(path("frames")) else []
expected = [f"snapshot_{t:04d}_{s}.png" for t in range(3) for s in "uv"]
check(frames == expected, f"simulate --plot wrote {frames}")
for name in frames:
    check_png(os.path.join(path("frames"), name), 800, 600, f"simulate --plot {name}", 20,
              decode=name.startswith("snapshot_0002"))
multi = subprocess.run([tessera] + base + ["--out", path("multi.h5"), "--mesh", "2x2",
                                           "--extents", "5,7;4,6", "--plot", path("frames4")],
                       capture_output=True, text=True, timeout=300)
with h5py.File(path("plain.h5")) as a, h5py.File(path("multi.h5")) as b:
    same = np.array_equal(a["snapshots"][...].view(np.uint32), b["snapshots"][...].view(np.uint32))
check(multi.returncode == 0 and same and len(os.listdir(path("frames4"))) == 6,
      "simulate --plot on a 2x2 mesh of 4 ranks: same snapshots, 6 PNGs")

# plot slice on the run: asked size, colours, [T, C, X, Y, Z] with t,c; z axis at 0.5.
result = run("plot", "slice", path("plain.h5") + ":/snapshots", "--index", "2,1", "--axis", "z",
             "--at", "0.5", "--out", path("slice.png"), "--size", "400x300", "--cmap", "magma")
check(result.returncode == 0, f"plot slice ran ({result.stderr.strip()})")
check_png(path("slice.png"), 400, 300, "plot slice", 20)
result = run("plot", "slice", path("plain.h5") + ":/snapshots", "--index=-1,0", "--axis", "x",
             "--at", "1", "--vmin", "0", "--vmax", "1", "--out", path("slice_x.png"),
             "--size", "320x240")
check(result.returncode == 0, f"plot slice --index=-1,0 --axis x --at 1 ran ({result.stderr.strip()})")
check_png(path("slice_x.png"), 320, 240, "plot slice along x", 20)

# plot losses: two files overlaid.
for name, rate in (("run_a", 0.1), ("run_b", 0.05)):
    with open(path(f"{name}.json"), "w") as f:
        json.dump([{"step": s, "loss": float(np.exp(-rate * s))} for s in range(1, 41)], f)
result = run("plot", "losses", path("run_a.json"), path("run_b.json"), "--out", path("loss.png"),
             "--size", "400x250")
check(result.returncode == 0, f"plot losses ran ({result.stderr.strip()})")
check_png(path("loss.png"), 400, 250, "plot losses", 4)

# plot scaling: simulate --json lines (strong scaling at one size) and a list form.
with open(path("strong.json"), "w") as f:
    for ranks, seconds in ((1, 0.04), (2, 0.022), (4, 0.013)):
        f.write(json.dumps({"command": "simulate gray-scott", "size": [64, 64, 64],
                            "ranks": ranks, "step_seconds": seconds}) + "\n")
result = run("plot", "scaling", path("strong.json"), "--out", path("scaling.png"),
             "--size", "500x220")
check(result.returncode == 0, f"plot scaling ran ({result.stderr.strip()})")
check_png(path("scaling.png"), 500, 220, "plot scaling", 3)

# plot mesh: the 4-d mesh of docs/parallelism.md.
result = run("plot", "mesh", "--shape", "2x2x2x2", "--names", "pp,dp,tp,domain", "--out",
             path("mesh.png"))
check(result.returncode == 0, f"plot mesh ran ({result.stderr.strip()})")
check_png(path("mesh.png"), 900, 650, "plot mesh", decode=False)
result = run("plot", "mesh", "--shape", "3x2", "--out", path("mesh_small.png"), "--size", "300x200")
check_png(path("mesh_small.png"), 300, 200, "plot mesh 3x2", 6)

# Bad input: one line naming the option, exit 2, no PNG nor temporary left.
with open(path("broken.json"), "w") as f:
    f.write('[{"step": 1, "loss": 0.5},')
with open(path("no_ranks.json"), "w") as f:
    f.write('[{"step_seconds": 0.5}]')
run_h5 = path("plain.h5") + ":/snapshots"
bad = [
    (["slice", path("none.h5") + ":/snapshots", "--index", "0,0"], "none.h5"),
    (["slice", path("plain.h5") + ":/nothing", "--index", "0,0"], "/nothing"),
    (["slice", path("plain.h5"), "--index", "0,0"], "FILE.h5:/dataset"),
    (["slice", run_h5, "--index", "3,0"], "--index"),
    (["slice", run_h5, "--index", "0,2"], "--index"),
    (["slice", run_h5, "--index", "0"], "--index"),
    (["slice", run_h5, "--index", "0,0", "--at", "1.5"], "--at"),
    (["slice", run_h5, "--index", "0,0", "--at", "-0.1"], "--at"),
    (["slice", run_h5, "--index", "0,0", "--at", "nan"], "--at"),
    (["slice", run_h5, "--index", "0,0", "--axis", "w"], "--axis"),
    (["slice", run_h5, "--index", "0,0", "--size", "800"], "--size"),
    (["slice", run_h5, "--index", "0,0", "--size", "20x20"], "--size"),
    (["slice", run_h5, "--index", "0,0", "--cmap", "jet"], "--cmap"),
    (["slice", run_h5, "--index", "0,0", "--vmin", "1", "--vmax", "0"], "--vmin"),
    (["slice", run_h5, "--index", "0,0", "--vmin", "x"], "--vmin"),
    (["losses", path("broken.json")], "malformed JSON"),
    (["losses", path("none.json")], "none.json"),
    (["losses", path("run_a.json"), "--size", "0x0"], "--size"),
    (["scaling", path("broken.json")], "malformed JSON"),
    (["scaling", path("no_ranks.json")], "no measurements"),
    (["scaling", path("strong.json"), "--time", "forward"], "--time"),
    (["mesh", "--shape", "2x2x2x2x2"], "--shape"),
    (["mesh", "--shape", "2x0"], "--shape"),
    (["mesh", "--shape", "2x2", "--names", "a,b,c"], "--names"),
]
for args, needle in bad:
    out = path("bad.png")
    result = run("plot", *args, "--out", out)
    one_line, lines = single_error_line(result.stderr, False)
    check(result.returncode == 2 and one_line and needle in lines[0]
          and not os.path.exists(out) and not leftovers(scratch),
          f"plot {' '.join(os.path.basename(a) for a in args)}: exit {result.returncode}, "
          f"{result.stderr.strip()!r}")
result = run("plot", "mesh", "--shape", "2", "--out", path("no/such/dir/mesh.png"))
check(result.returncode == 2 and "--out" in result.stderr, f"unwritable --out: {result.stderr.strip()!r}")
open(path("a_file"), "w").close()
result = run(*base, "--out", path("x.h5"), "--plot", path("a_file"))
check(result.returncode == 2 and "--plot" in result.stderr and not os.path.exists(path("x.h5")),
      f"simulate --plot onto a file: {result.stderr.strip()!r}")

sys.exit(1 if failures else 0)

#!/usr/bin/env bash
# Reproduces the validation table of docs/scaling.md: calibrates this machine (tessera estimate
# --calibrate), then runs simulate gray-scott, bench train (conv3d) and bench na traced at 1, 2, 4
# local ranks and under mpiexec -n 2 and 4, and bench comm at 1, 4 and 16 MiB, and compares each
# measured step time (collective / redistribute time) with the estimate of its trace on the
# calibrated machine. Prints the table (Markdown) and writes OUT/validation.json. The load average
# is printed beside each row: on a shared machine the figures move with it.
#
# Usage: scripts/validate-estimate.sh            (TESSERA=build/apps/tessera, OUT=/tmp/tessera-validate)
#        MACHINE=machine.json scripts/validate-estimate.sh   (skip the calibration)
#        QUICK=1 ...                              (fewer configurations: local 1 and 2 ranks)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export TESSERA=${TESSERA:-$root/build/apps/tessera}
export OUT=${OUT:-/tmp/tessera-validate}
export MACHINE=${MACHINE:-}
export QUICK=${QUICK:-}
mkdir -p "$OUT"
exec python3 - <<'PYTHON'
import json, os, re, shutil, subprocess, sys

tessera, out, quick = os.environ["TESSERA"], os.environ["OUT"], bool(os.environ["QUICK"])
machine = os.environ["MACHINE"] or os.path.join(out, "machine.json")
have_mpi = shutil.which("mpiexec") is not None


def load():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run(command, env=None):
    result = subprocess.run(command, capture_output=True, text=True,
                            env=dict(os.environ, **(env or {})), timeout=1800)
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}): {' '.join(command)}\n{result.stderr}")
    return result.stdout


def estimate(trace, launch=None):
    command = [tessera, "estimate", "--cluster", machine, "--trace-in", trace, "--json"]
    if launch is not None:
        command += ["--launch", str(launch)]
    return json.loads(run(command))


if not os.environ["MACHINE"]:
    print(f"calibrating (load {load():.2f}) ...", file=sys.stderr)
    run([tessera, "estimate", "--calibrate", "--out", machine])

configs = [("local", 1), ("local", 2), ("local", 4), ("mpiexec", 2), ("mpiexec", 4)]
if quick:
    configs = configs[:2]
if not have_mpi:
    configs = [c for c in configs if c[0] == "local"]


def launcher(kind, ranks):
    if kind == "mpiexec":
        return ["mpiexec", "-n", str(ranks)], {"TESSERA_BACKEND": "mpi"}
    return [], {"TESSERA_BACKEND": "local"}


rows = []


def add(workload, kind, ranks, measured, estimated, load_before):
    ratio = estimated / measured if measured > 0 else float("nan")
    rows.append({"workload": workload, "launcher": kind, "ranks": ranks,
                 "measured_ms": measured * 1e3, "estimated_ms": estimated * 1e3,
                 "ratio": ratio, "within_20pct": abs(ratio - 1) <= 0.2, "load": load_before})
    print(f"{workload:40s} {kind:8s} {ranks:2d}  measured {measured * 1e3:9.3f} ms  "
          f"estimated {estimated * 1e3:9.3f} ms  x{ratio:5.2f}  load {load_before:.2f}",
          file=sys.stderr, flush=True)


for kind, ranks in configs:
    prefix, env = launcher(kind, ranks)
    tag = f"{kind}{ranks}"

    # simulate gray-scott 96^3 f32, 20 steps (step_seconds: median over steps, slowest rank).
    trace = os.path.join(out, f"sim_{tag}.json")
    before = load()
    summary = json.loads(run(prefix + [tessera, "simulate", "gray-scott", "--size", "96,96,96",
                                       "--mesh", str(ranks), "--steps", "20", "--every", "20",
                                       "--out", os.path.join(out, f"sim_{tag}.h5"), "--json",
                                       "--trace", trace], env))
    add("simulate gray-scott 96^3", kind, ranks, summary["step_seconds"],
        estimate(trace)["step_seconds"], before)

    # bench train: 3 conv3d layers (hidden 16) on 2x8x24^3, domain-decomposed over x.
    trace = os.path.join(out, f"train_{tag}.json")
    before = load()
    document = json.loads(run(prefix + [tessera, "bench", "train", "--shape", "2,8,24,24,24",
                                        "--hidden", "16", "--layers", "3", "--mesh", f"1x{ranks}",
                                        "--steps", "3", "--json", "--trace", trace], env))
    for launch, row in enumerate(document["rows"]):
        add(f"bench train conv3d ({row['reduction']})", kind, ranks, row["step_seconds"],
            estimate(trace, launch)["step_seconds"], before)

    # bench na: 2-d neighborhood attention 48x48, 2 heads, D 32, window 7, forward+backward.
    trace = os.path.join(out, f"na_{tag}.json")
    before = load()
    document = json.loads(run(prefix + [tessera, "bench", "na", "--size", "48", "--heads", "2",
                                        "--dim", "32", "--kernel", "7", "--ranks", str(ranks),
                                        "--iterations", "3", "--reference-size", "0", "--json",
                                        "--trace", trace], env))
    add("bench na 48^2 k7 fwd+bwd", kind, ranks, document["rows"][-1]["step_seconds"],
        estimate(trace)["step_seconds"], before)

    # bench comm: each collective and redistribute at 1, 4, 16 MiB (ranks >= 2).
    if ranks < 2:
        continue
    for size in (1 << 20, 4 << 20, 16 << 20):
        trace = os.path.join(out, f"comm_{tag}_{size}.json")
        before = load()
        document = json.loads(run(prefix + [tessera, "bench", "comm", "--ranks", str(ranks),
                                            "--min-bytes", str(size), "--max-bytes", str(size),
                                            "--iterations", "10", "--json"],
                                  dict(env, TESSERA_TRACE=trace)))
        calls = estimate(trace)["calls"]
        modeled = {}
        for name, times in calls.items():
            if name.startswith("redistribute "):
                # "redistribute global [..] on mesh [..]: S(0)[..] -> global ..: R" -> "S(0)->R"
                parts = [re.sub(r"\[[^\]]*\]", "", p.split(":")[-1]).strip()
                         for p in name[len("redistribute "):].split(" -> ")]
                modeled["redistribute " + "->".join(parts)] = times["mean_seconds"]
            else:
                modeled[name] = times["mean_seconds"]
        for row in document["rows"]:
            if row["op"] in modeled:
                add(f"comm {row['op']} {size >> 20} MiB", kind, ranks, row["time_us"] * 1e-6,
                    modeled[row["op"]], before)

with open(os.path.join(out, "validation.json"), "w") as f:
    json.dump({"machine": machine, "rows": rows}, f, indent=2)
print("| workload | launcher | ranks | measured (ms) | estimated (ms) | est/meas | within 20% | load |")
print("|---|---|---:|---:|---:|---:|:-:|---:|")
for r in rows:
    print(f"| {r['workload']} | {r['launcher']} | {r['ranks']} | {r['measured_ms']:.3f} | "
          f"{r['estimated_ms']:.3f} | {r['ratio']:.2f} | {'yes' if r['within_20pct'] else 'no'} | "
          f"{r['load']:.1f} |")
within = sum(r["within_20pct"] for r in rows)
print(f"\n{within} of {len(rows)} rows within 20%")
PYTHON

#!/usr/bin/env python3
"""tessera bench ops beside PyTorch over several rounds, alternated, with the ratios' spread.

One round of `tessera bench ops --baseline` compares one run of each side; on a shared or small
machine a ~1 ms op moves by 20% or more from run to run, on both sides, so one round cannot say
whether an op is slower than PyTorch. This script runs apps/bench/torch_ops_bench.py and
`tessera bench ops` alternately for --rounds rounds (PyTorch first in odd rounds, Tessera first
in even ones, so that a drift of the machine does not favour one side) and prints, per op, the
median of each side's times and the median, least and largest of the per-round ratios
(tessera / PyTorch), forward and forward+backward. An op is "slower" only when its ratio is
above 1 in every round.

Usage: scripts/compare-ops.py [--rounds 5] [--threads 1] [--cpu-time] [--iterations 20]
                              [--ops "mul,concat dim 1"] [--shape 2,16,48,48,48] [--json]
       (TESSERA: the binary, default build/apps/tessera; PYTHON: the interpreter with torch,
        default /usr/bin/python3)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json(command):
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        sys.exit(f"compare-ops: {' '.join(command)} failed ({result.returncode}):\n{result.stderr}")
    return json.loads(result.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--ops", default="")
    parser.add_argument("--shape", default="2,16,48,48,48")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1 or args.iterations < 1:
        parser.error("--rounds and --iterations must be at least 1")
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time needs --threads 1")

    tessera = os.environ.get("TESSERA", os.path.join(ROOT, "build", "apps", "tessera"))
    python = os.environ.get("PYTHON", "/usr/bin/python3")
    common = ["--threads", str(args.threads), "--iterations", str(args.iterations),
              "--shape", args.shape] + (["--cpu-time"] if args.cpu_time else []) + \
             (["--ops", args.ops] if args.ops else [])
    torch_command = [python, os.path.join(ROOT, "apps", "bench", "torch_ops_bench.py"),
                     "--json"] + common
    tessera_command = [tessera, "bench", "ops", "--ranks", "1", "--json"] + common

    # times[op][side][kind] = list over rounds
    times = {}
    for round_index in range(args.rounds):
        order = ["torch", "tessera"] if round_index % 2 == 0 else ["tessera", "torch"]
        for side in order:
            document = run_json(torch_command if side == "torch" else tessera_command)
            for row in document["rows"]:
                entry = times.setdefault(row["op"], {"torch": {"f": [], "fb": []},
                                                     "tessera": {"f": [], "fb": []}})
                entry[side]["f"].append(row["forward_ms"])
                entry[side]["fb"].append(row["forward_backward_ms"])
        print(f"# round {round_index + 1} of {args.rounds} done", file=sys.stderr, flush=True)

    rows = []
    for op, entry in times.items():
        if len(entry["torch"]["f"]) != args.rounds or len(entry["tessera"]["f"]) != args.rounds:
            continue  # an op only one side runs
        row = {"op": op}
        for kind, name in (("f", "forward"), ("fb", "forward_backward")):
            ours, theirs = entry["tessera"][kind], entry["torch"][kind]
            ratios = [a / b for a, b in zip(ours, theirs)]
            row[f"{name}_ms"] = statistics.median(ours)
            row[f"torch_{name}_ms"] = statistics.median(theirs)
            row[f"{name}_ratio_median"] = statistics.median(ratios)
            row[f"{name}_ratio_min"] = min(ratios)
            row[f"{name}_ratio_max"] = max(ratios)
            row[f"{name}_slower_every_round"] = min(ratios) > 1.0
        rows.append(row)

    if args.json:
        json.dump({"benchmark": "compare_ops", "rounds": args.rounds, "threads": args.threads,
                   "cpu_time": args.cpu_time, "iterations": args.iterations,
                   "shape": [int(v) for v in args.shape.split(",")], "rows": rows},
                  sys.stdout, indent=2)
        print()
        return
    clock = "thread cpu time" if args.cpu_time else "wall time"
    print(f"# {args.rounds} rounds alternated, {args.threads} thread(s), {clock}, "
          f"{args.iterations} iterations a figure; ms are medians over the rounds; ratio = "
          f"tessera / PyTorch per round: median [least, largest]")
    print(f"# {'op':22s} {'fwd':>7s} {'torch':>7s} {'ratio':>22s}   {'f+b':>7s} {'torch':>7s} "
          f"{'ratio':>22s}")
    for row in rows:
        cells = []
        for name in ("forward", "forward_backward"):
            mark = " *" if row[f"{name}_slower_every_round"] else "  "
            cells.append(f"{row[f'{name}_ms']:7.2f} {row[f'torch_{name}_ms']:7.2f} "
                         f"{row[f'{name}_ratio_median']:6.2f}x [{row[f'{name}_ratio_min']:.2f}, "
                         f"{row[f'{name}_ratio_max']:.2f}]{mark}")
        print(f"  {row['op']:22s} {cells[0]}   {cells[1]}")
    print("# *: above 1.0 in every round")


if __name__ == "__main__":
    main()

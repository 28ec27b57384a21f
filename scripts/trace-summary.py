#!/usr/bin/env python3
"""Where each rank's steps spend their time, from a trace written by --trace / TESSERA_TRACE.

For each launch in the trace (a command that launches ranks several times, such as `bench na
--ranks 1,4`, writes one launch after the other) and each rank: the number of `step` events and
their median duration (a trace without step events counts as one step from its first event to
its last), then per event name inside the steps (category and name) the calls and
the self time (the event's duration less the events nested in it) per step (means over the
steps), largest first. On
cuda the durations are host time: an op's event spans its launches, not its kernels, so a step
whose self times add up to its duration is bound by the host (launches, waits), and one whose
step is much longer than its events waited for the device at its end.

Usage: scripts/trace-summary.py TRACE.json [--top 15] [--rank R] [--json]
"""
import argparse
import json
import statistics
import sys
from collections import defaultdict


def launches_of(document):
    """[{pid: [events]}] split as tessera estimate splits them: a rank named a second time starts
    the next launch."""
    events = document["traceEvents"] if isinstance(document, dict) else document
    launches = [{}]
    for entry in events:
        ph, pid = entry.get("ph"), entry.get("pid", 0)
        if ph == "M" and entry.get("name") == "process_name":
            if pid in launches[-1]:
                launches.append({})
            launches[-1].setdefault(pid, [])
        elif ph == "X":
            launches[-1].setdefault(pid, []).append(entry)
    return [launch for launch in launches if any(launch.values())]


def summarize(events):
    """(step count, median and mean step ms, {(cat, name): [calls, self ms]} per step) of one
    rank."""
    events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    steps = [e for e in events if e.get("cat") == "step"]
    if not steps and events:  # no step events: the whole trace as one step (as estimate does)
        begin = min(e["ts"] for e in events)
        end = max(e["ts"] + e["dur"] for e in events)
        steps = [{"cat": "step", "name": "whole trace", "ts": begin, "dur": end - begin}]
        events = steps + events
    if not steps:
        return 0, 0.0, 0.0, {}
    totals = defaultdict(lambda: [0, 0.0])
    # Self time: walk each step's events in start order with a stack of open events.
    for step in steps:
        begin, end = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in events if e is not step and begin <= e["ts"] < end]
        stack = []
        self_time = {}
        for event in inside:
            while stack and event["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                self_time[id(stack[-1])] -= min(event["dur"],
                                                 stack[-1]["ts"] + stack[-1]["dur"] - event["ts"])
            self_time[id(event)] = event["dur"]
            stack.append(event)
        for event in inside:
            key = (event.get("cat", ""), event.get("name", ""))
            totals[key][0] += 1
            totals[key][1] += self_time[id(event)] / 1e3
    count = len(steps)
    per_step = {key: [calls / count, ms / count] for key, (calls, ms) in totals.items()}
    durations = [s["dur"] / 1e3 for s in steps]
    return count, statistics.median(durations), statistics.fmean(durations), per_step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--rank", type=int, default=None, help="only this rank (pid)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        with open(args.trace) as f:
            document = json.load(f)
    except (OSError, ValueError) as error:
        sys.exit(f"trace-summary: cannot read {args.trace}: {error}")
    report = []
    for index, launch in enumerate(launches_of(document)):
        for pid in sorted(launch):
            if args.rank is not None and pid != args.rank:
                continue
            count, median_ms, mean_ms, per_step = summarize(launch[pid])
            rows = sorted(per_step.items(), key=lambda item: -item[1][1])
            report.append({"launch": index, "ranks": len(launch), "rank": pid, "steps": count,
                           "step_ms": median_ms, "mean_step_ms": mean_ms,
                           "events_per_step": sum(calls for calls, _ in per_step.values()),
                           "self_ms_per_step": sum(ms for _, ms in per_step.values()),
                           "top": [{"cat": cat, "name": name, "calls": calls, "self_ms": ms}
                                   for (cat, name), (calls, ms) in rows[:args.top]]})
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for r in report:
        print(f"launch {r['launch']} ({r['ranks']} ranks), rank {r['rank']}: {r['steps']} steps, "
              f"median {r['step_ms']:.3f} ms, mean {r['mean_step_ms']:.3f}; per step (means): "
              f"{r['events_per_step']:.0f} events, {r['self_ms_per_step']:.3f} ms of self time")
        for row in r["top"]:
            print(f"  {row['cat']:>12s} {row['name'][:60]:60s} {row['calls']:6.1f} calls "
                  f"{row['self_ms']:9.3f} ms")


if __name__ == "__main__":
    main()

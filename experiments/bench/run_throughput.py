"""Training throughput of finished or running runs, read from their ``metrics.jsonl``.

    python experiments/bench/run_throughput.py \\
        --sequential "1 process, 2 XLA threads" RUN_DIR \\
        --concurrent "2 processes at once, each pinned to 1 core, 1 thread" RUN_DIR RUN_DIR \\
        --out experiments/results/perf/seed_processes_cpu.json

A run's rate is its useful client steps (``total_client_steps``) per second between its first
and last logged rows, so compilation and the first chunk are left out and runs of different
length or cohorts compare fairly. A ``--sequential`` group's runs ran one after another: its
throughput is their mean rate. A ``--concurrent`` group's runs shared the machine at the same
time: its throughput is the sum of their rates. The machine facts are read when this script
runs; it must run on the host the runs ran on. How the runs were started (thread flags,
pinning) is not in their folders: say it in the group's name.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def run_rate(folder: Path) -> dict:
    """Client steps per second of one run after its first logged row."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{folder}: no metrics.jsonl; pass a run folder (OUT/<method>/seed<k>)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(rows) < 2:
        raise ValueError(f"{path}: {len(rows)} logged row(s); a rate needs two (let the run log more)")
    first, last = rows[0], rows[-1]
    steps = int(last["total_client_steps"]) - int(first["total_client_steps"])
    seconds = float(last["seconds"]) - float(first["seconds"])
    return {"run": str(folder), "rounds": [int(first["round"]), int(last["round"])],
            "finished": (folder / "summary.json").exists(), "client_steps": steps, "seconds": seconds,
            "client_steps_per_second": steps / seconds}


def group_throughput(runs: list[dict], concurrent: bool) -> float:
    rates = [r["client_steps_per_second"] for r in runs]
    return sum(rates) if concurrent else sum(rates) / len(rates)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequential", nargs="+", action="append", default=[], metavar=("NAME", "RUN_DIR"),
                        help="a group of runs that ran one after another")
    parser.add_argument("--concurrent", nargs="+", action="append", default=[], metavar=("NAME", "RUN_DIR"),
                        help="a group of runs that ran at the same time")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    groups = [(g, False) for g in args.sequential] + [(g, True) for g in args.concurrent]
    if not groups:
        parser.error("give at least one --sequential or --concurrent group")
    for group, _ in groups:
        if len(group) < 2:
            parser.error(f"group {group[0]!r} names no run folder: NAME RUN_DIR [RUN_DIR ...]")
    from fedjax_sparse.tools import timing
    report = {"what": "training throughput (useful client steps per second after each run's first logged row)",
              "command": [sys.executable, *sys.argv], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine_when_read": timing.machine_facts(), "groups": []}
    for (name, *folders), concurrent in groups:
        runs = [run_rate(Path(f)) for f in folders]
        report["groups"].append({"name": name, "concurrent": concurrent, "runs": runs,
                                 "client_steps_per_second": group_throughput(runs, concurrent)})
    base = report["groups"][0]["client_steps_per_second"]
    for g in report["groups"]:
        g["vs_first_group"] = g["client_steps_per_second"] / base
        print(f"{g['name']}: {g['client_steps_per_second']:.1f} client steps/s ({g['vs_first_group']:.2f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

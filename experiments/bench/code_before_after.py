"""The same round benchmark under two revisions of the package, alternating, so that a change that should
not move speed (a refactor) shows it side by side: ``experiments/bench/bench_rounds.py`` of the *after*
revision runs each named configuration with the *before* and the *after* package in turn (each in its
own process, ``PYTHONPATH`` set to a checkout of that revision), ``--repeats`` times, alternating which
goes first.

    python experiments/bench/code_before_after.py --before 334b77e --after HEAD --data-dir ../shared/data \\
        --configs fedavg_fmnist spafl_fmnist --out experiments/results/perf/weight_removal_before_after_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def checkout(rev: str, into: Path) -> tuple[Path, str]:
    """A detached worktree of ``rev`` under ``into``; (its path, the full commit)."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True,
                            text=True).stdout.strip()
    path = into / commit[:12]
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), commit], check=True)
    return path, commit


def bench(tree: Path, config: str, data_dir: str, rounds: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, str(ROOT / "experiments/bench/bench_rounds.py"), "--config", config,
                        "--data-dir", data_dir, "--rounds", str(rounds), "--paths", "scan", "--out", out.name],
                       check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(tree)})
        report = json.loads(Path(out.name).read_text())
    (row,) = report["results"]
    return {key: row[key] for key in ("client_parallelism", "seconds_per_round", "warmup_seconds_incl_compile",
                                      "final_loss")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--configs", nargs="+", default=["fedavg_fmnist", "spafl_fmnist"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    data_dir = str(Path(args.data_dir).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        try:
            for label, rev in (("before", args.before), ("after", args.after)):
                trees[label] = checkout(rev, Path(tmp))
            record = {"what": __doc__.split("\n\n")[0], "command": " ".join(["python",
                      "experiments/bench/code_before_after.py", *(argv or sys.argv[1:])]),
                      "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "commits": {label: commit for label, (_, commit) in trees.items()}, "configs": {}}
            for config in args.configs:
                runs: dict = {"before": [], "after": []}
                for r in range(args.repeats):
                    for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
                        runs[label].append(bench(trees[label][0], config, data_dir, args.rounds))
                medians = {label: statistics.median(x["seconds_per_round"] for x in rows)
                           for label, rows in runs.items()}
                record["configs"][config] = {"runs": runs, "median_seconds_per_round": medians,
                                             "after_over_before": medians["after"] / medians["before"],
                                             "same_final_loss": len({x["final_loss"] for rows in runs.values()
                                                                     for x in rows}) == 1}
                print(f"{config}: before {medians['before']:.3f} s/round, after {medians['after']:.3f} "
                      f"({medians['after'] / medians['before']:.3f}x)", flush=True)
                Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        finally:
            for path, _ in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

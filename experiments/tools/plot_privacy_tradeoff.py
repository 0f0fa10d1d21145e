"""Accuracy against epsilon from DP sweeps (``run --sweep dp_target_epsilon=...``): one line per sweep,
the mean final accuracy over its seeds with a +- one sample std band, and the table beside it.

    python experiments/tools/plot_privacy_tradeoff.py experiments/results/privacy/dp_fedavg_fmnist \\
        experiments/results/privacy/dp_spafl_fmnist --out experiments/results/privacy/accuracy_vs_epsilon.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def points(folder: Path) -> tuple[str, list[tuple[float, float, float | None, float | None]]]:
    """(algorithm, [(target epsilon, mean final accuracy, its std, mean achieved epsilon)])."""
    record = json.loads((folder / "sweep.json").read_text())
    out = []
    for point in record["points"]:
        achieved = [json.loads((folder / point["point"] / f"seed{s}" / "summary.json").read_text())["dp_epsilon"]
                    for s in point["seeds"] if (folder / point["point"] / f"seed{s}" / "summary.json").exists()]
        out.append((float(point["values"]["dp_target_epsilon"]), point["final_accuracy"], point["final_accuracy_std"],
                    sum(achieved) / len(achieved) if achieved else None))
    return record["algorithm"], sorted(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweeps", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from matplotlib.figure import Figure
    fig = Figure(figsize=(5.6, 4))
    ax = fig.subplots()
    lines = ["| algorithm | target epsilon | achieved epsilon (mean) | final accuracy % (mean ± std over seeds) |",
             "|---|---|---|---|"]
    for folder in map(Path, args.sweeps):
        algorithm, rows = points(folder)
        eps = [r[0] for r in rows]
        mean = [100 * (r[1] or 0.0) for r in rows]
        std = [100 * (r[2] or 0.0) for r in rows]
        line, = ax.plot(eps, mean, marker="o", label=algorithm)
        ax.fill_between(eps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=line.get_color(), alpha=0.2)
        for (target, _, _, achieved), m, s in zip(rows, mean, std):
            lines.append(f"| {algorithm} | {target:g} | {'n/a' if achieved is None else f'{achieved:.3f}'} | "
                         f"{m:.2f} ± {s:.2f} |")
    ax.set_xlabel("epsilon (delta = 1e-5), K of N without replacement, RDP")
    ax.set_ylabel("final personalised accuracy (%)")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    table = "\n".join(lines) + "\n"
    Path(args.out).with_suffix(".md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Learning curves from one or more run directories (their metrics.jsonl).

    python experiments/tools/plot_curves.py RUN_DIR [RUN_DIR ...] --out curves.png [--key accuracy]

Left: accuracy vs round; right: accuracy vs cumulative communication (Gbit, up + down).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    from fedjax_sparse.driver.checkpoint import read_metrics
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found; pass run directories written with --out")
    return read_metrics(run_dir)


def label_of(run_dir: Path) -> str:
    config = Path(run_dir) / "config.json"
    if config.is_file():
        c = json.loads(config.read_text())["config"]
        return f"{c['algorithm']} (seed {c['seed']})"
    return Path(run_dir).name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--key", default="accuracy", help="metrics.jsonl key to plot (e.g. global_accuracy)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in args.runs:
        rows = [r for r in read_metrics(Path(run)) if r.get(args.key) is not None]
        rounds = [r["round"] for r in rows]
        values = [100 * r[args.key] for r in rows]
        gbit = [(r["total_uplink_bits"] + r["total_downlink_bits"]) / 1e9 for r in rows]
        ax1.plot(rounds, values, label=label_of(Path(run)))
        ax2.plot(gbit, values, label=label_of(Path(run)))
    ax1.set_xlabel("round")
    ax2.set_xlabel("cumulative communication, up + down (Gbit)")
    ax2.set_xscale("symlog", linthresh=1e-3)
    for ax in (ax1, ax2):
        ax.set_ylabel(f"{args.key} (%)")
        ax.grid(alpha=0.3)
    ax1.legend()
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

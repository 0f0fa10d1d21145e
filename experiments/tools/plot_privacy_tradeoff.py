"""Accuracy against epsilon from DP sweeps (``run --sweep dp_target_epsilon=...``): one line per sweep,
the mean final accuracy over its finished seeds with a +- one sample std band, non-DP references
(``run --seeds ...`` folders) as dashed lines with their bands, and the table beside the figure
(``--out`` with ``.md``). Points whose every seed diverged (NaN/inf loss) are drawn as crosses on
the x axis and said so in the table, never as an accuracy.

    python experiments/tools/plot_privacy_tradeoff.py experiments/results/privacy/n500/dp_fedavg \\
        experiments/results/privacy/n500/dp_spafl --reference fedavg=experiments/results/privacy/n500/fedavg \\
        --out experiments/results/privacy/n500/accuracy_vs_epsilon.png
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def sweep_points(folder: Path) -> tuple[str, list[dict]]:
    """(algorithm, one dict per grid point): target epsilon, the calibrated noise multiplier and
    clip, the finished seeds' final accuracies and achieved epsilons, the diverged seeds, and the
    rows' mean clipped fraction and median update norm before clipping (evaluated rounds, seeds)."""
    record = json.loads((folder / "sweep.json").read_text())
    out = []
    for point in record["points"]:
        finished, clipped, norms = [], [], []
        for seed in point["seeds"]:
            run = folder / point["point"] / f"seed{seed}"
            if (run / "summary.json").exists():
                finished.append(json.loads((run / "summary.json").read_text()))
            if (run / "metrics.jsonl").exists():
                for row in _rows(run):
                    if row.get("dp_clipped_fraction") is not None:
                        clipped.append(row["dp_clipped_fraction"])
                    if row.get("server_dp_update_norm") is not None:
                        norms.append(row["server_dp_update_norm"])
        # config.json holds the calibrated z even for a member that diverged before its summary
        written = json.loads((folder / point["point"] / f"seed{point['seeds'][0]}" / "config.json").read_text())
        out.append({"target": float(point["values"]["dp_target_epsilon"]),
                    "accuracy": [s["final_accuracy"] for s in finished],
                    "epsilon": [s["dp_epsilon"] for s in finished],
                    "noise_multiplier": written["algorithm_options"]["dp_noise_multiplier"],
                    "clip": written["config"]["dp_clip"],
                    "seeds": len(point["seeds"]), "diverged": list(point.get("diverged", [])),
                    "clipped_fraction": statistics.fmean(clipped) if clipped else None,
                    "update_norm": statistics.median(norms) if norms else None})
    return record["algorithm"], sorted(out, key=lambda p: p["target"])


def reference_accuracies(folder: Path) -> list[float]:
    """Final accuracies of a non-DP ``--seeds`` folder (``seed*/summary.json``) or of one run."""
    summaries = sorted(folder.glob("seed*/summary.json")) or [folder / "summary.json"]
    missing = [str(s) for s in summaries if not s.exists()]
    if missing:
        raise SystemExit(f"error: no finished run in {folder} (missing {missing[0]})")
    return [json.loads(s.read_text())["final_accuracy"] for s in summaries]


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _pct(mean: float | None, std: float | None) -> str:
    return "n/a" if mean is None else f"{100 * mean:.2f} ± {100 * std:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweeps", nargs="+", help="sweep folders over dp_target_epsilon")
    parser.add_argument("--reference", action="append", default=[], metavar="LABEL=DIR",
                        help="a non-DP run or --seeds folder drawn as a dashed line (repeatable; LABEL without '='); "
                             "a LABEL naming a sweep's algorithm takes its colour")
    parser.add_argument("--out", required=True, help="figure path; the table goes beside it as .md")
    parser.add_argument("--xlabel", default="ε (δ = 1e-5; K of N without replacement, RDP)",
                        help="the x axis' label (say the sampling and accountant of the sweeps)")
    args = parser.parse_args(argv)
    references = []
    for item in args.reference:
        label, sep, folder = item.partition("=")
        if not sep or not folder:
            parser.error(f"--reference {item!r}: expected LABEL=DIR")
        references.append((label, reference_accuracies(Path(folder))))

    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.2, 4.2))
    ax = fig.subplots()
    lines = ["| algorithm | target ε | achieved ε (mean) | noise multiplier z | clip C | seeds finished | "
             "final accuracy % (mean ± std) | clipped fraction | median update norm |",
             "|---|---|---|---|---|---|---|---|---|"]
    all_eps: list[float] = []
    colors: dict[str, str] = {}
    swept = [(Path(folder), *sweep_points(Path(folder))) for folder in args.sweeps]
    repeated = {a for _, a, _ in swept if sum(b == a for _, b, _ in swept) > 1}
    for folder, algorithm, points in swept:
        name = f"DP-{algorithm} ({folder.name})" if algorithm in repeated else f"DP-{algorithm}"
        shown = [p for p in points if p["accuracy"]]
        stats = [_mean_std(p["accuracy"]) for p in shown]
        eps = [p["target"] for p in shown]
        all_eps += [p["target"] for p in points]
        mean = [100 * m for m, _ in stats]
        std = [100 * s for _, s in stats]
        line, = ax.plot(eps, mean, marker="o", label=name)
        colors.setdefault(algorithm.lower(), line.get_color())
        ax.fill_between(eps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=line.get_color(), alpha=0.2)
        lost = [p["target"] for p in points if not p["accuracy"]]
        if lost:
            ax.plot(lost, [0.0] * len(lost), linestyle="none", marker="x", markersize=9, color=line.get_color(),
                    label=f"{name}: every seed diverged", clip_on=False)
        for p in points:
            acc_mean, acc_std = _mean_std(p["accuracy"])
            eps_mean, _ = _mean_std(p["epsilon"])
            done = f"{len(p['accuracy'])}/{p['seeds']}" + (f" (diverged: {p['diverged']})" if p["diverged"] else "")
            lines.append(f"| {name} | {p['target']:g} | {_num(eps_mean, '.3f')} | "
                         f"{_num(p['noise_multiplier'], '.3f')} | {_num(p['clip'], 'g')} | {done} | "
                         f"{_pct(acc_mean, acc_std)} | {_num(p['clipped_fraction'], '.2f')} | "
                         f"{_num(p['update_norm'], '.3g')} |")
    for label, accuracies in references:
        m, s = _mean_std(accuracies)
        lo, hi = (min(all_eps), max(all_eps)) if all_eps else (1.0, 8.0)
        line, = ax.plot([lo, hi], [100 * m, 100 * m], linestyle="--", label=f"{label}, no DP",
                        color=colors.get(label.lower()))
        ax.fill_between([lo, hi], [100 * (m - s)] * 2, [100 * (m + s)] * 2, color=line.get_color(), alpha=0.12)
        n = len(accuracies)
        lines.append(f"| {label}, no DP | ∞ | – | – | – | {n}/{n} | {_pct(m, s)} | – | – |")
    ax.set_xlabel(args.xlabel)
    ax.set_ylabel("final accuracy (%), mean over clients' test sets")
    ax.set_xscale("log")
    if all_eps:
        ax.set_xticks(sorted(set(all_eps)), [f"{e:g}" for e in sorted(set(all_eps))])
        ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    table = "\n".join(lines) + "\n"
    Path(args.out).with_suffix(".md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SpaFL's Table 2 (FMNIST column) and Fig. 2(a) from the recorded runs, all six methods.

    python experiments/reproduce/spafl_table2.py --results experiments/results/spafl_fmnist

No training: it reads what ``experiments/reproduce/spafl_fmnist.py`` recorded and writes
``table2.{md,json}`` and ``fig2a_learning_curves.png`` into ``--results``.
Where each row comes from (each produced by the command in its README):

* SpaFL: ``spafl_cpu/spafl/seed*`` (500 rounds, CPU, with every evaluated
  round) where present; else ``results_spafl_variants.json`` (500 rounds,
  seed 0, H100; its per-round metrics were lost, so its curve is then the
  rounds 1-50 of the five seeds in ``vs_authors/ours_seed*.json``, drawn as a
  band and marked so);
* FedAvg, Local: ``fedavg/seed*``, ``local/seed*`` (500 rounds; seed 0 on an
  H100, further seeds on the CPU);
* FedPM, HeteroFL, FjORD: ``baselines_cpu/<method>/seed*`` (500 rounds, CPU).

Accuracy is the personalised one of the paper (every client on its own test
set, unweighted mean); "best" is the highest evaluated round (every 5 rounds),
"final" the last. Gbit: uplink + downlink over the run, our exact counts.
FLOPs in the paper's convention: ours (2 x MACs, summed over sampled clients)
/ (2 x 100 clients). A row with fewer seeds or rounds than the paper's says so.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from fedjax_sparse import papers
from fedjax_sparse.papers import studies

ROWS = (  # (method, label, where its runs are, relative to --results)
    ("spafl", "SpaFL", "spafl_cpu"),   # falls back to the H100 record (see the docstring)
    ("fedavg", "FedAvg", "."),
    ("fedpm", "FedPM", "baselines_cpu"),
    ("heterofl", "HeteroFL", "baselines_cpu"),
    ("fjord", "FjORD", "baselines_cpu"),
    ("local", "Local", "."),
)


def seed_runs(folder: Path) -> tuple[dict[int, dict], list[int]]:
    """({seed: run} of the runs that did not diverge, [seeds whose training diverged])."""
    seeds = sorted(int(path.name[4:]) for path in folder.glob("seed*"))
    runs, diverged = studies.collect(folder.parent, [folder.name], seeds)
    return runs.get(folder.name, {}), diverged.get(folder.name, [])


def _fmt(values, scale=1.0, digits=2):
    """mean ± std (population std over seeds), or the one value; ``digits``
    decimals, 4 for magnitudes under 1 (SpaFL's 0.1856 Gbit)."""
    v = np.asarray(values, np.float64) * scale
    if v.size == 0:
        return "–"
    digits = max(digits, 4) if abs(v.mean()) < 1 and v.mean() != 0 else digits
    if v.size == 1:
        return f"{v[0]:.{digits}f}"
    return f"{v.mean():.{digits}f} ± {v.std():.{digits}f}"


def build(results: Path) -> tuple[dict, dict]:
    """Returns (table rows by method, curves by method: list of (rounds, accuracy %))."""
    table, curves = {}, {}
    for method, label, where in ROWS:
        runs, diverged = seed_runs(results / where / method)
        if not runs and method == "spafl":
            recorded = json.loads((results / "results_spafl_variants.json").read_text())[method]
            stats = [dict(best_acc=b, final_acc=f, rounds=r, gbit=g, flops_paper_convention=p, density_at_best=d)
                     for b, f, r, g, p, d in zip(recorded["best_acc"], recorded["final_acc"], recorded["rounds"],
                                                 recorded["gbit"], recorded["flops_paper_convention"],
                                                 recorded["density_at_best"])]
            seeds, source, diverged = recorded["seeds"], "results_spafl_variants.json (H100)", []
            curves[method] = []
            for path in sorted((results / "vs_authors").glob("ours_seed*.json")):
                rows = json.loads(path.read_text())["rows"]
                curves[method].append((np.array([r["round"] for r in rows]),
                                       np.array([r["accuracy"] for r in rows], np.float64)))   # already %
        elif not runs:
            continue
        else:
            stats = [studies.run_stats(run) for run in runs.values()]
            seeds, source = sorted(runs), f"{where}/{method}/seed*"
            curves[method] = [(np.array([r["round"] for r in run["rows"]]),
                               100 * np.array([r["accuracy"] for r in run["rows"]])) for run in runs.values()]
        table[method] = dict(
            label=label, seeds=list(seeds), rounds=[int(s["rounds"]) for s in stats],
            best_acc=[float(s["best_acc"]) for s in stats], final_acc=[float(s["final_acc"]) for s in stats],
            gbit=[float(s["gbit"]) for s in stats],
            flops_paper_convention=[float(s["flops_paper_convention"]) for s in stats],
            density_at_best=[float(s["density_at_best"]) for s in stats], source=source, diverged_seeds=diverged,
            paper=papers.SPAFL_FMNIST_PAPER[method])
    return table, curves


def markdown(table: dict) -> str:
    lines = ["# SpaFL Table 2, FMNIST column: all six methods", "",
             "Personalised accuracy (each client on its own test set, unweighted mean over the 100 clients), "
             "best evaluated round and final round (runs whose training diverged are counted apart in the "
             "seeds column and left out of the means); Gbit = uplink + downlink over the run (exact counts); "
             "FLOPs in the paper's convention (ours / (2 x 100)). Built by "
             "`python experiments/reproduce/spafl_table2.py --results experiments/results/spafl_fmnist`.", "",
             "| method | seeds | rounds | best acc % | final acc % | paper acc % | Gbit | paper Gbit | "
             "FLOPs (e+11) | paper FLOPs (e+11) | source |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, _, _ in ROWS:
        if method not in table:
            continue
        t, p = table[method], table[method]["paper"]
        lines.append("| " + " | ".join([
            t["label"], studies.seeds_cell(len(t["seeds"]), len(t["diverged_seeds"])), str(min(t["rounds"])),
            _fmt(t["best_acc"], 100),
            _fmt(t["final_acc"], 100), p["acc"], _fmt(t["gbit"], 1, 2), f"{p['gbit']:g}",
            _fmt(t["flops_paper_convention"], 1e-11, 4), f"{p['flops'] / 1e11:.4f}" if "flops" in p else "–",
            t["source"]]) + " |")
    return "\n".join(lines) + "\n"


def plot(table: dict, curves: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for method, label, _ in ROWS:
        if method not in curves or not curves[method]:
            continue
        n = min(len(r) for r, _ in curves[method])
        x = curves[method][0][0][:n]
        acc = np.stack([a[:n] for _, a in curves[method]])
        name = f"{label} ({len(acc)} seed{'s' if len(acc) > 1 else ''})"
        if table[method]["source"].startswith("results_spafl_variants"):
            name = f"SpaFL (rounds 1-{int(x[-1])} only, {len(acc)} seeds)"
        line, = ax.plot(x, acc.mean(0), label=name)
        if len(acc) > 1:
            ax.fill_between(x, acc.mean(0) - acc.std(0), acc.mean(0) + acc.std(0), alpha=0.2, color=line.get_color())
    ax.set(xlabel="round", ylabel="accuracy (%)", title="FMNIST, LeNet-5-Caffe (SpaFL Fig. 2(a) setting)",
           ylim=(0, 100))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="experiments/results/spafl_fmnist")
    args = parser.parse_args(argv)
    results = Path(args.results)
    if not (results / "results_spafl_variants.json").exists():
        parser.error(f"{results} has no results_spafl_variants.json: point --results at the SpaFL FMNIST results "
                     "folder (experiments/results/spafl_fmnist)")
    table, curves = build(results)
    text = markdown(table)
    (results / "table2.md").write_text(text)
    (results / "table2.json").write_text(json.dumps(table, indent=2))
    plot(table, curves, results / "fig2a_learning_curves.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SpaFL on Fashion-MNIST: the authors' PyTorch code next to this project, several seeds.

    python experiments/tools/spafl_vs_authors.py \\
        --authors /work/sidebyside/authors_runs/seed{1,2,3,4,5} \\
        --ours /work/sidebyside/ours/seed{1,2,3,4,5} \\
        --pair-authors /work/sidebyside/authors_runs/seed1 --pair-ours /work/sidebyside/ours/pinned_seed1 \\
        --commands commands.json --out experiments/results/spafl_fmnist

Inputs (produced outside the project; see docs/spafl.md for how):
  * ``--authors DIR ...``: one folder per seed of the authors' code
    (github news-vt/SpaFL_NeruIPS_2024, main/fmnist) run by a driver that writes
    ``DIR/curve.json`` = {"seed", "rounds": [{"round" (1-based), "accuracy" (percent,
    unweighted mean over all 100 clients of their personalised test accuracy, as
    their code logs it), "density" (mean over all clients, as their code logs it),
    "round_seconds"}, ...]}.
  * ``--ours DIR ...``: this project's run folders (``metrics.jsonl``; accuracy is a
    fraction and is converted to percent; density is ``density_all_clients`` when
    present, else ``density``, the mean over the round's sampled clients).
  * ``--pair-authors`` / ``--pair-ours``: one run of each on identical draws (the
    project run pinned with ``--partition-file``, ``--init-params`` and
    ``--cohort-schedule`` exported from the authors' seed).
  * ``--commands``: optional JSON with the exact commands and versions, copied into
    the output.

Writes ``OUT/vs_authors.json`` (per round mean, std (ddof=1), n over seeds for each
implementation; the pair's two curves and their gaps; per-seed final and round-20
numbers), ``OUT/vs_authors.png`` (mean +- std bands over rounds, pair as lines) and
the raw per-seed curves as small JSON files under ``OUT/vs_authors/``. Seeds that
stopped early simply contribute fewer rounds (``n`` per round says how many).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedjax_sparse.tools.sidebyside import at_round, read_authors, read_ours, summarise


def band(runs: list[dict], key: str, max_round: int) -> list[dict]:
    out = []
    for r in range(1, max_round + 1):
        vals = [row[key] for run in runs for row in run["rows"] if row["round"] == r]
        if not vals:
            continue
        s = summarise(vals)
        out.append({"round": r, "mean": s["mean"], "std": s["std"] if s["std"] is not None else 0.0, "n": s["n"]})
    return out


def per_seed(runs: list[dict]) -> list[dict]:
    out = []
    for run in runs:
        last = run["rows"][-1] if run["rows"] else None
        secs = sorted(r["seconds"] for r in run["rows"][1:] if r["seconds"] == r["seconds"])
        out.append({"seed": run["seed"], "source": run["source"], "rounds_done": len(run["rows"]),
                    "finished": run["finished"],
                    "final_round": last["round"] if last else None,
                    "final_accuracy": last["accuracy"] if last else None,
                    "final_density": last["density"] if last else None,
                    "accuracy_round_20": at_round(run, 20), "density_round_20": at_round(run, 20, "density"),
                    "median_round_seconds_after_first": secs[len(secs) // 2] if secs else None})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--authors", nargs="+", default=[], type=Path)
    ap.add_argument("--ours", nargs="+", default=[], type=Path)
    ap.add_argument("--pair-authors", type=Path)
    ap.add_argument("--pair-ours", type=Path)
    ap.add_argument("--commands", type=Path, help="JSON with the commands and versions used")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/spafl_fmnist"))
    ap.add_argument("--variant", default="SpaFL",
                    help="what both sides ran, for the title and the 'what' text (e.g. 'SpaFL thresholds only')")
    args = ap.parse_args(argv)

    authors = [read_authors(p) for p in args.authors if (p / "curve.json").exists()]
    ours = [read_ours(p) for p in args.ours if (p / "metrics.jsonl").exists()]
    authors = [a for a in authors if a["rows"]]
    ours = [o for o in ours if o["rows"]]
    R = args.rounds
    result = {
        "what": f"{args.variant}, Fashion-MNIST (100 clients, Dirichlet 0.2, 10 per round, 5 local epochs, batch 64, "
                "LeNet-5-Caffe, lr 1e-3, momentum 0.9, alpha 0.002 with ramp, raw 0-255 inputs): the authors' "
                "code vs this project over seeds. Accuracy in percent = unweighted mean over all 100 clients "
                "of each client's accuracy on its own test split; density = mean over all clients of the mean "
                "per-layer kept fraction. std is the sample std (ddof=1) over seeds.",
        "authors": {"accuracy": band(authors, "accuracy", R), "density": band(authors, "density", R)},
        "ours": {"accuracy": band(ours, "accuracy", R), "density": band(ours, "density", R),
                 "density_key": sorted({o["density_key"] for o in ours})},
        "per_seed": {"authors": per_seed(authors), "ours": per_seed(ours)},
    }
    if args.pair_authors and args.pair_ours and (args.pair_ours / "metrics.jsonl").exists():
        pa, po = read_authors(args.pair_authors), read_ours(args.pair_ours)
        common = sorted({r["round"] for r in pa["rows"]} & {r["round"] for r in po["rows"]})
        common = [r for r in common if r <= R]
        gaps = {}
        for key in ("accuracy", "density"):
            d = [abs(at_round(pa, r, key) - at_round(po, r, key)) for r in common]
            gaps[key] = {"max_abs_gap": max(d) if d else None, "mean_abs_gap": sum(d) / len(d) if d else None,
                         "rounds_compared": len(d)}
        result["identical_draw_pair"] = {
            "authors": {"source": pa["source"], "seed": pa["seed"],
                        "accuracy": [r["accuracy"] for r in pa["rows"] if r["round"] <= R],
                        "density": [r["density"] for r in pa["rows"] if r["round"] <= R]},
            "ours": {"source": po["source"],
                     "accuracy": [r["accuracy"] for r in po["rows"] if r["round"] <= R],
                     "density": [r["density"] for r in po["rows"] if r["round"] <= R]},
            "gap": gaps}
    if args.commands and args.commands.exists():
        result["commands_and_versions"] = json.loads(args.commands.read_text())

    out = args.out
    raw = out / "vs_authors"
    raw.mkdir(parents=True, exist_ok=True)
    for impl, runs in (("authors", authors), ("ours", ours)):
        for run in runs:
            (raw / f"{impl}_seed{run['seed']}.json").write_text(json.dumps(run, indent=1))
    if "identical_draw_pair" in result:
        pair_seed = result["identical_draw_pair"]["authors"]["seed"]
        (raw / f"pair_ours_pinned_seed{pair_seed}.json").write_text(json.dumps(read_ours(args.pair_ours), indent=1))
    (out / "vs_authors.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "vs_authors.png", R, args.variant)
    print(f"wrote {out / 'vs_authors.json'}, {out / 'vs_authors.png'} and {raw}/")
    return 0


def plot(result: dict, path: Path, R: int, variant: str = "SpaFL") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"authors": "tab:red", "ours": "tab:blue"}
    labels = {"authors": "authors' PyTorch code", "ours": "fedjax_sparse"}
    for ax, key in zip(axes, ("accuracy", "density")):
        for impl in ("authors", "ours"):
            b = result[impl][key]
            if not b:
                continue
            x = [p["round"] for p in b]
            m = [p["mean"] for p in b]
            s = [p["std"] for p in b]
            n = sorted({p["n"] for p in b})
            ax.plot(x, m, color=colors[impl], label=f"{labels[impl]}: mean ± std, n={'/'.join(map(str, n))} seeds")
            ax.fill_between(x, [a - c for a, c in zip(m, s)], [a + c for a, c in zip(m, s)],
                            color=colors[impl], alpha=0.2)
        pair = result.get("identical_draw_pair")
        if pair:
            for impl, style in (("authors", "--"), ("ours", ":")):
                y = pair[impl][key]
                ax.plot(range(1, len(y) + 1), y, style, color=colors[impl], lw=1.5,
                        label=f"{labels[impl]}, identical draws (authors' seed {pair['authors']['seed']})")
        ax.set_xlabel("round")
        last = max([p["round"] for impl in ("authors", "ours") for p in result[impl][key]] or [R])
        ax.set_xlim(1, max(2, last))
        ax.set_ylabel("mean personalised test accuracy (%)" if key == "accuracy" else
                      "density (mean over all clients)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{variant}, Fashion-MNIST: authors' code vs fedjax_sparse")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

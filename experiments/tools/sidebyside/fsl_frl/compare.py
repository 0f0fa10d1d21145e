"""Collects runs/frl/seed*/rounds.json, runs/ours/seed*/mnist_test.json and the identical-draw pair into
vs_frl.json and vs_frl.png.   cd /work/main && .venv/bin/python /work/sidebyside_fsl/compare.py"""
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RUNS = HERE / "runs"


def load(kind, fname, key):
    out = {}
    for d in sorted((RUNS / kind).glob("seed*")):
        f = d / fname
        if f.exists():
            rows = json.loads(f.read_text())["rounds"]
            out[d.name] = {r["round"]: r[key] for r in rows if r.get(key) is not None}
    return out


def stats(per_seed, rounds):
    res = {}
    for r in rounds:
        v = [s[r] for s in per_seed.values() if r in s]
        if v:
            res[r] = {"mean": float(np.mean(v)), "std": float(np.std(v)), "n": len(v), "values": v}
    return res


frl = load("frl", "rounds.json", "global_test_accuracy")
ours_mnist = load("ours", "mnist_test.json", "mnist_test_accuracy")
ours_local = load("ours", "mnist_test.json", "accuracy_local_tests_mean")
ours_union = load("ours", "mnist_test.json", "global_accuracy_union_local_tests")
R = list(range(1, 21))
frl_time = [r["train_seconds"] + r["eval_seconds"] for d in sorted((RUNS / "frl").glob("seed*"))
            if (d / "rounds.json").exists() for r in json.loads((d / "rounds.json").read_text())["rounds"]]
ours_time = [r["round_wall_seconds"] for d in sorted((RUNS / "ours").glob("seed*"))
             if (d / "mnist_test.json").exists() for r in json.loads((d / "mnist_test.json").read_text())["rounds"]
             if r["round"] > 1]
pair = {}
pf, po = RUNS / "frl" / "seed1" / "rounds.json", RUNS / "pinned_ours" / "mnist_test.json"
if pf.exists() and po.exists():
    a = {r["round"]: r["global_test_accuracy"] for r in json.loads(pf.read_text())["rounds"]}
    b = {r["round"]: r["mnist_test_accuracy"] for r in json.loads(po.read_text())["rounds"]}
    pair = {r: {"frl": a[r], "ours": b[r], "ours_minus_frl": b[r] - a[r]} for r in R if r in a and r in b}
doc = {
    "setting": "FSL (no attack), MNIST LeNet (conv32-conv64-pool-fc128-fc10), 1000 clients, Dirichlet 1.0, "
               "25 clients/round, 2 local epochs, batch 8, lr 0.4*0.999^t, momentum 0.9, wd 1e-4, k=50%",
    "metric": "accuracy of the global model on the full MNIST test set (10,000 images) after each round; "
              "FRL: its own test(); ours: global_predict on dataset.test_x (runs/ours/*/mnist_test.json)",
    "differences": ["FRL's clients train on all their samples (its cached pickle, 59,956 of 60,000 images); "
                    "ours (seed runs) use dirichlet_split:1.0:0.8, i.e. 80% of each client's samples for training "
                    "and a new Dirichlet draw per seed",
                    "FRL normalises with (0.1307, 0.3081); ours --preprocess standardize with mean/std measured "
                    "on the clients' training pixels",
                    "FRL has no local test splits, so the paper's mean-over-clients metric exists only for ours "
                    "(ours_local_test_mean)"],
    "frl_global_test": stats(frl, R), "ours_global_test": stats(ours_mnist, R),
    "ours_local_test_mean": stats(ours_local, R), "ours_union_local_tests": stats(ours_union, R),
    "frl_seeds": sorted(frl), "ours_seeds": sorted(ours_mnist),
    "frl_seconds_per_round_mean": float(np.mean(frl_time)) if frl_time else None,
    "ours_seconds_per_round_mean_excl_round1": float(np.mean(ours_time)) if ours_time else None,
    "identical_draw_pair_seed1": pair,
}
(HERE / "vs_frl.json").write_text(json.dumps(doc, indent=1))

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(10, 4))
ax = axes[0]
for name, st, c in (("FRL (authors' code), MNIST test", doc["frl_global_test"], "C0"),
                    ("ours, MNIST test", doc["ours_global_test"], "C1"),
                    ("ours, mean over clients' local tests", doc["ours_local_test_mean"], "C2")):
    if st:
        rs = sorted(st)
        m = np.array([st[r]["mean"] for r in rs]) * 100
        s = np.array([st[r]["std"] for r in rs]) * 100
        n = max(st[r]["n"] for r in rs)
        ax.plot(rs, m, "o-", ms=3, color=c, label=f"{name} (n={n})")
        ax.fill_between(rs, m - s, m + s, color=c, alpha=0.2)
ax.set_xlabel("round")
ax.set_ylabel("accuracy (%)")
ax.set_title("FSL MNIST, mean ± std over seeds")
ax.legend(fontsize=7)
ax = axes[1]
if pair:
    rs = sorted(pair)
    ax.plot(rs, [pair[r]["frl"] * 100 for r in rs], "o-", ms=3, label="FRL seed 1")
    ax.plot(rs, [pair[r]["ours"] * 100 for r in rs], "s--", ms=3, label="ours, FRL's draws")
    ax.legend(fontsize=7)
ax.set_xlabel("round")
ax.set_title("identical draws (partition, init, cohorts)")
fig.tight_layout()
fig.savefig(HERE / "vs_frl.png", dpi=120)
print(json.dumps({k: v for k, v in doc.items() if k in ("frl_seeds", "ours_seeds", "frl_seconds_per_round_mean",
                                                      "ours_seconds_per_round_mean_excl_round1")}))

# table for the report
lines = ["| round | FRL MNIST test | ours (own draws) MNIST test | ours (own draws) mean local test | ours on FRL's seed-1 draws, MNIST test | gap ours-FRL (identical draws) |",
         "|---|---|---|---|---|---|"]


def cell(st, r):
    if r not in st:
        return "–"
    s = st[r]
    return f"{100 * s['mean']:.1f} ± {100 * s['std']:.1f} (n={s['n']})" if s["n"] > 1 else f"{100 * s['mean']:.1f} (n=1)"


for r in (1, 2, 5, 10, 15, 20):
    p = pair.get(r)
    po_ = "–" if p is None else "%.1f" % (100 * p["ours"])
    pg_ = "–" if p is None else "%+.1f" % (100 * p["ours_minus_frl"])
    lines.append(f"| {r} | {cell(doc['frl_global_test'], r)} | {cell(doc['ours_global_test'], r)} | "
                 f"{cell(doc['ours_local_test_mean'], r)} | {po_} | {pg_} |")
(HERE / "vs_frl_table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))

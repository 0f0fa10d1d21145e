"""FedDrop on Fashion-MNIST: the paper's Table 1 (FMNIST rows), its trade-off
plot (Fig. 5 / 11) and keep-probability histograms (Fig. 9).

    python experiments/reproduce/feddrop_fmnist.py --data-dir ../shared/data --rounds 100 \\
        --epochs 1 2 4 8 --out experiments/results/feddrop_fmnist

Setting (paper Sec. 4 and App. E): 100 clients, per-class Dirichlet(0.5)
split (train and test), every client takes part in every round, batch 4,
SGD lr 0.02, the Table 6 CNN (``feddrop_fmnist_cnn``), standardised inputs.
``--participation fractional``: 1000 clients, 10 per round, a new cohort every
2 rounds (Table 2).

Methods (``--methods``): feddrop, unidrop (FLOPs budget r in
``--flops-ratios``), fedavg, fedprox (``--fedprox-mu``), scaffold (option
II; not in Table 2) and caldas (keep fraction in ``--caldas-keep``); each
for every local-epoch count in ``--epochs``. A run goes to
``OUT/<participation>/<method>/<config>/`` (runner outputs; finished runs are
skipped, interrupted ones resume); FedDrop runs also record the histogram of
all clients' keep probabilities after every round (``keep_hist.npz``).

Table 1's quantity: for a target accuracy and a communication budget, the
TFLOPs a method needs: over its configurations, the smallest cumulative
training FLOPs at the first round where the global model's test accuracy
(``global_accuracy``: App. E reports the server model on the test set) is
>= target while the cumulative up+down traffic is still <= budget. Written to
``OUT/<participation>/table.md`` / ``table.json`` with the paper's numbers,
plus ``tradeoff.png`` (FLOPs vs communication to reach each target, Pareto
front per method), ``keep_probs.png`` (Fig. 9) and the sampled-vs-expected
FLOPs error of FedDrop (App. D.5). ``--report-only`` rebuilds them.

FLOPs convention (ours, ``fedjax_sparse.core.accounting``): a multiply-accumulate is
2 FLOPs, training = forward + 2 x forward backward = 3 x forward, so one
training example costs 6 x its forward MACs; FedDrop's are expected FLOPs
under the keep probabilities; summed over the sampled clients. The paper counts
forward MACs per example only (``OURS_PER_PAPER_FLOP`` = 6, derived there), so
every TFLOPs table is written in both units: "ours" and "paper" (= ours / 6).
Ratios between methods are the same in both. GB = 1e9 bytes of float32
traffic, both directions, all clients.

``--bench`` instead times rounds (after compilation) of the FMNIST setting
for the given methods and reports the FedDrop server optimisation's share.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse import papers

# The setting (fedjax_sparse.papers): participation -> clients, and the data, model and optimiser.
PARTICIPATION = papers.FEDDROP_PARTICIPATION
BASE = papers.FEDDROP_FMNIST_BASE
ALL_METHODS = ("feddrop", "unidrop", "fedavg", "fedprox", "scaffold", "caldas")

# Our FLOPs per FLOP of the FedDrop paper (exact for the MACs; the paper also adds ReLU outputs,
# +0.34 % on the FMNIST CNN). Ours (fedjax_sparse.core.accounting): 2 FLOPs per multiply-accumulate and
# training = forward + backward (2 x forward) = 3 x forward, i.e. 3 x 2 = 6 FLOPs per forward MAC of
# every example trained on. The paper's "FLOPs" are forward MACs per example (times examples), no
# factor 2 and no backward pass:
# * Table 6 lists one FLOP per MAC (+ ReLU outputs) despite eq. (9)'s leading 2: conv1
#   32x28x28 outputs x 25 MACs = 627,200 + 25,088 ReLUs = 652 k (Table 6: 652 k, not 1.30 M);
# * Table 5 (FMNIST, r = 0.5, R = 100 rounds, E = 8, 100 clients holding the 60,000 training images)
#   reports 281.85 expected TFLOPs; 0.5 x 11,720,192 forward MACs x 60,000 x 8 x 100 = 281.28 T
#   (+0.2 %; with the ReLU outputs 282.24 T). Forward 2 x MACs would give 562.6 T, MACs with backward
#   (3 x MACs) 843.8 T, our 6 x MACs 1687.7 T. Its r = 0.25 / 0.75 columns agree the same way;
# * App. D.2 (VGG-9, 20 clients, E = 8, r = 0.5, CIFAR-10's 50,000 images): 25.8 T per round vs
#   0.5 x 133.4 M MACs x 50,000 x 8 = 26.7 T.
# Hence paper TFLOPs = our TFLOPs / 6 (not / 2).
OURS_PER_PAPER_FLOP = 6


def to_paper_unit(flops_ours: float) -> float:
    """Our FLOPs (2 per MAC, forward + backward) in the FedDrop paper's unit (forward MACs)."""
    return flops_ours / OURS_PER_PAPER_FLOP


UNIT_OURS = "TFLOPs (ours: 2 FLOPs/MAC, fwd+bwd)"
UNIT_PAPER = "TFLOPs (paper: forward MACs)"

# Paper Table 1 (full participation) and Table 2 (1000 clients, 1 %), FMNIST rows: TFLOPs in the
# paper's unit (forward MACs; OURS_PER_PAPER_FLOP x these in ours).
PAPER = {
    "full": {(0.80, 4): dict(feddrop=12.85, unidrop=29.81, fedavg=32.68, fedprox=32.68, scaffold=31.25, caldas=34.82),
             (0.80, 8): dict(feddrop=9.82, unidrop=26.97, fedavg=30.54, fedprox=30.54, scaffold=26.99, caldas=31.65),
             (0.85, 4): dict(feddrop=32.83, unidrop=65.30, fedavg=68.19, fedprox=68.19, scaffold=56.83, caldas=94.78),
             (0.85, 8): dict(feddrop=25.69, unidrop=59.62, fedavg=66.77, fedprox=62.51, scaffold=51.14, caldas=72.02)},
    "fractional": {(0.80, 4): dict(feddrop=1.32, unidrop=1.89, fedavg=2.70, fedprox=2.59, caldas=2.89),
                   (0.80, 8): dict(feddrop=1.04, unidrop=1.64, fedavg=2.25, fedprox=2.32, caldas=2.28),
                   (0.85, 4): dict(feddrop=4.83, unidrop=6.72, fedavg=6.00, fedprox=6.01, caldas=7.78),
                   (0.85, 8): dict(feddrop=2.77, unidrop=5.59, fedavg=5.54, fedprox=5.47, caldas=6.50)},
}


# ---------------------------------------------------------------------------- configurations
def configurations(method: str, args) -> list[tuple[str, dict]]:
    """(name, {"local_epochs", "options"}) for every configuration of a method."""
    out = []
    for epochs in args.epochs:
        if method in ("feddrop", "unidrop"):
            for r in args.flops_ratios:
                options = {"budget": r}
                if method == "feddrop":
                    options.update(args.feddrop_options)
                out.append((f"E{epochs}_r{r:g}", dict(local_epochs=epochs, options=options)))
        elif method == "caldas":
            for keep in args.caldas_keep:
                out.append((f"E{epochs}_keep{keep:g}", dict(local_epochs=epochs, options={"keep": keep})))
        elif method == "fedprox":
            out.append((f"E{epochs}_mu{args.fedprox_mu:g}", dict(local_epochs=epochs,
                                                                  options={"mu": args.fedprox_mu})))
        else:
            out.append((f"E{epochs}", dict(local_epochs=epochs, options={})))
    return out


def run_config(args, method: str, local_epochs: int, options: dict, out: Path | None, rounds: int):
    clients = dict(PARTICIPATION[args.participation])
    for key in ("num_clients", "clients_per_round"):
        if getattr(args, key) is not None:
            clients[key] = getattr(args, key)
    return fjs.RunConfig.from_json(dict(algorithm=method, seed=args.seed, rounds=rounds, data_dir=args.data_dir,
                                        out=None if out is None else str(out), local_epochs=local_epochs,
                                        options=dict(options), client_parallelism=args.client_parallelism,
                                        **clients, **dict(BASE, eval_every=args.eval_every)))


class KeepProbRecorder:
    """After every evaluation: histogram (``bins`` on [0, 1]) of all clients'
    keep probabilities and their mean, saved to ``path`` (npz)."""

    def __init__(self, path: Path, bins: int = 50):
        self.path, self.bins = path, bins
        self.rounds, self.hist, self.mean = [], [], []
        if path.exists():
            with np.load(path) as f:
                self.rounds, self.hist, self.mean = list(f["rounds"]), list(f["hist"]), list(f["mean"])

    def __call__(self, row, state, exp):
        keep = [i for i, r in enumerate(self.rounds) if r < row["round"]]  # drop rows past a resume point
        self.rounds, self.hist, self.mean = ([self.rounds[i] for i in keep], [self.hist[i] for i in keep],
                                             [self.mean[i] for i in keep])
        probs = np.asarray(state.server.keep_probs).ravel()
        self.rounds.append(int(row["round"]))
        self.hist.append(np.histogram(probs, bins=self.bins, range=(0.0, 1.0))[0].astype(np.int64))
        self.mean.append(float(probs.mean()))
        tmp = self.path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, rounds=np.array(self.rounds), hist=np.stack(self.hist), mean=np.array(self.mean))
        tmp.replace(self.path)


def run_all(args, root: Path) -> None:
    from fedjax_sparse.driver.checkpoint import has_checkpoint
    for method in args.methods:
        for name, spec in configurations(method, args):
            out = root / method / name
            if (out / "summary.json").exists():
                print(f"[skip] {out} is complete", flush=True)
                continue
            resume = has_checkpoint(out)
            print(f"[run] {method} {name} -> {out}" + (" (resuming)" if resume else ""), flush=True)
            config = run_config(args, method, spec["local_epochs"], spec["options"], out, args.rounds)
            recorder = KeepProbRecorder(out / "keep_hist.npz") if method == "feddrop" else None
            fjs.run(config, resume=resume, progress=not args.quiet, on_eval=recorder)


# ---------------------------------------------------------------------------- analysis
def load_rows(path: Path) -> list[dict]:
    from fedjax_sparse.driver.checkpoint import read_metrics
    return read_metrics(path)


def accuracy_of(row: dict) -> float:
    value = row.get("global_accuracy")
    return float("nan") if value is None else float(value)


def cost_to_target(rows: list[dict], target: float, budget_bytes: float = math.inf):
    """(cumulative FLOPs, cumulative bytes, round) at the first round whose
    global accuracy is >= target while the traffic so far is <= budget; None
    if that never happens. Rows must be evaluated every round (eval_every=1)
    for the costs to be exact; with eval_every = M they are upper bounds, at
    most M - 1 rounds late."""
    for row in rows:
        sent = (row["total_uplink_bits"] + row["total_downlink_bits"]) / 8
        if sent > budget_bytes:
            return None  # traffic only grows: the budget is spent
        if accuracy_of(row) >= target:
            return float(row["total_flops"]), sent, int(row["round"])
    return None


def collect(root: Path, methods) -> dict:
    """{method: {config: rows}} of every run found under root."""
    runs = {}
    for method in methods:
        for path in sorted((root / method).glob("*")) if (root / method).exists() else []:
            rows = load_rows(path)
            if rows:
                runs.setdefault(method, {})[path.name] = rows
    return runs


def compute_table(runs: dict, targets, budgets_gb) -> dict:
    """{(target, budget): {method: (tflops, config) or None}}."""
    table = {}
    for target in targets:
        for budget in budgets_gb:
            cell = {}
            for method, configs in runs.items():
                best = None
                for name, rows in configs.items():
                    hit = cost_to_target(rows, target, budget * 1e9)
                    if hit is not None and (best is None or hit[0] < best[0] * 1e12):
                        best = (hit[0] / 1e12, name)
                cell[method] = best
            table[(target, budget)] = cell
    return table


def format_table(table: dict, methods, participation: str) -> str:
    """Table 1/2 in markdown, twice: in our unit (the paper's numbers x OURS_PER_PAPER_FLOP) and in
    the paper's (ours / OURS_PER_PAPER_FLOP). Multiples of FedDrop are the same in both."""
    lines = [f"# FedDrop, Fashion-MNIST, {participation} participation: TFLOPs to reach the target accuracy "
             "within the communication budget", "",
             "Ours: cumulative training FLOPs (all clients) at the first round whose global test accuracy "
             "reaches the target with up+down traffic <= budget; best configuration per method (in brackets; "
             "x = multiple of FedDrop). Paper: Table 1/2. Two units: ours counts 2 FLOPs per multiply-accumulate "
             "and training = 3 x forward (6 FLOPs per forward MAC per example); the paper counts forward MACs "
             f"per example (Table 5 / Table 6), so paper = ours / {OURS_PER_PAPER_FLOP}."]
    paper = PAPER.get(participation, {})
    for unit, ours_in_unit, paper_scale, paper_label in (
            (UNIT_OURS, float, OURS_PER_PAPER_FLOP, f"paper x{OURS_PER_PAPER_FLOP}"),
            (UNIT_PAPER, to_paper_unit, 1.0, "paper")):
        lines += ["", f"## {unit}", "",
                  "| acc | comm | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
        for (target, budget), cell in sorted(table.items()):
            ref = cell.get("feddrop")
            entries = []
            for method in methods:
                value = cell.get(method)
                if value is None:
                    entries.append("not reached")
                    continue
                ratio = f" ({value[0] / ref[0]:.2f}x)" if ref and method != "feddrop" else ""
                entries.append(f"{ours_in_unit(value[0]):.2f}{ratio} [{value[1]}]")
            lines.append(f"| {100 * target:.0f}% | {budget:g} GB | " + " | ".join(entries) + " |")
            ref_paper = paper.get((round(target, 2), budget))
            if ref_paper:
                lines.append(f"| | {paper_label} | " + " | ".join(
                    f"{paper_scale * ref_paper[m]:.2f}" if m in ref_paper else "-" for m in methods) + " |")
    return "\n".join(lines) + "\n"


def run_summaries(runs: dict) -> list[dict]:
    """Per run: rounds evaluated, final and best global accuracy, total TFLOPs and GB, GB per round
    (so a "not reached" cell can be read against what was run)."""
    out = []
    for method, configs in runs.items():
        for name, rows in configs.items():
            last = rows[-1]
            gbytes = (last["total_uplink_bits"] + last["total_downlink_bits"]) / 8e9
            out.append(dict(method=method, config=name, rounds=int(last["round"]),
                            final_accuracy=accuracy_of(last), best_accuracy=max(accuracy_of(r) for r in rows),
                            tflops=last["total_flops"] / 1e12,
                            tflops_paper_unit=to_paper_unit(last["total_flops"]) / 1e12,
                            gbytes=gbytes, gbytes_per_round=gbytes / last["round"]))
    return out


def sampled_flops_error(runs: dict) -> list[dict]:
    """App. D.5: relative error of the FLOPs of the drawn masks vs the expected FLOPs (FedDrop/UniDrop)."""
    out = []
    for method in ("feddrop", "unidrop"):
        for name, rows in runs.get(method, {}).items():
            sampled = sum(r.get("server_sampled_flops", 0.0) for r in rows)
            expected = rows[-1]["total_flops"]
            if sampled > 0 and len({r["round"] for r in rows}) == rows[-1]["round"]:
                out.append(dict(method=method, config=name, expected_tflops=expected / 1e12,
                                sampled_tflops=sampled / 1e12, relative_error=sampled / expected - 1))
    return out


def plot_tradeoff(runs: dict, targets, path: Path) -> None:
    """FLOPs vs communication to reach each target (every configuration a
    point), with each method's Pareto front (the paper's Fig. 5 / 11)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(targets), figsize=(5.5 * len(targets), 4.2), squeeze=False)
    for ax, target in zip(axes[0], targets):
        for method, configs in runs.items():
            points = sorted(p for p in (cost_to_target(rows, target) for rows in configs.values()) if p)
            if not points:
                continue
            comm = np.array([p[1] / 1e9 for p in points])
            flops = np.array([p[0] / 1e12 for p in points])
            line = ax.scatter(comm, flops, label=method, s=18)
            front, best = [], math.inf
            for c, f in sorted(zip(comm, flops)):
                if f < best:
                    front.append((c, f))
                    best = f
            ax.plot(*zip(*front), linestyle=":", color=line.get_facecolor()[0])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("communication to target (GB)")
        ax.set_ylabel("TFLOPs to target, ours (2/MAC, fwd+bwd)")
        ax.secondary_yaxis("right", functions=(to_paper_unit, lambda x: x * OURS_PER_PAPER_FLOP)).set_ylabel(
            f"paper's unit (fwd MACs) = ours / {OURS_PER_PAPER_FLOP}")
        ax.set_title(f"target accuracy {100 * target:.0f}%")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_keep_probs(root: Path, path: Path, max_runs: int = 4) -> bool:
    """Fig. 9: per round (vertical), the histogram of all clients' keep probabilities."""
    files = sorted((root / "feddrop").glob("*/keep_hist.npz")) if (root / "feddrop").exists() else []
    if not files:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = files[:max_runs]
    fig, axes = plt.subplots(1, len(files), figsize=(4.5 * len(files), 4.5), squeeze=False)
    for ax, file in zip(axes[0], files):
        with np.load(file) as f:
            hist, rounds = f["hist"].astype(np.float64), f["rounds"]
        hist = hist / np.maximum(hist.sum(1, keepdims=True), 1)
        image = ax.imshow(np.log10(hist + 1e-5), aspect="auto", origin="lower", cmap="viridis",
                          extent=(0.0, 1.0, rounds[0] - 0.5, rounds[-1] + 0.5))
        fig.colorbar(image, ax=ax, label="log10 fraction of (client, channel) pairs")
        ax.set_xlabel("keep probability")
        ax.set_ylabel("round")
        ax.set_title(f"FedDrop {file.parent.name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def report(args, root: Path) -> None:
    runs = collect(root, args.methods)
    if not runs:
        print(f"no runs under {root}", file=sys.stderr)
        return
    methods = [m for m in args.methods if m in runs]
    table = compute_table(runs, args.targets, args.budgets)
    text = format_table(table, methods, args.participation)
    summaries = run_summaries(runs)
    text += (f"\n## Runs\n\n| method | config | rounds | final acc. | best acc. | {UNIT_OURS} | {UNIT_PAPER} "
             "| GB | GB/round |\n|---|---|---|---|---|---|---|---|---|\n")
    text += "".join(f"| {r['method']} | {r['config']} | {r['rounds']} | {100 * r['final_accuracy']:.1f}% | "
                    f"{100 * r['best_accuracy']:.1f}% | {r['tflops']:.1f} | {r['tflops_paper_unit']:.2f} | "
                    f"{r['gbytes']:.2f} | {r['gbytes_per_round']:.3f} |\n" for r in summaries)
    errors = sampled_flops_error(runs)
    if errors:
        text += ("\n## Sampled vs expected FLOPs (App. D.5; our unit)\n\n"
                 "| method | config | expected TFLOPs | sampled TFLOPs | rel. error |\n|---|---|---|---|---|\n")
        text += "".join(f"| {e['method']} | {e['config']} | {e['expected_tflops']:.3f} | {e['sampled_tflops']:.3f} | "
                        f"{100 * e['relative_error']:+.3f}% |\n" for e in errors)
    (root / "table.md").write_text(text)
    paper = PAPER.get(args.participation, {})
    (root / "table.json").write_text(json.dumps({
        "units": {"tflops": UNIT_OURS, "tflops_paper_unit": UNIT_PAPER, "ours_per_paper_flop": OURS_PER_PAPER_FLOP},
        "cells": [dict(target=t, budget_gb=b,
                       results={m: (None if v is None else dict(tflops=v[0], tflops_paper_unit=to_paper_unit(v[0]),
                                                                config=v[1]))
                                for m, v in cell.items()},
                       paper_tflops_paper_unit=paper.get((round(t, 2), b)))
                  for (t, b), cell in sorted(table.items())],
        "runs": summaries, "sampled_flops": errors}, indent=2))
    plot_tradeoff(runs, args.targets, root / "tradeoff.png")
    plot_keep_probs(root, root / "keep_probs.png")
    print(text)


# ---------------------------------------------------------------------------- timing
def bench(args) -> None:
    """Seconds per round after compilation (per-round jit, FMNIST setting) for
    each method; FedDrop's server share = its round time minus UniDrop's (same
    clients and budget, no similarity/optimisation), and the optimiser alone."""
    import jax
    from fedjax_sparse.tools.timing import time_rounds
    results = {}
    for method in args.methods:
        options = {"budget": args.flops_ratios[0]} if method in ("feddrop", "unidrop") else {}
        if method == "feddrop":
            options.update(args.feddrop_options)
        config = run_config(args, method, args.epochs[0], options, None, args.bench_rounds + 1)
        exp = fjs.build(config)
        state = exp.engine.init(jax.random.PRNGKey(args.seed))
        state, first, times, metrics = time_rounds(exp.engine, state, exp.data, args.bench_rounds)
        entry = dict(first_round_incl_compile=first, seconds_per_round=float(np.median(times)), rounds=times)
        if method == "feddrop":
            entry["optimiser_iterations"] = float(metrics["server_opt_iterations"])
            entry["server_seconds"] = time_feddrop_server(exp, state)
        results[method] = entry
        print(method, json.dumps(entry), flush=True)
    if "feddrop" in results:
        share = results["feddrop"]["server_seconds"] / results["feddrop"]["seconds_per_round"]
        print(f"FedDrop server step (similarity + PSD shift + optimisation): "
              f"{results['feddrop']['server_seconds']:.2f} s = {100 * share:.1f}% of its round", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"bench_{args.participation}.json").write_text(json.dumps(results, indent=2))


def time_feddrop_server(exp, state) -> float:
    """Median seconds of FedDrop's jitted server_update on messages shaped like
    a real round's (the global model plus the last round's update per client)."""
    import jax
    import jax.numpy as jnp
    alg, k = exp.algorithm, exp.engine.clients_per_round
    ids = jnp.arange(k, dtype=jnp.int32)
    noise = jax.random.normal(jax.random.PRNGKey(0), (k,))

    def perturb(x):
        return x[None] + 1e-2 * noise.reshape((k,) + (1,) * x.ndim) * jnp.sign(x)[None]
    messages = {"variables": jax.tree_util.tree_map(perturb, state.server.variables),
                "sampled_flops": jnp.zeros((k,))}
    ctx = fjs.ServerContext(state.round, ids, exp.data.train_count[ids].astype(jnp.float32), jax.random.PRNGKey(1))
    update = jax.jit(alg.server_update)
    jax.block_until_ready(update(state.server, messages, ctx))
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        jax.block_until_ready(update(state.server, messages, ctx))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# ---------------------------------------------------------------------------- main
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder with the Fashion-MNIST IDX files")
    parser.add_argument("--out", default=None, help="output folder (required unless --bench)")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--methods", nargs="+", default=None, choices=ALL_METHODS,
                        help="default: all (without scaffold for fractional participation, as Table 2)")
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 2, 4, 8], help="local epochs E to sweep")
    parser.add_argument("--flops-ratios", type=float, nargs="+", default=[0.25, 0.333, 0.5],
                        help="FedDrop/UniDrop FLOPs budgets r")
    parser.add_argument("--budgets", type=float, nargs="+", default=[4.0, 8.0], help="communication budgets (GB)")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.80, 0.85], help="target accuracies")
    parser.add_argument("--caldas-keep", type=float, nargs="+", default=[0.75, 0.5])
    parser.add_argument("--fedprox-mu", type=float, default=0.01)
    parser.add_argument("--feddrop-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra FedDrop option, e.g. mu=1e-3 or opt_iters=2000 (repeatable)")
    parser.add_argument("--participation", default="full", choices=sorted(PARTICIPATION))
    parser.add_argument("--num-clients", type=int, default=None, help="override (smoke tests)")
    parser.add_argument("--clients-per-round", type=int, default=None, help="override (smoke tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=1,
                        help="evaluate every M rounds (default 1: exact costs to target; M > 1 "
                             "over-states each cost by at most M - 1 rounds)")
    parser.add_argument("--client-parallelism", default="auto", choices=["auto", "map", "vmap"])
    parser.add_argument("--report-only", action="store_true", help="only rebuild the table and plots")
    parser.add_argument("--bench", action="store_true", help="time rounds instead of running experiments")
    parser.add_argument("--bench-rounds", type=int, default=2)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.methods is None:
        args.methods = [m for m in ALL_METHODS if not (m == "scaffold" and args.participation == "fractional")]
    if args.out is None and not args.bench:
        parser.error("--out is required")
    args.feddrop_options = {}
    for item in args.feddrop_option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--feddrop-option expects KEY=VALUE, got {item!r}")
        args.feddrop_options[key] = value
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from fedjax_sparse.cli import enable_compile_cache
    enable_compile_cache(None)  # as `run` does: reruns and resumes load their programs
    if args.bench:
        bench(args)
        return 0
    root = Path(args.out) / args.participation
    if not args.report_only:
        try:
            run_all(args, root)
        except fjs.RunStopped as stop:
            # The stopped run checkpointed; the same command skips finished runs and resumes this one.
            print(f"{str(stop).split(';')[0]}; the same command resumes it", file=sys.stderr, flush=True)
            return stop.exit_code
    report(args, root)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FSL on MNIST: the paper's Table 1, Table 2, Figure 4 (and Table 5) for the MNIST LeNet.

    python experiments/reproduce/fsl_mnist.py --rounds 2000 --seeds 0 --out experiments/results/fsl_mnist
    python experiments/reproduce/fsl_mnist.py --tables table1 --methods fsl sfsl10 --rounds 2000 --out ...
    python experiments/reproduce/fsl_mnist.py --bench --bench-clients 25 100 250 \\
        --out experiments/results/fsl_mnist_bench

Setting (seed 003, Sec. 6 and App. B.1/B.3; FRL's MNIST configs): 1000 clients,
per-class Dirichlet(1.0) split of the MNIST train set, each client's share
then split 80/20 into local train/test (``dirichlet_split:1.0:0.8``), 25
clients per round, 2000 rounds, 2 local epochs, batch 8, the LeNet of Table 3
(``fsl_lenet``). Supermask training (FSL/SFSL): SGD lr 0.4, momentum 0.9,
weight decay 1e-4; weight training (FedAvg, robust AGRs, SignSGD, TopK): lr
0.01, momentum 0.9, weight decay 1e-4. Both decay the lr by 0.999 per round
and anneal it with a cosine over the local epochs (the authors' code).
Accuracy: the final global model on every client's local test set, mean (std)
over clients. Communication: per client per round, in the paper's MB (2^20 bytes).

Tables (``--tables``):
* ``table1``: FedAvg, FSL, SFSL top 50 % / 10 %, SignSGD, TopK 50 % / 10 %.
* ``table2``: FedAvg, Trimmed-mean, Multi-Krum, SignSGD, FSL, SFSL top 50 %
  with 0 / 10 / 20 % malicious clients. Attacks: FedAvg - the authors' code's
  scaling attack (1e5 x the global model; ``fedavg_minmax``: AGR-agnostic
  min-max instead, not in the paper's table); Trimmed-mean and Multi-Krum - the AGR-tailored DYN-OPT (std
  perturbation); SignSGD - the reversed majority sign; FSL/SFSL - the reverse-
  ranking attack (App. A.1). The robust AGRs know the round's number of
  malicious clients.
* ``fig4``: FSL with subnetwork size k = 10 ... 90 % (Fig. 4), FedAvg as the line.
* ``init``: FSL with signed-constant / Kaiming-normal / Glorot-normal weights (Table 5).

Each (method, malicious %, seed) is one ``fjs.run`` into
``OUT/<run>/seed<k>/``; finished runs are skipped, interrupted ones resume.
``OUT/results.md`` / ``results.json`` put our numbers next to the paper's.
``--bench`` instead times rounds of FSL and FedAvg for several clients per
round (``bench.md`` / ``bench.json``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse import papers

DEFAULT_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"

# The setting and the methods (fedjax_sparse.papers): App. B.1's learning rates, FRL's MNIST configs.
BASE = papers.FSL_MNIST_BASE
METHODS = papers.FSL_MNIST_METHODS

LABELS = {"fedavg": "FedAvg", "fedavg_minmax": "FedAvg (min-max attack)", "trimmed_mean": "Trimmed-mean",
          "multi_krum": "Multi-Krum", "signsgd": "SignSGD",
          "topk50": "TopK 50%", "topk10": "TopK 10%", "fsl": "FSL", "sfsl50": "SFSL top 50%",
          "sfsl10": "SFSL top 10%", "fsl_kaiming_normal": "FSL, Kaiming normal weights",
          "fsl_glorot_normal": "FSL, Glorot normal weights"}

# The paper's MNIST numbers: accuracy "mean (std)" over clients, MB per client per round.
PAPER_TABLE1 = {
    "fedavg": ("98.8 (3.1)", 6.20, 6.20), "fsl": ("98.8 (3.2)", 4.05, 4.05), "sfsl50": ("98.2 (3.8)", 2.03, 4.05),
    "sfsl10": ("89.5 (9.2)", 0.40, 4.05), "signsgd": ("97.2 (4.6)", 0.19, 6.20), "topk50": ("98.8 (3.2)", 3.29, 6.20),
    "topk10": ("98.7 (3.2)", 0.81, 6.20),
}
PAPER_TABLE2 = {   # no / 10 % / 20 % malicious
    "fedavg": ("98.8 (3.2)", "10.0 (10.0)", "10.0 (10.0)"),
    "trimmed_mean": ("98.8 (3.2)", "95.1 (7.7)", "87.6 (9.5)"),
    "multi_krum": ("98.8 (3.2)", "98.6 (3.3)", "97.9 (4.1)"),
    "signsgd": ("97.2 (4.6)", "96.6 (5.0)", "96.2 (5.6)"),
    "fsl": ("98.8 (3.1)", "98.8 (3.1)", "98.7 (3.3)"),
    "sfsl50": ("98.2 (3.8)", "97.04 (4.4)", "95.1 (7.8)"),
}
PAPER_TABLE5 = {"fsl": "98.8 (3.1)", "fsl_kaiming_normal": "98.7 (1.2)", "fsl_glorot_normal": "96.6 (5.2)"}

TABLES = {
    "table1": [(m, 0) for m in PAPER_TABLE1],
    "table2": [(m, pct) for m in PAPER_TABLE2 for pct in (0, 10, 20)] + [("fedavg_minmax", 10), ("fedavg_minmax", 20)],
    "fig4": [("fedavg", 0)] + [(f"fsl_k{k}" if k != 50 else "fsl", 0) for k in range(10, 100, 10)],
    "init": [(m, 0) for m in PAPER_TABLE5],
}


DIVERGED = "diverged.txt"


def run_name(method: str, malicious_pct: int) -> str:
    return method if malicious_pct == 0 else f"{method}_mal{malicious_pct}"


def make_config(method: str, malicious_pct: int, seed: int, args, out: Path | None):
    spec = METHODS[method]
    options = dict(spec["options"])
    if malicious_pct:
        options["malicious_fraction"] = malicious_pct / 100
        if spec["algorithm"] in ("fsl", "sfsl") and args.attacker_knowledge is not None:
            options["attacker_knowledge"] = args.attacker_knowledge
    if spec["algorithm"] == "signsgd":
        options["server_lr"] = args.signsgd_server_lr
    base = dict(BASE, **args.overrides)
    return fjs.RunConfig.from_json(dict(algorithm=spec["algorithm"], lr=spec["lr"], seed=seed, rounds=args.rounds,
                                        data_dir=args.data_dir, out=None if out is None else str(out),
                                        options=options, client_parallelism=args.client_parallelism, **base))


def run_one(method: str, malicious_pct: int, seed: int, args, out: Path) -> None:
    from fedjax_sparse.driver.checkpoint import has_checkpoint
    from fedjax_sparse.errors import RunError
    if (out / "summary.json").exists() or (out / DIVERGED).exists():
        print(f"[skip] {out} is complete", flush=True)
        return
    resume = has_checkpoint(out)
    print(f"[run] {run_name(method, malicious_pct)} seed {seed} -> {out}" + (" (resuming)" if resume else ""),
          flush=True)
    config = make_config(method, malicious_pct, seed, args, out)
    try:
        fjs.run(config, resume=resume, overwrite=not resume, progress=not args.quiet)
    except RunError as e:
        if "diverged" not in str(e) or not malicious_pct:
            raise
        # An attack that blows the model up (FedAvg under the scaling attack) is a result, not an
        # error: keep the last evaluated round (already in metrics.jsonl) and mark the run as done.
        (out / DIVERGED).write_text(str(e) + "\n")
        print(f"[diverged] {out}: {e}", flush=True)


# ---------------------------------------------------------------------------- reporting
def load_final(path: Path) -> dict | None:
    """The last evaluated round of one run (None when it has not been evaluated yet)."""
    from fedjax_sparse.driver.checkpoint import read_metrics
    rows = read_metrics(path)
    if not rows:
        return None
    config = json.loads((path / "config.json").read_text())["config"]
    last = rows[-1]
    k = config["clients_per_round"]
    from fedjax_sparse.mechanisms.supermask import mebibytes
    return dict(round=last["round"], complete=(path / "summary.json").exists() or (path / DIVERGED).exists(),
                diverged=(path / DIVERGED).exists(), accuracy=last["accuracy"],
                accuracy_std=last["accuracy_std"], global_accuracy=last.get("global_accuracy"),
                upload_mb=mebibytes(last["uplink_bits"] / k), download_mb=mebibytes(last["downlink_bits"] / k))


def summarize_runs(out: Path, method: str, pct: int, seeds) -> dict | None:
    finals = [f for f in (load_final(out / run_name(method, pct) / f"seed{s}") for s in seeds) if f is not None]
    if not finals:
        return None
    return dict(seeds=len(finals), rounds=min(f["round"] for f in finals), diverged=sum(f["diverged"] for f in finals),
                accuracy=float(np.mean([f["accuracy"] for f in finals])),
                accuracy_std_over_clients=float(np.mean([f["accuracy_std"] for f in finals])),
                accuracy_std_over_seeds=float(np.std([f["accuracy"] for f in finals])),
                upload_mb=finals[0]["upload_mb"], download_mb=finals[0]["download_mb"])


def fmt_acc(s: dict | None) -> str:
    if s is None:
        return "–"
    text = f"{100 * s['accuracy']:.1f} ({100 * s['accuracy_std_over_clients']:.1f})"
    text += f" ±{100 * s['accuracy_std_over_seeds']:.1f}" if s["seeds"] > 1 else ""
    return text + f" [r{s['rounds']}" + (", diverged" if s["diverged"] else "") + "]"


def write_report(out: Path, tables: list[str], seeds) -> dict:
    results, lines = {}, ["# FSL on MNIST (LeNet, 1000 clients, Dirichlet 1.0, 25 clients per round)", "",
                          "Accuracy: final global model on each client's local test set, mean (std over "
                          "clients) in %; ±x = std over seeds when several; [rN] = rounds completed (with "
                          "'diverged': the attack made the loss NaN/inf at round N; the accuracy is that round's). "
                          "MB = 2^20 bytes per client per round, as in the paper.", ""]
    if "table1" in tables:
        lines += ["## Table 1: accuracy and communication", "",
                  "| method | accuracy | paper | upload MB | paper | download MB | paper |",
                  "|---|---|---|---|---|---|---|"]
        for method, (acc, up, down) in PAPER_TABLE1.items():
            s = summarize_runs(out, method, 0, seeds)
            results.setdefault("table1", {})[method] = dict(ours=s, paper=dict(accuracy=acc, upload_mb=up,
                                                                                download_mb=down))
            up_ours = "–" if s is None else f"{s['upload_mb']:.2f}"
            down_ours = "–" if s is None else f"{s['download_mb']:.2f}"
            lines.append(f"| {LABELS[method]} | {fmt_acc(s)} | {acc} | {up_ours} | {up:.2f} | "
                         f"{down_ours} | {down:.2f} |")
        lines.append("")
    if "table2" in tables:
        lines += ["## Table 2: robustness (ours / paper)", "",
                  "| AGR | no malicious | 10 % malicious | 20 % malicious |", "|---|---|---|---|"]
        for method, paper in list(PAPER_TABLE2.items()) + [("fedavg_minmax", ("(as FedAvg)", "–", "–"))]:
            cells = []
            for pct, p in zip((0, 10, 20), paper):
                # Without attackers the min-max variant is plain FedAvg: reuse that run.
                s = summarize_runs(out, "fedavg" if (method, pct) == ("fedavg_minmax", 0) else method, pct, seeds)
                results.setdefault("table2", {}).setdefault(method, {})[pct] = dict(ours=s, paper=p)
                cells.append(f"{fmt_acc(s)} / {p}")
            lines.append(f"| {LABELS[method]} | " + " | ".join(cells) + " |")
        lines.append("")
    if "fig4" in tables:
        lines += ["## Figure 4: subnetwork size k (the paper shows a plot: best for k in [40, 70] %)", "",
                  "| k % | FSL accuracy |", "|---|---|"]
        curve = {}
        for k in range(10, 100, 10):
            s = summarize_runs(out, "fsl" if k == 50 else f"fsl_k{k}", 0, seeds)
            curve[k] = s
            lines.append(f"| {k} | {fmt_acc(s)} |")
        fedavg = summarize_runs(out, "fedavg", 0, seeds)
        lines += [f"| FedAvg (k = 100 %, weights trained) | {fmt_acc(fedavg)} |", ""]
        results["fig4"] = dict(fsl=curve, fedavg=fedavg)
        plot_fig4(curve, fedavg, out / "fig4_subnetwork_size.png")
    if "init" in tables:
        lines += ["## Table 5: weight initialisation", "", "| weights | accuracy | paper |", "|---|---|---|"]
        for method, p in PAPER_TABLE5.items():
            s = summarize_runs(out, method, 0, seeds)
            results.setdefault("init", {})[method] = dict(ours=s, paper=p)
            lines.append(f"| {LABELS[method]} | {fmt_acc(s)} | {p} |")
        lines.append("")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print("\n".join(lines))
    return results


def plot_fig4(curve: dict, fedavg: dict | None, path: Path) -> None:
    points = [(k, s["accuracy"]) for k, s in curve.items() if s is not None]
    if not points:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([k for k, _ in points], [100 * a for _, a in points], "o-", label="FSL")
    if fedavg is not None:
        ax.axhline(100 * fedavg["accuracy"], color="k", ls="--", label="FedAvg")
    ax.set_xlabel("k %")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("MNIST: subnetwork size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- timing
def bench(args, out: Path) -> dict:
    """Seconds per round (after a compile round) for FSL and FedAvg at several clients per round."""
    import jax
    from fedjax_sparse.tools.timing import time_rounds
    results = []
    for method in args.bench_methods:
        for k in args.bench_clients:
            args.overrides["clients_per_round"] = k
            exp = fjs.build(make_config(method, 0, 0, args, None))
            state = exp.engine.init(jax.random.PRNGKey(0))
            state, compile_s, times, _ = time_rounds(exp.engine, state, exp.data, args.bench_rounds)
            row = dict(method=method, clients_per_round=k, first_round_incl_compile_s=compile_s,
                       seconds_per_round=float(np.mean(times)), rounds_timed=len(times),
                       backend=jax.default_backend(), parallelism=exp.engine.mode)
            results.append(row)
            print(json.dumps(row), flush=True)
            del exp, state
    lines = ["| method | clients/round | s/round | first round incl. compile (s) |", "|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['clients_per_round']} | {r['seconds_per_round']:.1f} | "
              f"{r['first_round_incl_compile_s']:.1f} |" for r in results]
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    print("\n".join(lines))
    return {"bench": results}


# ---------------------------------------------------------------------------- main
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA))
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--tables", nargs="+", default=["table1", "table2", "fig4"], choices=sorted(TABLES))
    parser.add_argument("--methods", nargs="+", default=None,
                        help=f"only these methods of the chosen tables (of {', '.join(METHODS)})")
    parser.add_argument("--malicious", type=int, nargs="+", default=None, help="only these malicious %% (table 2)")
    parser.add_argument("--signsgd-server-lr", type=float, default=1e-3)
    parser.add_argument("--attacker-knowledge", default=None,
                        choices=["malicious_population", "malicious", "all"],
                        help="FSL/SFSL reverse-ranking attacker's knowledge (default: the algorithm's, "
                             "malicious_population = paper App. A.1 / FRL code; `malicious` = the sampled "
                             "malicious clients only, which produced the cpu_40rounds Table 2 FSL rows)")
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--preprocess", default=None, choices=["unit", "raw", "standardize"],
                        help="input scaling (default unit = [0, 1], which produced the recorded tables; "
                             "the FRL code standardises: `standardize`)")
    parser.add_argument("--num-clients", type=int, default=None, help="override (smoke tests)")
    parser.add_argument("--clients-per-round", type=int, default=None, help="override (smoke tests)")
    parser.add_argument("--local-epochs", type=int, default=None, help="override (smoke tests)")
    parser.add_argument("--dataset", default=None,
                        help="override, e.g. emnist_letters as a FEMNIST stand-in (not the paper's setting)")
    parser.add_argument("--client-parallelism", default="auto", choices=["auto", "map", "vmap"])
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--bench", action="store_true", help="time rounds instead of running the tables")
    parser.add_argument("--bench-clients", type=int, nargs="+", default=[25, 100, 250])
    parser.add_argument("--bench-methods", nargs="+", default=["fsl", "fedavg"])
    parser.add_argument("--bench-rounds", type=int, default=2)
    args = parser.parse_args(argv)
    args.overrides = {k: v for k, v in dict(num_clients=args.num_clients, clients_per_round=args.clients_per_round,
                                            local_epochs=args.local_epochs, eval_every=args.eval_every,
                                            dataset=args.dataset, preprocess=args.preprocess).items() if v is not None}
    unknown = sorted(set(args.methods or []) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; valid: {', '.join(METHODS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from fedjax_sparse.cli import enable_compile_cache
    enable_compile_cache(None)  # as `run` does: reruns and resumes load their programs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.bench:
        bench(args, out)
        return 0
    runs = []
    for table in args.tables:
        for method, pct in TABLES[table]:
            if (args.methods is None or method in args.methods) and (args.malicious is None or pct in args.malicious):
                if (method, pct) not in runs:
                    runs.append((method, pct))
    if not args.report_only:
        try:
            for method, pct in runs:
                for seed in args.seeds:
                    run_one(method, pct, seed, args, out / run_name(method, pct) / f"seed{seed}")
        except fjs.RunStopped as stop:
            # The stopped run checkpointed; the report shows what has finished (and the stopped run's
            # last evaluated round), and the same command skips finished runs and resumes this one.
            write_report(out, args.tables, args.seeds)
            print(f"{str(stop).split(';')[0]}; the same command resumes it", file=sys.stderr, flush=True)
            return stop.exit_code
    write_report(out, args.tables, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

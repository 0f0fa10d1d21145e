"""Seed studies: a table of methods, each run over several seeds, reported next to a paper's numbers.

A study is a dict: ``title``, ``base`` (``RunConfig`` fields shared by every method), ``methods``
(name -> ``algorithm``, ``lr``, ``options``, optionally ``model_options``, ``base`` (data settings of
that method) and ``config`` (further RunConfig keys)), ``paper`` (name -> the paper's ``acc``,
``gbit``, ``flops``, ``density``), ``rounds`` and ``default_methods``.
``fedjax_sparse.papers.SPAFL_FMNIST_STUDY`` is one; ``experiments/reproduce/spafl_fmnist.py`` and
``spafl_cifar.py`` are ``main`` with their studies.

Each (method, seed) is one ``fjs.run`` into ``OUT/<method>/seed<k>/``, skipped when finished, resumed
when interrupted, recorded as diverged (:func:`run_one`); ``--replicas`` runs a method's seeds in one
process (:func:`run_method_replicas`); the SpaFL family's masks are recorded by :class:`MaskRecorder`;
:func:`write_report` writes the table and plots (``--report-only``: only those). The command line as a
user reads it: the docstring (``--help``) of ``experiments/reproduce/spafl_fmnist.py``.

FLOPs: ours count a multiply-accumulate as 2 FLOPs and sum over all sampled clients; the SpaFL paper
counts MACs and reports the mean per client, so "paper convention" = ours / (2 * N).
"""
from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

import fedjax_sparse as fjs

DIVERGED = "diverged.json"   # written into a run folder whose training diverged (NaN/inf loss)


# ---------------------------------------------------------------------------- running
def is_spafl(algorithm: str) -> bool:
    return algorithm.startswith("spafl")


class MaskRecorder:
    """After each evaluation: every client's row masks of ``layer`` and its
    density (mean over thresholded layers of the kept fraction), saved to
    ``path`` (npz) so an interrupted run keeps what it recorded."""

    def __init__(self, path: Path, layer: str | None = None):
        self.path, self.layer = path, layer
        self.rounds: list = []
        self.masks: list = []
        self.density: list = []
        self._fn: Callable | None = None
        if path.exists():
            with np.load(path) as f:
                self.rounds, self.masks, self.density = list(f["rounds"]), list(f["masks"]), list(f["density"])
                self.layer = str(f["layer"])

    def _build(self, exp):
        import jax
        # the module, not the builder function that ``fedjax_sparse.algorithms.spafl_family`` names
        spafl = importlib.import_module("fedjax_sparse.algorithms.spafl_family")
        setup = spafl.make_setup(exp.model, exp.algorithm.hparams)
        if self.layer is None:
            self.layer = setup.layers[0].name

        def all_clients(server, clients):
            def one(client):
                row_mask = spafl.personal_row_masks(setup, server, client)
                return row_mask[self.layer], spafl.mean_layer_density(setup, spafl.kept_fractions(row_mask))
            return jax.lax.map(one, clients)
        return jax.jit(all_clients)

    def __call__(self, row, state, exp):
        if self._fn is None:
            self._fn = self._build(exp)
        # On resume, drop anything recorded past the checkpoint.
        keep = [i for i, r in enumerate(self.rounds) if r < row["round"]]
        self.rounds, self.masks, self.density = ([recorded[i] for i in keep]
                                                 for recorded in (self.rounds, self.masks, self.density))
        masks, density = self._fn(state.server, state.clients)
        self.rounds.append(int(row["round"]))
        self.masks.append(np.asarray(masks, np.uint8))
        self.density.append(np.asarray(density, np.float32))
        tmp = self.path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, rounds=np.array(self.rounds), masks=np.stack(self.masks),
                            density=np.stack(self.density), layer=self.layer)
        tmp.replace(self.path)


def method_config(study: dict, method: str, seed: int, args, out: Path | str) -> fjs.RunConfig:
    """The ``RunConfig`` of one (method, seed); ``args`` gives ``rounds``, ``data_dir``,
    ``client_parallelism`` and ``overrides`` (RunConfig keys over the study's base)."""
    spec = study["methods"][method]
    base = dict(study["base"])
    base.update(spec.get("base", {}))   # a method's own data settings (FedPM: unit-scaled inputs)
    base.update(args.overrides)
    fields = dict(algorithm=spec["algorithm"], lr=spec["lr"], seed=seed, rounds=args.rounds, data_dir=args.data_dir,
                  out=str(out), options=dict(spec.get("options", {})),
                  model_options=dict(spec.get("model_options", {})), client_parallelism=args.client_parallelism,
                  **base)
    fields.update(spec.get("config", {}))
    return fjs.RunConfig.from_json(fields)   # flat keys, as config.json: execution's among them


def run_method_replicas(study: dict, method: str, args, out: Path) -> None:
    """Every seed of one method as replicas in one process (``--replicas``): the same
    ``OUT/<method>/seed<k>/`` files as one run per seed, one compiled program."""
    from fedjax_sparse.driver import replicas
    spec = study["methods"][method]
    config = method_config(study, method, args.seeds[0], args, out)
    spafl = is_spafl(spec["algorithm"])
    print(f"[run] {method} seeds {args.seeds} as replicas ({args.replicas}) -> {out}/seed<k>", flush=True)
    replicas.run_replicas(config, args.seeds, parallelism=args.replicas, resume=True, progress=not args.quiet,
                          on_eval_for_seed=(lambda seed: MaskRecorder(out / f"seed{seed}" / "spafl_masks.npz"))
                          if spafl else None)


def run_one(study: dict, method: str, seed: int, args, out: Path) -> dict | None:
    """Runs (or skips, or resumes) one seed. A run that diverges is a result, not a crash: its
    folder gets ``diverged.json`` (the error), the study goes on with the next run, the report
    counts it apart, and reruns skip it (delete the folder to try again). Returns the summary,
    or None for a diverged run."""
    from fedjax_sparse.driver.checkpoint import has_checkpoint
    from fedjax_sparse.errors import RunError
    spec = study["methods"][method]
    config = method_config(study, method, seed, args, out)
    if (out / "summary.json").exists():
        print(f"[skip] {out} is complete", flush=True)
        return json.loads((out / "summary.json").read_text())
    if (out / DIVERGED).exists():
        print(f"[skip] {out} diverged ({DIVERGED}); delete the folder to run it again", flush=True)
        return None
    resume = has_checkpoint(out)
    recorder = MaskRecorder(out / "spafl_masks.npz") if is_spafl(spec["algorithm"]) else None
    print(f"[run] {method} seed {seed} -> {out}" + (" (resuming)" if resume else ""), flush=True)
    try:
        summary = fjs.run(config, resume=resume, progress=not args.quiet, on_eval=recorder).summary
    except RunError as error:
        if not str(error).startswith(("training diverged", "evaluation diverged")):   # NaN/inf training or test loss
            raise
        (out / DIVERGED).write_text(json.dumps({"method": method, "seed": seed, "error": str(error)}, indent=2))
        print(f"[diverged] {method} seed {seed}: {error}", flush=True)
        return None
    return summary


# ---------------------------------------------------------------------------- reporting
def load_run(path: Path) -> dict | None:
    """One run folder: its metrics rows, summary, divergence, config and recorded masks (None
    when it has no metrics yet)."""
    from fedjax_sparse.driver.checkpoint import read_metrics
    rows = read_metrics(path)
    if not rows:
        return None
    run: dict[str, Any] = {
        "rows": rows,
        "summary": json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else None,
        "diverged": json.loads((path / DIVERGED).read_text())["error"] if (path / DIVERGED).exists() else None,
        "config": json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else None}
    if (path / "spafl_masks.npz").exists():
        with np.load(path / "spafl_masks.npz") as f:
            run["masks"] = {k: f[k] for k in ("rounds", "masks", "density")}
            run["masks"]["layer"] = str(f["layer"])
    return run


def run_stats(run: dict) -> dict:
    """Best and final accuracy (and the best round), density at the best and the final round,
    total Gbit and FLOPs (ours, and in the SpaFL paper's convention) of one loaded run."""
    rows = run["rows"]
    acc = np.array([r["accuracy"] for r in rows])
    best = int(np.argmax(acc))
    # Density as the paper reports it: mean over all clients (recorded), else over sampled clients.
    if "masks" in run:
        by_round = dict(zip(run["masks"]["rounds"].tolist(), run["masks"]["density"].mean(axis=1).tolist()))
        density = [by_round.get(r["round"], np.nan) for r in rows]
    else:
        density = [r.get("density", np.nan) for r in rows]
    num_clients = run["config"]["config"]["num_clients"] if run["config"] else np.nan
    last = rows[-1]
    total_bits = last["total_uplink_bits"] + last["total_downlink_bits"]
    return dict(rounds=int(last["round"]), best_acc=float(acc[best]), best_round=int(rows[best]["round"]),
                final_acc=float(acc[-1]), density_at_best=float(density[best]), final_density=float(density[-1]),
                gbit=total_bits / 1e9, flops=float(last["total_flops"]),
                flops_paper_convention=float(last["total_flops"]) / (2 * num_clients))


def mean_std(values, scale=1.0, fmt="{:.2f}") -> str:
    v = np.asarray(values, np.float64) * scale
    if len(v) == 0 or np.all(np.isnan(v)):
        return "n/a"
    return (fmt + " ± " + fmt).format(np.nanmean(v), np.nanstd(v)) if len(v) > 1 else fmt.format(v[0])


def collect(out: Path, methods: list[str], seeds: list[int]) -> tuple[dict, dict]:
    """({method: {seed: run}} of the runs that did not diverge, {method: [diverged seeds]})."""
    runs: dict = {}
    diverged: dict = {}
    for method in methods:
        for seed in seeds:
            run = load_run(out / method / f"seed{seed}")
            if run is not None and run["diverged"]:
                diverged.setdefault(method, []).append(seed)
            elif run is not None:
                runs.setdefault(method, {})[seed] = run
    return runs, diverged


def seeds_cell(num_runs: int, num_diverged: int) -> str:
    """The seeds column: runs in the means, and those that diverged (left out of them)."""
    return f"{num_runs} (+{num_diverged} diverged)" if num_diverged else str(num_runs)


def write_report(study: dict, out: Path, methods: list[str], seeds: list[int]) -> dict:
    """``OUT/results.md`` and ``results.json`` (accuracy mean ± std over seeds, best round and final; Gbit;
    FLOPs; density; next to the paper's numbers), ``learning_curves.png`` and the sparsity pattern of the
    first layer (the SpaFL paper's Fig. 3) of the runs in ``out``; returns the table."""
    runs, diverged = collect(out, methods, seeds)
    table = {}
    for method, by_seed in runs.items():
        stats = [run_stats(r) for r in by_seed.values()]
        # run_stats' keys, each a list over the seeds
        table[method] = dict(seeds=sorted(by_seed), **{key: [s[key] for s in stats] for key in stats[0]},
                             paper=study["paper"].get(method, {}), diverged_seeds=diverged.get(method, []))
    lines = [f"# {study['title']}", "",
             "Accuracy: personalised (each client on its own test set, unweighted mean over clients), "
             "mean ± std over seeds of the best round and of the final round; runs whose training "
             "diverged (NaN/inf loss) are counted apart in the seeds column and left out of the means. "
             "Density: mean over all "
             "clients of the mean per-layer kept fraction (SpaFL family), at the best round. "
             "FLOPs: ours = 2 x MACs summed over all sampled clients; paper convention = MACs per "
             "client (ours / 2N).", "",
             "| method | seeds | rounds | best acc % | final acc % | paper acc % | density % (best) | "
             "paper density % | Gbit | paper Gbit | FLOPs (ours) | FLOPs (paper conv.) | paper FLOPs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method in methods:
        if method not in table:
            if method in diverged:
                lines.append(f"| {method} | {seeds_cell(0, len(diverged[method]))} |" + " – |" * 11)
            continue
        t, p = table[method], table[method]["paper"]
        lines.append("| " + " | ".join([
            method, seeds_cell(len(t["seeds"]), len(t["diverged_seeds"])), str(max(t["rounds"])),
            mean_std(t["best_acc"], 100),
            mean_std(t["final_acc"], 100), p.get("acc", "–"), mean_std(t["density_at_best"], 100, "{:.1f}"),
            str(p.get("density", "–")), mean_std(t["gbit"], 1, "{:.4g}"), str(p.get("gbit", "–")),
            mean_std(t["flops"], 1, "{:.4g}"), mean_std(t["flops_paper_convention"], 1, "{:.4g}"),
            f"{p['flops']:.4g}" if "flops" in p else "–"]) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(table, indent=2))
    print("\n".join(lines))
    plot_learning_curves(study, runs, methods, out / "learning_curves.png")
    pattern_method = next((m for m in methods if m in runs and any("masks" in r for r in runs[m].values())), None)
    if pattern_method is not None:
        seed = sorted(runs[pattern_method])[0]
        plot_sparsity_pattern(runs[pattern_method][seed], out / f"sparsity_pattern_{pattern_method}_seed{seed}.png",
                              f"{pattern_method}, seed {seed}")
    return table


def plot_learning_curves(study, runs, methods, path: Path) -> None:
    from matplotlib.figure import Figure   # no pyplot: the process's backend is untouched (as reporting)
    fig = Figure(figsize=(12, 4.5))
    ax_acc, ax_den = fig.subplots(1, 2)
    for method in methods:
        if method not in runs:
            continue
        curves, dens = [], []
        for run in runs[method].values():
            rounds = np.array([r["round"] for r in run["rows"]])
            curves.append((rounds, np.array([r["accuracy"] for r in run["rows"]]) * 100))
            if "masks" in run:
                dens.append((run["masks"]["rounds"], run["masks"]["density"].mean(axis=1) * 100))
        n = min(len(c[0]) for c in curves)
        acc = np.stack([c[1][:n] for c in curves])
        x = curves[0][0][:n]
        line, = ax_acc.plot(x, acc.mean(0), label=method)
        if len(acc) > 1:
            ax_acc.fill_between(x, acc.mean(0) - acc.std(0), acc.mean(0) + acc.std(0), alpha=0.2,
                                color=line.get_color())
        if dens:
            m = min(len(d[0]) for d in dens)
            ax_den.plot(dens[0][0][:m], np.stack([d[1][:m] for d in dens]).mean(0), label=method,
                        color=line.get_color())
    ax_acc.set(xlabel="round", ylabel="accuracy (%)", title=study["title"])
    ax_den.set(xlabel="round", ylabel="density (%) over all clients", title="model density")
    for ax in (ax_acc, ax_den):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:   # a panel with no curve (diverged runs, no density) gets none
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_sparsity_pattern(run: dict, path: Path, label: str, fractions=(0.08, 0.3, 1.0)) -> None:
    """Paper Fig. 3: active (black) / pruned (white) filters of the first
    layer, one row per client, at three rounds (by default 8%, 30% and 100%
    of training, i.e. rounds 40/150/500 of 500)."""
    from matplotlib.figure import Figure
    rounds, masks = run["masks"]["rounds"], run["masks"]["masks"]
    picks = sorted({int(np.argmin(np.abs(rounds - max(1, round(f * rounds[-1]))))) for f in fractions})
    fig = Figure(figsize=(4 * len(picks), 5))
    axes = fig.subplots(1, len(picks), squeeze=False)
    for ax, i in zip(axes[0], picks):
        ax.imshow(masks[i], cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set(title=f"round {rounds[i]} ({100 * masks[i].mean():.0f}% active)",
               xlabel=f"{run['masks']['layer']} filter", ylabel="client")
    fig.suptitle(f"Sparsity pattern of {run['masks']['layer']} ({label}); black = active")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------- command line
def parse_args(argv, studies: dict, default_study: str, extra: Callable | None = None,
               description: str | None = None) -> tuple[argparse.Namespace, dict]:
    """The study command line (``--study`` when there are several); ``extra(parser)`` adds a
    script's own flags."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if len(studies) > 1:
        parser.add_argument("--study", default=default_study, choices=sorted(studies))
    parser.add_argument("--data-dir", default=None, help="folder with the dataset's original files")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the paper's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-clients", type=int, default=None, help="override (smoke tests)")
    parser.add_argument("--clients-per-round", type=int, default=None, help="override (smoke tests)")
    parser.add_argument("--local-epochs", type=int, default=None, help="override (smoke tests)")
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--client-parallelism", default="auto", choices=["auto", "map", "vmap"])
    parser.add_argument("--replicas", default="off", choices=["off", "auto", "sequential", "vmap"],
                        help="run each method's seeds as replicas in one process (fedjax_sparse.driver.replicas; "
                             "same files and numbers, one compiled program); off: one run per seed")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the table and plots")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    args.study_name = getattr(args, "study", default_study)
    study = studies[args.study_name]
    args.methods = args.methods or study["default_methods"]
    unknown = [m for m in args.methods if m not in study["methods"]]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; valid: {', '.join(study['methods'])}")
    args.rounds = args.rounds or study["rounds"]
    args.overrides = {k: v for k, v in dict(num_clients=args.num_clients, clients_per_round=args.clients_per_round,
                                            local_epochs=args.local_epochs, eval_every=args.eval_every).items()
                      if v is not None}
    return args, study


def main(argv, studies: dict, default_study: str, extra: Callable | None = None,
         adjust: Callable[[dict, Any], dict] | None = None, description: str | None = None) -> int:
    """Runs the chosen study's methods over its seeds (unless ``--report-only``), then writes the
    report. ``adjust(study, args)`` returns the study changed by a script's own flags."""
    args, study = parse_args(argv, studies, default_study, extra, description)
    from fedjax_sparse.cli import enable_compile_cache
    enable_compile_cache(None)  # as `run` does: reruns and resumes load their programs
    if adjust is not None:
        study = adjust(study, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for method in args.methods:
            if args.replicas != "off":
                run_method_replicas(study, method, args, out / method)
                continue
            for seed in args.seeds:
                run_one(study, method, seed, args, out / method / f"seed{seed}")
    write_report(study, out, args.methods, args.seeds)
    return 0

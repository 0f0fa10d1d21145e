"""Comparing finished (or running) runs from their own files: the ``plot`` and ``report`` commands.

A run directory is what ``run --out DIR`` writes (``config.json``, ``metrics.jsonl``,
``summary.json``). The three views the seed papers argue with are accuracy against rounds,
against cumulative communication (Gbit, up + down) and against cumulative training compute
(TFLOPs, this project's accounting: 2 FLOPs per multiply-accumulate, backward = 2 x forward);
density against rounds is added when the runs report it.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from fedjax_sparse.driver.checkpoint import read_metrics
from fedjax_sparse.errors import RunError, arg, in_cli
from fedjax_sparse.driver.progress import dp_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Config fields that tell runs apart in a legend, in the order they are shown.
LABEL_FIELDS = ("algorithm", "options", "dataset", "model", "lr", "local_epochs", "clients_per_round",
                "num_clients", "partition", "batch_size", "seed")
DERIVED = {
    "gbit": ("cumulative communication, up + down (Gbit)",
             lambda r: (r["total_uplink_bits"] + r["total_downlink_bits"]) / 1e9),
    "tflops": ("cumulative training compute (TFLOPs)", lambda r: r["total_flops"] / 1e12),
}


@dataclasses.dataclass
class RunRecord:
    path: Path
    config: dict
    rows: list[dict]
    summary: dict
    label: str = ""
    # config.json's ``resumed[*].changed_experiment`` (``--resume --change``): [(at_round, {key: {from, to}})].
    changes: list = dataclasses.field(default_factory=list)
    # config.json's ``algorithm_options`` (the wrapped algorithm's hparams: a DP run's calibrated z).
    algorithm_options: dict = dataclasses.field(default_factory=dict)

    @property
    def dp(self) -> dict | None:
        """A DP run's privacy (``dp_epsilon``, ``dp_delta``, ``dp_noise_multiplier``, ``dp_clip``,
        ``dp_accountant``) from its summary, or, for a run still going (or of an earlier version), from its
        latest row and config; None for a run without --dp-clip."""
        clip = self.summary.get("dp_clip", self.config.get("dp_clip"))
        if clip is None:
            return None
        from fedjax_sparse.driver.config import resolved_dp_accountant
        latest = next((r["dp_epsilon"] for r in reversed(self.rows) if r.get("dp_epsilon") is not None), None)
        z = self.summary.get("dp_noise_multiplier", self.algorithm_options.get(
            "dp_noise_multiplier", self.config.get("dp_noise_multiplier")))
        return {"dp_epsilon": self.summary.get("dp_epsilon", latest) if self.finished else latest,
                "dp_delta": self.summary.get("dp_delta", self.config.get("dp_delta")),
                "dp_noise_multiplier": z, "dp_clip": clip,
                "dp_accountant": self.summary.get("dp_accountant") or resolved_dp_accountant(
                    self.config.get("dp_accountant"), self.config.get("client_sampling"))}

    @property
    def changes_text(self) -> str:
        """"lr 0.1→0.01 from round 21" for each ``--change`` (joined by "; "), "" when none."""
        return "; ".join(", ".join(f"{key} {v.get('from')}→{v.get('to')}" for key, v in changed.items())
                         + f" from round {at_round + 1}" for at_round, changed in self.changes)

    @property
    def reached(self) -> int:
        """The last round the run recorded (its last metrics row)."""
        if self.rows:
            return int(self.rows[-1]["round"])
        return int(self.summary.get("rounds") or 0)

    @property
    def finished(self) -> bool:
        """Whether the run wrote its summary.json at the rounds its config.json asks for (a run still
        in progress, stopped or failed has no summary; a finished run resumed with a larger
        --rounds keeps its old summary until it finishes again)."""
        planned = self.config.get("rounds")
        return bool(self.summary) and not (isinstance(planned, int) and self.reached < planned)

    @property
    def progress(self) -> str:
        """"" for a finished run, else e.g. "round 37/100" (the rounds reached, of the planned)."""
        if self.finished:
            return ""
        planned = self.config.get("rounds")
        return f"round {self.reached}/{planned}" if isinstance(planned, int) else f"round {self.reached}"

    def series(self, key: str) -> list:
        """Per-evaluation values of a metrics.jsonl key or a derived one (``gbit``, ``tflops``);
        None where a row lacks it."""
        if key in DERIVED:
            return [_safe(DERIVED[key][1], r) for r in self.rows]
        return [r.get(key) for r in self.rows]


def _safe(fn, row):
    try:
        return fn(row)
    except (KeyError, TypeError):
        return None


def load_run(path: str | Path) -> RunRecord:
    """One run directory; one-line errors when it is not one."""
    path = Path(path)
    if not (path / "metrics.jsonl").is_file():
        raise RunError(f"{path} is not a run directory (no metrics.jsonl); pass directories written by "
                       f"{in_cli('run ')}{arg('out')}")
    config, changes, options = {}, [], {}   # type: dict, list, dict
    if (path / "config.json").is_file():
        try:
            recorded = json.loads((path / "config.json").read_text())
        except ValueError:
            raise RunError(f"{path / 'config.json'} is damaged (not JSON)") from None
        config = recorded.get("config", {})
        options = recorded.get("algorithm_options") or {}
        changes = [(int(r["at_round"]), r["changed_experiment"]) for r in recorded.get("resumed", [])
                   if r.get("changed_experiment")]
    summary = {}
    if (path / "summary.json").is_file():
        try:
            summary = json.loads((path / "summary.json").read_text())
        except ValueError:
            summary = {}
    return RunRecord(path, config, read_metrics(path), summary, changes=changes, algorithm_options=options)


def load_runs(paths) -> list[RunRecord]:
    """Runs from folders and/or in-memory :class:`RunResult` s (a list), or ``{label: folder or result}``;
    labelled by the dict's keys, else by :func:`legend_labels`."""
    labels = [str(k) for k in paths] if isinstance(paths, dict) else None
    items = list(paths.values()) if isinstance(paths, dict) else list(paths)
    runs = [_record(item, f"run{i + 1}") for i, item in enumerate(items)]
    for run, label in zip(runs, labels or legend_labels([r.config for r in runs], [r.path for r in runs])):
        run.label = label
    return runs


def _record(item, name: str) -> RunRecord:
    """A folder's run, or an in-memory result's (``name``: its legend label without a config)."""
    from fedjax_sparse.driver.runner import RunResult
    if isinstance(item, RunResult):
        config = item.config.to_json() if item.config is not None else {}
        return RunRecord(Path(name), config, list(item.rows), dict(item.summary))
    if isinstance(item, (str, Path)):
        return load_run(item)
    raise RunError(f"expected a run folder or a RunResult, got {type(item).__name__}")


def _is_sweep(item) -> bool:
    from fedjax_sparse.driver import sweeps
    return isinstance(item, sweeps.SweepResult) or (isinstance(item, (str, Path)) and sweeps.is_sweep(item))


def _short(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
    return str(value)


def legend_labels(configs: list[dict], paths: list[Path]) -> list[str]:
    """The algorithm plus every config field whose value differs among the runs (so two seeds
    of one method read "spafl seed=1", "spafl seed=2"); the folder name without a config."""
    differing = [f for f in LABEL_FIELDS if f != "algorithm" and len({_short(c.get(f)) for c in configs}) > 1]
    labels = []
    for config, path in zip(configs, paths):
        if not config:
            labels.append(Path(path).name)
            continue
        parts = [str(config.get("algorithm", Path(path).name))]
        parts += [f"{f}={_short(config.get(f))}" for f in differing if f != "options"]
        if "options" in differing and config.get("options"):
            parts.append(_short(config["options"]))
        labels.append(" ".join(parts))
    return labels


def plot_keys(runs: list[RunRecord]) -> list[str]:
    """The keys ``plot --x`` / ``--y`` accept for these runs: those of their metrics.jsonl rows (in
    first-seen order) and the derived ``gbit`` and ``tflops``."""
    keys = ["round"]
    for run in runs:
        for row in run.rows:
            keys += [k for k in row if k not in keys]
    return keys + [k for k in DERIVED if k not in keys]


def _views(runs: list[RunRecord], x: str | None, y: str | None) -> list[tuple[str, str]]:
    if x or y:
        valid = plot_keys(runs)
        for flag, key in (("--x", x), ("--y", y)):
            if key is not None and key not in valid:
                raise RunError(f"unknown {flag} {key!r}; valid keys for these runs: {', '.join(valid)}")
        return [(x or "round", y or "accuracy")]
    views = [("round", "accuracy"), ("gbit", "accuracy"), ("tflops", "accuracy")]
    if any(v is not None and v < 1.0 for run in runs for v in run.series("density")):  # some run is sparse
        views.append(("round", "density"))
    return views


def _axis_label(key: str) -> str:
    if key in DERIVED:
        return DERIVED[key][0]
    return {"accuracy": "personalised accuracy (%)", "global_accuracy": "global-model accuracy (%)",
            "density": "density (kept fraction)"}.get(key, key)


def plot_runs(paths, out: str | Path | None = None, *, x: str | None = None, y: str | None = None,
              title: str | None = None) -> "Figure":
    """Draws the runs' curves; returns the matplotlib ``Figure`` (a notebook shows it inline) and saves
    it to ``out`` (PNG/PDF/SVG by its suffix) only when given. ``paths``: run folders and/or in-memory
    :class:`RunResult` s, a list or ``{label: folder or result}`` (the keys are the legend). A sweep
    (its folder, with ``sweep.json``, or a :class:`SweepResult`) is drawn alone, as one mean curve per
    grid point with a band of +- one sample std over its seeds."""
    items = list(paths.values()) if isinstance(paths, dict) else list(paths)
    if any(_is_sweep(item) for item in items):
        if len(items) != 1:
            raise RunError("plot draws one sweep at a time (its grid points' mean curves); pass its folder alone")
        return _plot_sweep(items[0], out, x=x, y=y, title=title)
    runs = load_runs(paths)
    views = _views(runs, x, y)   # unknown keys are refused before anything is drawn
    fig, axes = _figure(views)
    for ax, (xk, yk) in zip(axes.ravel(), views):
        for run in runs:
            points = [(a, b) for a, b in zip(run.series(xk), run.series(yk)) if a is not None and b is not None]
            if not points:
                continue
            xs, ys = zip(*points)
            scale = 100.0 if yk.endswith("accuracy") else 1.0
            # An unfinished run's curve is marked in the legend: its last point is not its final one.
            label = run.label + (f" ({run.progress}, running or stopped)" if run.progress else "")
            label += f" [{run.changes_text}]" if run.changes else ""
            label += f" ({dp_text(run.dp)})" if run.dp else ""   # a DP curve says its privacy
            line, = ax.plot(xs, [scale * v for v in ys], marker="." if len(xs) < 30 else None, label=label)
            for at_round, _ in run.changes:   # --resume --change: a dotted line where the new values start
                at = [a for r, a in zip(run.series("round"), run.series(xk)) if r == at_round and a is not None]
                if at:
                    ax.axvline(at[0], color=line.get_color(), linestyle=":", linewidth=1)
        _scale_x(ax, [v for run in runs for v in run.series(xk) if isinstance(v, (int, float))])
    return _finished(fig, axes, views, title, out, legend_size=8)


def _figure(views: list[tuple[str, str]]):
    """A Figure of its own (no pyplot: the process's backend, a notebook's inline one, is untouched)
    with one panel per (x, y) view, two a row: (figure, axes [rows, cols])."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RunError("plot needs matplotlib: pip install 'fedjax_sparse[plot]'") from None
    cols = min(len(views), 2)
    fig = Figure(figsize=(5.6 * cols, 4 * math.ceil(len(views) / cols)))
    return fig, fig.subplots(math.ceil(len(views) / cols), cols, squeeze=False)


def _finished(fig: "Figure", axes, views, title: str | None, out, legend_size: int) -> "Figure":
    """The panels labelled and gridded, the unused ones hidden, the legend in the first; saved to ``out``
    when given."""
    for ax, (xk, yk) in zip(axes.ravel(), views):
        ax.set_xlabel(_axis_label(xk))
        ax.set_ylabel(_axis_label(yk))
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(views):]:
        ax.axis("off")
    axes.ravel()[0].legend(fontsize=legend_size)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(Path(out), dpi=110)
    return fig


def _sweep_curves(sweep) -> dict[str, list[RunRecord]]:
    """The sweep's (its folder's or a :class:`SweepResult`'s) members' runs by grid point."""
    from fedjax_sparse.driver import sweeps
    if isinstance(sweep, sweeps.SweepResult):
        return {label: [_record(r, f"{label}/seed{seed}") for seed, r in by_seed.items() if r is not None]
                for label, by_seed in sweep.by_point.items() if any(r is not None for r in by_seed.values())}
    return {label: [load_run(folder) for folder in folders]
            for label, folders in sweeps.member_dirs(Path(sweep)).items()}


def _plot_sweep(sweep, out, *, x, y, title) -> "Figure":
    """Mean curve and +- one sample std band over the seeds of every grid point (the seeds of a point
    evaluate at the same rounds; x is their mean where it differs, e.g. Gbit)."""
    import numpy as np
    points = _sweep_curves(sweep)
    name = Path(sweep).name if isinstance(sweep, (str, Path)) else "(in memory)"
    if not points:
        raise RunError(f"the sweep {name} has no member with metrics yet")
    views = _views([run for runs in points.values() for run in runs], x, y)
    fig, axes = _figure(views)
    for ax, (xk, yk) in zip(axes.ravel(), views):
        scale = 100.0 if yk.endswith("accuracy") else 1.0
        for label, runs in points.items():
            length = min(len(run.rows) for run in runs)
            # [seeds, rounds]; a missing value (None) is NaN.
            xs, ys = (np.array([run.series(key)[:length] for run in runs], float) for key in (xk, yk))
            if not length or np.isnan(ys).all():
                continue
            mean_x, mean_y = np.nanmean(xs, 0), scale * np.nanmean(ys, 0)
            line, = ax.plot(mean_x, mean_y, label=f"{label} ({len(runs)} seeds)")
            if len(runs) > 1:
                std = scale * np.nanstd(ys, 0, ddof=1)
                ax.fill_between(mean_x, mean_y - std, mean_y + std, color=line.get_color(), alpha=0.2)
    return _finished(fig, axes, views, title or f"sweep {name}: mean ± sample std over seeds", out, legend_size=7)


def _scale_x(ax, values: list[float]) -> None:
    """Log x when the values span more than two decades (e.g. SpaFL's thresholds-only traffic next
    to FedAvg's), symlog when a run sits at 0 (Local sends nothing); linear otherwise."""
    positive = [v for v in values if v > 0]
    if not positive or max(positive) / min(positive) <= 100:
        return
    if len(positive) == len(values):
        ax.set_xscale("log")
    else:
        ax.set_xscale("symlog", linthresh=min(positive))


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.2f}"


def _cell(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


# The density a run's table and report show: metrics.jsonl's ``density``, over the final round's sampled
# clients (``density_all_clients``, over every client's personal model, is in metrics.jsonl too).
DENSITY_SHOWN = "density (sampled clients)"
# The column of a DP run's privacy (progress.dp_text): epsilon at delta by its accountant, z and the clip.
DP_SHOWN = "DP: ε at δ (accountant), z, clip"


def report_table(paths) -> str:
    """A markdown table of the runs: final and best accuracy, Gbit, TFLOPs, density, rounds/s. A run
    without summary.json, or short of its config's rounds, is marked "round R/T (running or stopped)".
    ``paths``: as for :func:`plot_runs` (folders and/or results, a list or ``{label: ...}``); a sweep
    (folder or :class:`SweepResult`) gives its own table."""
    from fedjax_sparse.driver import sweeps
    entries = list(paths.items()) if isinstance(paths, dict) else [(None, p) for p in paths]
    if any(_is_sweep(item) for _, item in entries):
        def one(label, item) -> str:
            if isinstance(item, sweeps.SweepResult):
                return item.table()
            if _is_sweep(item):
                return sweeps.format_table(sweeps.load_sweep(item))
            return report_table([item] if label is None else {label: item})
        return "\n".join(one(label, item) for label, item in entries)
    runs = load_runs(paths)
    # A run still in progress (or stopped) has no final numbers: its row says how far it got, and the
    # column then names its numbers the latest ones.
    final = "final acc % (std)" if all(run.finished for run in runs) else "final (or latest) acc % (std)"
    # Density as the run's own table shows it (format_summary): the final round's sampled clients'.
    # DP runs add their privacy in a last column (a table without one keeps its columns).
    private = any(run.dp for run in runs)
    dp_head, dp_rule = (f" {DP_SHOWN} |", "---|") if private else ("", "")
    lines = [f"| run | rounds | {final} | best acc % (round) | Gbit (up+down) | TFLOPs | {DENSITY_SHOWN} | rounds/s |"
             + dp_head, "|---|---|---|---|---|---|---|---|" + dp_rule]
    for run in runs:
        rounds = f"{run.progress} (running or stopped)" if run.progress else str(run.reached)
        dp_cell = (f" {dp_text(run.dp) if run.dp else '–'} |") if private else ""
        if not run.rows:
            lines.append(f"| {run.label} | {rounds} | – | – | – | – | – | – |" + dp_cell)
            continue
        last = run.rows[-1]
        evaluated = [r for r in run.rows if r.get("accuracy") is not None]
        best = max(evaluated, key=lambda r: r["accuracy"]) if evaluated else None
        std = last.get("accuracy_std")
        acc = _pct(last.get("accuracy")) + ("" if std is None else f" ({100 * std:.2f})")
        best_s = "–" if best is None else f"{_pct(best['accuracy'])} ({best['round']})"
        label = run.label + (f" [{run.changes_text}]" if run.changes else "")
        cells = [label, rounds, acc, best_s, _cell(_safe(DERIVED["gbit"][1], last), ".4g"),
                 _cell(_safe(DERIVED["tflops"][1], last), ".4g"), _cell(last.get("density"), ".3f"),
                 _cell(run.summary.get("rounds_per_second_after_first_chunk"), ".3g")]
        lines.append("| " + " | ".join(cells) + " |" + dp_cell)
    return "\n".join(lines) + "\n"

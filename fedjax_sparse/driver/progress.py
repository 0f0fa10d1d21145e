"""A run's progress and summaries: the progress bar, the JSON-ready values of ``metrics.jsonl`` and
``summary.json``, the summary itself and its readable table."""
from __future__ import annotations

import math
import resource
import sys
import time

import jax
import numpy as np

from fedjax_sparse.core.memory import device_peak_memory_mib
from fedjax_sparse.driver.config import resolved_dp_accountant


COST_KEYS = ("uplink_bits", "downlink_bits", "flops")


def exact_number(value):
    """A recorded cost as an exact Python int when it is integral (older checkpoints stored floats)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def jsonable(value):
    """JSON-ready: numpy scalars and arrays as Python numbers and lists, NaN and inf as None
    (``null``: bare NaN is not valid JSON for most readers)."""
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


class Progress:
    """Run progress on stderr: a ``rich`` bar (round, accuracy, rounds/s, ETA) on a terminal; off
    a terminal (CI logs, files) one plain line per tenth of the run, so logs stay short. Rates and
    the ETA count from :meth:`restart` (after compilation)."""

    def __init__(self, total: int, start_round: int, enabled: bool):
        self.total, self.start_round, self.enabled = total, start_round, enabled
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._bar = None
        self._last_tenth = -1
        if enabled and self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn
            self._bar = RichProgress(TextColumn("round"), MofNCompleteColumn(), BarColumn(),
                                     TextColumn("acc {task.fields[acc]}"), TextColumn("{task.fields[rate]} rounds/s"),
                                     TextColumn("ETA {task.fields[eta]}"), console=Console(stderr=True),
                                     transient=False)
            self._task = self._bar.add_task("run", total=total, completed=start_round, acc="  n/a ",
                                            rate="  –  ", eta="--:--:--")
            self._bar.start()

    def note(self, text: str) -> None:
        """A line of its own (compilation start and end), quiet when progress is off."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def restart(self, round_: int) -> None:
        """Rates and ETA count from here (after compilation)."""
        self.t0, self.start_round = time.perf_counter(), round_

    def update(self, round_: int, accuracy: float | None) -> None:
        if not self.enabled:
            return
        done = round_ - self.start_round
        elapsed = time.perf_counter() - self.t0
        rate = done / elapsed if elapsed > 0 and done > 0 else 0.0
        eta = (self.total - round_) / rate if rate > 0 else float("nan")
        acc = "  n/a " if accuracy is None else f"{100 * accuracy:5.2f}%"
        eta_s = "--:--:--" if not math.isfinite(eta) else time.strftime("%H:%M:%S", time.gmtime(eta))
        rate_s = f"{rate:6.2f}" if rate > 0 else "  –  "
        if self._bar is not None:
            self._bar.update(self._task, completed=round_, acc=acc, rate=rate_s, eta=eta_s)
            return
        tenth = 10 * round_ // max(self.total, 1)
        if tenth != self._last_tenth or round_ == self.total:
            self._last_tenth = tenth
            print(f"round {round_}/{self.total} | acc {acc} | {rate_s} rounds/s | ETA {eta_s}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def summarize(config, exp, rows, totals, build_seconds, compile_seconds) -> dict:
    best = max(rows, key=lambda r: r["accuracy"]) if rows else None
    final = rows[-1] if rows else {}
    train_seconds = float(totals["seconds"])
    all_compile = float(totals.get("compile_seconds", compile_seconds))
    steady = max(train_seconds - all_compile, 1e-9)
    steady_rounds = max(int(totals["round"]) - int(totals.get("first_chunk_rounds", 0)), 0)
    return {
        "algorithm": config.algorithm, "dataset": config.dataset, "model": exp.model.name,
        "rounds": int(totals["round"]),
        "final_accuracy": final.get("accuracy"), "final_accuracy_std": final.get("accuracy_std"),
        "final_global_accuracy": final.get("global_accuracy"),
        "best_accuracy": best["accuracy"] if best else None, "best_round": best["round"] if best else None,
        "final_density": final.get("density"),
        "total_uplink_bits": totals["uplink_bits"], "total_downlink_bits": totals["downlink_bits"],
        "total_gbit": (None if totals["uplink_bits"] is None or totals["downlink_bits"] is None
                       else (totals["uplink_bits"] + totals["downlink_bits"]) / 1e9),
        "total_flops": totals["flops"],
        # Local steps the sampled clients needed, and what the client schedule ran (padding included).
        "total_client_steps": totals.get("client_steps"),
        "total_client_steps_executed": totals.get("client_steps_executed"),
        "seconds": train_seconds, "build_seconds": build_seconds,
        "first_chunk_seconds_incl_compile": compile_seconds,
        "rounds_per_second_after_first_chunk": (steady_rounds / steady) if steady_rounds else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        # The accelerator's allocator peak (null on CPU, which keeps no such statistics).
        "peak_device_memory_mib": device_peak_memory_mib(),
        "backend": jax.default_backend(), "client_parallelism": exp.engine.mode,
        **({} if config.dp_clip is None else {
            "dp_epsilon": final.get("dp_epsilon"), "dp_delta": config.dp_delta, "dp_clip": config.dp_clip,
            "dp_noise_multiplier": exp.algorithm.hparams.get("dp_noise_multiplier"),
            # The accountant of dp_epsilon (--dp-accountant auto resolved).
            "dp_accountant": resolved_dp_accountant(config.dp_accountant, config.client_sampling),
            **_dp_statistics(exp),
            **(_poisson_dp_summary(config, exp) if config.client_sampling == "poisson" else {
                "dp_accounting": "RDP (dp-accounting), K of N clients sampled without replacement each round, "
                                 "replace-one-client adjacency"})}),
        **({} if config.client_sampling != "poisson" else {
            "client_sampling": "poisson", "cohort_capacity": exp.engine.cohort_capacity,
            "total_cohort_overflow": totals.get("cohort_overflow", 0)}),
    }


def _dp_statistics(exp) -> dict:
    """``dp_statistics``: what dp_epsilon does not cover, when the clients send BatchNorm running statistics."""
    from fedjax_sparse.algorithms.private import released_statistics
    count = released_statistics(exp.algorithm)
    if not count:
        return {}
    return {"dp_statistics": f"{count} BatchNorm running statistics per client message, averaged without noise: "
                             "not covered by dp_epsilon"}


def _poisson_dp_summary(config, exp) -> dict:
    """Poisson sampling's accounting: epsilon after all rounds by RDP and by PLD (rows carry RDP's)."""
    from fedjax_sparse.driver import privacy
    z = float(exp.algorithm.hparams.get("dp_noise_multiplier"))
    kwargs = dict(num_clients=config.num_clients, clients_per_round=config.clients_per_round, sampling="poisson")
    epsilons = {"dp_epsilon_rdp": privacy.epsilon(z, config.rounds, config.dp_delta, accountant="rdp", **kwargs),
                "dp_epsilon_pld": privacy.epsilon(z, config.rounds, config.dp_delta, accountant="pld", **kwargs)}
    accountant = resolved_dp_accountant(config.dp_accountant, config.client_sampling)
    return {**epsilons, "dp_calibrated_with": accountant if config.dp_target_epsilon is not None else None,
            "dp_accounting": "PoissonSampledDpEvent(q = K / N, GaussianDpEvent(z)) composed over the rounds "
                             f"(dp-accounting), add-or-remove-one-client adjacency; dp_epsilon is "
                             f"{accountant.upper()}'s"}


def dp_text(summary: dict) -> str:
    """A DP run's privacy in a few words, ε to 4 significant digits: "ε 7.998 at δ 1e-05 (PLD), z 0.6808, clip 1"
    (the run table, ``report``, the plots' legends). A summary of an earlier version without ``dp_accountant``
    names no accountant."""
    def number(x, fmt):
        return "n/a" if x is None else format(x, fmt)
    accountant = summary.get("dp_accountant")
    return (f"ε {number(summary.get('dp_epsilon'), '#.4g')} at δ {number(summary.get('dp_delta'), 'g')}"
            + (f" ({accountant.upper()})" if accountant else "")
            + f", z {number(summary.get('dp_noise_multiplier'), '.4g')}, clip {number(summary.get('dp_clip'), 'g')}")


def format_summary(summary: dict) -> str:
    """A small readable result table."""
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.2f}%"
    lines = [
        ("algorithm / dataset / model", f"{summary['algorithm']} / {summary['dataset']} / {summary['model']}"),
        ("rounds", str(summary["rounds"])),
        ("final accuracy (personalised, mean ± std)",
         f"{pct(summary['final_accuracy'])} ± {pct(summary['final_accuracy_std'])}"),
        ("final global accuracy", pct(summary["final_global_accuracy"])),
        ("best accuracy (round)", f"{pct(summary['best_accuracy'])} ({summary['best_round']})"),
        ("density (sampled clients)",   # reporting.DENSITY_SHOWN: report shows the same
         "n/a" if summary["final_density"] is None else f"{summary['final_density']:.3f}"),
        ("communication (up + down)",
         "not counted" if summary["total_gbit"] is None else f"{summary['total_gbit']:.4f} Gbit"),
        ("training compute",
         "not counted" if summary["total_flops"] is None else f"{summary['total_flops'] / 1e12:.3f} TFLOPs"),
        ("wall time", f"{summary['seconds']:.1f} s (first chunk incl. compile "
                      f"{summary['first_chunk_seconds_incl_compile']:.1f} s)"),
    ]
    if summary.get("dp_clip") is not None:
        lines.append(("client-level DP", dp_text(summary)))
    width = max(len(k) for k, _ in lines)
    rule = "-" * (width + 3 + max(len(v) for _, v in lines))
    return "\n".join([rule] + [f"{k:<{width}} | {v}" for k, v in lines] + [rule])

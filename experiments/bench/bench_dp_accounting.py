"""Seconds a DP run spends in its privacy accounting and calibration: RDP against PLD.

The 20-round digits run of docs/privacy.md (100 clients, 10 expected a round, ``--client-sampling
poisson``, ``--dp-target-epsilon 8``), once with each accountant. Every call into
``fedjax_sparse.driver.privacy`` the run makes (the calibration before it, epsilon for the metrics rows and
the summary) is timed from the outside, by wrapping the module's public functions, so the same
script measures any version of the package (``--label before`` on the code before a change, with
``PYTHONPATH`` pointing at it, ``--label after`` on the new one; both land in one JSON). Also counted:
the log records and Python warnings the accounting emits (dp-accounting's "failed to converge"), and, for
the last run's z, epsilon by dp_accounting's PLD on grids of 1e-4 (its default), 1e-3 and 1e-2.

    PYTHONPATH=/tmp/old python experiments/bench/bench_dp_accounting.py --label before \\
        --out experiments/results/perf/dp_accounting_digits_cpu.json
    PYTHONPATH=. python experiments/bench/bench_dp_accounting.py --label after \\
        --out experiments/results/perf/dp_accounting_digits_cpu.json
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import fedjax_sparse as fjs
from fedjax_sparse.driver import privacy


class Timer:
    """Wraps ``privacy``'s public functions; books the seconds of the outermost calls by name."""

    def __init__(self):
        self.depth, self.seconds, self.calls = 0, {}, {}

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                    self.calls[name] = self.calls.get(name, 0) + 1
        return timed


class Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(record.getMessage()[:120])


def measure(accountant: str, rounds: int, target: float, out: Path) -> dict:
    # Each accountant from cold caches (versions that cache epsilons and calibrations would otherwise
    # answer a second run from the first's); the round programs' compilation is not timed here.
    for name in ("_epsilon", "_calibrate", "_round_pld"):
        cached = getattr(privacy, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    timer = Timer()
    originals = {name: getattr(privacy, name) for name in privacy.__all__ if callable(getattr(privacy, name))}
    for name, fn in originals.items():
        setattr(privacy, name, timer.wrap(name, fn))
    handler = Count()
    logging.getLogger().addHandler(handler)
    config = fjs.RunConfig(algorithm="fedavg", dataset="digits", num_clients=100, clients_per_round=10,
                           rounds=rounds, dp_clip=1.0, dp_target_epsilon=target, client_sampling="poisson",
                           dp_accountant=accountant, out=str(out))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            summary = fjs.run(config, progress=False).summary
            total = time.perf_counter() - start
    finally:
        for name, fn in originals.items():
            setattr(privacy, name, fn)
        logging.getLogger().removeHandler(handler)
    calibration = timer.seconds.get("calibrate_noise_multiplier", 0.0)
    accounting = sum(s for name, s in timer.seconds.items() if name != "calibrate_noise_multiplier")
    return {"accountant": accountant, "run_seconds_total": round(total, 3),
            "calibration_seconds": round(calibration, 3), "accounting_seconds": round(accounting, 3),
            "seconds_by_function": {k: round(v, 3) for k, v in sorted(timer.seconds.items())},
            "calls_by_function": dict(sorted(timer.calls.items())),
            "noise_multiplier": summary.get("dp_noise_multiplier"), "dp_epsilon": summary.get("dp_epsilon"),
            "dp_epsilon_rdp": summary.get("dp_epsilon_rdp"), "dp_epsilon_pld": summary.get("dp_epsilon_pld"),
            "final_accuracy": summary.get("final_accuracy"),
            "log_warnings": len(handler.records), "log_warning_examples": sorted(set(handler.records))[:3],
            "python_warnings": [str(w.message)[:200] for w in caught]}


def grid_check(z: float, rounds: int, q: float = 0.1, delta: float = 1e-5) -> dict:
    """epsilon of the run's z by dp_accounting's PLD on its default grid (1e-4) and on coarser ones: each a
    pessimistic estimate (an upper bound); the coarser must not say less."""
    import dp_accounting
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    out = {}
    for interval in (1e-4, 1e-3, 1e-2):
        start = time.perf_counter()
        accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, interval)
        out[f"{interval:g}"] = {"epsilon": accountant.compose(event).get_epsilon(delta),
                                "seconds": round(time.perf_counter() - start, 3)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the code measured, e.g. before / after")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    parser.add_argument("--accountants", nargs="+", default=["rdp", "pld"],
                        help="--dp-accountant values to measure, each from cold caches (auto: the default since 0.2.0)")
    parser.add_argument("--out", default="experiments/results/perf/dp_accounting_digits_cpu.json")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for accountant in args.accountants:
            results.append(measure(accountant, args.rounds, args.target_epsilon, Path(tmp) / accountant))
            r = results[-1]
            print(f"{args.label} {accountant}: calibration {r['calibration_seconds']} s, accounting "
                  f"{r['accounting_seconds']} s, {r['log_warnings']} log warnings, z {r['noise_multiplier']}, "
                  f"epsilon {r['dp_epsilon']}")
    path = Path(args.out)
    recorded = json.loads(path.read_text()) if path.is_file() else {}
    package = Path(fjs.__file__).parent
    try:
        commit = subprocess.run(["git", "-C", str(package), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:
        commit = None
    recorded[args.label] = {"package": str(package), "git_head": commit, "machine": platform.processor() or
                            platform.machine(), "cpus": os.cpu_count(), "rounds": args.rounds,
                            "target_epsilon": args.target_epsilon, "runs": results,
                            "pld_grid_check": grid_check(results[-1]["noise_multiplier"], args.rounds)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recorded, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

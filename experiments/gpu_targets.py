"""Issue 10's speed targets (items 1, 3 and 7), measured in one command and written as one JSON.

    python experiments/gpu_targets.py --data-dir .device/data \\
        --out experiments/results/perf/gpu_targets_h100.json

Each part runs in a fresh Python process (so its compile time is cold and its peak device memory
is its own) and lands in ``--out`` under its name, next to the device and machine facts. A part
already in ``--out`` is not measured again unless ``--overwrite`` is given, so a device session can
split the parts over several calls (each call is limited to 10 minutes) into one file:

| part | what | GPU target (one H100) |
|---|---|---|
| ``eval_fmnist_100`` | personalised evaluation of 100 SpaFL FMNIST clients | <= 20 ms (2 CPU cores: <= 0.5 s) |
| ``eval_mnist_1000`` | evaluation of 1000 FSL MNIST clients (``engine.evaluate``) | <= 100 ms |
| ``fsl_cohort`` | FSL MNIST rounds at 25 / 100 / 250 of 1000 clients | >= 10 rounds/s at 25; sub-linear |
| ``feddrop_100`` | FedDrop FMNIST, 100 clients per round, batch 4 | <= 0.3 s per round |
| ``spafl_eval_every_1`` | SpaFL FMNIST, 500 rounds, every client evaluated every round, the whole run | <= 60 s |
| ``spafl_eval_every_25`` | the same with evaluation every 25 rounds | <= 25 s |
| ``sweep_3x3`` | SpaFL FMNIST, 20 rounds: a 3 x 3 lr x alpha sweep vmapped vs one member | grid <= 1.5 x one |

Settings are the papers' own (``fedjax_sparse.papers``, as ``experiments/reproduce/spafl_fmnist.py``,
``fsl_mnist.py`` and ``feddrop_fmnist.py`` run them); the SpaFL runs are ``fjs.run`` end to end
(build, compilation, evaluation and files included), without the persistent compilation cache. ``met`` is null where
the issue sets no target for the backend. ``--smoke`` shrinks every part (a few clients and
rounds) to check the plumbing on a CPU; its numbers mean nothing and are marked so.

On a lent GPU (the device receives the checkout only): copy ``../shared/data/{fashion_mnist,mnist}``
into the git-ignored ``.device/data`` and name ``.device/data`` in ``carry``; the device image
already holds jax, flax, optax, chex and orbax, so ``PYTHONPATH=.`` replaces installing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse import papers, timing

# part -> backend -> [(quantity, comparison, target)]
TARGETS = {
    "eval_fmnist_100": {"gpu": [("personal_eval_seconds", "<=", 0.020)], "cpu": [("personal_eval_seconds", "<=", 0.5)]},
    "eval_mnist_1000": {"gpu": [("evaluate_seconds", "<=", 0.100)]},
    "fsl_cohort": {"gpu": [("rounds_per_second_at_smallest_cohort", ">=", 10.0),
                           ("time_ratio_largest_to_smallest_cohort", "<", "cohort_ratio")]},
    "feddrop_100": {"gpu": [("seconds_per_round", "<=", 0.3)]},
    "spafl_eval_every_1": {"gpu": [("total_seconds", "<=", 60.0)]},
    "spafl_eval_every_25": {"gpu": [("total_seconds", "<=", 25.0)]},
    "sweep_3x3": {"gpu": [("grid_over_one_member", "<=", 1.5)]},
}
PARTS = tuple(TARGETS)


# ---------------------------------------------------------------------------- settings
def spafl_config(args, **fields):
    method = papers.SPAFL_FMNIST_METHODS["spafl"]
    base = dict(papers.SPAFL_FMNIST_BASE, **method.get("base", {}))
    if args.smoke:
        base.update(clients_per_round=2, local_epochs=1)  # all 100 clients: ~600 examples each
    return fjs.RunConfig.from_json({**base, **fields, "algorithm": method["algorithm"], "lr": method["lr"],
                                    "options": dict(method["options"]), "data_dir": args.data_dir, "seed": args.seed})


def fsl_config(args, clients_per_round: int):
    method = papers.FSL_MNIST_METHODS["fsl"]
    base = dict(papers.FSL_MNIST_BASE)
    if args.smoke:
        base.update(local_epochs=1)
    return fjs.RunConfig.from_json(dict(base, clients_per_round=clients_per_round, algorithm=method["algorithm"],
                                        lr=method["lr"], options=dict(method["options"]), data_dir=args.data_dir,
                                        seed=args.seed))


def feddrop_config(args):
    clients = dict(papers.FEDDROP_PARTICIPATION["full"])
    if args.smoke:
        clients = dict(num_clients=100, clients_per_round=4)
    return fjs.RunConfig.from_json(dict(papers.FEDDROP_FMNIST_BASE, **clients, algorithm="feddrop", local_epochs=1,
                                        options={"budget": 0.5}, data_dir=args.data_dir, seed=args.seed))


# ---------------------------------------------------------------------------- parts
def trained_state(config, rounds: int = 1):
    """(experiment, state after ``rounds`` training rounds) so evaluation sees trained personal models."""
    exp = fjs.build(config)
    state = exp.engine.init(jax.random.PRNGKey(config.seed))
    state, _ = exp.engine.run_rounds(state, exp.data, rounds)
    return exp, state


def part_eval_fmnist_100(args) -> dict:
    exp, state = trained_state(spafl_config(args, rounds=1))
    evaluator = exp.engine.evaluator
    first, times = timing.time_calls(lambda: evaluator.personal_stats(state, exp.data), args.repeats)
    whole_first, whole = timing.time_calls(lambda: exp.engine.evaluate(state, exp.data), args.repeats)
    return {"clients": exp.engine.num_clients, "personal_eval": evaluator.personal_eval,
            "test_examples": int(np.asarray(exp.data.test_count).sum()),
            "personal_eval_seconds": float(np.median(times)), "personal_eval_seconds_all": times,
            "personal_eval_first_seconds_incl_compile": first,
            "evaluate_seconds": float(np.median(whole)), "evaluate_first_seconds_incl_compile": whole_first,
            # The evaluator's other modes side by side (the run's auto is per_client; batched, meant for
            # accelerators, returns as a run mode only if it wins here: docs/design.md).
            "other_modes_seconds": {mode: float(np.median(timing.time_calls(
                lambda m=mode: dataclasses.replace(evaluator, personal_eval=m).personal_stats(state, exp.data),
                args.repeats)[1])) for mode in ("batched", "loop")}}


def part_eval_mnist_1000(args) -> dict:
    exp, state = trained_state(fsl_config(args, 2 if args.smoke else 25))
    first, times = timing.time_calls(lambda: exp.engine.evaluate(state, exp.data), args.repeats)
    return {"clients": exp.engine.num_clients, "test_examples": int(np.asarray(exp.data.test_count).sum()),
            "evaluate_seconds": float(np.median(times)), "evaluate_seconds_all": times,
            "evaluate_first_seconds_incl_compile": first}


def part_fsl_cohort(args) -> dict:
    rows = []
    for k in ([2, 4] if args.smoke else [25, 100, 250]):
        exp = fjs.build(fsl_config(args, k))
        state = exp.engine.init(jax.random.PRNGKey(args.seed))
        state, first, times, _ = timing.time_rounds(exp.engine, state, exp.data, args.rounds_timed)
        rows.append({"clients_per_round": k, "client_parallelism": exp.engine.mode,
                     "seconds_per_round": float(np.median(times)), "seconds_all": times,
                     "first_round_seconds_incl_compile": first})
        del exp, state
    smallest, largest = rows[0], rows[-1]
    return {"cohorts": rows, "rounds_per_second_at_smallest_cohort": 1.0 / smallest["seconds_per_round"],
            "time_ratio_largest_to_smallest_cohort": largest["seconds_per_round"] / smallest["seconds_per_round"],
            "cohort_ratio": largest["clients_per_round"] / smallest["clients_per_round"]}


def part_feddrop_100(args) -> dict:
    exp = fjs.build(feddrop_config(args))
    state = exp.engine.init(jax.random.PRNGKey(args.seed))
    state, first, times, _ = timing.time_rounds(exp.engine, state, exp.data, args.rounds_timed)
    return {"clients_per_round": exp.engine.clients_per_round, "client_parallelism": exp.engine.mode,
            "seconds_per_round": float(np.median(times)), "seconds_all": times,
            "first_round_seconds_incl_compile": first}


def spafl_run(args, eval_every: int) -> dict:
    rounds = args.spafl_rounds or (3 if args.smoke else 500)
    with tempfile.TemporaryDirectory() as tmp:
        config = spafl_config(args, rounds=rounds, eval_every=min(eval_every, rounds), out=str(Path(tmp) / "run"))
        t0 = time.perf_counter()
        summary = fjs.run(config, progress=False).summary
        total = time.perf_counter() - t0
    keys = ("rounds", "final_accuracy", "best_accuracy", "seconds", "build_seconds",
            "first_chunk_seconds_incl_compile", "rounds_per_second_after_first_chunk", "client_parallelism",
            "peak_device_memory_mib")
    return {"rounds": rounds, "eval_every": config.eval_every, "total_seconds": total,
            # Fewer rounds than the 500 (--spafl-rounds) measure something else: no verdict.
            "whole_setting": rounds == 500 and not args.smoke, **{f"run_{k}": summary[k] for k in keys}}


def part_spafl_eval_every_1(args) -> dict:
    return spafl_run(args, 1)


def part_spafl_eval_every_25(args) -> dict:
    return spafl_run(args, 25)


def part_sweep_3x3(args) -> dict:
    """Issue 33: the whole 3 x 3 grid (lr x SpaFL's alpha, one seed) vmapped through one program, against
    one member run alone the same way (a one-point sweep); both end to end (build, compile, files)."""
    from fedjax_sparse import sweeps
    rounds = 4 if args.smoke else 20
    config = spafl_config(args, rounds=rounds, eval_every=rounds)
    grid = {"lr": [0.0005, 0.001, 0.002], "option.alpha": [0.001, 0.002, 0.004]}
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, axes in (("one_member", {"lr": [0.001], "option.alpha": [0.002]}), ("grid", grid)):
            t = time.perf_counter()
            result = sweeps.sweep(dataclasses.replace(config, out=str(Path(tmp) / name)), axes, [args.seed],
                                  parallelism="vmap", progress=False)
            seconds[name] = time.perf_counter() - t
            record = result.record
    return {"rounds": rounds, "grid": grid, "seconds": seconds, "grid_over_one_member": seconds["grid"] /
            seconds["one_member"], "programs": record["programs"], "traced_keys": record["traced_keys"],
            "best": record["best"]}


# ---------------------------------------------------------------------------- verdicts and files
def verdicts(part: str, result: dict, backend: str, smoke: bool) -> list[dict]:
    """The issue's targets for ``part`` on ``backend`` against ``result`` (``met`` null when the
    issue sets none, when --smoke shrank the setting, or when the setting was not the whole one)."""
    out = []
    for quantity, comparison, target in TARGETS[part].get(backend, []):
        bound = result[target] if isinstance(target, str) else target
        value = result[quantity]
        met = value <= bound if comparison == "<=" else value >= bound if comparison == ">=" else value < bound
        if smoke or result.get("whole_setting") is False:
            met = None
        out.append({"quantity": quantity, "comparison": comparison, "target": bound, "measured": value,
                    "met": met})
    return out


def measure(part: str, args) -> dict:
    """Runs one part in this process; returns its record."""
    result = globals()[f"part_{part}"](args)
    backend = jax.default_backend()
    return {"result": result, "targets": verdicts(part, result, backend, args.smoke), "smoke": args.smoke,
            "backend": backend, "device_kind": jax.devices()[0].device_kind,
            "peak_device_memory_mib": timing.device_peak_memory_mib(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def measure_in_child(part: str, argv: list[str]) -> dict:
    """Runs one part in a fresh interpreter (cold compilation, its own device-memory peak)."""
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "part.json"
        subprocess.run([sys.executable, __file__, *argv, "--part-worker", part, "--part-out", str(record)],
                       check=True)
        return json.loads(record.read_text())


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder with the MNIST / Fashion-MNIST IDX files")
    parser.add_argument("--out", required=False, help="JSON file; parts already in it are kept")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--overwrite", action="store_true", help="measure again parts already in --out")
    parser.add_argument("--repeats", type=int, default=5, help="timed evaluation calls after the compiling one")
    parser.add_argument("--rounds-timed", type=int, default=5, help="timed rounds after the compiling one")
    parser.add_argument("--spafl-rounds", type=int, default=None,
                        help="rounds of the SpaFL runs (default 500; fewer gives no verdict)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a few clients and rounds: plumbing only")
    parser.add_argument("--in-process", action="store_true", help="all parts in this process (tests)")
    parser.add_argument("--part-worker", default=None, choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part_worker is None and not args.out:
        parser.error("--out is required")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.part_worker:
        Path(args.part_out).write_text(json.dumps(measure(args.part_worker, args)))
        return 0
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {"parts": {}}
    todo = [p for p in args.parts if args.overwrite or p not in report["parts"]]
    skipped = sorted(set(args.parts) - set(todo))
    if skipped:
        print(f"already in {out} (kept; --overwrite measures them again): {', '.join(skipped)}", flush=True)
    child_argv = [a for a in argv if a not in ("--overwrite", "--in-process")]
    for part in todo:
        print(f"[{part}] ...", flush=True)
        record = measure(part, args) if args.in_process else measure_in_child(part, child_argv)
        record["command"] = "python experiments/gpu_targets.py " + " ".join(argv)   # each part its own
        report["parts"][part] = record
        report["machine_facts"] = timing.machine_facts()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, out)  # after every part: a call stopped at its time limit keeps what it measured
        for t in record["targets"]:
            print(f"[{part}] {t['quantity']} = {t['measured']:.4g} (target {t['comparison']} {t['target']:.4g}): "
                  f"{ {True: 'met', False: 'NOT met', None: 'no verdict'}[t['met']] }", flush=True)
        if not record["targets"]:
            print(f"[{part}] no target for backend {record['backend']}: "
                  f"{json.dumps({k: v for k, v in record['result'].items() if not isinstance(v, (list, dict))})}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

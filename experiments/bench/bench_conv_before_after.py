"""The CPU paths that the per-platform convolution change touches, timed before and after it in one
invocation: each measurement runs in a fresh child process from its own checkout (so it imports that
checkout's package), alternating before/after ``--repeats`` times so that drift on a shared machine
hits both sides alike.

What changed on CPU: ``conv_impl="auto"`` is now chosen while lowering (``lax.platform_dependent``; on
CPU the same im2col inside loops and XLA's convolution outside them, the latter wrapped in the batched
form's ``custom_vmap``/``custom_vjp``), and FSL's argsort likewise. Measured, with the papers' settings:

* ``fedavg_round``: FedAvg FMNIST round (LeNet-5-Caffe, 10 clients, E = 5, B = 64; the runner's
  scan program, CPU's ``map`` schedule): the im2col convolutions inside the local loops;
* ``spafl_personal_eval``: personalised evaluation of 100 SpaFL FMNIST clients (``per_client``): the
  native convolutions outside loops;
* ``fedavg_global_eval``: the global model over the union of the test sets (outside loops; the
  evaluations run in a process of their own);
* ``fsl_round``: FSL MNIST round, 25 of 1000 clients (argsort and top-k masks).

Each side also compiles the four programs once more and hashes them, normalised (metadata, debug
tables and instruction numbering dropped): ``compiled_programs_identical`` says whether this CPU runs
the same programs before and after, whatever the timings' noise.

    git worktree add /tmp/before <commit before the change>
    python experiments/bench/bench_conv_before_after.py --data-dir ../shared/data --before-checkout /tmp/before \\
        --out experiments/results/perf/conv_before_after_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

# Runs in the child, from one checkout: prints one JSON line of seconds per measurement. Uses only API
# present before and after the change.
CHILD_TRAINING = r"""
import json, sys, time
import jax
import fedjax_sparse as fjs
from fedjax_sparse import papers
data_dir, rounds = sys.argv[1], int(sys.argv[2])
out = {"package": fjs.__file__}

def build(fields):
    exp = fjs.build(fjs.RunConfig.from_json({**fields, "data_dir": data_dir, "seed": 0}))
    return exp, exp.engine.init(jax.random.PRNGKey(0))

def time_rounds(exp, state):
    state, m = exp.engine.run_rounds(state, exp.data, 1)  # compiles
    jax.block_until_ready(state)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        state, m = exp.engine.run_rounds(state, exp.data, 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return state, times

exp, state = build(dict(papers.ROUND_BENCHMARKS["fedavg_fmnist"], client_parallelism="map"))
state, out["fedavg_round"] = time_rounds(exp, state)
del exp, state
m = papers.FSL_MNIST_METHODS["fsl"]
exp, state = build(dict(papers.FSL_MNIST_BASE, algorithm=m["algorithm"], lr=m["lr"], options=dict(m["options"])))
state, out["fsl_round"] = time_rounds(exp, state)
print("RESULT " + json.dumps(out))
"""

# Evaluation in a process of its own: measured after the training rounds in one process, the 'after'
# side's evaluations came out 10-14 % slower although both sides compile identical evaluation programs
# (their optimised HLO compared line by line); alone, neither side is slower.
CHILD_EVALUATION = r"""
import json, sys
import jax
import fedjax_sparse as fjs
from fedjax_sparse import papers
from fedjax_sparse.tools import timing
data_dir = sys.argv[1]
out = {"package": fjs.__file__}
exp = fjs.build(fjs.RunConfig.from_json({**papers.ROUND_BENCHMARKS["fedavg_fmnist"], "data_dir": data_dir,
                                         "seed": 0}))
state = exp.engine.init(jax.random.PRNGKey(0))
out["fedavg_global_eval"] = timing.time_calls(lambda: exp.engine.evaluator.global_stats(state, exp.data), 9)[1]
del exp, state
m = papers.SPAFL_FMNIST_METHODS["spafl"]
exp = fjs.build(fjs.RunConfig.from_json(dict(papers.SPAFL_FMNIST_BASE, algorithm=m["algorithm"], lr=m["lr"],
                                             options=dict(m["options"]), local_epochs=1, data_dir=data_dir, seed=0)))
state = exp.engine.init(jax.random.PRNGKey(0))
state, _ = exp.engine.run_rounds(state, exp.data, 1)
out["spafl_personal_eval"] = timing.time_calls(lambda: exp.engine.evaluator.personal_stats(state, exp.data), 9)[1]
print("RESULT " + json.dumps(out))
"""

# The programs each side compiles for this CPU, normalised (metadata, debug tables and instruction
# numbering dropped) and hashed: equal hashes mean the CPU runs the same program before and after.
CHILD_PROGRAMS = r"""
import hashlib, json, re, sys
import jax, jax.numpy as jnp
import fedjax_sparse as fjs
from fedjax_sparse import papers
data_dir = sys.argv[1]
out = {"package": fjs.__file__}

def normalised(text):
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = "\n".join(l for l in text.splitlines()
                     if not re.match(r"^\d+ |^(FileNames|FunctionNames|FileLocations|StackFrames)", l))
    return hashlib.sha256(re.sub(r"\.\d+", "", text).encode()).hexdigest()

def build(fields):
    exp = fjs.build(fjs.RunConfig.from_json({**fields, "data_dir": data_dir, "seed": 0}))
    return exp, exp.engine.init(jax.random.PRNGKey(0))

def round_program(exp, state):
    return jax.jit(lambda s, d: exp.engine.round_step(s, d)).lower(state, exp.data).compile().as_text()

exp, state = build(dict(papers.ROUND_BENCHMARKS["fedavg_fmnist"], client_parallelism="map"))
out["fedavg_round"] = normalised(round_program(exp, state))
out["fedavg_global_eval"] = normalised(exp.engine.evaluator._global_batch_fn.lower(
    state.server, exp.data, jnp.int32(0)).compile().as_text())
m = papers.SPAFL_FMNIST_METHODS["spafl"]
exp, state = build(dict(papers.SPAFL_FMNIST_BASE, algorithm=m["algorithm"], lr=m["lr"], options=dict(m["options"])))
out["spafl_personal_eval"] = normalised(exp.engine.evaluator._per_client_fn.lower(
    state, exp.data, jnp.int32(3), 128).compile().as_text())
m = papers.FSL_MNIST_METHODS["fsl"]
exp, state = build(dict(papers.FSL_MNIST_BASE, algorithm=m["algorithm"], lr=m["lr"], options=dict(m["options"])))
out["fsl_round"] = normalised(round_program(exp, state))
print("RESULT " + json.dumps(out))
"""

MEASUREMENTS = ("fedavg_round", "fedavg_global_eval", "spafl_personal_eval", "fsl_round")


def measure(checkout: Path, data_dir: str, rounds: int) -> dict:
    """Both children from ``checkout`` (training, then evaluation, each a fresh process)."""
    result: dict = {}
    for child in (CHILD_TRAINING, CHILD_EVALUATION):
        # Run from the checkout: ``-c`` puts the working directory first on sys.path.
        done = subprocess.run([sys.executable, "-c", child, str(Path(data_dir).resolve()), str(rounds)],
                              cwd=checkout, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the measurement in {checkout} failed:\n{done.stderr[-3000:]}")
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
        result.update(json.loads(line.removeprefix("RESULT ")))
        if not result["package"].startswith(str(checkout.resolve())):
            raise SystemExit(f"{checkout} imported {result['package']}, not its own package")
    return result


def programs(checkout: Path, data_dir: str) -> dict:
    """Hashes of the normalised programs ``checkout`` compiles for this CPU (``CHILD_PROGRAMS``)."""
    done = subprocess.run([sys.executable, "-c", CHILD_PROGRAMS, str(Path(data_dir).resolve())], cwd=checkout,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compiling in {checkout} failed:\n{done.stderr[-3000:]}")
    result = json.loads([x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1].removeprefix("RESULT "))
    if not result.pop("package").startswith(str(checkout.resolve())):
        raise SystemExit(f"{checkout} did not import its own package")
    return result


def git_head(checkout: Path) -> str:
    # "-dirty": the checkout's uncommitted changes were measured (the change before its commit).
    return subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty"], capture_output=True,
                          text=True, check=True).stdout.strip()


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if len(xs) % 2 else sum(sorted(xs)[len(xs) // 2 - 1:len(xs) // 2 + 1]) / 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--before-checkout", required=True, type=Path)
    parser.add_argument("--after-checkout", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per process (after a compiling one)")
    parser.add_argument("--repeats", type=int, default=2, help="before/after process pairs, alternating")
    parser.add_argument("--out", required=True)
    parser.add_argument("--programs-only", action="store_true",
                        help="compare the compiled programs only, adding them to an existing --out record")
    args = parser.parse_args(argv)
    sides = {"before": args.before_checkout, "after": args.after_checkout}
    hashes = {side: programs(checkout, args.data_dir) for side, checkout in sides.items()}
    identical = {m: hashes["before"][m] == hashes["after"][m] for m in MEASUREMENTS}
    print("compiled programs identical:", identical, flush=True)
    if args.programs_only:
        record = json.loads(Path(args.out).read_text())
        record["compiled_programs_identical"] = identical
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        return 0
    samples: dict[str, dict[str, list[float]]] = {side: {m: [] for m in MEASUREMENTS} for side in sides}
    for _ in range(args.repeats):
        for side, checkout in sides.items():
            result = measure(checkout, args.data_dir, args.rounds)
            for m in MEASUREMENTS:
                samples[side][m] += result[m]
            print(side, {m: round(median(result[m]), 4) for m in MEASUREMENTS}, flush=True)
    summary = {m: {"before_seconds": median(samples["before"][m]), "after_seconds": median(samples["after"][m]),
                   "after_over_before": median(samples["after"][m]) / median(samples["before"][m])}
               for m in MEASUREMENTS}
    record = {"what": __doc__.split("\n\n")[0], "commits": {s: git_head(c) for s, c in sides.items()},
              "command": "python experiments/bench/bench_conv_before_after.py --data-dir ../shared/data "
                         f"--before-checkout <worktree at {git_head(sides['before'])}> --rounds {args.rounds} "
                         f"--repeats {args.repeats} --out {args.out}",
              "device": f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()})",
              "load_average_at_end": list(os.getloadavg()), "compiled_programs_identical": identical,
              "median_seconds": summary, "samples": samples}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

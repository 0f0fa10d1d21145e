"""XLA:CPU's YNNPACK library fusions on or off, side by side: one round of the papers' settings compiled
twice from the same lowering (the compiler's default, and ``xla_cpu_experimental_ynn_fusion_type`` set to
individual dots only), the two executables timed alternately in one process, with XLA's cost analysis of
each compiled round and whether their results are bitwise equal.

    python experiments/bench/cpu_library_fusions.py --data-dir ../shared/data \\
        --out experiments/results/perf/cpu_library_fusions.json

A measurement for users who choose ``XLA_FLAGS`` on a CPU; the package sets no compiler option.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax

import fedjax_sparse as fjs
from fedjax_sparse import papers
from fedjax_sparse.tools import timing

# The settings of experiments/bench/step_cost.py.
SETTINGS = {
    "fedavg_fmnist_10": papers.ROUND_BENCHMARKS["fedavg_fmnist"],
    "spafl_fmnist_10": papers.ROUND_BENCHMARKS["spafl_fmnist"],
    "fsl_mnist_25": dict(papers.FSL_MNIST_BASE, algorithm="fsl", lr=papers.FSL_SUPERMASK_LR, clients_per_round=25),
    "feddrop_fmnist_100": dict(papers.FEDDROP_FMNIST_BASE, **papers.FEDDROP_PARTICIPATION["full"],
                               algorithm="feddrop", local_epochs=1, options={"budget": 0.5}),
}

OPTION = "xla_cpu_experimental_ynn_fusion_type"
VARIANTS = {"default": None, "dots_only": {OPTION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}}


def measure(name: str, schedule: str, data_dir: str, repeats: int) -> dict:
    exp = fjs.build(fjs.RunConfig.from_json({**SETTINGS[name], "client_parallelism": schedule, "data_dir": data_dir,
                                             "seed": 0}))
    state = exp.engine.init(jax.random.PRNGKey(0))
    lowered = jax.jit(exp.engine.round_fn).lower(state, exp.data)
    compiled, row = {}, {"setting": name, "client_parallelism": schedule, "variants": {}}
    for variant, options in VARIANTS.items():
        t = time.perf_counter()
        compiled[variant] = lowered.compile(options) if options else lowered.compile()
        cost = compiled[variant].cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        row["variants"][variant] = {"compiler_options": options, "compile_seconds": time.perf_counter() - t,
                                    "round_bytes_accessed": cost.get("bytes accessed"), "seconds": []}
    outs = {v: jax.block_until_ready(f(state, exp.data)) for v, f in compiled.items()}
    row["state_bitwise_equal"] = all(bool((a == b).all()) for a, b in zip(
        jax.tree.leaves(outs["default"][0]), jax.tree.leaves(outs["dots_only"][0])))
    row["loss"] = {v: float(o[1]["loss"]) for v, o in outs.items()}
    for r in range(repeats):
        for variant in (list(compiled) if r % 2 == 0 else list(compiled)[::-1]):
            t = time.perf_counter()
            jax.block_until_ready(compiled[variant](state, exp.data))
            row["variants"][variant]["seconds"].append(time.perf_counter() - t)
    medians = {v: statistics.median(r["seconds"]) for v, r in row["variants"].items()}
    row["median_seconds"] = medians
    row["dots_only_over_default"] = medians["dots_only"] / medians["default"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--runs", nargs="+", default=["fedavg_fmnist_10/map", "spafl_fmnist_10/map",
                                                      "fsl_mnist_25/map", "feddrop_fmnist_100/map",
                                                      "fedavg_fmnist_10/vmap"])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    record = {"what": __doc__.split("\n\n")[0], "command": "python experiments/bench/cpu_library_fusions.py "
              f"--data-dir ../shared/data --out {args.out}", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "jax": jax.__version__, "source_hash": timing.source_hash(), "machine": timing.machine_facts(),
              "rows": []}
    for run in args.runs:
        name, schedule = run.split("/")
        row = measure(name, schedule, args.data_dir, args.repeats)
        record["rows"].append(row)
        print(f"{run}: default {row['median_seconds']['default']:.2f} s, dots only "
              f"{row['median_seconds']['dots_only']:.2f} s ({row['dots_only_over_default']:.2f}x)", flush=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

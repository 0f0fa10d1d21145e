"""What one local step costs, per client schedule, for the papers' settings (issue 48 item 1), read from
the round program on this machine: XLA's FLOPs and bytes accessed for one iteration of the local-step
loop, in the program a GPU would run (lowered for CUDA, before fusion) and in the one compiled here (after
fusion), per lockstep iteration and per client-step, and the schedule's executed / useful client-steps
over 50 rounds' cohorts (``fedjax_sparse.tools.bench.step_cost``; ``bench --count-kernels`` reports the same
per variant).

    python experiments/bench/step_cost.py --data-dir ../shared/data --label before \\
        --out experiments/results/perf/step_cost.json

Each ``--label`` is a snapshot kept in ``--out`` beside the others (a change records its before and
after under two labels); ``--source-hash`` of the package says which code each measured.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import jax

import fedjax_sparse as fjs
from fedjax_sparse.tools import bench, timing
from fedjax_sparse import papers

SETTINGS = {
    "fedavg_fmnist_10": papers.ROUND_BENCHMARKS["fedavg_fmnist"],
    "spafl_fmnist_10": papers.ROUND_BENCHMARKS["spafl_fmnist"],
    "fsl_mnist_25": dict(papers.FSL_MNIST_BASE, algorithm="fsl", lr=papers.FSL_SUPERMASK_LR, clients_per_round=25),
    "fsl_mnist_250": dict(papers.FSL_MNIST_BASE, algorithm="fsl", lr=papers.FSL_SUPERMASK_LR, clients_per_round=250),
    "feddrop_fmnist_100": dict(papers.FEDDROP_FMNIST_BASE, **papers.FEDDROP_PARTICIPATION["full"],
                               algorithm="feddrop", local_epochs=1, options={"budget": 0.5}),
}
SCHEDULES = ("vmap", "packed")


def measure(fields: dict, schedule: str, data_dir: str) -> dict:
    exp = fjs.build(fjs.RunConfig.from_json({**fields, "client_parallelism": schedule, "data_dir": data_dir,
                                             "seed": 0}))
    engine = exp.engine
    state = engine.init(jax.random.PRNGKey(0))
    t = time.perf_counter()
    record = bench.step_cost(engine, state, exp.data)
    return {"clients_per_round": engine.clients_per_round, "pack_width": engine.pack_width, **record,
            "seconds_to_measure": time.perf_counter() - t}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=["map", "vmap", "packed"])
    parser.add_argument("--label", required=True, help="the snapshot's name in --out (e.g. before, after)")
    parser.add_argument("--note", default="", help="what the snapshot's code is (e.g. the change it follows)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else {
        "what": __doc__.split("\n\n")[0], "command": "python experiments/bench/step_cost.py --data-dir ../shared/data "
        f"--label LABEL --out {args.out}", "snapshots": {}}
    snapshot = record["snapshots"].setdefault(args.label, {"rows": {}})
    snapshot.update(note=args.note, date=time.strftime("%Y-%m-%d %H:%M:%S"), jax=jax.__version__,
                    source_hash=timing.source_hash())
    for name in args.settings:
        for schedule in args.schedules:
            row = measure(SETTINGS[name], schedule, args.data_dir)
            snapshot["rows"][f"{name}/{schedule}"] = row
            cuda, cpu = row["cost"]["cuda"], row["cost"]["cpu"]
            print(f"{name}/{schedule}: lockstep {row['lockstep_clients']}, cuda {cuda['flops'] / 1e9:.3g} GFLOP "
                  f"{cuda['bytes_accessed'] / 1e9:.3g} GB, cpu {cpu['flops'] / 1e9:.3g} GFLOP "
                  f"{cpu['bytes_accessed'] / 1e9:.3g} GB per step; executed/useful "
                  f"{row['padding']['executed_per_useful']:.3f}", flush=True)
            out.write_text(json.dumps(record, indent=1) + "\n")
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())

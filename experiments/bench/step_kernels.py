"""What one local training step launches, read from the round program (no GPU needed): for the papers'
settings and both client schedules, the kernels one iteration of the local-step loop runs in the
program compiled for this machine, and the ops of the same loop lowered for CUDA before fusion (dots,
convolutions and grouped convolutions among them). The loop is found by the ``local_step`` name
scope ``training.run_local_epochs`` puts on the step (``fedjax_sparse.tools.programs``).

A GPU launches at least one kernel per fused op and library call of a step (a few microseconds each
unless the loop runs as a CUDA graph): the step's count bounds how fast small cohorts can go. On a GPU,
``python -m fedjax_sparse bench`` reports the compiled count of the device's own program.

    python experiments/bench/step_kernels.py --data-dir ../shared/data --out experiments/results/perf/step_kernels.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

import fedjax_sparse as fjs
from fedjax_sparse import papers
from fedjax_sparse.tools import programs

SETTINGS = {
    "fedavg_fmnist": papers.ROUND_BENCHMARKS["fedavg_fmnist"],
    "spafl_fmnist": papers.ROUND_BENCHMARKS["spafl_fmnist"],
    "feddrop_fmnist": dict(papers.FEDDROP_FMNIST_BASE, **papers.FEDDROP_PARTICIPATION["full"], algorithm="feddrop",
                           local_epochs=1, options={"budget": 0.5}),
    "fsl_mnist": dict(papers.FSL_MNIST_BASE, algorithm="fsl", lr=papers.FSL_SUPERMASK_LR),
}
# Ops that stay calls or kernels of their own after fusion.
LIBRARY_OPS = ("dot_general", "convolution", "sort", "custom_call", "scatter")


def step_counts(fields: dict, schedule: str, data_dir: str) -> dict:
    exp = fjs.build(fjs.RunConfig.from_json({**fields, "client_parallelism": schedule, "data_dir": data_dir,
                                             "seed": 0}))
    engine = exp.engine
    state = engine.init(jax.random.PRNGKey(0))
    round_step = jax.jit(lambda s, d: engine.round_step(s, d))
    compiled = round_step.lower(state, exp.data).compile().as_text()
    cpu_step = programs.loop_op_counts(compiled)[0]
    cuda = programs.lowered_text(round_step, state, exp.data, platform="cuda")
    cuda_step = programs.stablehlo_loop_op_counts(cuda)[0]
    # A loop inside the step (FSL's top-k bisections) runs many iterations per step: its kernels are
    # listed apart (per iteration) and not in the step's count.
    return {"clients_per_round": engine.clients_per_round, "batch_size": fields["batch_size"],
            "this_backend": {"backend": jax.default_backend(), "kernels_per_step": cpu_step["kernels"],
                             "loops_inside_step": cpu_step["ops"].get("while", 0), "ops": cpu_step["ops"]},
            "cuda_lowered": {"ops_per_step_before_fusion": cuda_step["total"],
                             "library_ops_per_step": {k: cuda_step["ops"].get(k, 0) for k in LIBRARY_OPS},
                             "loops_inside_step": cuda_step["ops"].get("while", 0),
                             "grouped_convolutions_in_round": len(programs.grouped_convolutions(cuda))}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = {}
    for name in args.settings.split(","):
        for schedule in ("map", "vmap"):
            rows[f"{name}/{schedule}"] = row = step_counts(SETTINGS[name], schedule, args.data_dir)
            print(name, schedule, row["this_backend"]["kernels_per_step"], row["cuda_lowered"], flush=True)
    record = {"what": __doc__.split("\n\n")[0], "command": "python experiments/bench/step_kernels.py --data-dir "
              f"../shared/data --out {args.out}", "jax": jax.__version__, "steps": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

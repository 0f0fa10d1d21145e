"""The project's FSL on MNIST (same RunConfig as
`python -m fedjax_sparse run --algorithm fsl --dataset mnist --model fsl_lenet --num-clients 1000
 --clients-per-round 25 --local-epochs 2 --batch-size 8 --lr 0.4 --partition dirichlet_split:1.0:0.8
 --eval-every 1 ...`), plus, after every round, the global model on the whole MNIST test set (FRL's metric),
written to OUT/mnist_test.json. The project's own metrics.jsonl is written as usual.

    cd /work/main && nice -n 10 .venv/bin/python /work/sidebyside_fsl/run_ours.py --seed 1 --rounds 20 \
        --preprocess standardize --out /work/sidebyside_fsl/runs/ours/seed1
"""
import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import fedjax_sparse as fjs

p = argparse.ArgumentParser()
p.add_argument("--seed", type=int, required=True)
p.add_argument("--rounds", type=int, default=20)
p.add_argument("--out", required=True)
p.add_argument("--preprocess", default="standardize")
p.add_argument("--partition", default="dirichlet_split:1.0:0.8")
p.add_argument("--partition-file", default=None)
p.add_argument("--init-params", default=None)
p.add_argument("--cohort-schedule", default=None)
p.add_argument("--data-dir", default="/work/shared/data")
cli = p.parse_args()

config = fjs.RunConfig(algorithm="fsl", dataset="mnist", data_dir=cli.data_dir, model="fsl_lenet",
                       num_clients=1000, clients_per_round=25, local_epochs=2, batch_size=8, lr=0.4,
                       partition=cli.partition, seed=cli.seed, eval_every=1, rounds=cli.rounds,
                       preprocess=cli.preprocess, out=cli.out, partition_file=cli.partition_file,
                       init_params=cli.init_params, cohort_schedule=cli.cohort_schedule)
out = Path(cli.out)
rows = []
cache = {}
t_prev = [time.perf_counter()]


def on_eval(row, state, exp):
    t0 = time.perf_counter()
    if "fn" not in cache:
        tx = np.asarray(exp.dataset.test_x)
        if tx.ndim == 3:
            tx = tx[..., None]
        cache["x"] = jnp.asarray(tx)
        cache["y"] = np.asarray(exp.dataset.test_y)

        @jax.jit
        def predict(server, x):
            return jnp.argmax(exp.algorithm.global_predict(server, exp.data.preprocess(x)), -1)
        cache["fn"] = predict
    preds = np.concatenate([np.asarray(cache["fn"](state.server, cache["x"][i:i + 1000]))
                            for i in range(0, len(cache["y"]), 1000)])
    acc = float((preds == cache["y"]).mean())
    t1 = time.perf_counter()
    rows.append({"round": row["round"], "mnist_test_accuracy": acc,
                 "accuracy_local_tests_mean": row["accuracy"], "accuracy_local_tests_std": row["accuracy_std"],
                 "global_accuracy_union_local_tests": row.get("global_accuracy"),
                 "round_wall_seconds": t0 - t_prev[0], "mnist_eval_seconds": t1 - t0})
    (out / "mnist_test.json").write_text(json.dumps({"seed": cli.seed, "preprocess": cli.preprocess,
                                                     "rounds": rows}, indent=1))
    print(f"round {row['round']}: mnist test {acc:.4f} local-test mean {row['accuracy']:.4f} "
          f"({t0 - t_prev[0]:.1f}s)", flush=True)
    t_prev[0] = time.perf_counter()


summary = dict(fjs.run(config, overwrite=True, progress=False, on_eval=on_eval).summary)
print(json.dumps({k: summary[k] for k in summary if not isinstance(summary[k], (dict, list))}, default=str))

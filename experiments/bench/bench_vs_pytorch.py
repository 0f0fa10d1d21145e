"""This project's SpaFL Fashion-MNIST round against a plain PyTorch implementation of the same
round (``experiments/tools/torch_spafl.py``), on identical draws, in one invocation; optionally also
the SpaFL authors' own code. Writes both times and their ratios as JSON.

The real measurement (CPU; run it when the machine is otherwise idle; a few minutes):

    .venv/bin/python experiments/bench/bench_vs_pytorch.py --torch-python /work/sidebyside/torchenv/bin/python \\
        --authors 6 --out experiments/results/perf/bench_vs_pytorch_cpu.json

(with torch installed in the project env, ``pip install -e .[bench]``, ``--torch-python`` can be
left out: it defaults to this interpreter). ``--threads`` (default 2) sets the PyTorch sides'
``torch.set_num_threads``; JAX keeps XLA's default pool. On a loaded machine two OpenMP threads
collapse (measured at load 7 on 2 cores: 290 ms per LeNet step with 2 threads, 68 ms with 1), so
only a quiet machine gives a meaningful 2-thread number; ``--threads 1`` is the fallback.

Smoke run (minutes, not a measurement): ``--num-clients 10 --clients-per-round 2 --local-epochs 1
--rounds 1 --threads 1 --out /tmp/bench_smoke.json``.

What is timed, per round (median, min and max over ``--rounds`` rounds after ``--warmup``
warm-up rounds; the JAX warm-up includes compilation):

* ``train``: the training part of a round - broadcast, eq. (13), 5 local epochs of the 10
  sampled clients, threshold aggregation. JAX: ``engine.advance(state, data, 1, "scan")`` (what
  ``fjs.run`` calls per round with ``eval_every=1``, metrics fetched to the host);
* ``eval``: every one of the 100 clients on its own test set with its personal masked model
  (JAX: ``engine.evaluate``, as ``fjs.run`` does after every round);
* ``round``: both.

The setting is ``experiments/reproduce/spafl_fmnist.py``'s (``fedjax_sparse.papers``: 100 clients,
Dirichlet 0.2 with per-client test mix, 10 per round, 5 local epochs, batch 64, LeNet-5-Caffe,
raw 0-255 inputs, lr 0.001, momentum 0.9 kept per client, alpha 0.002 with the ramp). Both sides
get the same draws: the partition built by the project (``--seed``), the project's initial
weights (exported in ``fedjax_sparse/driver/pinning.py``'s layouts) and one cohort schedule (numpy,
``--seed``) that the JAX engine replays via ``cohort_schedule``; they are written to a temporary
folder with the images and read by the PyTorch process (``--torch-python``), which prints its
timings as JSON. Shuffling RNGs differ (torch vs JAX).

Semantics checks (printed and recorded under ``semantics_check``): the initial model's logits on 8
test images agree (layout check, ~1e-5); ``--fixed-batch-steps`` SpaFL steps on fixed, unshuffled
batches of client 0's data give the same cross-entropy sequence on both sides (no RNG involved:
float precision, ~1e-4); and, loosely, the cohort's mean training cross-entropy of the first round
(different shuffling RNGs, so a few percent apart with the full setting; with raw 0-255 inputs
the first steps' losses are ~10 and dominate small smoke settings).

``--authors N``: also runs the authors' FMNIST code (news-vt/SpaFL_NeruIPS_2024 ``main/fmnist``,
via ``experiments/tools/sidebyside/spafl_authors/run_authors.py`` under ``--torch-python``, with
``--threads`` torch threads) for N rounds on *its own* seed-1 draws, reads its per-round seconds
(``curve.json``: ``round_seconds``, training plus evaluation of all 100 clients, so comparable to
``round``), and then runs ``torch_spafl.py`` on exactly those exported draws (partition,
initial weights, cohorts) for N rounds, so the two PyTorch loops are compared on identical work.
Medians skip the first round. Needs the authors' code where ``run_authors.py`` expects it
(``/work/sidebyside/spafl_authors/main/fmnist``) and the IDX files at
``/work/shared/data/fashion_mnist``; if it fails, the JSON says so (``authors.ran: false`` with
the driver's stderr) instead of a time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import fedjax_sparse as fjs
from fedjax_sparse import papers

TOOLS = Path(__file__).resolve().parents[1] / "tools"
REPO = TOOLS.parents[1]
# Scripts this one starts (never imports): the PyTorch loop and the authors'-code driver.
TORCH_WORKER = TOOLS / "torch_spafl.py"
AUTHORS_DRIVER = TOOLS / "sidebyside" / "spafl_authors" / "run_authors.py"
AUTHORS_EPOCHS = 5   # run_authors.py always runs their FMNIST setting (100 clients, 10 per round, 5 epochs)


def summary(seconds) -> dict:
    s = np.asarray(seconds, np.float64)
    return {"median": float(np.median(s)), "min": float(s.min()), "max": float(s.max()),
            "per_round": [float(x) for x in s]}


def run_jax(args, workdir: Path) -> tuple[dict, dict]:
    """Builds the experiment, exports its draws to ``workdir`` and times the JAX rounds."""
    import jax

    from fedjax_sparse.driver import pinning
    total = args.warmup + args.rounds
    rng = np.random.default_rng(args.seed)
    pinning.write_cohort_schedule(
        np.stack([rng.choice(args.num_clients, args.clients_per_round, replace=False) for _ in range(total)]),
        workdir / "cohorts.json")
    base = dict(papers.SPAFL_FMNIST_BASE, num_clients=args.num_clients, clients_per_round=args.clients_per_round,
                local_epochs=args.local_epochs)
    config = fjs.RunConfig.from_json(dict(
        algorithm="spafl", lr=0.001, seed=args.seed, rounds=total, data_dir=args.data_dir,
        options=dict(papers.SPAFL_FMNIST_OPTIONS), cohort_schedule=str(workdir / "cohorts.json"),
        client_parallelism=args.client_parallelism, personal_eval=args.personal_eval, **base))
    exp = fjs.build(config)
    engine, data = exp.engine, exp.data
    state = engine.init(jax.random.PRNGKey(config.seed))
    params0 = jax.tree_util.tree_map(lambda x: np.asarray(x[0]), state.clients.params)
    pinning.save_init_params({"params": params0}, workdir / "init_params.npz")
    (workdir / "partition.json").write_text(json.dumps(
        pinning.partition_to_json(exp.partition, dataset=config.dataset, seed=config.seed)))
    np.savez(workdir / "data.npz", train_x=np.asarray(data.train_x), train_y=np.asarray(data.train_y),
             test_x=np.asarray(data.test_x), test_y=np.asarray(data.test_y))
    fixed_ce = fixed_batch_check(exp, params0, np.asarray(exp.partition.train_indices[0]), args.fixed_batch_steps)
    x8 = data.preprocess(data.test_x[:8])
    init_logits = np.asarray(exp.model.apply({"params": params0, "batch_stats": {}}, x8, train=False)[0])

    rows = []
    for r in range(total):
        t0 = time.perf_counter()
        state, metrics = engine.advance(state, data, 1, "scan")
        t1 = time.perf_counter()
        ev = engine.evaluate(state, data)
        t2 = time.perf_counter()
        rows.append({"round": r + 1, "train_seconds": t1 - t0, "eval_seconds": t2 - t1, "round_seconds": t2 - t0,
                     "loss": float(metrics["loss"][0]), "examples": int(metrics["num_examples"][0]),
                     "accuracy": ev["accuracy"], "test_loss": ev["test_loss"],
                     "density_all_clients": ev.get("density_all_clients")})
        print("[jax]", json.dumps(rows[-1]), file=sys.stderr, flush=True)
    from fedjax_sparse.core.evaluation import resolve_personal_eval
    info = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "path": {"round": "engine.advance(state, data, 1, 'scan') then engine.evaluate (as fjs.run)",
                     "client_parallelism": engine.mode, "personal_eval": config.execution.personal_eval,
                     "personal_eval_resolved": resolve_personal_eval(config.execution.personal_eval),
                     "eval_batch_size": engine.eval_batch_size},
            "threads": "XLA CPU default (its intra-op pool spans all visible cores)",
            "rounds": rows, "init_logits": init_logits.tolist(), "fixed_batch_ce": fixed_ce,
            "config": config.to_json()}
    return info, {"train": [r["train_seconds"] for r in rows], "eval": [r["eval_seconds"] for r in rows],
                  "round": [r["round_seconds"] for r in rows]}


def fixed_batch_check(exp, params0, client_rows, steps: int) -> list[float]:
    """JAX twin of ``torch_spafl.fixed_batch_check``: ``steps`` SpaFL local steps (the project's
    ``spafl_local_step``, SGD momentum, regulariser alpha without the ramp) from the initial weights
    on fixed, unshuffled batches of client 0's first 640 samples (in partition order)."""
    import jax
    import jax.numpy as jnp
    import optax

    from fedjax_sparse.algorithms import spafl_family as spafl
    from fedjax_sparse.core.training import Batch
    data, bs = exp.data, exp.config.batch_size
    options = {**spafl.SPAFL_OPTIONS, **exp.config.options}
    setup = spafl.make_setup(exp.model, options)
    opt = optax.trace(decay=options["momentum"])
    rows = client_rows[:640]
    x = data.preprocess(data.train_x[jnp.asarray(rows)])
    y = data.train_y[jnp.asarray(rows)]
    trainable = {"params": params0, "tau": spafl.init_thresholds(setup.layers)}
    carry = spafl.SpaflCarry(trainable, {}, opt.init(trainable), {layer.name: jnp.ones(()) for layer in setup.layers},
                             jnp.zeros((len(exp.model.layers),), jnp.int32), jnp.zeros(()))
    step = jax.jit(lambda c, b: spafl.spafl_local_step(setup, opt, jnp.float32(exp.config.lr),
                                                       jnp.float32(options["alpha"]), c, b))
    num_batches = max(len(rows) // bs, 1)
    out = []
    for s in range(steps):
        b = s % num_batches
        carry, ce = step(carry, Batch(x[b * bs:(b + 1) * bs], y[b * bs:(b + 1) * bs], jnp.ones((bs,), jnp.float32)))
        out.append(float(ce))
    return out


def run_torch(args, inputs: Path, rounds: int, extra=(), epochs: int | None = None) -> dict:
    cmd = [args.torch_python, str(TORCH_WORKER), "--inputs", str(inputs), "--rounds", str(rounds),
           "--epochs", str(epochs or args.local_epochs), "--threads", str(args.threads), "--seed", str(args.seed),
           "--fixed-batch-steps", str(args.fixed_batch_steps), *extra]
    print("[torch]", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["command"] = cmd
    return result


def per_phase(rows, skip: int) -> dict:
    timed = rows[skip:]
    return {k: summary([r[f"{k}_seconds"] for r in timed]) for k in ("train", "eval", "round")}


def run_authors(args, workdir: Path) -> dict:
    out = workdir / "authors"
    cmd = [args.torch_python, str(AUTHORS_DRIVER), "--seed", str(args.authors_seed), "--rounds", str(args.authors),
           "--threads", str(args.threads), "--out", str(out)]
    print("[authors]", " ".join(cmd), file=sys.stderr, flush=True)
    load_before = os.getloadavg()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    curve_path = out / "curve.json"
    if proc.returncode != 0 or not curve_path.exists():
        return {"ran": False, "command": cmd, "returncode": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    curve = json.loads(curve_path.read_text())
    rounds = curve["rounds"]
    partition = json.loads((out / "partition.json").read_text())
    cohorts = json.loads((out / "cohorts.json").read_text())["rounds"]
    counts = [len(c["train_indices"]) for c in partition["clients"]]
    examples = [AUTHORS_EPOCHS * sum(counts[c] for c in row) for row in cohorts[:len(rounds)]]
    seconds = [r["round_seconds"] for r in rounds]
    result = {"ran": True, "command": cmd, "commit": curve.get("authors_commit"), "threads": curve.get("threads"),
              "torch": curve.get("torch"), "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "round": summary(seconds[1:] if len(seconds) > 1 else seconds),
              "rounds": [dict(r, examples=e) for r, e in zip(rounds, examples)],
              "note": "round_seconds = training of the cohort + evaluation of all 100 clients (between two "
                      "wandb.log calls); the first round is not in the median"}
    # Our PyTorch loop on exactly the authors' draws (partition, initial weights, cohorts).
    ours = run_torch(args, workdir, len(rounds),
                     ["--partition", str(out / "partition.json"), "--cohorts", str(out / "cohorts.json"),
                      "--init", str(out / "init_params.npz"), "--eq13-divisor", "kernel_area"], epochs=AUTHORS_EPOCHS)
    skip = 1 if len(ours["rounds"]) > 1 else 0
    result["torch_spafl_on_authors_draws"] = {"round": per_phase(ours["rounds"], skip)["round"],
                                              "rounds": ours["rounds"], "command": ours["command"],
                                              "eq13_divisor": "kernel_area (as the authors' code)"}
    result["ratio_torch_spafl_over_authors_round"] = (result["torch_spafl_on_authors_draws"]["round"]["median"]
                                                      / result["round"]["median"])
    result["torch_spafl_no_slower_than_authors"] = result["ratio_torch_spafl_over_authors_round"] <= 1.0
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"))
    parser.add_argument("--out", default="experiments/results/perf/bench_vs_pytorch_cpu.json")
    parser.add_argument("--torch-python", default=sys.executable,
                        help="interpreter with torch for the PyTorch side (default: this one)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads of the PyTorch side(s)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--num-clients", type=int, default=papers.SPAFL_FMNIST_BASE["num_clients"],
                        help="override (smoke tests)")
    parser.add_argument("--clients-per-round", type=int, default=papers.SPAFL_FMNIST_BASE["clients_per_round"],
                        help="override (smoke tests)")
    parser.add_argument("--local-epochs", type=int, default=papers.SPAFL_FMNIST_BASE["local_epochs"],
                        help="override (smoke)")
    parser.add_argument("--client-parallelism", default="auto")
    parser.add_argument("--personal-eval", default="auto")
    parser.add_argument("--authors", type=int, default=0, metavar="N",
                        help="also run the authors' code for N rounds (0: no)")
    parser.add_argument("--authors-seed", type=int, default=1)
    parser.add_argument("--fixed-batch-steps", type=int, default=20,
                        help="steps of the RNG-free semantics check (both sides, fixed batches)")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first JAX round compiles)")

    load_start = os.getloadavg()
    date = time.strftime("%Y-%m-%d %H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="bench_vs_pytorch_") as tmp:
        workdir = Path(tmp)
        jax_info, _ = run_jax(args, workdir)
        load_after_jax = os.getloadavg()
        torch_result = run_torch(args, workdir, args.warmup + args.rounds)
        load_after_torch = os.getloadavg()
        authors = run_authors(args, workdir) if args.authors else {"ran": False, "reason": "--authors not given"}

    jax_t = per_phase(jax_info["rounds"], args.warmup)
    torch_t = per_phase(torch_result["rounds"], args.warmup)
    ratios = {k: torch_t[k]["median"] / jax_t[k]["median"] for k in ("train", "eval", "round")}
    from fedjax_sparse.tools import timing
    loss_j, loss_t = jax_info["rounds"][0]["loss"], torch_result["rounds"][0]["loss"]
    logits_diff = float(np.max(np.abs(np.asarray(jax_info["init_logits"]) - np.asarray(torch_result["init_logits"]))))
    j0, t0 = jax_info["rounds"][0], torch_result["rounds"][0]
    ce_j, ce_t = jax_info["fixed_batch_ce"], torch_result["fixed_batch_ce"]
    check = {"round1_train_loss": {"jax": loss_j, "torch": loss_t,
                                   "relative_difference": abs(loss_t - loss_j) / loss_j},
             "round1_accuracy": {"jax": j0["accuracy"], "torch": t0["accuracy"]},
             "round1_density_all_clients": {"jax": j0["density_all_clients"], "torch": t0["density_all_clients"]},
             "init_logits_max_abs_difference": logits_diff,
             "fixed_batch_ce": {"jax": ce_j, "torch": ce_t,
                                "max_abs_difference": float(np.max(np.abs(np.subtract(ce_j, ce_t)))) if ce_j else None},
             "init_logits_scale": float(np.max(np.abs(np.asarray(jax_info["init_logits"]))))}
    report = {
        "what": "SpaFL FMNIST round: fedjax_sparse (JAX) vs plain PyTorch (experiments/tools/torch_spafl.py)",
        "date": date,
        "command": [sys.executable, *sys.argv],
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor(), "machine": platform.machine(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_start": load_start, "load_average_after_jax": load_after_jax,
                    "load_average_after_torch": load_after_torch, "load_average_end": os.getloadavg(),
                    **timing.machine_facts()},
        "versions": {"jax": jax_info["jax"], "torch": torch_result["torch"], "numpy": np.__version__,
                     "torch_numpy": torch_result["numpy"]},
        "threads": {"torch": torch_result["threads"], "torch_interop": torch_result["interop_threads"],
                    "jax": jax_info["threads"]},
        "setting": {**papers.SPAFL_FMNIST_BASE, "num_clients": args.num_clients,
                    "clients_per_round": args.clients_per_round, "local_epochs": args.local_epochs,
                    "algorithm": "spafl", "lr": 0.001, "options": papers.SPAFL_FMNIST_OPTIONS,
                    "seed": args.seed, "warmup_rounds": args.warmup, "timed_rounds": args.rounds,
                    "examples_per_round": [r["examples"] for r in jax_info["rounds"]]},
        "jax": {"path": jax_info["path"], "backend": jax_info["backend"], "devices": jax_info["devices"],
                "warmup_round_seconds_incl_compile": jax_info["rounds"][0]["round_seconds"], **jax_t,
                "rounds": jax_info["rounds"]},
        "torch": {"command": torch_result["command"], **torch_t, "rounds": torch_result["rounds"]},
        "ratio_torch_over_jax": ratios,
        "semantics_check": check,
        "authors": authors,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"round-1 training loss: jax {loss_j:.4f}  torch {loss_t:.4f}  "
          f"(relative difference {check['round1_train_loss']['relative_difference']:.2%}); "
          f"initial logits max |diff| {logits_diff:.2e}; fixed-batch CE max |diff| "
          f"{check['fixed_batch_ce']['max_abs_difference']}")
    for k in ("train", "eval", "round"):
        print(f"{k:5s}: jax {jax_t[k]['median']:.3f} s  torch {torch_t[k]['median']:.3f} s  "
              f"torch/jax {ratios[k]:.2f}")
    if authors.get("ran"):
        print(f"authors' code round {authors['round']['median']:.3f} s, torch_spafl on their draws "
              f"{authors['torch_spafl_on_authors_draws']['round']['median']:.3f} s "
              f"(ratio {authors['ratio_torch_spafl_over_authors_round']:.2f})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

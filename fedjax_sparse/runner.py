"""The experiment driver: config -> data, model, algorithm, engine -> outputs.

``run(RunConfig(...))`` is what the CLI and the experiment scripts call. It
runs rounds in jitted chunks of ``eval_every`` rounds (``lax.scan``), and
between chunks evaluates, appends one JSON line to ``OUT/metrics.jsonl``,
saves a checkpoint (so ``resume=True`` continues an interrupted run exactly)
and updates the progress bar.

Output files (a public contract: keys are only ever added):
* ``config.json``  - the resolved config, algorithm options and environment;
* ``metrics.jsonl`` - per evaluated round: round, accuracy (personalised
  mean), accuracy_std/min/max, global_accuracy (null without a global model),
  loss (training loss of that round), test_loss, uplink_bits, downlink_bits,
  flops, density (that round), seconds (since start), total_uplink_bits,
  total_downlink_bits, total_flops (cumulative), plus algorithm extras;
* ``summary.json`` - final and best accuracy, totals, speed, memory.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse import pinning
from fedjax_sparse.algorithms import Task, make_algorithm
from fedjax_sparse.algorithms.registry import algorithm_names, resolve_options
from fedjax_sparse.data.federated import PREPROCESSING, FederatedData, build_federated_data
from fedjax_sparse.engine import CLIENT_PARALLELISM, Engine, EngineState
from fedjax_sparse.models import make_model, model_names

ROUND_MODES = ("scan", "per_round")
CHECKPOINT = "checkpoint.npz"


class RunError(ValueError):
    """A user error in a run's configuration or output directory."""


# Model used when --model is not given.
DEFAULT_MODELS = {
    "mnist": "lenet5_caffe", "fashion_mnist": "lenet5_caffe", "emnist_letters": "lenet5_caffe",
    "digits": "cnn_small", "synthetic": "logreg", "cifar10": "cnn7", "cifar10_sample": "cnn7",
    "cifar100": "resnet18_narrow", "svhn": "lenet5_caffe",
}


@dataclasses.dataclass
class RunConfig:
    algorithm: str = "fedavg"
    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False
    model: str | None = None
    num_clients: int = 20
    clients_per_round: int = 5
    resample_every: int = 1  # keep each sampled cohort for this many rounds
    rounds: int = 30
    local_epochs: int = 2
    batch_size: int = 32
    lr: float = 0.1
    partition: str = "dirichlet:0.5"
    min_client_samples: int = 1  # the partition is redrawn until every client has this many
    seed: int = 0
    eval_every: int = 1
    out: str | None = None
    preprocess: str = "unit"
    client_parallelism: str = "auto"
    round_mode: str = "scan"
    eval_batch_size: int | None = None  # None: auto (see auto_eval_batch_size)
    # Pinned draws (fedjax_sparse.pinning): replay another run's partition, initial weights, cohorts.
    partition_file: str | None = None
    init_params: str | None = None
    cohort_schedule: str | None = None
    options: dict = dataclasses.field(default_factory=dict)
    model_options: dict = dataclasses.field(default_factory=dict)
    dataset_options: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "RunConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise RunError(f"unknown config key(s) {unknown}; valid keys: {sorted(names)}")
        return cls(**data)


def validate(config: RunConfig):
    """Raises RunError naming the problem and the fix; returns the algorithm's typed options."""
    positive = dict(num_clients=config.num_clients, clients_per_round=config.clients_per_round,
                    resample_every=config.resample_every,
                    rounds=config.rounds, local_epochs=config.local_epochs,
                    batch_size=config.batch_size, eval_every=config.eval_every,
                    eval_batch_size=config.eval_batch_size if config.eval_batch_size is not None else 1)
    for name, value in positive.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RunError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if not (isinstance(config.lr, (int, float)) and math.isfinite(config.lr) and config.lr > 0):
        raise RunError(f"--lr must be a positive number, got {config.lr!r}")
    if config.clients_per_round > config.num_clients:
        raise RunError(f"--clients-per-round ({config.clients_per_round}) is larger than --num-clients "
                       f"({config.num_clients}); sample at most as many clients as there are")
    if config.algorithm not in algorithm_names():
        raise RunError(f"unknown algorithm {config.algorithm!r}; valid algorithms: {', '.join(algorithm_names())}")
    if config.model is not None and config.model not in model_names():
        raise RunError(f"unknown model {config.model!r}; valid models: {', '.join(model_names())}")
    from fedjax_sparse.data import datasets
    if config.dataset not in datasets.DATASETS:
        raise RunError(f"unknown dataset {config.dataset!r}; valid datasets: {', '.join(datasets.DATASETS)}")
    if config.preprocess not in PREPROCESSING:
        raise RunError(f"unknown --preprocess {config.preprocess!r}; valid: {', '.join(PREPROCESSING)}")
    if config.client_parallelism not in CLIENT_PARALLELISM:
        raise RunError(f"unknown --client-parallelism {config.client_parallelism!r}; valid: "
                       f"{', '.join(CLIENT_PARALLELISM)}")
    if config.round_mode not in ROUND_MODES:
        raise RunError(f"unknown --round-mode {config.round_mode!r}; valid: {', '.join(ROUND_MODES)}")
    try:
        return resolve_options(config.algorithm, config.options)
    except ValueError as e:
        raise RunError(str(e)) from None


@dataclasses.dataclass
class Experiment:
    """Everything built from a config, ready to run (also handy in notebooks)."""
    config: RunConfig
    dataset: Any
    partition: Any
    data: FederatedData
    task: Task
    engine: Engine

    # Paths and sha256 of the pinned-draw files used ({} when none).
    pinned: dict = dataclasses.field(default_factory=dict)

    @property
    def algorithm(self):
        return self.engine.algorithm

    @property
    def model(self):
        return self.task.model


def build(config: RunConfig) -> Experiment:
    options = validate(config)   # resolved once: typed, before any data is loaded
    from fedjax_sparse.data import datasets, partition as partition_lib
    dataset_options = dict(config.dataset_options)
    if config.dataset == "synthetic":
        dataset_options.setdefault("num_clients", config.num_clients)
        dataset_options.setdefault("seed", config.seed)
    dataset = datasets.load_dataset(config.dataset, config.data_dir, download=config.download,
                                    **dataset_options)
    min_samples = config.min_client_samples
    pinned = {}
    try:
        if config.partition_file:
            partition = pinning.load_partition_file(config.partition_file, dataset, config.num_clients)
            pinned["partition_file"] = {"path": config.partition_file,
                                        "sha256": pinning.file_digest(config.partition_file)}
        else:
            partition = partition_lib.partition_dataset(dataset, config.partition, config.num_clients,
                                                        config.seed, min_train_samples=min_samples)
        data = build_federated_data(dataset, partition, preprocess=config.preprocess)
    except datasets.DataError:
        raise
    except ValueError as e:
        raise RunError(str(e)) from None
    model_name = config.model or DEFAULT_MODELS.get(config.dataset, "mlp")
    model = make_model(model_name, data.input_shape, data.num_classes, **config.model_options)
    initial_variables = None
    if config.init_params:
        if getattr(options, "init", "model") != "model":
            raise RunError(f"--init-params gives the initial weights, but {config.algorithm} re-initialises "
                           f"them (option init={options.init!r}); add --option init=model")
        template = jax.eval_shape(model.init, jax.random.PRNGKey(0))
        try:
            variables, extras = pinning.load_init_params(config.init_params, template)
        except ValueError as e:
            raise RunError(str(e)) from None
        model = dataclasses.replace(model, init_fn=_constant_init(variables))
        initial_variables = dict(variables)
        if extras:
            initial_variables["scores"] = {k.split("/")[1]: v for k, v in extras.items()}
        pinned["init_params"] = {"path": config.init_params, "sha256": pinning.file_digest(config.init_params)}
    schedule = None
    if config.cohort_schedule:
        if config.resample_every != 1:
            raise RunError("--cohort-schedule fixes every round's cohort; drop --resample-every")
        try:
            schedule = pinning.load_cohort_schedule(config.cohort_schedule, num_clients=config.num_clients,
                                                    clients_per_round=config.clients_per_round,
                                                    rounds=config.rounds)
        except ValueError as e:
            raise RunError(str(e)) from None
        pinned["cohort_schedule"] = {"path": config.cohort_schedule,
                                     "sha256": pinning.file_digest(config.cohort_schedule)}
    task = Task(model=model, num_clients=config.num_clients, clients_per_round=config.clients_per_round,
                local_epochs=config.local_epochs, batch_size=config.batch_size, lr=float(config.lr),
                rounds=config.rounds, preprocess=data.preprocess,
                train_counts=np.asarray(data.train_count), seed=config.seed,
                initial_variables=initial_variables)
    algorithm = make_algorithm(config.algorithm, task, options)
    engine = Engine(algorithm, config.num_clients, config.clients_per_round,
                    client_parallelism=config.client_parallelism, resample_every=config.resample_every,
                    eval_batch_size=config.eval_batch_size or auto_eval_batch_size(data),
                    cohort_schedule=None if schedule is None else tuple(map(tuple, schedule.tolist())))
    return Experiment(config, dataset, partition, data, task, engine, pinned)


def _constant_init(variables: dict):
    """model.init replacement returning the pinned variables whatever the key."""
    def init(key):
        return jax.tree_util.tree_map(jnp.asarray, variables)
    return init




def auto_eval_batch_size(data: FederatedData, cap: int = 512) -> int:
    """Smallest power of two >= the mean client test-set size (at most ``cap``):
    each client's test set is cut into ceil(n / B) batches, so a batch much
    larger than a client's test set is mostly padding."""
    counts = np.asarray(data.test_count)
    mean = float(counts[counts > 0].mean()) if (counts > 0).any() else 1.0
    return int(min(cap, max(16, 2 ** math.ceil(math.log2(max(mean, 1.0))))))


# ---------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, state: EngineState, totals: dict) -> None:
    """Atomic: write a temp file, then rename over the old checkpoint."""
    leaves = jax.tree_util.tree_leaves(jax.device_get(state))
    tmp = path.with_suffix(".tmp.npz")
    with open(tmp, "wb") as f:
        np.savez(f, *[np.asarray(x) for x in leaves], totals=json.dumps(totals))
    os.replace(tmp, path)


def read_metrics(out: str | Path) -> list[dict]:
    """The rows of ``OUT/metrics.jsonl`` (one per evaluated round); [] when there is none yet."""
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_checkpoint(path: Path, template: EngineState) -> tuple[EngineState, dict]:
    leaves, treedef = jax.tree_util.tree_flatten(template)
    try:
        with np.load(path) as f:
            loaded = [f[f"arr_{i}"] for i in range(len(leaves))]
            totals = json.loads(str(f["totals"]))
    except (OSError, KeyError, ValueError) as e:
        raise RunError(f"checkpoint {path} is unreadable or from another configuration ({e}); "
                       "start a fresh run in a new --out directory") from None
    for new, old in zip(loaded, leaves):
        if new.shape != old.shape:
            raise RunError(f"checkpoint {path} does not match this configuration (a leaf of shape "
                           f"{new.shape} where {old.shape} is expected); use a new --out directory")
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in loaded]), totals


# ---------------------------------------------------------------- progress
class Progress:
    """A one-line progress bar on stderr (round, accuracy, rounds/s, ETA)."""

    def __init__(self, total: int, start_round: int, enabled: bool):
        self.total, self.start_round, self.enabled = total, start_round, enabled
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, round_: int, accuracy: float | None) -> None:
        if not self.enabled:
            return
        done = round_ - self.start_round
        elapsed = time.perf_counter() - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - round_) / rate if rate > 0 else float("nan")
        width = 24
        filled = int(width * round_ / max(self.total, 1))
        acc = "  n/a " if accuracy is None else f"{100 * accuracy:5.2f}%"
        eta_s = "--:--" if not math.isfinite(eta) else time.strftime("%H:%M:%S", time.gmtime(eta))
        line = (f"round {round_:>5d}/{self.total} |{'#' * filled}{'.' * (width - filled)}| "
                f"acc {acc} | {rate:6.2f} rounds/s | ETA {eta_s}")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


# ---------------------------------------------------------------- the run
COST_KEYS = ("uplink_bits", "downlink_bits", "flops")


def _exact_number(value):
    """A recorded cost as an exact Python int when it is integral (older checkpoints stored floats)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _jsonable(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def prepare_out_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise RunError(f"--out {out} exists and is not a directory; choose another --out")
    if resume:
        if not (out / CHECKPOINT).exists():
            raise RunError(f"nothing to resume in {out}: no {CHECKPOINT} there; run without --resume")
        return
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise RunError(f"output directory {out} is not empty (it holds a previous run); pass --resume "
                           "to continue it, --overwrite to replace it, or choose another --out")
        for name in ("config.json", "metrics.jsonl", "summary.json", CHECKPOINT):
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def run(config: RunConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
        on_eval: Callable[[dict, EngineState, Experiment], None] | None = None,
        experiment: Experiment | None = None) -> dict:
    """Runs an experiment; returns the summary dict (also written to OUT/summary.json).

    ``on_eval(row, state, experiment)`` is called after every evaluation (e.g.
    to record masks for plots). ``experiment`` reuses an already built one.
    """
    out = Path(config.out) if config.out else None
    if out is not None:
        prepare_out_dir(out, resume=resume, overwrite=overwrite)
        if resume:
            saved = RunConfig.from_json(json.loads((out / "config.json").read_text())["config"])
            saved.rounds = config.rounds if config.rounds > saved.rounds else saved.rounds
            saved.out = config.out
            config = saved
    t_build = time.perf_counter()
    exp = experiment or build(config)
    engine, data = exp.engine, exp.data
    build_seconds = time.perf_counter() - t_build
    state = engine.init(jax.random.PRNGKey(config.seed))
    # Costs are exact Python ints (float only for expectations such as FedDrop's FLOPs).
    totals = {"round": 0, "uplink_bits": 0, "downlink_bits": 0, "flops": 0, "seconds": 0.0}
    rows: list[dict] = []
    if out is not None:
        if resume:
            state, totals = load_checkpoint(out / CHECKPOINT, state)
            totals = {k: _exact_number(v) if k in COST_KEYS else v for k, v in totals.items()}
            rows = [r for r in read_metrics(out) if r["round"] <= totals["round"]]  # drop rows past the checkpoint
            (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "config.json").write_text(json.dumps({
            "config": config.to_json(), "algorithm_options": exp.algorithm.hparams,
            "model": exp.model.name, "num_params": exp.model.num_params,
            "forward_macs_per_example": exp.model.forward_macs,
            "pinned_draws": exp.pinned, "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "python": platform.python_version(),
            "client_parallelism": engine.mode}, indent=2))
    bar = Progress(config.rounds, int(totals["round"]), progress)
    t0 = time.perf_counter() - float(totals["seconds"])
    compile_seconds = 0.0
    while int(totals["round"]) < config.rounds:
        n = min(config.eval_every - int(totals["round"]) % config.eval_every, config.rounds - int(totals["round"]))
        t_chunk = time.perf_counter()
        state, metrics = engine.advance(state, data, n, config.round_mode)
        if not rows and int(totals["round"]) == 0:
            compile_seconds = time.perf_counter() - t_chunk  # first chunk includes compilation
        bad = [int(totals["round"]) + i + 1 for i in range(n) if not np.isfinite(metrics["loss"][i])]
        totals["round"] = int(totals["round"]) + n
        for key in COST_KEYS:
            totals[key] = totals[key] + sum(metrics[key].tolist())
        evaluation = engine.evaluate(state, data)
        totals["seconds"] = time.perf_counter() - t0
        row = {"round": totals["round"],
               **{k: v for k, v in evaluation.items() if k != "client_accuracies"},
               "loss": float(metrics["loss"][-1]),
               "uplink_bits": metrics["uplink_bits"][-1],
               "downlink_bits": metrics["downlink_bits"][-1],
               "flops": metrics["flops"][-1],
               "density": float(metrics["density"][-1]),
               # The same value under an explicit name: the mean over the round's sampled clients
               # (``density_all_clients``, when the algorithm has personal models, is over all clients).
               "density_sampled": float(metrics["density"][-1]),
               "seconds": totals["seconds"],
               "total_uplink_bits": totals["uplink_bits"],
               "total_downlink_bits": totals["downlink_bits"],
               "total_flops": totals["flops"]}
        for key, value in metrics.items():
            if key not in row and key != "num_examples":
                row[key] = float(value[-1])
        row = {k: _jsonable(v) for k, v in row.items()}
        rows.append(row)
        if out is not None:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        if bad:
            bar.close()
            raise RunError(f"training diverged: the loss is NaN/inf at round {bad[0]}; lower --lr "
                           f"(now {config.lr}) or check the data preprocessing (--preprocess)")
        if out is not None:
            save_checkpoint(out / CHECKPOINT, state, totals)
        if on_eval is not None:
            on_eval(row, state, exp)
        bar.update(int(totals["round"]), row["accuracy"])
    bar.close()
    summary = summarize(config, exp, rows, totals, build_seconds, compile_seconds)
    if out is not None:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    summary["_state"] = state
    return summary


def summarize(config, exp, rows, totals, build_seconds, compile_seconds) -> dict:
    best = max(rows, key=lambda r: r["accuracy"]) if rows else None
    final = rows[-1] if rows else {}
    train_seconds = float(totals["seconds"])
    steady = max(train_seconds - compile_seconds, 1e-9)
    steady_rounds = max(int(totals["round"]) - (config.eval_every if compile_seconds else 0), 0)
    return {
        "algorithm": config.algorithm, "dataset": config.dataset, "model": exp.model.name,
        "rounds": int(totals["round"]),
        "final_accuracy": final.get("accuracy"), "final_accuracy_std": final.get("accuracy_std"),
        "final_global_accuracy": final.get("global_accuracy"),
        "best_accuracy": best["accuracy"] if best else None, "best_round": best["round"] if best else None,
        "final_density": final.get("density"),
        "total_uplink_bits": totals["uplink_bits"], "total_downlink_bits": totals["downlink_bits"],
        "total_gbit": (totals["uplink_bits"] + totals["downlink_bits"]) / 1e9,
        "total_flops": totals["flops"],
        "seconds": train_seconds, "build_seconds": build_seconds,
        "first_chunk_seconds_incl_compile": compile_seconds,
        "rounds_per_second_after_first_chunk": (steady_rounds / steady) if steady_rounds else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "backend": jax.default_backend(), "client_parallelism": exp.engine.mode,
    }


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
        ("density", "n/a" if summary["final_density"] is None else f"{summary['final_density']:.3f}"),
        ("communication (up + down)", f"{summary['total_gbit']:.4f} Gbit"),
        ("training compute", f"{summary['total_flops'] / 1e12:.3f} TFLOPs"),
        ("wall time", f"{summary['seconds']:.1f} s (first chunk incl. compile "
                      f"{summary['first_chunk_seconds_incl_compile']:.1f} s)"),
    ]
    width = max(len(k) for k, _ in lines)
    rule = "-" * (width + 3 + max(len(v) for _, v in lines))
    return "\n".join([rule] + [f"{k:<{width}} | {v}" for k, v in lines] + [rule])

"""Writes the tutorial notebooks (quickstart, your_model_and_data, spafl, feddrop, fsl) from the cell sources below.

    python notebooks/make_notebooks.py          # rewrites notebooks/*.ipynb, without outputs

The notebooks are committed without outputs (small diffs); ``tests/end_to_end/test_notebooks.py`` executes
each one top to bottom with ``FEDJAX_SPARSE_NOTEBOOK_SMOKE=1`` (tiny runs on the embedded digits).
Edit the cells here, not in the .ipynb files, and rerun this script.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------- shared cells
SETUP = '''\
import json, os, shutil, time
from pathlib import Path

{imports}
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

import fedjax_sparse as fjs

# SMOKE=1 (the test suite): a few rounds on the embedded digits, to check every cell runs.
SMOKE = os.environ.get("FEDJAX_SPARSE_NOTEBOOK_SMOKE") == "1"
# Real data: the `shared/data` folder beside the repository (notebooks/ -> repo -> its parent).
DATA_DIR = Path("..") / ".." / "shared" / "data"
REAL = (not SMOKE) and (DATA_DIR / "{real}").is_dir()
# Run folders (config, metrics.jsonl, summary): runs/{name} beside the notebook (FEDJAX_SPARSE_NOTEBOOK_RUNS: another
# parent; the test suite's is its own temporary folder), emptied first so that a rerun starts afresh.
RUNS = Path(os.environ.get("FEDJAX_SPARSE_NOTEBOOK_RUNS", "runs")) / "{name}"
shutil.rmtree(RUNS, ignore_errors=True)


print("smoke run" if SMOKE else "full run", "| data:", DATA_DIR.resolve() if REAL else "embedded digits",
      "| runs in", RUNS, "|", jax.devices())'''


def setup(real: str, name: str, imports: str) -> str:
    return SETUP.replace("{real}", real).replace("{name}", name).replace("{imports}", imports)


def nb_cells(cells):
    out = []
    for i, (kind, source) in enumerate(cells):
        cell = {"cell_type": "markdown" if kind == "md" else "code", "id": f"c{i:02d}", "metadata": {},
                "source": source.strip("\n").splitlines(keepends=True)}
        if kind != "md":
            cell.update(execution_count=None, outputs=[])
        out.append(cell)
    return out


def write(name: str, cells) -> Path:
    nb = {"cells": nb_cells(cells),
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                       "language_info": {"name": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = HERE / f"{name}.ipynb"
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return path


# ---------------------------------------------------------------- quickstart
QUICKSTART = [
    ("md", '''\
# Quickstart: the Python API

Everything here goes through the library's front door, `import fedjax_sparse as fjs`: `fjs.data` loads
and splits a data set across clients, `fjs.RunConfig` holds a run's settings (the same fields as the CLI
flags) and `fjs.run(config, data=...)` trains and returns a `RunResult` (`.summary`, the final `.state`)
and writes a run folder. We look at how the data is split, run FedAvg against purely local training,
read the run folders' `metrics.jsonl` back and compare the folders with `fjs.report_table` / `fjs.plot_runs`.
(`your_model_and_data.ipynb` continues with your own arrays, Flax models and algorithms.)

It uses Fashion-MNIST from `../shared/data` when that folder exists and the embedded scikit-learn digits
otherwise. With `FEDJAX_SPARSE_NOTEBOOK_SMOKE=1` (the test suite) every run is shrunk to a couple of rounds
on the digits: the numbers are then meaningless, only the mechanics are checked.'''),
    ("code", setup("fashion_mnist", "quickstart", "import jax")),
    ("code", '''\
if REAL:
    DATASET, MODEL, DATA = "fashion_mnist", "lenet5_caffe", str(DATA_DIR)
else:
    DATASET, MODEL, DATA = "digits", "cnn_small", None
NUM_CLIENTS = 8 if SMOKE else (100 if REAL else 20)
CLIENTS_PER_ROUND = 3 if SMOKE else 5
ROUNDS = 2 if SMOKE else (20 if REAL else 30)
EVAL_EVERY = 1 if SMOKE else 5
PARTITION = "dirichlet:0.5"
print(DATASET, MODEL, NUM_CLIENTS, "clients,", CLIENTS_PER_ROUND, "per round,", ROUNDS, "rounds")'''),
    ("md", '''\
## How the data is split

`fjs.data.load` reads a built-in data set (or `"npz:PATH"`, your own file) and `fjs.data.partition` splits
its train and test sets across clients into a `PartitionedData`, which `fjs.run(..., data=...)` trains on.
`dirichlet:0.5` draws each class's shares from a Dirichlet(0.5), so every client sees a skewed label mix
(and is tested on the same mix). `fjs.data.partition_report` summarises the split; the plot shows each
client's training labels.'''),
    ("code", '''\
dataset = fjs.data.load(DATASET, DATA)
data = fjs.data.partition(dataset, PARTITION, NUM_CLIENTS, seed=0)
print(data)
report = fjs.data.partition_report(data.dataset, data.partition)
s = report["summary"]
print(f"train examples per client min/mean/max {s['train_samples']['min']}/{s['train_samples']['mean']:.1f}/"
      f"{s['train_samples']['max']}, classes per client {s['mean_classes_per_client']:.2f} "
      f"({s['mean_classes_over_5pct_per_client']:.2f} with a share of at least 5 %)")
for c in report["clients"][:5]:
    top = sorted(range(len(c["train_counts"])), key=lambda k: -c["train_counts"][k])[:3]
    print(f"client {c['client']}: {c['train_total']:5d} train / {c['test_total']:4d} test, top labels",
          ", ".join(f"{k}:{c['train_counts'][k]}" for k in top))'''),
    ("code", '''\
counts = np.array([c["train_counts"] for c in report["clients"]])   # [clients, classes]
fig, ax = plt.subplots(figsize=(9, 3.2))
bottom = np.zeros(len(counts))
cmap = plt.get_cmap("tab10")
for label in range(counts.shape[1]):
    ax.bar(np.arange(len(counts)), counts[:, label], bottom=bottom, color=cmap(label % 10), label=str(label))
    bottom += counts[:, label]
ax.set_xlabel("client"); ax.set_ylabel("train samples"); ax.set_title(f"{DATASET}, {PARTITION}")
ax.legend(title="label", ncol=2, fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
plt.tight_layout(); plt.show()'''),
    ("md", '''\
## FedAvg against Local

Both runs use the same partitioned data, model and local training. FedAvg averages the sampled
clients' models every round (one global model); Local (`algorithm="local"`) never communicates: every
client trains its own model on its own data. Accuracy is the *personalised* accuracy: each client's model
(FedAvg: the global one) on that client's test set, averaged over clients. A Local client only trains
in the rounds it is sampled, so with many clients and few rounds most Local models have barely trained:
FedAvg's single model, trained on a few clients per round, serves all of them.

`fjs.run` returns a `RunResult`: `result.summary` (also the run folder's `summary.json`) and
`result.state`, the final engine state (`state.server`: the algorithm's typed server state,
`state.clients`: the clients' states stacked along a leading client axis).'''),
    ("code", '''\
base = dict(model=MODEL, clients_per_round=CLIENTS_PER_ROUND, rounds=ROUNDS, eval_every=EVAL_EVERY, local_epochs=1,
            batch_size=32, lr=0.05 if REAL else 0.1, seed=0)
run_dirs, results = {}, {}
for algorithm in ["fedavg", "local"]:
    run_dirs[algorithm] = RUNS / algorithm
    t = time.perf_counter()
    results[algorithm] = fjs.run(fjs.RunConfig(algorithm=algorithm, out=str(run_dirs[algorithm]), **base),
                                 data=data, progress=False)
    print(fjs.format_summary(results[algorithm].summary), f"\\n({time.perf_counter() - t:.1f} s)\\n")
server = results["fedavg"].state.server
print(type(server).__name__, server._fields, "| parameters:",
      sum(x.size for x in jax.tree_util.tree_leaves(server.variables["params"])))'''),
    ("md", '''\
## Reading `metrics.jsonl`

Every evaluation appends one JSON object to `OUT/metrics.jsonl` (round, personalised accuracy and its
spread over clients, global accuracy, training loss, this round's and the cumulative bits and FLOPs,
density, seconds, plus algorithm-specific extras). Reading it back is one line per row.'''),
    ("code", '''\
metrics = {name: [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
           for name, path in run_dirs.items()}
print("keys:", sorted(metrics["fedavg"][0]))
columns = ["round", "accuracy", "accuracy_std", "global_accuracy", "loss", "total_uplink_bits", "total_flops"]
try:
    import pandas as pd
    frame = pd.concat({name: pd.DataFrame(rows)[columns] for name, rows in metrics.items()})
    display(frame)
except ImportError:  # no pandas: a plain table
    print(f"{'run':8s}" + "".join(f"{c:>18s}" for c in columns))
    for name, rows in metrics.items():
        for r in rows:
            print(f"{name:8s}" + "".join(f"{'-' if r[c] is None else format(r[c], '.4g'):>18s}" for c in columns))'''),
    ("code", '''\
fig, ax = plt.subplots(figsize=(5, 3.2))
for name, rows in metrics.items():
    ax.plot([r["round"] for r in rows], [100 * r["accuracy"] for r in rows], marker="o", label=name)
ax.set_xlabel("round"); ax.set_ylabel("personalised accuracy (%)"); ax.legend(); plt.tight_layout(); plt.show()'''),
    ("md", '''\
## Comparing run folders

`fjs.report_table` and `fjs.plot_runs` compare finished run folders (the CLI's `report` and `plot`
commands): accuracy against rounds, against cumulative communication and against training FLOPs.
Local sends nothing, so its communication axis sits at 0.'''),
    ("code", '''\
table = fjs.report_table(list(run_dirs.values()))
display(Markdown(table))
display(fjs.plot_runs(list(run_dirs.values()), RUNS / "comparison.png"))  # a Figure, also saved there'''),
    ("md", "The checks the test suite relies on (a failing `assert` fails the notebook's test):"),
    ("code", '''\
checks = {
    "table_has_fedavg": "| fedavg" in table, "table_has_local": "| local" in table,
    "rows": {name: len(rows) for name, rows in metrics.items()},
    "local_uplink_bits": metrics["local"][-1]["total_uplink_bits"],
    "fedavg_uplink_bits": metrics["fedavg"][-1]["total_uplink_bits"],
    "partition_clients": report["num_clients"],
}
assert checks["table_has_fedavg"] and checks["table_has_local"], table
assert all(n == ROUNDS // EVAL_EVERY for n in checks["rows"].values()), checks
assert checks["local_uplink_bits"] == 0 < checks["fedavg_uplink_bits"], checks
assert all(0.0 <= r["accuracy"] <= 1.0 for rows in metrics.values() for r in rows)
print("NOTEBOOK_CHECKS", json.dumps(checks))'''),
]

# ---------------------------------------------------------------- your model and data
YOUR_MODEL_AND_DATA = [
    ("md", '''\
# Your model and your data

The library's front door with nothing of its own: your arrays split by your own client ids
(`fjs.data.from_arrays`), your Flax networks, one `flax.linen` and one `flax.nnx`
(`fjs.models.from_flax`), the built-in algorithms on them (`fjs.run(config, model=..., data=...)`), an
algorithm of your own in twenty lines (`fjs.Algorithm`), and the runs compared by accuracy against rounds
and against communication (`fjs.plot_runs`, `fjs.report_table`).

It uses Fashion-MNIST from `../shared/data` when that folder exists and scikit-learn's 8x8 digits
(embedded in scikit-learn, no download) otherwise, and always with `FEDJAX_SPARSE_NOTEBOOK_SMOKE=1` (the
test suite: a few rounds, only the mechanics are checked).'''),
    ("code", setup("fashion_mnist", "your_model_and_data", "import jax, jax.numpy as jnp")),
    ("md", '''\
## Your arrays, your client ids

Any arrays will do: inputs `[n, ...]` (`uint8` pixels 0..255, scaled to 0..1, or float features) and
integer labels `[n]`, plus, for a natural partition, one **client id** per example (integers or strings,
any values). Here the ids are store numbers and every example's store is drawn at random with a label skew
(each store holds mostly a few classes), for the test examples by the same rule, so each store is tested
on its own mix. Client `k` is the `k`-th smallest id: `data.client_names[k]`.'''),
    ("code", '''\
if REAL:   # Fashion-MNIST's files, read into plain arrays (yours would come from anywhere)
    fmnist = fjs.data.load("fashion_mnist", str(DATA_DIR))
    x_train, y_train, x_test, y_test = fmnist.train_x, fmnist.train_y, fmnist.test_x, fmnist.test_y
else:      # scikit-learn's digits: 8x8 images with values 0..16, as uint8 pixels 0..255
    from sklearn.datasets import load_digits
    digits = load_digits()
    x, y = (digits.images * 16).clip(0, 255).astype(np.uint8), digits.target
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
NUM_CLIENTS = 6 if SMOKE else (50 if REAL else 12)
rng = np.random.default_rng(0)
STORE_IDS = np.sort(rng.choice(np.arange(100, 1000), NUM_CLIENTS, replace=False))   # not 0..N-1
share = rng.dirichlet(np.full(NUM_CLIENTS, 0.5), size=10)   # share[c, k]: store k's share of class c


def store_of(labels):
    """One store id per example, drawn from its class's shares."""
    k = (rng.random(len(labels))[:, None] > share[labels].cumsum(1)).sum(1)
    return STORE_IDS[np.minimum(k, NUM_CLIENTS - 1)]


train_ids, test_ids = store_of(y_train), store_of(y_test)
data = fjs.data.from_arrays(x_train, y_train, x_test, y_test, train_ids, test_ids, name="stores")
print(data)
print("client_names:", data.client_names)
for k, store in enumerate(data.client_names[:8]):
    labels = y_train[data.partition.train_indices[k]]
    top = np.argsort(-np.bincount(labels, minlength=10))[:3]
    print(f"client {k} = store {store}: {len(labels):5d} train / {len(data.partition.test_indices[k]):4d} test, "
          f"top labels {', '.join(f'{c}:{np.sum(labels == c)}' for c in top)}")'''),
    ("md", '''\
## Your models: `flax.linen` and `flax.nnx`

`fjs.models.from_flax(module, input_shape=...)` turns either kind into a `Model` every algorithm trains.
One abstract forward pass finds the weight layers (every `Dense`/`Linear` and `Conv`, in call order, named
by module path) with their kernel shapes and multiply-accumulates per example, which layer feeds which
(`input_layer`), and whether the network is a plain chain (`model.sequential`). The `flax.nnx` network has
a residual connection, so it is not: the head reads the sum of `block`'s output and `stem`'s.'''),
    ("code", '''\
import flax.linen as nn
from flax import nnx


class LinenCNN(nn.Module):
    """conv 3x3, max-pool 2, conv 3x3, max-pool 2, dense, dense: a plain chain."""
    channels: tuple = (8, 16)
    hidden: int = 32

    @nn.compact
    def __call__(self, x):
        for i, c in enumerate(self.channels):
            x = nn.max_pool(nn.relu(nn.Conv(c, (3, 3), name=f"conv{i + 1}")(x)), (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(self.hidden, name="fc1")(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, name="fc2")(x)


class NnxResidual(nnx.Module):
    """conv 3x3, a residual conv block, max-pool 2, linear head (nnx modules know their input sizes)."""

    def __init__(self, input_shape, width=8, num_classes=10, seed=0):
        rngs, (h, w, c) = nnx.Rngs(seed), input_shape
        self.stem = nnx.Conv(c, width, (3, 3), rngs=rngs)
        self.block = nnx.Conv(width, width, (3, 3), rngs=rngs)
        self.head = nnx.Linear((h // 2) * (w // 2) * width, num_classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.stem(x))
        x = nnx.relu(x + self.block(x))                   # the residual connection
        x = nnx.max_pool(x, (2, 2), strides=(2, 2))
        return self.head(x.reshape(x.shape[0], -1))


models = {"linen_cnn": fjs.models.from_flax(LinenCNN(), input_shape=data.input_shape),
          "nnx_residual": fjs.models.from_flax(NnxResidual(data.input_shape), input_shape=data.input_shape)}
for key, model in models.items():
    rows = [f"| {l.name} | {l.kind} | {l.kernel_shape} | {l.macs:,} | {l.input_layer or '(input)'} |" for l in model.layers]
    display(Markdown(f"**{key}** (`{model.name}`): {model.num_params:,} parameters, "
                     f"{model.forward_macs:,} MACs per example, `sequential={model.sequential}`\\n\\n"
                     "| layer | kind | kernel | MACs | input layer |\\n|---|---|---|---|---|\\n" + "\\n".join(rows)))'''),
    ("md", '''\
## SpaFL, FedAvg and FedDrop on them

`fjs.run(config, model=..., data=...)`: the config says how to train (the same fields as the CLI flags);
the data object sets the clients. SpaFL (one trainable threshold per output unit, only thresholds
communicated) and FedAvg run on both networks; FedDrop (channel dropout after every conv) needs a
sequential network with conv layers, so it runs on the `linen` one and refuses the residual one with a
one-line message. Each run writes a folder (`out=`) of `config.json`, `metrics.jsonl` and `summary.json`.'''),
    ("code", '''\
ROUNDS = 3 if SMOKE else (20 if REAL else 40)
EVAL_EVERY = 1 if SMOKE else 5
base = dict(clients_per_round=3 if SMOKE else (10 if REAL else 5), rounds=ROUNDS, eval_every=EVAL_EVERY,
            local_epochs=1, batch_size=32, seed=0)
SPECS = {   # run name: (model, algorithm, lr, options)
    "cnn_spafl": ("linen_cnn", "spafl", 0.01, {}),
    "cnn_fedavg": ("linen_cnn", "fedavg", 0.05, {}),
    "cnn_feddrop": ("linen_cnn", "feddrop", 0.05, {"opt_iters": 200}),
    "residual_spafl": ("nnx_residual", "spafl", 0.01, {}),
    "residual_fedavg": ("nnx_residual", "fedavg", 0.05, {}),
}
results = {}
for name, (model, algorithm, lr, options) in SPECS.items():
    t = time.perf_counter()
    config = fjs.RunConfig(algorithm=algorithm, lr=lr, options=options, out=str(RUNS / name), **base)
    results[name] = fjs.run(config, model=models[model], data=data, progress=False)
    s = results[name].summary
    print(f"{name:16s} accuracy {100 * s['final_accuracy']:6.2f} %   {s['total_gbit']:.5f} Gbit   "
          f"({time.perf_counter() - t:.1f} s)")
refused = ""
try:
    fjs.run(fjs.RunConfig(algorithm="feddrop", **base), model=models["nnx_residual"], data=data, progress=False)
except fjs.RunError as e:
    refused = str(e)
print("feddrop on nnx_residual:", refused)'''),
    ("md", '''\
## An algorithm of your own

An algorithm is data plus pure functions: `init` (server and client states), `broadcast` (what goes down),
`client_update` (local work on one client's data; here `fjs.algorithms.local_train`, SGD epochs), and
`server_update` (what the server does with the stacked messages). Below: FedAvg with **server momentum**
(FedAvgM) in about twenty lines, its server state a typed `NamedTuple`. Communication is counted by the
algorithm (`uplink_bits`, `downlink_bits`: the float32 model each way); what it does not count (FLOPs) is
recorded as unknown, never as 0. Built for a task (`fjs.build(config, ...).task`) and passed to `fjs.run`
as an object.'''),
    ("code", '''\
from typing import NamedTuple

tree_map = jax.tree_util.tree_map


class MomentumState(NamedTuple):
    variables: dict   # the global model
    velocity: dict    # the server's momentum buffer, shaped as the params


def fedavg_server_momentum(task, beta=0.9):
    optimizer = fjs.algorithms.sgd(task.lr)

    def init(key):
        variables = task.model.init(key)
        return MomentumState(variables, tree_map(jnp.zeros_like, variables["params"])), ()

    def broadcast(server, round_index):
        return server.variables

    def client_update(variables, client_state, data, ctx):
        new, _, stats = fjs.algorithms.local_train(
            task.model, optimizer, variables, optimizer.init(variables["params"]), data, ctx.key,
            epochs=task.local_epochs, batch_size=task.batch_size, preprocess=task.preprocess)
        bits = 32 * sum(x.size for x in jax.tree_util.tree_leaves(variables))
        return client_state, new, fjs.client_metrics(loss=stats.loss, num_examples=stats.num_examples,
                                                     uplink_bits=bits, downlink_bits=bits)

    def server_update(server, messages, ctx):
        mean = fjs.algorithms.tree_weighted_mean(messages, ctx.weights)
        velocity = tree_map(lambda v, old, new: beta * v + (old - new), server.velocity,
                            server.variables["params"], mean["params"])
        params = tree_map(lambda old, v: old - v, server.variables["params"], velocity)
        return MomentumState({**mean, "params": params}, velocity), {}

    def global_predict(server, x):
        return fjs.algorithms.predict_fn(task.model, server.variables)(x)
    return fjs.Algorithm("fedavg_server_momentum", init, broadcast, client_update, server_update,
                         global_predict=global_predict)


config = fjs.RunConfig(lr=0.05, out=str(RUNS / "cnn_server_momentum"), **base)
task = fjs.build(config, model=models["linen_cnn"], data=data).task
my_algorithm = fedavg_server_momentum(task, beta=0.9)
t = time.perf_counter()
results["cnn_server_momentum"] = fjs.run(config, model=models["linen_cnn"], data=data, algorithm=my_algorithm,
                                         progress=False)
print(fjs.format_summary(results["cnn_server_momentum"].summary), f"\\n({time.perf_counter() - t:.1f} s)")
server = results["cnn_server_momentum"].state.server
print(type(server).__name__, "| velocity norm",
      float(jnp.sqrt(sum(jnp.sum(v ** 2) for v in jax.tree_util.tree_leaves(server.velocity)))))'''),
    ("md", '''\
## Comparing the runs

Accuracy is the personalised one (each client's model on its own test set; SpaFL's clients keep personal
weights, so it has no global model), against rounds and against the cumulative communication up and down.
SpaFL sends one 32-bit threshold per output unit instead of the model: its curve sits orders of
magnitude to the left. FedDrop saves training FLOPs, not communication.'''),
    ("code", '''\
run_dirs = {name: RUNS / name for name in results}
metrics = {name: [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
           for name, path in run_dirs.items()}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
for name, rows in metrics.items():
    acc = [100 * r["accuracy"] for r in rows]
    ax1.plot([r["round"] for r in rows], acc, marker="o", label=name)
    ax2.plot([(r["total_uplink_bits"] + r["total_downlink_bits"]) / 1e9 for r in rows], acc, marker="o", label=name)
ax1.set_xlabel("round"); ax1.xaxis.get_major_locator().set_params(integer=True)
ax2.set_xlabel("cumulative communication, up + down (Gbit)"); ax2.set_xscale("log")
for ax in (ax1, ax2):
    ax.set_ylabel("personalised accuracy (%)"); ax.grid(alpha=0.3)
ax1.legend(fontsize=8); plt.tight_layout(); plt.show()'''),
    ("code", '''\
table = fjs.report_table(list(run_dirs.values()))
display(Markdown(table))
display(fjs.plot_runs(list(run_dirs.values()), RUNS / "comparison.png"))  # a Figure, also saved there'''),
    ("md", "Checks for the test suite:"),
    ("code", '''\
def out_units(model):
    return sum(layer.out_units for layer in model.layers)


spafl_runs = {name: spec[0] for name, spec in SPECS.items() if spec[1] == "spafl"}
checks = {
    "layers": {key: len(model.layers) for key, model in models.items()},
    "sequential": {key: model.sequential for key, model in models.items()},
    "client_names": len(data.client_names),
    "spafl_uplink_is_32_bits_per_unit": all(
        rows["uplink_bits"] == 32 * out_units(models[spafl_runs[name]]) * base["clients_per_round"]
        for name in spafl_runs for rows in metrics[name]),
    "final_accuracy": {name: r.summary["final_accuracy"] for name, r in results.items()},
    "custom_rounds": results["cnn_server_momentum"].summary["rounds"],
    "custom_uplink_bits": metrics["cnn_server_momentum"][-1]["uplink_bits"],
    "feddrop_refused_residual": "not sequential" in refused,
    "table_rows": len(table.strip().splitlines()) - 2,   # a header, a rule, one row per run
}
assert checks["layers"] == {"linen_cnn": 4, "nnx_residual": 3}, checks
assert checks["sequential"] == {"linen_cnn": True, "nnx_residual": False}, checks
assert checks["client_names"] == NUM_CLIENTS and list(data.client_names) == sorted(STORE_IDS.tolist())
assert checks["spafl_uplink_is_32_bits_per_unit"], checks
assert all(0.0 <= a <= 1.0 for a in checks["final_accuracy"].values()), checks
assert checks["custom_rounds"] == ROUNDS and checks["custom_uplink_bits"] == 32 * models["linen_cnn"].num_params * base["clients_per_round"]
assert checks["feddrop_refused_residual"] and checks["table_rows"] == len(results), checks
print("NOTEBOOK_CHECKS", json.dumps(checks))'''),
]

# ---------------------------------------------------------------- SpaFL
SPAFL = [
    ("md", '''\
# SpaFL: trainable thresholds and the sparse structures they learn

SpaFL (Kim, Saad, Debbah, Hong; NeurIPS 2024) gives every neuron / conv filter ("row") one trainable
threshold $\\tau_i$; row $i$ of a layer is kept iff $\\frac{1}{n_{in}}\\sum_j |w_{ij}| > \\tau_i$ (eq. 1),
with straight-through gradients. Clients train weights and thresholds on
$\\mathrm{CE} + \\alpha \\sum \\exp(-\\tau)$ (eq. 5), upload **only the thresholds**, the server averages
them (eq. 7) and broadcasts them with their last change $\\Delta\\tau$, which each client turns into a weight
update by eq. (13): $w_{ij} \\mathrel{-}= \\mathrm{sign}(\\sum_j w_{ij})\\,\\Delta\\tau_i / n_{in}$.

Here (scaled down from `experiments/reproduce/spafl_fmnist.py`: few clients, few rounds) we follow one client's
thresholds and masks over rounds, the density of every layer, the conv1 sparsity pattern of all clients
(the paper's Fig. 3) and SpaFL with and without eq. (13) (Table 3's "w.o. (13)").'''),
    ("code", setup("fashion_mnist", "spafl", "import jax")),
    ("code", '''\
import importlib
spafl_lib = importlib.import_module("fedjax_sparse.algorithms.spafl_family")   # the module (fjs.algorithms.spafl is the builder)

if REAL:   # the paper's FMNIST setting (LeNet-5-Caffe, raw pixels, lr 0.001, momentum 0.9), scaled down
    data = dict(dataset="fashion_mnist", data_dir=str(DATA_DIR), model="lenet5_caffe", preprocess="raw",
                lr=0.001, batch_size=64, partition="dirichlet:0.2", min_client_samples=64)
else:
    data = dict(dataset="digits", model="cnn_small", preprocess="raw", lr=0.001, batch_size=32,
                partition="dirichlet:0.5")
# Personal models: few enough clients that each is sampled several times in a short run.
NUM_CLIENTS = 6 if SMOKE else (30 if REAL else 20)
ROUNDS = 3 if SMOKE else (20 if REAL else 40)
EVAL_EVERY = 1 if SMOKE else 4
base = dict(num_clients=NUM_CLIENTS, clients_per_round=3 if SMOKE else (6 if REAL else 5), rounds=ROUNDS,
            eval_every=EVAL_EVERY,
            local_epochs=1 if SMOKE or REAL else 2, seed=0, **data)
# alpha: the regulariser's weight (eq. 5); ramp: the FMNIST code's c(t) = sigmoid(10 t - 5).
OPTIONS = dict(alpha=0.002, ramp=True, momentum=0.9)
print(base, OPTIONS)'''),
    ("md", '''\
## Recording thresholds and masks after every evaluation

`fjs.run(config, on_eval=...)` calls `on_eval(row, state, experiment)` after every evaluation. The recorder
below keeps every client's thresholds and row masks (the masks each client's model is evaluated with:
its own thresholds, after the reset rule), computed with `spafl.personal_row_masks` in one jitted
`lax.map` over the clients.'''),
    ("code", '''\
class Recorder:
    def __init__(self):
        self.rounds, self.tau, self.masks, self.fn = [], [], [], None

    def __call__(self, row, state, experiment):
        if self.fn is None:
            setup = spafl_lib.make_setup(experiment.model, experiment.algorithm.hparams)
            self.layers = [layer.name for layer in setup.layers]
            self.fn = jax.jit(lambda server, clients: jax.lax.map(
                lambda c: spafl_lib.personal_row_masks(setup, server, c), clients))
        self.rounds.append(row["round"])
        tau = state.clients.tau                                 # {layer: [clients, rows]}
        self.tau.append({k: np.asarray(v) for k, v in tau.items()})
        self.masks.append({k: np.asarray(v) for k, v in self.fn(state.server, state.clients).items()})

    def density(self):
        """{layer: [evaluations, clients]} kept fraction of each layer's rows."""
        return {l: np.stack([m[l].mean(-1) for m in self.masks]) for l in self.layers}


recorders, run_dirs = {}, {}
for algorithm in ["spafl", "spafl_no_eq13"]:
    recorders[algorithm], run_dirs[algorithm] = Recorder(), RUNS / algorithm
    t = time.perf_counter()
    result = fjs.run(fjs.RunConfig(algorithm=algorithm, options=OPTIONS, out=str(run_dirs[algorithm]), **base),
                     progress=False, on_eval=recorders[algorithm])
    print(fjs.format_summary(result.summary), f"\\n({time.perf_counter() - t:.1f} s)\\n")
rec = recorders["spafl"]
# The client to follow: the one whose thresholds changed at the most evaluations (sampled most often).
changes = sum(np.abs(np.diff(np.stack([t[l] for t in rec.tau]), axis=0, prepend=0)).sum(-1) > 0 for l in rec.layers)
CLIENT = int(np.argmax(changes.sum(0)))
print("thresholded layers:", rec.layers, "| following client", CLIENT)'''),
    ("md", '''\
## One client's thresholds and masks over rounds

Left: the followed client's thresholds, the mean per layer (line) and its spread (band). All thresholds start at 0 and
the regulariser $\\alpha\\sum e^{-\\tau}$ pushes them up; a layer that kept at most 1 % of its rows gets its
thresholds reset to 0. Right: which of its conv1 filters are kept (white) after each evaluated round
(a client's own thresholds only change in the rounds it is sampled).
The recorder keeps every client's thresholds; we follow the client sampled most often.'''),
    ("code", '''\
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
for layer in rec.layers:
    t = np.stack([x[layer][CLIENT] for x in rec.tau])
    ax1.plot(rec.rounds, t.mean(1), label=layer)
    ax1.fill_between(rec.rounds, t.min(1), t.max(1), alpha=0.15)
ax1.set_xlabel("round"); ax1.set_ylabel(f"threshold tau (client {CLIENT})"); ax1.legend()
first = rec.layers[0]
ax2.imshow(np.stack([m[first][CLIENT] for m in rec.masks]).T, aspect="auto", cmap="gray", vmin=0, vmax=1,
           extent=[rec.rounds[0] - 0.5, rec.rounds[-1] + 0.5, rec.masks[0][first].shape[1] - 0.5, -0.5])
ax2.set_xlabel("round"); ax2.set_ylabel(f"{first} filter"); ax2.set_title(f"client {CLIENT}: kept {first} filters")
plt.tight_layout(); plt.show()'''),
    ("md", '''\
## Density per layer

The kept fraction of every thresholded layer's rows, averaged over all clients (the paper's density is the
mean over layers of this, averaged over clients: the black line). Large layers (the first dense layer)
are usually pruned hardest.'''),
    ("code", '''\
density = rec.density()
fig, ax = plt.subplots(figsize=(6, 3.4))
for layer, d in density.items():
    ax.plot(rec.rounds, d.mean(1), label=layer)
ax.plot(rec.rounds, np.mean([d.mean(1) for d in density.values()], axis=0), "k--", label="mean (paper's density)")
ax.set_xlabel("round"); ax.set_ylabel("kept fraction of rows"); ax.set_ylim(0, 1.05); ax.legend()
plt.tight_layout(); plt.show()
print({layer: round(float(d[-1].mean()), 3) for layer, d in density.items()})'''),
    ("md", '''\
## The conv1 sparsity pattern across clients (Fig. 3)

Fig. 3 of the paper shows which conv1 filters each client keeps at three points of training: since the
thresholds are shared, clients converge on largely the same structure while their weights stay personal.
Rows are clients, columns conv1 filters, white = kept.'''),
    ("code", '''\
picks = sorted({0, len(rec.rounds) // 2, len(rec.rounds) - 1})
fig, axes = plt.subplots(1, len(picks), figsize=(4 * len(picks), 3), squeeze=False)
for ax, i in zip(axes[0], picks):
    ax.imshow(rec.masks[i][first], aspect="auto", cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(f"round {rec.rounds[i]}: density {rec.masks[i][first].mean():.2f}")
    ax.set_xlabel(f"{first} filter"); ax.set_ylabel("client")
plt.tight_layout(); plt.show()
agree = [float((m[first] == np.round(m[first].mean(0))).mean()) for m in rec.masks]
print("share of (client, filter) entries equal to the clients' majority:", np.round(agree, 3))'''),
    ("md", '''\
## Eq. (13) on and off

Without eq. (13) (`spafl_no_eq13`) the shared thresholds still decide the masks, but the global threshold
changes no longer move the clients' weights, so the shared structure carries less of the other clients'
knowledge. The paper's Table 3 loses about 1 point on FMNIST without it; in a run this short and small
the two curves may well cross (the masks are the same mechanism).'''),
    ("code", '''\
metrics = {name: [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
           for name, path in run_dirs.items()}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
for name, rows in metrics.items():
    ax1.plot([r["round"] for r in rows], [100 * r["accuracy"] for r in rows], marker="o", label=name)
    ax2.plot([r["round"] for r in rows], [r.get("density_all_clients", r["density"]) for r in rows], label=name)
ax1.set_xlabel("round"); ax1.set_ylabel("personalised accuracy (%)"); ax1.legend()
ax2.set_xlabel("round"); ax2.set_ylabel("density (all clients)"); ax2.legend()
plt.tight_layout(); plt.show()
display(Markdown(fjs.report_table(list(run_dirs.values()))))'''),
    ("md", "Checks for the test suite:"),
    ("code", '''\
tau_last = rec.tau[-1]
checks = {
    "evaluations": len(rec.rounds),
    "layers": rec.layers,
    "followed_client": CLIENT,
    "max_tau_followed_client": float(max(np.abs(t[CLIENT]).max() for t in tau_last.values())),
    "final_density_per_layer": {l: float(d[-1].mean()) for l, d in density.items()},
    "uplink_bits_per_round": metrics["spafl"][-1]["uplink_bits"],
}
assert checks["evaluations"] == ROUNDS // EVAL_EVERY and len(rec.masks) == checks["evaluations"]
assert all(0.0 <= d <= 1.0 for d in checks["final_density_per_layer"].values())
assert checks["max_tau_followed_client"] > 0, "the followed client's thresholds never moved"
# SpaFL sends one 32-bit threshold per row, each way: far less than the model.
n_tau = sum(m.shape[1] for m in rec.masks[-1].values())
assert checks["uplink_bits_per_round"] == base["clients_per_round"] * 32 * n_tau, checks
print("NOTEBOOK_CHECKS", json.dumps(checks))'''),
]

# ---------------------------------------------------------------- FedDrop
FEDDROP = [
    ("md", '''\
# FedDrop: synchronised channel dropout under a FLOPs budget

FedDrop trains FedAvg with channel dropout after every conv+ReLU, with a **per-client, per-channel** keep
probability $p_c^n$. Its SyncDrop draws (Sec. 3.3, eq. 3) use uniforms $u^n$ shared by all clients of a
round: channel $n$ of client $c$ is kept iff $u^n < p_c^n$, so two clients' dropouts are correlated,
$E[d_i d_j] = \\min(p_i, p_j)$ (eq. 4), instead of $p_i p_j$ for independent draws. The server chooses the
keep probabilities to minimise the trajectory-similarity objective (eq. 8) subject to a FLOPs budget
$r$ (eq. 5), with the FLOPs model of App. B (eq. 9-10).

This notebook checks eq. (4) empirically, shows the FLOPs model, the clients' keep-probability
histograms after training (Fig. 9), and accuracy against training TFLOPs against FedAvg (the trade-off of
Table 1 / Fig. 5), scaled down from `experiments/reproduce/feddrop_fmnist.py`.'''),
    ("code", setup("fashion_mnist", "feddrop", "import jax, jax.numpy as jnp")),
    ("md", '''\
## SyncDrop draws: $E[d_i d_j] = \\min(p_i, p_j)$

`syncdrop.channel_uniforms(key, step, layout)` gives one uniform per channel for a local step; with the
round's shared key every client gets the same numbers. `keep_mask(u, p)` is $d = 1[u < p]$. We draw
many steps for pairs of keep probabilities and compare the empirical $E[d_i d_j]$ with $\\min(p_i, p_j)$,
and with independent draws (each client its own key), which give $p_i p_j$.'''),
    ("code", '''\
from fedjax_sparse.mechanisms.syncdrop import ChannelLayout, SparseFlopsModel, channel_uniforms, keep_mask

layout = ChannelLayout(names=("conv",), sizes=(512,))
STEPS = 100 if SMOKE else 400
draw = jax.jit(jax.vmap(lambda key, s: channel_uniforms(key, s, layout), in_axes=(None, 0)))
shared = draw(jax.random.PRNGKey(0), jnp.arange(STEPS))            # [steps, channels], same for everyone
private_i, private_j = draw(jax.random.PRNGKey(1), jnp.arange(STEPS)), draw(jax.random.PRNGKey(2), jnp.arange(STEPS))
pairs = [(0.1, 0.9), (0.3, 0.5), (0.5, 0.5), (0.25, 0.75), (0.6, 0.8), (0.9, 0.95)]
draws = []   # (p_i, p_j, SyncDrop, min, independent, product)
for p_i, p_j in pairs:
    sync = float((keep_mask(shared, p_i) * keep_mask(shared, p_j)).mean())
    indep = float((keep_mask(private_i, p_i) * keep_mask(private_j, p_j)).mean())
    draws.append((p_i, p_j, sync, min(p_i, p_j), indep, p_i * p_j))
print(f"{'p_i':>5} {'p_j':>5} | {'SyncDrop E[d_i d_j]':>20} {'min(p_i,p_j)':>13} | {'independent':>12} {'p_i p_j':>8}")
for r in draws:
    print(f"{r[0]:5.2f} {r[1]:5.2f} | {r[2]:20.4f} {r[3]:13.4f} | {r[4]:12.4f} {r[5]:8.4f}")
syncdrop_error = max(abs(r[2] - r[3]) for r in draws)
fig, ax = plt.subplots(figsize=(4, 3.6))
ax.plot([0, 1], [0, 1], "k:", lw=1)
ax.scatter([r[3] for r in draws], [r[2] for r in draws], label="SyncDrop vs min(p_i, p_j)")
ax.scatter([r[5] for r in draws], [r[4] for r in draws], marker="x", label="independent vs p_i p_j")
ax.set_xlabel("theory"); ax.set_ylabel("empirical E[d_i d_j]"); ax.legend(fontsize=8); plt.tight_layout(); plt.show()
print(f"largest |SyncDrop - min(p_i, p_j)|: {syncdrop_error:.4f} over {STEPS * layout.total} draws per pair")'''),
    ("md", '''\
## The FLOPs model (App. B, eq. 9-10)

A weight layer whose output channels are kept with mean probability $m_{out}$ and whose input channels
with $m_{in}$ costs $m_{out} m_{in}$ of its dense FLOPs in expectation (channels of different layers are
drawn independently). `SparseFlopsModel.ratio(p)` is the expected fraction of the dense forward FLOPs;
`uniform_keep_prob(r)` solves ratio$(p\\,\\mathbf{1}) = r$ (UniDrop's keep probability, and FedDrop's start).'''),
    ("code", '''\
if REAL:
    MODEL, INPUT, DATASET, DATA = "feddrop_fmnist_cnn", (28, 28, 1), "fashion_mnist", str(DATA_DIR)
else:
    MODEL, INPUT, DATASET, DATA = "cnn_small", (8, 8, 1), "digits", None
model = fjs.models.make_model(MODEL, INPUT, 10)
model_layout = ChannelLayout.from_model(model)
flops = SparseFlopsModel.build(model, model_layout)
for layer, dense in zip(model.layers, flops.dense_flops):
    print(f"{layer.name:6s} {layer.kind:6s} dense forward FLOPs/example {dense:>12,.0f}"
          + ("  (dropout after it)" if layer.name in model_layout.names else ""))
BUDGET = 0.5
p_uniform = flops.uniform_keep_prob(BUDGET)
grid = np.linspace(0.05, 1, 40)
ratios = [float(flops.ratio(jnp.full((model_layout.total,), p))) for p in grid]
fig, ax = plt.subplots(figsize=(4.5, 3.2))
ax.plot(grid, ratios); ax.axhline(BUDGET, color="gray", ls=":"); ax.axvline(p_uniform, color="gray", ls=":")
ax.set_xlabel("uniform keep probability p"); ax.set_ylabel("expected FLOPs / dense FLOPs")
ax.set_title(f"{MODEL}: r = {BUDGET} at p = {p_uniform:.3f}"); plt.tight_layout(); plt.show()'''),
    ("md", '''\
## FedDrop against FedAvg

FedDrop with budget $r = 0.5$ and FedAvg on the same partition. The recorder keeps the server's table of
keep probabilities (`[clients, channels]`) after every evaluation. A sampled cohort is kept for two rounds
(`resample_every=2`, as in the paper's partial-participation setting), so the probabilities the server
optimises for a cohort are used by it in the next round.'''),
    ("code", '''\
# Real data: many small clients, few per round, so that a round of the Table 6 CNN stays cheap on a CPU.
NUM_CLIENTS = 6 if SMOKE else (200 if REAL else 20)
base = dict(dataset=DATASET, data_dir=DATA, model=MODEL, num_clients=NUM_CLIENTS,
            clients_per_round=3 if SMOKE else (4 if REAL else 5), resample_every=2,
            rounds=4 if SMOKE else (20 if REAL else 40), eval_every=2 if SMOKE else (5 if REAL else 4), local_epochs=1, batch_size=16, lr=0.02 if REAL else 0.05,
            partition="dirichlet:0.5", preprocess="standardize", seed=0)
FEDDROP_OPTIONS = dict(budget=BUDGET, **(dict(opt_iters=300, opt_check_every=100) if SMOKE else {}))
keep_history, run_dirs = [], {}
for algorithm, options in [("feddrop", FEDDROP_OPTIONS), ("fedavg", {})]:
    run_dirs[algorithm] = RUNS / algorithm
    on_eval = (lambda row, state, exp: keep_history.append((row["round"], np.asarray(state.server.keep_probs)))
               ) if algorithm == "feddrop" else None
    t = time.perf_counter()
    result = fjs.run(fjs.RunConfig(algorithm=algorithm, options=options, out=str(run_dirs[algorithm]), **base),
                     progress=False, on_eval=on_eval)
    print(fjs.format_summary(result.summary), f"\\n({time.perf_counter() - t:.1f} s)\\n")'''),
    ("md", '''\
## Keep-probability histograms per client (Fig. 9)

Every client starts at the uniform $p$ that meets the budget; the server re-optimises the probabilities of
each round's cohort, spreading them: eq. (8) charges $S_{ij}^n / \\max(q_i^n, q_j^n)$ for channel $n$ of
clients $i, j$, so channels whose updates are large and aligned across the cohort are kept (many at
$p = 1$) and the others dropped more, within the FLOPs budget. Clients never sampled keep the uniform
value (dotted line).'''),
    ("code", '''\
final_round, keep = keep_history[-1]
trained = [c for c in range(keep.shape[0]) if not np.allclose(keep[c], p_uniform)]   # sampled at least once
show = (trained + [c for c in range(keep.shape[0]) if c not in trained])[:4]
fig, axes = plt.subplots(1, len(show), figsize=(3.2 * len(show), 2.8), sharey=True, squeeze=False)
for ax, c in zip(axes[0], show):
    ax.hist(keep[c], bins=np.linspace(0, 1, 21), color="tab:blue")
    ax.axvline(p_uniform, color="gray", ls=":")
    ax.set_title(f"client {c}: mean {keep[c].mean():.2f}"); ax.set_xlabel("keep probability")
axes[0][0].set_ylabel("channels"); fig.suptitle(f"after round {final_round}"); plt.tight_layout(); plt.show()'''),
    ("md", '''\
## Accuracy against training TFLOPs

The paper's argument (Table 1, Fig. 5): for the same accuracy FedDrop needs fewer training FLOPs.
FLOPs here are this project's convention (2 per multiply-accumulate, training = 3 x forward, FedDrop's are
expected FLOPs under the keep probabilities, summed over the sampled clients); the paper's unit is ours / 6.
Accuracy is the global model's on all clients' test sets.'''),
    ("code", '''\
metrics = {name: [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
           for name, path in run_dirs.items()}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
for name, rows in metrics.items():
    ax1.plot([r["total_flops"] / 1e12 for r in rows], [100 * r["global_accuracy"] for r in rows], marker="o", label=name)
    ax2.plot([r["round"] for r in rows], [100 * r["global_accuracy"] for r in rows], marker="o", label=name)
ax1.set_xlabel("cumulative training TFLOPs"); ax2.set_xlabel("round")
for ax in (ax1, ax2):
    ax.set_ylabel("global accuracy (%)"); ax.legend()
plt.tight_layout(); plt.show()
display(Markdown(fjs.report_table(list(run_dirs.values()))))'''),
    ("md", "Checks for the test suite:"),
    ("code", '''\
flops_ratio = metrics["feddrop"][-1]["total_flops"] / metrics["fedavg"][-1]["total_flops"]
checks = {"syncdrop_max_error": syncdrop_error, "independent_max_error": max(abs(r[4] - r[5]) for r in draws),
          "uniform_keep_prob": p_uniform, "feddrop_over_fedavg_flops": flops_ratio,
          "keep_min": float(keep.min()), "keep_max": float(keep.max())}
assert checks["syncdrop_max_error"] < 0.02, checks            # eq. (4): E[d_i d_j] = min(p_i, p_j)
assert abs(float(flops.ratio(jnp.full((model_layout.total,), p_uniform))) - BUDGET) < 1e-3
assert flops_ratio < 0.75, checks                              # budget 0.5 (the dense layers are not dropped)
assert 0.0 < checks["keep_min"] <= checks["keep_max"] <= 1.0, checks
print("NOTEBOOK_CHECKS", json.dumps(checks))'''),
]

# ---------------------------------------------------------------- FSL
FSL = [
    ("md", '''\
# FSL: federated supermasks, rankings and VOTE

Federated Supermask Learning keeps every weight frozen at a random value (from a seed all parties
share) and learns a **score** per edge; the forward pass uses the edges with the top-$k$ scores of each
layer (a supermask, edge-popup). Clients upload a **ranking** of their edges (an argsort of their scores)
instead of weights; the server's VOTE sums every edge's positions in the clients' rankings and argsorts the
sums into the new global ranking. A malicious client can only submit a permutation: the reverse-ranking
attack (App. A.1) submits the reverse of what benign clients would vote, and VOTE bounds its influence.

Scaled down from `experiments/reproduce/fsl_mnist.py`: a toy layer first, then FSL against FedAvg, and FSL with 10 % and
20 % malicious clients.'''),
    ("code", setup("mnist", "fsl", "import jax, jax.numpy as jnp")),
    ("md", '''\
## A supermask on a toy layer

Ten edges with random scores. `ranking(scores)` lists the edge ids from least to most important;
`supermask(scores, 0.5)` keeps the top half by $|$score$|$ (the authors' code), `mask_from_ranking(r, 0.5)`
the top half of a ranking (eq. 6).'''),
    ("code", '''\
sm = fjs.mechanisms.supermask

scores = jax.random.normal(jax.random.PRNGKey(3), (10,))
r = sm.ranking(scores)
print("scores           ", np.round(np.asarray(scores), 2))
print("ranking (low->high)", np.asarray(r))
print("supermask |score| ", np.asarray(sm.supermask(scores, 0.5)).astype(int))
print("top of ranking    ", np.asarray(sm.mask_from_ranking(r, 0.5)).astype(int))'''),
    ("md", '''\
## VOTE, and a reversed ranking

Three benign clients whose scores are noisy versions of one "true" importance, plus one attacker that
submits the reverse of the benign clients' aggregate. An edge's reputation from a client is its position in
that client's ranking (`reputations`); VOTE sums them. The attacker can at most add $n-1-$position to each
edge, so with a benign majority the global top edges barely move.'''),
    ("code", '''\
n = 10
true = jnp.arange(n, dtype=jnp.float32)                       # edge i has importance i
benign = jnp.stack([sm.ranking(true + 2.0 * jax.random.normal(jax.random.PRNGKey(k), (n,))) for k in range(3)])
attacker = sm.reverse_ranking(sm.vote(benign))                # Alg. 3: reverse the benign aggregate
reps = jax.vmap(sm.reputations)(jnp.concatenate([benign, attacker[None]]))
for name, rep in zip(["client 0", "client 1", "client 2", "attacker"], np.asarray(reps)):
    print(f"{name:9s} reputations", rep)
clean, attacked = sm.vote(benign), sm.vote(jnp.concatenate([benign, attacker[None]]))
print("VOTE of the benign clients  ", np.asarray(clean))
print("VOTE with the attacker      ", np.asarray(attacked))
top = lambda ranking: set(np.asarray(ranking)[-n // 2:].tolist())
print("top-5 edges kept:", sorted(top(clean)), "->", sorted(top(attacked)))
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(np.arange(n) - 0.2, np.asarray(reps[:3].sum(0)), width=0.4, label="benign sum")
ax.bar(np.arange(n) + 0.2, np.asarray(reps.sum(0)), width=0.4, label="with attacker")
ax.set_xlabel("edge (true importance = id)"); ax.set_ylabel("summed reputation"); ax.legend(); plt.tight_layout(); plt.show()'''),
    ("md", '''\
## FSL against FedAvg, and the reverse-ranking attack

The paper's MNIST setting (FSL's LeNet, `dirichlet_split:1.0:0.8`: each client's share split 80/20 into
local train/test, supermask lr 0.4, weight lr 0.01), with far fewer clients and rounds. FedAvg trains the
same bias-free LeNet's weights. The attacked runs make 10 % and 20 % of the clients malicious
(`malicious_fraction`, FSL's own option): whenever one is sampled, the attacker votes the benign rankings
of a few malicious clients (`attacker_clients`) and every sampled malicious client submits the reverse.'''),
    ("code", '''\
if REAL:
    data = dict(dataset="mnist", data_dir=str(DATA_DIR))
else:
    data = dict(dataset="digits")
base = dict(model="fsl_lenet", num_clients=10 if SMOKE else (100 if REAL else 30),
            clients_per_round=4 if SMOKE else (5 if REAL else 10), rounds=2 if SMOKE else (12 if REAL else 30),
            eval_every=2 if SMOKE else (4 if REAL else 5), local_epochs=1 if SMOKE or REAL else 2, batch_size=16,
            partition="dirichlet_split:1.0:0.8", seed=0, **data)
RUNS_SPEC = {
    "fedavg": dict(algorithm="fedavg", lr=0.01 if REAL else 0.05, options=dict(momentum=0.9)),
    "fsl": dict(algorithm="fsl", lr=0.4, options={}),
    # attacker_clients: malicious clients whose benign rankings the attacker votes (FRL: 25 of 1000 clients).
    "fsl_10pct_malicious": dict(algorithm="fsl", lr=0.4, options=dict(malicious_fraction=0.1, attacker_clients=5)),
    "fsl_20pct_malicious": dict(algorithm="fsl", lr=0.4, options=dict(malicious_fraction=0.2, attacker_clients=5)),
}
run_dirs = {}
for name, spec in RUNS_SPEC.items():
    run_dirs[name] = RUNS / name
    t = time.perf_counter()
    summary = fjs.run(fjs.RunConfig(out=str(run_dirs[name]), **base, **spec), progress=False).summary
    print(f"{name:22s} final global accuracy {100 * summary['final_global_accuracy']:6.2f} %   "
          f"up+down {summary['total_gbit']:.4f} Gbit   ({time.perf_counter() - t:.1f} s)")'''),
    ("code", '''\
metrics = {name: [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
           for name, path in run_dirs.items()}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
for name, rows in metrics.items():
    ax1.plot([r["round"] for r in rows], [100 * r["global_accuracy"] for r in rows], marker="o", label=name)
    ax2.bar(name.replace("_malicious", "").replace("_", "\\n"), rows[-1]["uplink_bits"] / base["clients_per_round"] / 8 / 2**20)
ax1.set_xlabel("round"); ax1.set_ylabel("global accuracy (%)"); ax1.legend(fontsize=8)
ax2.set_ylabel("upload per client per round (MB)")
plt.tight_layout(); plt.show()
display(Markdown(fjs.report_table(list(run_dirs.values()))))
print("malicious clients in the cohort of each evaluated round:",
      {name: [int(r.get("server_malicious_clients", 0)) for r in rows] for name, rows in metrics.items()
       if "malicious" in name})'''),
    ("md", '''\
An FSL upload is one rank per edge, $\\lceil\\log_2 n_l\\rceil$ bits each instead of FedAvg's 32 bits per
weight (the paper's Table 1: 4.05 MB against 6.20 MB on MNIST). Checks for the test suite:'''),
    ("code", '''\
checks = {
    "toy_vote_top5": sorted(top(clean)), "toy_vote_top5_attacked": sorted(top(attacked)),
    "fsl_uplink_bits": metrics["fsl"][-1]["uplink_bits"], "fedavg_uplink_bits": metrics["fedavg"][-1]["uplink_bits"],
    "final_global_accuracy": {name: rows[-1]["global_accuracy"] for name, rows in metrics.items()},
}
# VOTE is the argsort of the summed reputations; the attacker moves at most one edge of a benign top 5 here.
assert np.array_equal(np.asarray(clean), np.argsort(np.asarray(reps[:3].sum(0)), kind="stable"))
assert len(top(clean) & top(attacked)) >= 4, checks
assert 0 < checks["fsl_uplink_bits"] < checks["fedavg_uplink_bits"], checks
assert all(0.0 <= a <= 1.0 for a in checks["final_global_accuracy"].values()), checks
print("NOTEBOOK_CHECKS", json.dumps(checks))'''),
]

NOTEBOOKS = {"quickstart": QUICKSTART, "your_model_and_data": YOUR_MODEL_AND_DATA, "spafl": SPAFL,
             "feddrop": FEDDROP, "fsl": FSL}


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        print("wrote", write(name, cells))


if __name__ == "__main__":
    main()

"""Tiny in-memory federated datasets for fast engine tests."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from fedjax_sparse.data.federated import build_federated_data


def tiny_dataset(n_train=240, n_test=60, shape=(8, 8, 1), num_classes=4, seed=0):
    """Learnable toy images: the class sets the brightness of one quadrant."""
    rng = np.random.default_rng(seed)

    def make(n):
        y = rng.integers(0, num_classes, n).astype(np.int32)
        x = rng.integers(0, 60, (n,) + shape).astype(np.uint8)
        h, w = shape[0] // 2, shape[1] // 2
        for c in range(num_classes):
            i, j = divmod(c, 2)
            x[y == c, i * h:(i + 1) * h, j * w:(j + 1) * w] += 150
        return x, y
    train_x, train_y = make(n_train)
    test_x, test_y = make(n_test)
    return SimpleNamespace(train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y,
                           num_classes=num_classes, name="tiny")


def split_partition(dataset, sizes, test_sizes=None, seed=0):
    """Clients with the given (unequal) train sizes; test split evenly."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(dataset.train_y))
    bounds = np.cumsum([0] + list(sizes))
    train = [np.sort(perm[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    n = len(sizes)
    test = np.array_split(rng.permutation(len(dataset.test_y)), n) if test_sizes is None else None
    return SimpleNamespace(train_indices=train, test_indices=[np.sort(t) for t in test], test_from_train=False)


def tiny_federated(sizes=(10, 37, 64, 23, 50, 41), **kw):
    ds = tiny_dataset(**kw)
    return ds, build_federated_data(ds, split_partition(ds, sizes))


def hand_accuracies(alg, state, data):
    """Test accuracies counted by hand from the algorithm's own predict
    functions, as a reference for ``Engine.evaluate``: ([clients with test
    data] per-client accuracy of the personal model, or of the global model
    when there is none; the global model's accuracy on the union of the
    clients' test rows, or None without a global model)."""
    import jax
    import jax.numpy as jnp

    x_all = data.preprocess(jnp.asarray(data.test_x))
    y_all = np.asarray(data.test_y)
    glob = None
    if alg.global_predict is not None:
        global_hits = np.argmax(np.asarray(jax.jit(alg.global_predict)(state.server, x_all)), -1) == y_all
        rows = np.asarray(data.global_test_idx)
        glob = float(global_hits[rows].mean())
    personal = jax.jit(alg.personal_predict) if alg.personal_predict is not None else None
    per_client = []
    for c in range(data.num_clients):
        n = int(data.test_count[c])
        if n == 0:
            continue
        rows = np.asarray(data.test_idx[c])[:n]
        if personal is None:
            hits = global_hits
        else:
            client = jax.tree_util.tree_map(lambda v: v[c], state.clients)
            hits = np.argmax(np.asarray(personal(state.server, client, jnp.int32(c), x_all)), -1) == y_all
        per_client.append(float(hits[rows].mean()))
    return np.array(per_client), glob


def make_task(data, model="cnn_small", **overrides):
    """A Task over ``data`` (a FederatedData) with small defaults; ``model`` is a model name or a Model."""
    from fedjax_sparse.algorithms import Task
    from fedjax_sparse.models import make_model
    if isinstance(model, str):
        model = make_model(model, data.input_shape, data.num_classes)
    fields = dict(model=model, num_clients=data.num_clients, clients_per_round=min(3, data.num_clients),
                  local_epochs=1, batch_size=8, lr=0.05, rounds=3, preprocess=data.preprocess, seed=0)
    fields.update(overrides)
    return Task(**fields)


def assert_sliced_equals_masked(name, options, rounds=2, model="cnn_small", shape=(8, 8, 1),
                                sizes=(10, 37, 64, 23, 50, 41), batch_size=8):
    """Runs width algorithm ``name`` (heterofl / fjord) with ``sliced`` true and
    false on the same keys: server models, losses, exact costs and the global
    predictions must agree (the two forms are one computation). ``model``: a
    name or a Model over images of ``shape``."""
    import jax
    import jax.numpy as jnp

    from fedjax_sparse.algorithms import make_algorithm
    from fedjax_sparse.core.engine import Engine

    _, data = tiny_federated(sizes, shape=shape)
    task = make_task(data, model=model, lr=0.1, batch_size=batch_size)
    algorithms = {s: make_algorithm(name, task, {**options, "sliced": s}) for s in (True, False)}
    results = {}
    for sliced, algorithm in algorithms.items():
        engine = Engine(algorithm, len(sizes), 3)
        results[sliced] = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, rounds)
    (a, ma), (b, mb) = results[True], results[False]
    for x, y in zip(jax.tree_util.tree_leaves(a.server), jax.tree_util.tree_leaves(b.server)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-4)
    for key in ("flops", "uplink_bits", "downlink_bits"):
        np.testing.assert_array_equal(np.asarray(ma[key]), np.asarray(mb[key]))
    x = data.preprocess(jnp.asarray(data.test_x[:16]))
    np.testing.assert_allclose(algorithms[True].global_predict(a.server, x),
                               algorithms[False].global_predict(a.server, x), rtol=1e-4, atol=1e-4)


def fake_run(path: Path, config: dict, rows: list[dict], summary: dict | None = None) -> Path:
    """A run folder as `run --out` writes it (config.json, metrics.jsonl, optionally summary.json)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"config": config}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def load_script(path: str):
    """The experiment script ``experiments/<path>`` as a module, for tests of its functions (scripts are
    no package and never import one another; tests load them by path, once per session)."""
    import importlib.util
    import sys
    name = "experiments." + path.removesuffix(".py").replace("/", ".")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def flat_config(**fields):
    """A RunConfig from flat keys, execution's among them, as config.json and config files give them."""
    from fedjax_sparse.driver.config import RunConfig
    return RunConfig.from_json(fields)


def static_training_flops_per_example(layout, counts) -> int:
    """A width layout's training FLOPs per example with ``counts`` kept channels, in plain Python:
    the reference ``WidthLayout.training_flops`` is checked against."""
    ins = [counts[s] if s >= 0 else n for s, n in zip(layout.source, layout.in_units)]
    return int(sum(u * i * c for u, i, c in zip(layout.flops_unit, ins, counts)))


# A few rounds of a small population: the defaults' first steps, not a training run (default learning rates).
TINY_RUN = dict(num_clients=40, clients_per_round=2, rounds=2, local_epochs=1, batch_size=32, partition="iid",
                eval_every=2)


def finite_losses(result) -> bool:
    """Every row of a run's result has a finite loss (and there are rows)."""
    losses = [row.get("loss") for row in result.rows]
    return bool(losses) and all(loss is not None and math.isfinite(loss) for loss in losses)


TINY_ALGORITHM_MODELS = ("cnn_small", "mlp", "conv8", "fsl_lenet")


def tiny_algorithm(name, options, data):
    """The algorithm on the first tiny model it accepts (FSL needs bias-free layers, the FedAvg-shaped
    robust baselines no BatchNorm, FedDrop conv layers)."""
    from fedjax_sparse.algorithms import make_algorithm
    errors = []
    for model in TINY_ALGORITHM_MODELS:
        try:
            return make_algorithm(name, make_task(data, model), options)
        except (ValueError, KeyError) as e:
            errors.append(f"{model}: {e}")
    raise AssertionError(f"{name}: no tiny model fits: {errors}")

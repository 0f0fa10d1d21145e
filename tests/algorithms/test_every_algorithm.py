"""The checks every registered algorithm must pass, in one place (issue 49 item 6).

Each test here runs over every name ``fedjax_sparse.algorithms.algorithm_names()`` returns, so an algorithm
registered with ``register_algorithm`` (docs/design.md, "How to add an algorithm in one file") goes through
all of them with nothing added. Every algorithm:

* has typed options: a frozen dataclass, one field per option (``--option KEY=VALUE``);
* is described: registered with ``description=`` (the line ``list`` prints) and read into
  ``catalog.ALGORITHMS``;
* has typed states: its server and client states are NamedTuples (or ``()`` when there is nothing to hold),
  never string-keyed dicts, with the options that switch on the states' optional fields (``VARIANTS``);
* round-trips through a checkpoint: orbax restores each of those states exactly (``None`` fields included);
* declares whether the aggregator and attack wrappers apply (``register_algorithm(..., unwrappable=...)``),
  and the declaration matches what its clients send; where they apply, a wrapped round traces;
* trains with its default learning rate (``lr=``; none: ``catalog.DEFAULT_LR``): finite losses on the
  embedded digits, and on every built-in image data set found under ``../shared/data`` (both ``slow``).

The tests of what each algorithm computes (its mechanism against hand computations) stay in its own file
(``tests/algorithms/test_<family>.py``).
"""
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import fedjax_sparse as fjs
from fedjax_sparse.algorithms import algorithm_names, algorithm_options
from fedjax_sparse.core.engine import EngineState
from fedjax_sparse.driver.catalog import default_lr
from fedjax_sparse.driver.checkpoint import load_checkpoint, save_checkpoint

from helpers import TINY_RUN as TINY, finite_losses, tiny_algorithm as build, tiny_federated

# Options that switch on the states' optional fields (FedAvg's server_optimizer: the state's class).
VARIANTS = [(name, {}) for name in algorithm_names()] + [
    ("spafl", {"eq13_apply": "all_after"}), ("spafl", {"keep_optimizer_state": False}),
    ("topk", {"error_feedback": True}), ("fedavg", {"server_optimizer": "momentum"}),
    ("fedavg", {"server_optimizer": "yogi"})]
DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"
IMAGE_DATASETS = ("mnist", "fashion_mnist", "emnist_letters", "cifar10", "cifar100", "cifar10_sample", "svhn")
# Seen, not a learning-rate matter: Caldas et al.'s dropout on cnn7 (BatchNorm) gives a NaN loss in round 1
# at every lr tried (0.1 ... 0.01) under this suite's XLA:CPU flags (backend optimisation level 0, the
# legacy fusion emitters: conftest.py), and trains (loss 2.32) with XLA's default flags. Left open.
KNOWN_NAN = {("caldas", "cifar10_sample"), ("caldas", "cifar10")}


@pytest.fixture(scope="module")
def data():
    return tiny_federated()[1]


# ---------------------------------------------------------------------------- options and description

@pytest.mark.fast
def test_every_algorithm_has_a_frozen_typed_options_class():
    for name in algorithm_names():
        cls = algorithm_options(name)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
        instance = cls()
        with pytest.raises(dataclasses.FrozenInstanceError):
            instance.x = 1


@pytest.mark.fast
def test_list_describes_each_algorithm_and_the_data_sets_each_model_suits(capsys):
    from fedjax_sparse.algorithms.registry import algorithm_entry
    from fedjax_sparse.driver.catalog import ALGORITHMS, MODELS
    from fedjax_sparse.cli import main
    from fedjax_sparse.models import model_names
    from fedjax_sparse.models.registry import _BUILDERS
    # The package's own (tests and notebooks register theirs in the same process) each declare their line
    # when they register, which is what catalog.ALGORITHMS holds.
    own = {n for n in algorithm_names() if algorithm_entry(n).builder.__module__.startswith("fedjax_sparse.")}
    assert not [n for n in own if not algorithm_entry(n).description], "an algorithm registered without description="
    assert own <= set(ALGORITHMS)
    assert set(MODELS) == {n for n in model_names() if _BUILDERS[n].__module__.startswith("fedjax_sparse.")}
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "  spafl                    SpaFL: trainable per-neuron thresholds" in out and "NeurIPS 2024" in out
    assert "  lenet5_caffe             fashion_mnist, mnist" in out
    assert "default --lr 0.01; options: alpha: float = 0.002" in out


# ---------------------------------------------------------------------------- states and checkpoints

def is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


@pytest.mark.parametrize("name,options", VARIANTS, ids=[f"{n}{'-' + '-'.join(o) if o else ''}" for n, o in VARIANTS])
@pytest.mark.fast
def test_states_are_namedtuples(name, options, data):
    alg = build(name, options, data)
    server, clients = jax.eval_shape(alg.init, jax.random.PRNGKey(0))
    for role, state in (("server", server), ("client", clients)):
        assert not isinstance(state, dict), f"{name}: the {role} state is a dict"
        if state == ():
            continue
        assert is_namedtuple(state), f"{name}: the {role} state is a {type(state).__name__}, not a NamedTuple"


@pytest.mark.parametrize("name,options", VARIANTS, ids=[f"{n}{'-' + '-'.join(o) if o else ''}" for n, o in VARIANTS])
def test_every_state_round_trips_through_a_checkpoint(name, options, data, tmp_path):
    """orbax checkpoints (None fields included) restore each algorithm's typed state exactly."""
    alg = build(name, options, data)
    server, clients = alg.init(jax.random.PRNGKey(0))
    state = EngineState(server, clients, jax.random.PRNGKey(1), jax.numpy.int32(3))
    save_checkpoint(tmp_path, state, {"round": 3, "flops": 2 ** 70})
    template = jax.tree_util.tree_map(jax.numpy.zeros_like, state)
    loaded, totals = load_checkpoint(tmp_path, template)
    assert totals == {"round": 3, "flops": 2 ** 70}
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(state)
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(state), strict=True):
        assert a.dtype == b.dtype and (jax.numpy.asarray(a) == jax.numpy.asarray(b)).all()


# ---------------------------------------------------------------------------- the wrappers

def _messages(alg, data):
    """The abstract message one client sends (shapes and dtypes only: nothing is compiled)."""
    from fedjax_sparse.core.algorithm import ClientContext
    from fedjax_sparse.data.federated import ClientData

    def message(key):
        server, clients = alg.init(key)
        payload = alg.broadcast(server, jnp.int32(0))
        client = jax.tree_util.tree_map(lambda x: x[0], clients)
        ctx = ClientContext(jnp.int32(0), jnp.int32(0), key, key)
        return alg.client_update(payload, client, ClientData(data.train_x, data.train_y, data.train_idx[0],
                                                             data.train_count[0]), ctx)[1]
    return jax.tree_util.tree_leaves(jax.eval_shape(message, jax.random.PRNGKey(0)))


def test_every_registered_algorithm_declares_whether_the_wrappers_apply():
    """The declaration of every algorithm (``register_algorithm(..., unwrappable=...)``) matches what
    its clients send: the wrappers apply exactly when the messages are non-empty float pytrees, and
    then a wrapped round traces (no TypeError deep in a run)."""
    from helpers import make_task

    from fedjax_sparse.algorithms import make_algorithm
    from fedjax_sparse.algorithms.compose import with_aggregator, with_attack
    from fedjax_sparse.algorithms.registry import resolve_options, wrapper_refusal
    from fedjax_sparse.core.engine import Engine
    _, data = tiny_federated((12,) * 6)
    task = make_task(data)
    refused, wrapped = [], []
    for name in algorithm_names():
        alg = make_algorithm(name, task)
        leaves = _messages(alg, data)
        floats = bool(leaves) and all(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in leaves)
        reason = wrapper_refusal(name, resolve_options(name))
        assert (reason is None) == floats, (name, reason, [str(leaf.dtype) for leaf in leaves])
        if reason is not None:
            assert reason.startswith("its clients send") and "\n" not in reason, (name, reason)
            refused.append(name)
            continue
        wrapped.append(name)
        alg = with_attack(with_aggregator(alg, "multi_krum", trim_fraction=0.2), "min_max", num_clients=6,
                          malicious_fraction=0.4, seed=0)
        engine = Engine(alg, 6, 3)
        state = jax.eval_shape(engine.init, jax.random.PRNGKey(0))
        jax.eval_shape(lambda s: engine.round_step(s, data), state)
    assert {"fsl", "sfsl", "local", "spafl_local", "signsgd", "fedpm", "heterofl", "fjord"} <= set(refused)
    assert {"fedavg", "spafl", "feddrop", "scaffold"} <= set(wrapped)
    # The declaration may depend on the options: SpaFL without shared thresholds sends nothing.
    assert wrapper_refusal("spafl", resolve_options("spafl", {"share_thresholds": "false"})) is not None


# ---------------------------------------------------------------------------- default learning rates

@pytest.mark.slow
@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_algorithm_trains_the_digits_with_its_default_learning_rate(algorithm):
    result = fjs.run(fjs.RunConfig(algorithm=algorithm, dataset="digits", **{**TINY, "num_clients": 8}),
                     progress=False)
    assert result.config.lr == default_lr(algorithm) and finite_losses(result), result.rows


@pytest.mark.slow
@pytest.mark.parametrize("dataset", IMAGE_DATASETS)
def test_every_algorithm_trains_every_built_in_image_data_set_with_its_default_learning_rate(dataset):
    if not any((DATA_DIR / name).is_dir() for name in (dataset, dataset.replace("_sample", ""))):
        pytest.skip(f"{dataset} not in {DATA_DIR}")
    data = fjs.data.load(dataset, DATA_DIR)
    failed = {}
    for algorithm in algorithm_names():
        try:
            result = fjs.run(fjs.RunConfig(algorithm=algorithm, dataset=dataset, **TINY), data=data, progress=False)
        except fjs.RunError as e:
            if "diverged" in str(e):
                failed[algorithm] = str(e)
            # else: the algorithm refuses the data set's default model in one line (BatchNorm, biases)
            continue
        if not finite_losses(result):
            failed[algorithm] = [row.get("loss") for row in result.rows]
    assert set(failed) == {a for a, d in KNOWN_NAN if d == dataset}, failed

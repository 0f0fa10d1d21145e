"""Every registered algorithm's server and client states are typed NamedTuples (or ``()`` when
there is nothing to hold), never string-keyed dicts; checkpoints restore them by field name, so a
state's fields may be reordered (or a checkpoint written before a reordering still loads)."""
import jax
import pytest

from fedjax_sparse.algorithms import algorithm_names, make_algorithm
from fedjax_sparse.driver.checkpoint import load_checkpoint, save_checkpoint
from fedjax_sparse.core.engine import EngineState

from helpers import make_task, tiny_federated

# Options that switch on the states' optional fields (FedAvg's server_optimizer: the state's class).
VARIANTS = [(name, {}) for name in algorithm_names()] + [
    ("spafl", {"eq13_apply": "all_after"}), ("spafl", {"keep_optimizer_state": False}),
    ("topk", {"error_feedback": True}), ("fedavg", {"server_optimizer": "momentum"}),
    ("fedavg", {"server_optimizer": "yogi"})]
MODELS = ("cnn_small", "mlp", "conv8", "fsl_lenet")


def build(name, options, data):
    """The algorithm on the first tiny model it accepts (FSL needs bias-free layers, the FedAvg-shaped
    robust baselines no BatchNorm, FedDrop conv layers)."""
    errors = []
    for model in MODELS:
        try:
            return make_algorithm(name, make_task(data, model), options)
        except (ValueError, KeyError) as e:
            errors.append(f"{model}: {e}")
    raise AssertionError(f"{name}: no tiny model fits: {errors}")


def is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


@pytest.fixture(scope="module")
def data():
    return tiny_federated()[1]


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


def _reordered(state):
    """The same values in a NamedTuple type whose fields are declared in reverse order."""
    from typing import NamedTuple
    fields = list(reversed(state._fields))
    reordered = NamedTuple(f"Reordered{type(state).__name__}", [(f, object) for f in fields])
    return reordered(*(getattr(state, f) for f in fields))


def test_a_checkpoint_restores_by_field_name_when_the_fields_were_reordered(tmp_path, data):
    """A checkpoint written with one field order loads into a state type declaring the fields in
    another order, each array into the field of its name (SpaFL's server and client states)."""
    alg = build("spafl", {"eq13_apply": "all_after"}, data)
    server, clients = alg.init(jax.random.PRNGKey(0))
    server = jax.tree_util.tree_map(lambda x: x + 1 if x.dtype.kind == "f" else x, server)  # fields differ
    state = EngineState(server, clients, jax.random.PRNGKey(1), jax.numpy.int32(2))
    save_checkpoint(tmp_path, state, {"round": 2})
    template = EngineState(_reordered(jax.tree_util.tree_map(jax.numpy.zeros_like, server)),
                           _reordered(jax.tree_util.tree_map(jax.numpy.zeros_like, clients)),
                           jax.random.PRNGKey(5), jax.numpy.int32(0))
    assert jax.tree_util.tree_leaves(template) != [] and template.server._fields != server._fields
    loaded, totals = load_checkpoint(tmp_path, template)
    assert totals == {"round": 2} and loaded.server._fields == template.server._fields
    for old, new in ((server, loaded.server), (clients, loaded.clients)):
        for field in old._fields:
            for a, b in zip(jax.tree_util.tree_leaves(getattr(old, field)),
                            jax.tree_util.tree_leaves(getattr(new, field)), strict=True):
                assert (jax.numpy.asarray(a) == jax.numpy.asarray(b)).all(), field


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

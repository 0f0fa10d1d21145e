"""Every registered algorithm's server and client states are typed NamedTuples (or ``()`` when
there is nothing to hold), never string-keyed dicts, and their fields are declared in sorted order.

The sorted order keeps old checkpoints readable: ``checkpoint.py`` stores a state as its leaves in
flatten order, dicts (the states before they were typed) flatten in sorted-key order and NamedTuples
in field order, so sorted fields give the same leaves in the same order as the old dicts did and a
checkpoint written by an earlier version loads unchanged."""
import jax
import pytest

from fedjax_sparse.algorithms import algorithm_names, make_algorithm
from fedjax_sparse.checkpoint import load_checkpoint, save_checkpoint
from fedjax_sparse.engine import EngineState

from helpers import make_task, tiny_federated

# Options that switch on the states' optional fields.
VARIANTS = [(name, {}) for name in algorithm_names()] + [
    ("spafl", {"eq13_apply": "all_after"}), ("spafl", {"keep_optimizer_state": False}),
    ("topk", {"error_feedback": True})]
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
def test_states_are_namedtuples_with_sorted_fields(name, options, data):
    alg = build(name, options, data)
    server, clients = jax.eval_shape(alg.init, jax.random.PRNGKey(0))
    for role, state in (("server", server), ("client", clients)):
        assert not isinstance(state, dict), f"{name}: the {role} state is a dict"
        if state == ():
            continue
        assert is_namedtuple(state), f"{name}: the {role} state is a {type(state).__name__}, not a NamedTuple"
        assert list(state._fields) == sorted(state._fields), \
            f"{name}: {type(state).__name__} fields {state._fields} are not sorted (old checkpoints would not load)"
        # The same leaves, in the same order, as the dict the state used to be.
        as_dict = {k: v for k, v in state._asdict().items() if v is not None}
        assert jax.tree_util.tree_leaves(state) == jax.tree_util.tree_leaves(as_dict)


def test_a_checkpoint_of_dict_states_loads_into_the_typed_states(tmp_path, data):
    """A legacy checkpoint (``checkpoint.npz``: the leaves in flatten order) written from dict states,
    as before the states were typed, restores SpaFL's typed states leaf for leaf."""
    import json

    import numpy as np
    alg = build("spafl", {"eq13_apply": "all_after"}, data)
    server, clients = alg.init(jax.random.PRNGKey(0))
    old = EngineState({k: v for k, v in server._asdict().items() if v is not None},
                      {k: v for k, v in clients._asdict().items() if v is not None},
                      jax.random.PRNGKey(1), jax.numpy.int32(2))
    np.savez(tmp_path / "checkpoint.npz", *[np.asarray(x) for x in jax.tree_util.tree_leaves(old)],
             totals=json.dumps({"round": 2}))
    template = EngineState(jax.tree_util.tree_map(jax.numpy.zeros_like, server),
                           jax.tree_util.tree_map(jax.numpy.zeros_like, clients),
                           jax.random.PRNGKey(5), jax.numpy.int32(0))
    loaded, totals = load_checkpoint(tmp_path, template)
    assert totals == {"round": 2} and type(loaded.server) is type(server) and type(loaded.clients) is type(clients)
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(old), strict=True):
        assert (jax.numpy.asarray(a) == jax.numpy.asarray(b)).all()


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

"""Typed states: checkpoints restore them by field name, so a state's fields may be reordered (or a
checkpoint written before a reordering still loads). That every registered algorithm's states are
NamedTuples and round-trip through a checkpoint: tests/algorithms/test_every_algorithm.py."""
import jax
import pytest

from fedjax_sparse.driver.checkpoint import load_checkpoint, save_checkpoint
from fedjax_sparse.core.engine import EngineState

from helpers import tiny_algorithm as build, tiny_federated


@pytest.fixture(scope="module")
def data():
    return tiny_federated()[1]


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



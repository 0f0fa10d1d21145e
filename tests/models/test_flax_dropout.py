"""Randomness the model's authors wrote: a Flax model's dropout is active in local training, with a fresh key
per step derived from the client's step key (the same seed gives the same numbers), and off in evaluation;
what the engine cannot give a module (another rng stream, a device axis) is refused at ``from_flax``."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_sparse as fjs
from fedjax_sparse.models import from_flax
from tests.helpers import tiny_dataset

SHAPE = (8, 8, 1)


class DropMLP(nn.Module):
    rate: float = 0.5

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(16, name="fc1")(x.reshape(x.shape[0], -1)))
        x = nn.Dropout(self.rate, deterministic=not train)(x)
        return nn.Dense(4, name="fc2")(x)


class OwnDropout(nn.Module):
    """Dropout written by hand with ``self.make_rng('dropout')``, gated on the train flag."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(16, name="fc1")(x.reshape(x.shape[0], -1)))
        if train:
            keep = jax.random.bernoulli(self.make_rng("dropout"), 0.5, x.shape)
            x = jnp.where(keep, x / 0.5, 0.0)
        return nn.Dense(4, name="fc2")(x)


class AttentionDropout(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(8, name="embed")(x.reshape(x.shape[0], 8, 8))
        h = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.5, deterministic=not train, name="att")(h)
        return nn.Dense(4, name="head")(h.reshape(h.shape[0], -1))


class Noise(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16, name="fc1")(x.reshape(x.shape[0], -1))
        if train:
            x = x + jax.random.normal(self.make_rng("noise"), x.shape)
        return nn.Dense(4, name="fc2")(x)


class SyncBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16, name="fc1")(x.reshape(x.shape[0], -1))
        x = nn.BatchNorm(use_running_average=not train, axis_name="batch", name="bn")(x)
        return nn.Dense(4, name="fc2")(nn.relu(x))


@pytest.fixture(scope="module")
def data():
    ds = tiny_dataset(n_train=64, n_test=24, shape=SHAPE)
    return fjs.data.from_arrays(ds.train_x, ds.train_y, ds.test_x, ds.test_y, partition="dirichlet:0.5",
                                num_clients=4, seed=1)


def _run(model, data, seed=0):
    rows = []
    config = fjs.RunConfig(algorithm="fedavg", rounds=2, clients_per_round=2, local_epochs=1, batch_size=8, lr=0.1,
                           seed=seed)
    result = fjs.run(config, model=model, data=data, progress=False, on_eval=lambda row, s, e: rows.append(row))
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows], result


def _server_params(result):
    return jax.tree_util.tree_leaves(result.state.server)


def test_dropout_is_active_in_training_and_reproducible(data):
    dropped = from_flax(DropMLP(0.5), SHAPE)
    first, first_result = _run(dropped, data)
    again, again_result = _run(dropped, data)
    assert first == again
    for a, b in zip(_server_params(first_result), _server_params(again_result)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The same network with rate 0 (the same weights: rate is no parameter) trains to other weights.
    _, plain_result = _run(from_flax(DropMLP(0.0), SHAPE), data)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(_server_params(first_result), _server_params(plain_result)))


def test_evaluation_is_deterministic_and_is_the_module_without_dropout(data):
    module = DropMLP(0.5)
    model = from_flax(module, SHAPE)
    _, result = _run(model, data)
    variables = result.state.server.variables
    x = jax.random.normal(jax.random.PRNGKey(1), (5,) + SHAPE)
    once, _ = model.apply(variables, x, train=False)
    twice, _ = model.apply(variables, x, train=False)
    np.testing.assert_array_equal(np.asarray(once), np.asarray(twice))
    nested = {"params": {k: v for k, v in variables["params"].items()}}
    want = module.apply(nested, x, train=False)
    np.testing.assert_allclose(np.asarray(once), np.asarray(want), rtol=1e-5, atol=1e-6)
    # In training with a key dropout changes the output, and the same key gives the same output.
    key = jax.random.PRNGKey(2)
    a, _ = model.apply(variables, x, train=True, rng=key)
    b, _ = model.apply(variables, x, train=True, rng=key)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), np.asarray(once))


@pytest.mark.parametrize("module", [OwnDropout(), AttentionDropout()], ids=["make_rng", "attention"])
def test_modules_drawing_dropout_keys_train(module, data):
    model = from_flax(module, SHAPE)
    rows, _ = _run(model, data)
    again, _ = _run(model, data)
    assert len(rows) == 2 and rows == again
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)


@pytest.mark.parametrize("module,words", [
    (Noise(), ["'noise'", "Noise.__call__", "make_rng('dropout')"]),
    (SyncBatchNorm(), ["'batch'", "layer 'bn' (BatchNorm)", "drop axis_name"]),
])
def test_what_the_engine_cannot_give_is_refused_at_from_flax(module, words):
    with pytest.raises(ValueError) as info:
        from_flax(module, SHAPE)
    message = str(info.value)
    assert message.startswith("from_flax:") and "\n" not in message
    for word in words:
        assert word in message

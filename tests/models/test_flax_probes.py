"""Issue 41 item 3: ``from_flax`` verifies on a probe that a dropped unit is zero where the next layer reads
it (else the mechanisms that drop units refuse, in one line) and that padded rows change nothing for the
real ones (else the model is refused, in one line). Tiny models: each test takes seconds."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fedjax_sparse as fjs
from fedjax_sparse.algorithms.registry import make_algorithm
from fedjax_sparse.models import from_flax
from fedjax_sparse.models.base import Hooks
from fedjax_sparse.algorithms import Task
from tests.helpers import tiny_dataset

SHAPE = (6, 6, 1)
DROPPING = [("feddrop", {}), ("unidrop", {}), ("caldas", {}), ("heterofl", {"sliced": False}),
            ("fjord", {"sliced": False})]


class ConvNorm(nn.Module):
    """conv1 -> [a normalisation] -> ReLU -> flatten -> head."""
    norm: str = "none"

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(4, (3, 3), name="conv1")(x)
        if self.norm == "group":
            x = nn.GroupNorm(num_groups=2, name="gn")(x)
        elif self.norm == "layer":
            x = nn.LayerNorm(name="ln")(x)
        elif self.norm == "batch":
            x = nn.BatchNorm(use_running_average=not train, name="bn")(x)
        x = nn.relu(x)
        if self.norm == "batch_after_relu":
            x = nn.BatchNorm(use_running_average=not train, name="bn")(x)
        return nn.Dense(3, name="head")(x.reshape(x.shape[0], -1))


class OwnBatchNorm(nn.Module):
    """A library's own BatchNorm: statistics over whatever rows the batch holds."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],))
        return (x - x.mean(0)) / jnp.sqrt(x.var(0) + 1e-5) * scale + bias


class WithOwnBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(OwnBatchNorm(name="own_bn")(nn.Conv(4, (3, 3), name="conv1")(x)))
        return nn.Dense(3, name="head")(x.reshape(x.shape[0], -1))


class NnxGroupNorm(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.gn = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
        self.head = nnx.Linear(6 * 6 * 4, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.gn(self.conv1(x))).reshape(x.shape[0], -1))


@pytest.fixture(scope="module")
def data():
    ds = tiny_dataset(n_train=48, n_test=12, shape=SHAPE, num_classes=3)
    return fjs.data.from_arrays(ds.train_x, ds.train_y, ds.test_x, ds.test_y, partition="iid", num_clients=3, seed=0)


def _task(model):
    return Task(model=model, num_clients=3, clients_per_round=2, local_epochs=1, batch_size=8, lr=0.05, rounds=1,
                preprocess=lambda x: x, seed=0)


def _head_input(model, variables, x, train, dropped):
    """What the module's Dense 'head' receives when the adapted model zeroes ``dropped`` channels of conv1
    (read by a Flax interceptor of our own, not by the probe)."""
    seen = {}

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and isinstance(context.module, nn.Dense):
            seen["x"] = args[0]
        return next_fun(*args, **kwargs)

    def hook(name, h):
        return h * (1.0 - dropped) if name == "conv1" else h
    with nn.intercept_methods(interceptor):
        model.apply(variables, x, train=train, hooks=Hooks(activation=hook),
                    sample_mask=jnp.ones((x.shape[0],)) if train else None)
    return np.asarray(seen["x"])


def test_a_plain_cnn_is_unchanged_and_every_mechanism_builds(data):
    model = from_flax(ConvNorm("none"), SHAPE)
    assert model.unit_drop_leaks == ()
    for name, options in DROPPING:
        make_algorithm(name, _task(model), options)


def test_flax_batch_norm_after_the_conv_keeps_a_dropped_channel_exactly_zero_downstream(data):
    module = ConvNorm("batch")
    model = from_flax(module, SHAPE)
    assert model.unit_drop_leaks == () and model.channel_entries == (("bn", "conv1"),)
    for name, options in DROPPING:
        make_algorithm(name, _task(model), options)
    variables = model.init(jax.random.PRNGKey(0))
    # Running statistics and BatchNorm offsets away from their initial values: a zero would not survive them.
    variables["batch_stats"]["bn"] = {"mean": jnp.full((4,), 0.7), "var": jnp.full((4,), 2.0)}
    variables["params"]["bn"] = {"scale": jnp.full((4,), 1.5), "bias": jnp.full((4,), 0.4)}
    dropped = jnp.asarray([0.0, 1.0, 0.0, 1.0])
    x = jax.random.normal(jax.random.PRNGKey(3), (4,) + SHAPE)
    for train in (True, False):
        h = _head_input(model, variables, x, train, dropped).reshape(4, -1)
        reads_dropped = np.arange(h.shape[1]) % 4 % 2 == 1
        assert np.all(h[:, reads_dropped] == 0.0)
        assert np.abs(h[:, ~reads_dropped]).max() > 0.1


@pytest.mark.parametrize("norm,words", [("group", "GroupNorm 'gn'"), ("layer", "LayerNorm 'ln'"),
                                        ("batch_after_relu", "BatchNorm 'bn'")])
def test_a_normalisation_between_the_layers_refuses_every_mechanism_that_drops_units(norm, words, data):
    module = ConvNorm(norm)
    model = from_flax(module, SHAPE)
    assert [layer for layer, _ in model.unit_drop_leaks] == ["conv1"]
    # The leak is real: the head reads nonzero values where conv1's dropped channels go (the normalisation's
    # offsets moved off zero, as training moves them).
    variables = model.init(jax.random.PRNGKey(0))
    variables["params"] = {k: (v if k in ("conv1", "head") else jax.tree_util.tree_map(lambda a: a + 0.4, v))
                           for k, v in variables["params"].items()}
    h = _head_input(model, variables, jax.random.normal(jax.random.PRNGKey(3), (4,) + SHAPE), True,
                    jnp.asarray([0.0, 1.0, 0.0, 1.0])).reshape(4, -1)
    assert np.abs(h[:, np.arange(h.shape[1]) % 2 == 1]).max() > 0.05
    for name, options in DROPPING:
        with pytest.raises(ValueError) as info:
            make_algorithm(name, _task(model), options)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"{name}: ")
        for word in ("'conv1'", "'head'", words, "nn.BatchNorm", "fedavg"):
            assert word in message, (word, message)


def test_fedavg_still_trains_a_model_with_group_norm(data):
    model = from_flax(ConvNorm("group"), SHAPE)
    config = fjs.RunConfig(algorithm="fedavg", rounds=1, clients_per_round=2, local_epochs=1, batch_size=8, lr=0.1)
    result = fjs.run(config, model=model, data=data, progress=False)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(result.state.server))


def test_an_nnx_group_norm_is_found_as_well(data):
    model = from_flax(NnxGroupNorm(nnx.Rngs(0)), SHAPE)
    assert [layer for layer, _ in model.unit_drop_leaks] == ["conv1"]
    with pytest.raises(ValueError, match=r"feddrop: .*'conv1'.*a GroupNorm"):
        make_algorithm("feddrop", _task(model), {})


def test_a_batch_norm_of_its_own_mixing_padded_rows_is_refused_at_from_flax():
    with pytest.raises(ValueError) as info:
        from_flax(WithOwnBatchNorm(), SHAPE)
    message = str(info.value)
    assert "\n" not in message and message.startswith("from_flax: WithOwnBatchNorm: padded rows")
    for word in ("OwnBatchNorm 'own_bn'", "before the output of layer 'head'", "training mode", "nn.BatchNorm"):
        assert word in message, (word, message)


class Transposed(nn.Module):
    """A flatten in PyTorch's order (channels first): the head's row f reads channel f // 36, not f % 4."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), name="conv1")(x))
        return nn.Dense(3, name="head")(x.transpose(0, 3, 1, 2).reshape(x.shape[0], -1))


def test_a_flatten_in_another_channel_order_refuses_what_depends_on_which_rows(data):
    model = from_flax(Transposed(), SHAPE)
    assert [layer for layer, _ in model.unit_drop_leaks] == ["conv1"]
    # FedDrop's FLOPs count how many inputs are dropped, not which rows: it runs. Caldas and the widths cut
    # the rows f with f % 4 of a dropped channel, which are not the ones the head reads it with: refused.
    for name in ("feddrop", "unidrop"):
        make_algorithm(name, _task(model), {})
    for name, options in DROPPING[2:]:
        with pytest.raises(ValueError, match=rf"^{name}: .*layer 'head' reads the channels of layer 'conv1' in "
                                             r"another order.*flatten channels last"):
            make_algorithm(name, _task(model), options)

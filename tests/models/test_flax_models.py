"""from_flax: a Flax model derives the zoo's layer table and trains to the zoo's numbers.

The reference is the zoo's hand-built LeNet-5-Caffe (``lenet5_caffe``); the same network written
in ``flax.linen`` and in ``flax.nnx``, given the zoo's initial weights, must give the same layer
table (kernel shapes, units, MACs, which layer feeds which), the same logits, and the same metrics
and final states for FedAvg, SpaFL, FSL and FedDrop over 3 rounds on real Fashion-MNIST clients.
"""
import dataclasses
import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.extend  # noqa: F401  (jax.extend.core: not imported by `import jax`)
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_sparse as fjs
from fedjax_sparse.models import Hooks, LayerInfo, Model, from_flax, make_model
from fedjax_sparse.models.flax.adapter import link_layers
from fedjax_sparse.models.flax_examples import LeNet5Caffe as LinenLeNet
from fedjax_sparse.models.flax_examples import NnxLeNet5Caffe


# A reference derivation of a hand-written model's layer table, independent of from_flax's program_flow.
def direct_sources(fn: Callable, x_aval, probe_avals: Sequence) -> tuple[list[frozenset], frozenset]:
    """Which probes each output of ``fn(x, *probes) -> (logits, [layer inputs])`` depends on.

    Returns (per layer input: a frozenset of probe indices, -1 standing for ``x``; the same for the
    logits). Dependencies are followed through the jaxpr conservatively (an equation's outputs
    depend on all its inputs), which is exact for the chains and sums of a network's data flow."""
    closed = jax.make_jaxpr(fn)(x_aval, *probe_avals)
    jaxpr = closed.jaxpr
    deps: dict = {}
    for i, var in enumerate(jaxpr.invars):
        deps[var] = frozenset({i - 1})

    def of(v):
        return frozenset() if isinstance(v, jax.extend.core.Literal) else deps.get(v, frozenset())
    for eqn in jaxpr.eqns:
        union = frozenset().union(*(of(v) for v in eqn.invars))
        for out in eqn.outvars:
            deps[out] = union
    outs = [of(v) for v in jaxpr.outvars]
    return outs[1:], outs[0]


def layers_from_hooks(model: Model) -> tuple[tuple[LayerInfo, ...], bool]:
    """The layer table of any :class:`Model` whose forward pass calls ``hooks.kernel`` on each
    weight layer's kernel and ``hooks.activation`` on its output (the zoo's models), derived as
    ``from_flax`` derives it: kernel shapes from the kernel hook, MACs from the output the
    activation hook sees (output positions x kernel entries), ``input_layer`` and ``sequential``
    from the data flow with each layer's output replaced by a probe. Layers whose kernel bypasses
    the hooks (the ResNet's classifier, the ViT's embeddings) are not seen. ``in_units`` is the
    kernel's input width (no grouped convolutions in the zoo). Returns (layers, sequential).

    It checks the zoo's hand-written tables independently (below)."""
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    x_aval = jax.ShapeDtypeStruct((2,) + tuple(model.input_shape), jnp.float32)
    kernels: dict[str, tuple] = {}
    outputs: dict[str, tuple] = {}

    def record_kernel(name, kernel):
        kernels.setdefault(name, tuple(kernel.shape))
        return kernel

    def record_output(name, h):
        if name in kernels:
            outputs.setdefault(name, tuple(h.shape))
        return h
    jax.eval_shape(lambda v, x: model.apply(v, x, hooks=Hooks(kernel=record_kernel, activation=record_output)),
                   variables, x_aval)
    names = [n for n in kernels if n in outputs]

    concrete = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), variables)

    def probed(x, *probes):
        # The value the activation hook receives depends on the layer's input only (its kernel is no
        # probe): its probe sources are the layer's direct sources. The hook then returns the probe.
        by_name = dict(zip(names, probes))
        received: dict[str, Any] = {}

        def activation(name, h):
            if name in by_name:
                received[name] = h
                return by_name[name]
            return h
        logits, _ = model.apply(concrete, x, hooks=Hooks(activation=activation))
        return logits, [received[n] for n in names]
    sources, logits_sources = direct_sources(probed, x_aval,
                                             [jax.ShapeDtypeStruct(outputs[n], jnp.float32) for n in names])
    in_units = [kernels[n][-2] for n in names]
    out_units = [kernels[n][-1] for n in names]
    inputs, sequential = link_layers(names, in_units, out_units, sources, logits_sources)
    layers = tuple(
        LayerInfo(n, "conv" if len(kernels[n]) > 2 else "dense", kernels[n], int(kernels[n][-2]), int(kernels[n][-1]),
                  int(math.prod(outputs[n][1:-1])) * int(math.prod(kernels[n])), inp)
        for n, inp in zip(names, inputs))
    return layers, sequential


class Residual(nn.Module):
    """A stem with BatchNorm, one residual conv and a head: not a chain."""
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.BatchNorm(use_running_average=not train, name="stem_bn")(nn.Conv(8, (3, 3), name="stem")(x)))
        x = nn.relu(x + nn.Conv(8, (3, 3), name="branch")(x))
        return nn.Dense(10, name="head")(x.mean(axis=(1, 2)))


class BatchNormChain(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(6, (3, 3), padding="SAME", name="conv")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, name="bn")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2)).reshape(x.shape[0], -1)
        return nn.Dense(4, name="out")(x)


# 16x16 crops keep LeNet-5-Caffe's layers (conv 5x5, pool, conv 5x5, pool, fc 500, fc) at a fraction
# of the compile and run time of 28x28 (the layer table at 28x28 is checked separately).
SHAPE = (16, 16, 1)


@pytest.mark.fast
def test_lenet_layer_table_equals_the_zoo_at_28x28():
    zoo = make_model("lenet5_caffe", (28, 28, 1), 10)
    linen = from_flax(LinenLeNet(), (28, 28, 1))
    nnx_model = from_flax(NnxLeNet5Caffe(), (28, 28, 1))
    assert linen.layers == zoo.layers  # shapes, units, MACs (288,000 / 1.6M / 400,000 / 5,000), input layers
    assert nnx_model.layers == zoo.layers
    assert linen.sequential and nnx_model.sequential and linen.num_classes == 10
    assert linen.forward_macs == zoo.forward_macs == 2_293_000


def test_same_weights_give_the_zoo_logits_and_hooks_act_on_the_same_layers():
    zoo = make_model("lenet5_caffe", SHAPE, 10)
    variables = zoo.init(jax.random.PRNGKey(3))
    x = jax.random.uniform(jax.random.PRNGKey(4), (5,) + SHAPE)
    seen = {}

    def kernel(name, k):
        seen.setdefault(name, k.shape)
        return k * 0.5

    def activation(name, h):
        return h * (1.0 + 0.25 * (name == "conv2"))
    hooks = Hooks(kernel=kernel, activation=activation)
    want = zoo.apply(variables, x, hooks=hooks)[0]
    for model in (from_flax(LinenLeNet(), SHAPE), from_flax(NnxLeNet5Caffe(flat_features=50), SHAPE)):
        got = model.apply(variables, x, hooks=hooks)[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert list(seen) == ["conv1", "conv2", "fc1", "fc2"]


@pytest.mark.fast
def test_residual_model_is_not_sequential_and_batchnorm_follows_its_layer():
    model = from_flax(Residual(), (8, 8, 3))
    assert [l.name for l in model.layers] == ["stem", "branch", "head"]
    assert not model.sequential  # the head reads stem + branch
    assert [l.input_layer for l in model.layers] == [None, "stem", "branch"]
    assert model.channel_entries == (("stem_bn", "stem"),)
    assert model.layer("stem").macs == 8 * 8 * 3 * 3 * 3 * 8  # SAME padding keeps 8x8 outputs


@pytest.mark.fast
def test_direct_sources_on_a_hand_made_data_flow():
    # y1 = f(x); y2 = g(y1); z = y1 + y2 -> the third layer's input reads probes 0 and 1.
    def fn(x, p0, p1, p2):
        return p2.sum(), [x * 2.0, jnp.tanh(p0), p0 + p1]
    sources, logits = direct_sources(fn, jnp.zeros(3), [jnp.zeros(3)] * 3)
    assert sources == [frozenset({-1}), frozenset({0}), frozenset({0, 1})] and logits == frozenset({2})
    inputs, sequential = link_layers(["a", "b", "c"], [3, 3, 3], [3, 3, 3], sources, logits)
    assert inputs == [None, "a", "b"] and not sequential


def test_batch_norm_statistics_ignore_padded_samples():
    model = from_flax(BatchNormChain(), (6, 6, 2))
    variables = model.init(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 6, 6, 2))
    padded = jnp.concatenate([x, 100.0 * jnp.ones((2, 6, 6, 2))])
    logits, stats = model.apply(variables, padded, train=True, sample_mask=jnp.array([1.0] * 4 + [0.0] * 2))
    ref_logits, ref_stats = model.apply(variables, x, train=True)
    np.testing.assert_allclose(np.asarray(logits[:4]), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
    for key in ("mean", "var"):
        np.testing.assert_allclose(np.asarray(stats["bn"][key]), np.asarray(ref_stats["bn"][key]), rtol=1e-5)
    assert not np.allclose(np.asarray(stats["bn"]["mean"]), np.asarray(variables["batch_stats"]["bn"]["mean"]))
    # Evaluation reads the running statistics: the padded batch changes nothing there.
    np.testing.assert_array_equal(np.asarray(model.apply(variables, padded)[0][:4]),
                                  np.asarray(model.apply(variables, x)[0]))


def test_wrong_outputs_are_refused():
    # Weight sharing is a layer with uses == 2 (tests/models/test_flax_any_model.py), no longer refused here.
    with pytest.raises(ValueError, match="returns 10 logits .* 7 classes"):
        from_flax(LinenLeNet(), SHAPE, num_classes=7)
    with pytest.raises(TypeError, match="flax.linen or flax.nnx Module"):
        from_flax(lambda x: x, SHAPE)


# ------------------------------------------------------------------ the algorithms, zoo vs Flax
@pytest.fixture(scope="module")
def fmnist_clients(shared_data):
    ds = fjs.data.load("fashion_mnist", shared_data)
    rng = np.random.default_rng(0)
    train = rng.choice(len(ds.train_y), 360, replace=False)
    test = rng.choice(len(ds.test_y), 120, replace=False)
    crop = (slice(None), slice(6, 22), slice(6, 22))
    return fjs.data.from_arrays(ds.train_x[train][crop], ds.train_y[train], ds.test_x[test][crop], ds.test_y[test],
                                partition="dirichlet:0.5", num_clients=6, seed=1)


def _rows(config, model, data):
    rows = []
    result = fjs.run(config, model=model, data=data, progress=False,
                     on_eval=lambda row, state, exp: rows.append(row))
    drop = {"seconds"}
    return [{k: v for k, v in r.items() if k not in drop} for r in rows], result


@pytest.mark.parametrize("algorithm,options", [
    ("fedavg", {}),
    ("spafl", {}),
    ("fsl", {}),
    ("feddrop", {"opt_iters": 200, "opt_check_every": 100}),
    ("heterofl", {"sliced": False}),   # masked widths: a Flax module's widths are fixed
    ("caldas", {}),
])
def test_flax_lenet_trains_to_the_zoo_metrics(fmnist_clients, algorithm, options):
    zoo = make_model("lenet5_caffe", SHAPE, 10)
    flax_model = dataclasses.replace(from_flax(LinenLeNet(), SHAPE), init_fn=zoo.init_fn)
    config = fjs.RunConfig(algorithm=algorithm, rounds=3, clients_per_round=3, local_epochs=1, batch_size=32,
                           lr=0.05, options=options, preprocess="unit")
    want, want_result = _rows(config, zoo, fmnist_clients)
    got, got_result = _rows(config, flax_model, fmnist_clients)
    assert len(got) == 3
    # Bitwise: the same programs up to the layers' code (the forward pass is bit-identical).
    assert got == want
    leaves = jax.tree_util.tree_leaves(want_result.state.server)
    for a, b in zip(leaves, jax.tree_util.tree_leaves(got_result.state.server)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert type(got_result.state.server) is type(want_result.state.server)


# ------------------------------------------------------------------ the zoo's hand-written tables, derived
@pytest.mark.parametrize("name,shape", [
    ("lenet5_caffe", (28, 28, 1)), ("cnn_small", (8, 8, 1)), ("mlp", (60,)), ("logreg", (60,)),
    ("cnn7", (32, 32, 3)), ("conv8", (32, 32, 3)), ("fsl_lenet", (28, 28, 1)), ("feddrop_fmnist_cnn", (28, 28, 1)),
    ("feddrop_svhn_cnn", (32, 32, 3)), ("feddrop_vgg9", (32, 32, 3)), ("resnet18_narrow", (32, 32, 3)),
])
def test_zoo_tables_equal_their_derivation_from_the_forward_pass(name, shape):
    model = make_model(name, shape, 10)
    derived, sequential = layers_from_hooks(model)
    assert sequential == model.sequential
    hand = {l.name: l for l in model.layers}
    if model.sequential:
        assert derived == model.layers
        return
    # The ResNet: its classifier bypasses the hooks; a block's input is the sum of two equal-width
    # layers (conv2 + shortcut), of which the hand table names conv2 and the derivation the later one.
    for layer in derived:
        ref = hand[layer.name]
        assert (layer.kernel_shape, layer.in_units, layer.out_units, layer.macs) == \
            (ref.kernel_shape, ref.in_units, ref.out_units, ref.macs)
        assert layer.input_layer == ref.input_layer or hand[layer.input_layer].out_units == layer.in_units
    assert [l.name for l in model.layers if l.name not in {d.name for d in derived}] == ["linear"]

"""Any Flax model, honestly, round three (issue 47 items 1, 2, 4, 5, 6).

* The forward-equality and norm/padding probes run with every parameter perturbed (a zero-initialised head
  no longer hides a layer computing something else), and a layer overriding anything of its Flax base class
  (BiT's ``StdConv.param``) runs its own code.
* Layers under lifted transforms (``nn.remat``, ``nn.jit``, ``nn.scan``, ``nnx.remat``, ``nnx.scan``) are seen
  with their true inputs and costs: HeteroFL/FjORD book the same with and without ``nn.remat``.
* Fan-in from the traced product's contraction (a fused qkv Einsum), for FedPM's and FSL's constants.
* A layer computing more than its kernel's product (LoRA) is refused by the mechanisms that threshold rows
  or drop units, and its extra products are booked outside the kernel's.
* Modules that run by themselves are followed (NNX after a first call, Rngs-holding blocks under
  ``nnx.vmap``/``nnx.scan``, ``nnx.remat``, ``nnx.bridge.ToNNX``, ``nnx.RNN``, a BatchNorm whose mode the
  module fixes, a shared head); what the adapter cannot follow is said as the adapter's limit.
Tiny models: seconds each.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fedjax_sparse as fjs
from fedjax_sparse.algorithms import Task
from fedjax_sparse.algorithms.registry import make_algorithm
from fedjax_sparse.mechanisms import supermask as sm
from fedjax_sparse.mechanisms.widths import WidthLayout
from fedjax_sparse.models.flax import adapter as flax_adapter
from fedjax_sparse.models import from_flax
from tests.helpers import tiny_dataset

ROW_AND_UNIT = [("spafl", {}), ("feddrop", {}), ("unidrop", {}), ("caldas", {}), ("heterofl", {"sliced": False}),
                ("fjord", {"sliced": False})]


def _task(model):
    return Task(model=model, num_clients=3, clients_per_round=2, local_epochs=1, batch_size=8, lr=0.05, rounds=1,
                preprocess=lambda x: x, seed=0)


def _nested(entries):
    return flax_adapter._unflatten({tuple(k.split("/")): v for k, v in entries.items()})


def _linen_variables(params):
    return {"params": _nested(params)}


def _moved(model, seed=5):
    """The model's variables moved off their initial values (a zero-initialised head included; variances stay
    positive)."""
    variables = model.init(jax.random.PRNGKey(0))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(variables)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    moved = [leaf + (jnp.abs if path[0].key == "batch_stats" else (lambda a: a))(0.3 * jax.random.normal(k, leaf.shape))
             for (path, leaf), k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, moved)


# ------------------------------------------------------------------ 1. probes that cannot be blind
def _standardize(x, axis, eps):
    x = x - jnp.mean(x, axis=axis, keepdims=True)
    return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=axis, keepdims=True) + eps)


class StdConv(nn.Conv):
    """big_vision's BiT convolution: the kernel is standardised where it is read (``param``), not in ``__call__``."""

    def param(self, name, *a, **kw):
        param = super().param(name, *a, **kw)
        if name == "kernel":
            param = _standardize(param, axis=[0, 1, 2], eps=1e-8)
        return param


class BiT(nn.Module):
    """A weight-standardised conv under a zero-initialised head (BiT's head starts at zero)."""
    conv: type = StdConv

    @nn.compact
    def __call__(self, x):
        x = nn.relu(self.conv(8, (3, 3), use_bias=False, name="conv")(x))
        return nn.Dense(3, kernel_init=nn.initializers.zeros, name="head")(x.mean(axis=(1, 2)))


def test_a_conv_standardising_its_kernel_in_param_runs_its_own_code():
    model = from_flax(BiT(), (8, 8, 3))
    variables = _moved(model)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 8, 3))
    want = BiT().apply(_linen_variables(variables["params"]), x)
    got = model.apply(variables, x)[0]
    assert float(jnp.max(jnp.abs(want))) > 0.5
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_forward_probe_is_not_blind_behind_a_zero_initialised_head(monkeypatch):
    """A fast path computing something else in the conv: the head's zero kernel made both sides' logits 0 on
    the initial weights, so the probe passed it; on perturbed weights it is refused, naming the layer."""
    real = flax_adapter._fast_conv

    def wrong(x, kernel, conv, impl):
        out = real(x, kernel, conv, impl)
        return None if out is None else out * 1.5
    monkeypatch.setattr(flax_adapter, "_fast_conv", wrong)
    with pytest.raises(ValueError, match=r"differs from the module's own .*first at layer conv\)") as refused:
        from_flax(BiT(conv=nn.Conv), (8, 8, 3))
    assert "\n" not in str(refused.value)


# ------------------------------------------------------------------ 2. lifted transforms
class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Conv(4, (3, 3), name="c1")(x))
        return x + nn.Conv(4, (3, 3), name="c2")(h)


class ResNet(nn.Module):
    """A stem, two residual blocks (optionally under a lifted transform), a head."""
    lift: str = "none"

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), name="stem")(x))
        block = {"none": Block, "remat": nn.remat(Block), "jit": nn.jit(Block)}[self.lift]
        x = block(name="b1")(block(name="b0")(x))
        return nn.Dense(3, name="head")(x.mean(axis=(1, 2)))


@pytest.fixture(scope="module")
def resnets():
    built: dict = {}

    def get(lift):
        if lift not in built:
            built[lift] = from_flax(ResNet(lift), (6, 6, 1))
        return built[lift]
    return get


@pytest.mark.parametrize("lift", ["remat", "jit"])
def test_layers_under_a_lifted_transform_have_their_true_inputs_and_costs(resnets, lift):
    plain, lifted = resnets("none"), resnets(lift)
    assert [layer.input_layer for layer in plain.layers] == [None, "stem", "b0/c1", "b0/c2", "b1/c1", "b1/c2"]
    assert lifted.layers == plain.layers
    assert (lifted.other_macs, lifted.sequential, lifted.channel_entries) == \
        (plain.other_macs, plain.sequential, plain.channel_entries)


def test_heterofl_and_fjord_book_the_same_with_and_without_remat(resnets):
    ds = tiny_dataset(n_train=48, n_test=12, shape=(6, 6, 1), num_classes=3)
    data = fjs.data.from_arrays(ds.train_x, ds.train_y, ds.test_x, ds.test_y, partition="iid", num_clients=3, seed=0)
    booked = {}
    for lift in ("none", "remat"):
        model = resnets(lift)
        layout = WidthLayout.from_model(model, model.init(jax.random.PRNGKey(0)))
        rows = []
        config = fjs.RunConfig(algorithm="heterofl", rounds=1, clients_per_round=2, local_epochs=1, batch_size=8,
                               lr=0.05, options={"sliced": False})
        fjs.run(config, model=model, data=data, progress=False, on_eval=lambda row, s, e: rows.append(row))
        booked[lift] = ({k: rows[-1][k] for k in ("flops", "uplink_bits", "downlink_bits", "density", "loss")},
                        layout.source, layout.flops_unit, layout.kernel_unit)
    assert booked["remat"] == booked["none"]
    assert booked["none"][0]["flops"] == 1120896    # before: 2116224 under nn.remat (blocks read the whole input)


class TokenMapped(nn.Module):
    """A Dense mapped over two halves of the features by nn.vmap (shared weights), between two Dense layers."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="inp")(x).reshape(x.shape[0], 2, 4)
        x = nn.vmap(nn.Dense, in_axes=1, out_axes=1, variable_axes={"params": None},
                    split_rngs={"params": False})(4, name="tok")(x)
        return nn.Dense(3, name="head")(x.reshape(x.shape[0], 8))


def test_a_layer_under_nn_vmap_is_seen_with_its_costs_and_feeds_the_next():
    model = from_flax(TokenMapped(), (6,))
    assert [(layer.name, layer.macs) for layer in model.layers] == [("inp", 48), ("tok", 2 * 4 * 4), ("head", 24)]
    assert model.layer("head").input_layer == "tok"            # before: "inp" (the mapped layer was not followed)
    assert model.layer("tok").input_layer is None              # it reads half of inp's channels per mapped call
    assert not model.sequential


class ScannedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(8, use_bias=False, name="fc")(nn.relu(x)), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, use_bias=False, name="inp")(x)
        x, _ = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)(
            name="blocks")(x, None)
        return nn.Dense(3, use_bias=False, name="head")(x)


def test_a_layer_scanned_over_repetitions_is_one_stacked_layer_masked_per_weight():
    model = from_flax(Scanned(), (6,))
    blocks = model.layer("blocks/fc")
    assert (blocks.kind, blocks.kernel_shape, blocks.macs, blocks.fan_in, blocks.input_layer) == \
        ("scanned", (3, 8, 8), 3 * 8 * 8, 8, "inp")
    assert model.forward_macs == 6 * 8 + 3 * 64 + 8 * 3
    server, _ = make_algorithm("fedpm", _task(model)).init(jax.random.PRNGKey(0))
    assert server.probs["blocks/fc"].shape == (3, 8, 8)
    for name, options in ROW_AND_UNIT:
        with pytest.raises(ValueError, match=rf"^{name}: layer blocks/fc .*'scanned'") as refused:
            make_algorithm(name, _task(model), options)
        assert "\n" not in str(refused.value)


# ------------------------------------------------------------------ 4. fan-in from the contraction
class FusedQKV(nn.Module):
    """A fused qkv projection 'BTD,SNDH->SBTNH' (kernel [3, heads, D, head_dim]) and attention by hand."""

    @nn.compact
    def __call__(self, x):
        qkv = nn.Einsum((3, 2, 16, 8), "BTD,SNDH->SBTNH", use_bias=False, name="qkv")(x)
        q, k, v = qkv[0], qkv[1], qkv[2]
        weights = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(8))
        out = jnp.einsum("bnts,bsnh->btnh", weights, v)
        return nn.Dense(3, use_bias=False, name="head")(out.reshape(out.shape[0], -1))


def test_the_fan_in_of_a_fused_qkv_einsum_is_its_contraction():
    tokens, dim, heads, head_dim = 4, 16, 2, 8
    model = from_flax(FusedQKV(), (tokens, dim))
    qkv = model.layer("qkv")
    # Each output qkv[s, b, t, n, h] sums x[b, t, d] * kernel[s, n, d, h] over d: 16 entries, not 3 x 2 x 16.
    assert qkv.kernel_shape == (3, heads, dim, head_dim)
    assert qkv.fan_in == dim == 16
    outputs = 3 * tokens * heads * head_dim
    assert qkv.macs == outputs * dim
    # FedPM's frozen constant e / sqrt(fan_in), FSL's signed constant sqrt(2 / fan_in) and its scores' bound.
    variables = model.init(jax.random.PRNGKey(0))
    from fedjax_sparse.algorithms.fedpm_family import signed_constant_kernels
    frozen = signed_constant_kernels(jax.random.PRNGKey(1), model, variables)["params"]["qkv"]["kernel"]
    np.testing.assert_allclose(np.unique(np.abs(np.asarray(frozen))), [math.e / 4], rtol=1e-6)
    weights, scores = sm.supernet_from_seed(jax.random.PRNGKey(2), {"qkv": qkv.kernel_shape}, "signed_constant",
                                            {"qkv": qkv.fan_in})
    np.testing.assert_allclose(np.unique(np.abs(np.asarray(weights["qkv"]))), [math.sqrt(2 / 16)], rtol=1e-6)
    assert float(jnp.max(jnp.abs(scores["qkv"]))) > 1 / math.sqrt(96)   # U(+-1/4), not U(+-1/sqrt(96))
    server, _ = make_algorithm("fsl", _task(model)).init(jax.random.PRNGKey(0))
    np.testing.assert_allclose(np.unique(np.abs(np.asarray(server.weights["qkv"]))), [math.sqrt(2 / 16)], rtol=1e-6)


# ------------------------------------------------------------------ 5. products beside the kernel's
class LoraDense(nn.Dense):
    """LoRA: the kernel's product plus x @ lora_a @ lora_b (lora_b zero-initialised, as LoRA does)."""
    rank: int = 2

    @nn.compact
    def __call__(self, x):
        y = super().__call__(x)
        a = self.param("lora_a", nn.initializers.normal(0.1), (x.shape[-1], self.rank))
        b = self.param("lora_b", nn.initializers.zeros, (self.rank, self.features))
        return y + x @ a @ b


class MergedLora(nn.Dense):
    """The same adapter merged into the kernel the layer multiplies by: x @ (kernel + a @ b)."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
        a = self.param("lora_a", nn.initializers.normal(0.1), (x.shape[-1], 2))
        b = self.param("lora_b", nn.initializers.zeros, (2, self.features))
        return x @ (kernel + a @ b)


class ScaledRows(nn.Dense):
    """A per-unit scale on the kernel (weight-norm style): a pruned row stays zero, no leak."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
        g = self.param("g", nn.initializers.ones, (self.features,))
        return x @ (kernel * g)


class AdapterInside(nn.Dense):
    """LoRA written with two Dense modules called inside the layer's own call."""

    @nn.compact
    def __call__(self, x):
        return super().__call__(x) + nn.Dense(self.features, use_bias=False, name="up")(
            nn.Dense(2, use_bias=False, name="down")(x))


class WithLayer(nn.Module):
    layer: type = LoraDense

    @nn.compact
    def __call__(self, x):
        h = nn.relu(self.layer(8, name="lora")(x))
        return nn.Dense(3, name="head")(h)


def test_a_lora_side_path_is_refused_by_row_and_unit_mechanisms_and_booked_beside_the_kernel():
    model = from_flax(WithLayer(LoraDense), (8,))
    for name, options in ROW_AND_UNIT:
        with pytest.raises(ValueError) as refused:
            make_algorithm(name, _task(model), options)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"{name}: layer lora ")
        assert "lora_a, lora_b" in message and "fedpm" in message
    make_algorithm("fedavg", _task(model), {})
    make_algorithm("fedpm", _task(model), {})
    make_algorithm("spafl", _task(model), {"dense_layers": "lora"})   # not thresholded: exact
    assert [name for name, _ in model.row_leaks] == ["lora"]
    # The kernel's product is the layer's; the side path (8 x 2 + 2 x 8 per example) is computed, dense.
    assert model.layer("lora").macs == 8 * 8
    assert model.other_macs == 8 * 2 + 2 * 8
    assert model.forward_macs == 8 * 8 + 32 + 8 * 3


@pytest.mark.parametrize("layer,leaks", [(MergedLora, True), (AdapterInside, True), (ScaledRows, False)])
def test_a_pruned_row_that_still_computes_is_found(layer, leaks):
    """(ScaledRows guards the probe against a false alarm: a pruned row scaled by g is still zero.)"""
    model = from_flax(WithLayer(layer), (8,))
    if leaks:
        with pytest.raises(ValueError, match=r"^spafl: layer lora "):
            make_algorithm("spafl", _task(model), {})
    else:
        make_algorithm("spafl", _task(model), {})
    assert [name for name, _ in model.row_leaks] == (["lora"] if leaks else [])


# ------------------------------------------------------------------ 6. modules that run by themselves
class FixedModeBatchNorm(nn.Module):
    """BatchNorm's mode fixed by the module from an attribute, as a popular textbook writes it."""
    training: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3), name="conv")(x)
        x = nn.relu(nn.BatchNorm(not self.training, name="bn")(x))
        return nn.Dense(3, name="head")(x.reshape(x.shape[0], -1))


def test_a_batch_norm_whose_mode_the_module_fixes_follows_the_adapters_mode():
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 6, 6, 1))
    results = []
    for training in (True, False):
        model = from_flax(FixedModeBatchNorm(training=training), (6, 6, 1))   # built for training: refused before
        variables = _moved(model)
        logits, stats = model.apply(variables, x, train=True, sample_mask=jnp.ones(4))
        assert float(jnp.max(jnp.abs(stats["bn"]["mean"] - variables["batch_stats"]["bn"]["mean"]))) > 1e-3
        evaluation, _ = model.apply(variables, x)
        results.append((logits, evaluation))
        # Evaluation reads the running averages: the module's own evaluation mode.
        want = FixedModeBatchNorm(training=False).apply(
            {"params": _nested(variables["params"]), "batch_stats": _nested(variables["batch_stats"])}, x)
        np.testing.assert_allclose(np.asarray(evaluation), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(results[0][0]), np.asarray(results[1][0]), rtol=1e-6)


class FixedModeDropout(nn.Module):
    training: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Dropout(0.5, deterministic=not self.training)(nn.relu(nn.Dense(16, name="fc")(x)))
        return nn.Dense(3, name="head")(x)


def test_a_dropout_whose_mode_the_module_fixes_follows_the_adapters_mode():
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 6))
    for training in (True, False):
        model = from_flax(FixedModeDropout(training=training), (6,))
        variables = model.init(jax.random.PRNGKey(0))
        evaluation = model.apply(variables, x)[0]
        trained = model.apply(variables, x, train=True, rng=jax.random.PRNGKey(2))[0]
        assert float(jnp.max(jnp.abs(trained - evaluation))) > 1e-3, training   # built for evaluation: off before
        np.testing.assert_array_equal(np.asarray(model.apply(variables, x, train=True)[0]), np.asarray(evaluation))


class ScaledDropout(nn.Dropout):
    """A Dropout subclass computing more than dropout: its own code must run in evaluation too."""

    @nn.compact
    def __call__(self, x, deterministic=None, rng=None):
        return 2.0 * super().__call__(x, deterministic=deterministic, rng=rng)


class WithScaledDropout(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="head")(ScaledDropout(0.5, deterministic=True)(nn.Dense(8, name="fc")(x)))


def test_a_dropout_subclass_with_its_own_code_runs_it_in_evaluation():
    model = from_flax(WithScaledDropout(), (6,))
    variables = model.init(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 6))
    want = WithScaledDropout().apply(_linen_variables(variables["params"]), x)
    np.testing.assert_allclose(np.asarray(model.apply(variables, x)[0]), np.asarray(want), rtol=1e-6)


class Sowing(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(6, 8, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.inp(x))
        self.sow(nnx.Intermediate, "h", h)
        return self.head(h)


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(8, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + nnx.relu(self.drop(self.fc(x)))


class NnxScanned(nnx.Module):
    """Blocks built with nnx.vmap (each holding Rngs) and run with nnx.scan."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NnxBlock(rngs)
        self.inp = nnx.Linear(6, 8, rngs=rngs)
        self.blocks = make(rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def step(block, x):
            return block(x)
        return self.head(step(self.blocks, self.inp(x)))


class NnxRemat(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(6, 8, rngs=rngs)
        self.block = NnxBlock(rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.remat(lambda block, x: block(x))(self.block, self.inp(x)))


class LinenMlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="d2")(nn.relu(nn.Dense(8, name="d1")(x)))


class Bridged(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.bridge.ToNNX(LinenMlp(), rngs=rngs)
        nnx.bridge.lazy_init(self.inp, jnp.ones((1, 6)))
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.inp(x)))


class NnxRecurrent(nnx.Module):
    def __init__(self, rngs):
        self.rnn = nnx.RNN(nnx.LSTMCell(6, 8, rngs=rngs))
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.rnn(x)[:, -1])


def _sowed():
    module = Sowing(nnx.Rngs(0))
    module(jnp.ones((2, 6)))   # the user called it once: sow stored an intermediate
    return module


@pytest.mark.parametrize("make,shape,layers", [
    (_sowed, (6,), {"inp": (None, 48), "head": ("inp", 24)}),
    (lambda: NnxScanned(nnx.Rngs(0)), (6,), {"inp": (None, 48), "blocks/fc": ("inp", 3 * 64), "head": ("blocks/fc", 24)}),
    (lambda: NnxRemat(nnx.Rngs(0)), (6,), {"inp": (None, 48), "block/fc": ("inp", 64), "head": ("block/fc", 24)}),
    (lambda: Bridged(nnx.Rngs(0)), (6,), {"inp/d1": (None, 48), "inp/d2": ("inp/d1", 64), "head": ("inp/d2", 24)}),
    (lambda: NnxRecurrent(nnx.Rngs(0)), (5, 6), None),
], ids=["sow-after-a-call", "vmap-scan-blocks-with-rngs", "nnx-remat", "bridge-ToNNX", "nnx-RNN"])
def test_nnx_modules_that_run_by_themselves_are_followed(make, shape, layers):
    module = make()
    x = jax.random.normal(jax.random.PRNGKey(3), (2,) + shape)
    reference = nnx.clone(module)
    reference.eval()   # its Dropout off, as the model's evaluation
    want = reference(x)
    model = from_flax(module, shape)
    got = model.apply(model.init(jax.random.PRNGKey(0)), x)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    if layers is not None:
        assert {layer.name: (layer.input_layer, layer.macs) for layer in model.layers} == layers
    else:   # the cell's eight gates, every step: the linen nn.RNN's count
        steps, features, hidden = 5, 6, 8
        assert model.forward_macs == steps * 4 * (features * hidden + hidden * hidden) + hidden * 3


class SharedHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        head = nn.Dense(3, name="head")
        h = nn.relu(nn.Dense(8, name="fc")(x))
        return head(h) + head(2 * h)


def test_a_layer_applied_twice_is_exact_where_it_can_be_and_refused_elsewhere():
    model = from_flax(SharedHead(), (6,))
    head = model.layer("head")
    assert (head.uses, head.macs, head.input_layer) == (2, 2 * 8 * 3, "fc")
    variables = _moved(model)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 6))
    np.testing.assert_allclose(np.asarray(model.apply(variables, x)[0]),
                               np.asarray(SharedHead().apply(_linen_variables(variables["params"]), x)), rtol=1e-5)
    for name in ("spafl", "fedpm", "fedavg"):   # a mask or threshold acts on the kernel at both uses
        make_algorithm(name, _task(model), {})
    for name, options in ROW_AND_UNIT[1:]:
        with pytest.raises(ValueError, match=rf"^{name}: layer head of model SharedHead is applied 2 times") as refused:
            make_algorithm(name, _task(model), options)
        assert "\n" not in str(refused.value)


def test_an_adapter_failure_on_a_module_that_runs_by_itself_is_said_as_the_adapters(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("something the adapter does not know")
    monkeypatch.setattr(flax_adapter, "_conv_config", broken)
    with pytest.raises(ValueError) as refused:
        from_flax(BiT(conv=nn.Conv), (8, 8, 3))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("from_flax: BiT runs by itself") and "not under from_flax" in message
    assert "limit of the adapter, not an error in the model" in message and "model's own code" not in message

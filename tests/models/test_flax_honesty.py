"""from_flax never trains a different network, never consumes the user's module, and says what is wrong.

* A ``Conv`` subclass with its own ``__call__`` (weight standardisation) runs its own code, not the
  adapter's fast convolution; an adapter that would compute something else is refused at ``from_flax``.
* ``Model.init`` returns copies of an NNX module's weights: the engine donates its state, and the
  user's module still works (same outputs) after several runs with the same model.
* Modules that fail are refused at ``from_flax`` in one line naming the problem and the fix.
"""
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fedjax_sparse as fjs
from fedjax_sparse.models.flax import adapter as flax_adapter
from fedjax_sparse.models import from_flax
from fedjax_sparse.models.flax_examples import LeNet5Caffe, NnxLeNet5Caffe

SHAPE = (16, 16, 1)


def _standardise(kernel):
    """kernel [kh, kw, in, out] -> zero mean, unit variance per output channel (BiT's weight standardisation)."""
    mean = kernel.mean(axis=(0, 1, 2))
    return (kernel - mean) / jnp.sqrt(kernel.var(axis=(0, 1, 2)) + 1e-5)


class StdConv(nn.Conv):
    """A linen Conv whose kernel is standardised before the convolution (its own ``__call__``)."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, tuple(self.kernel_size) + (x.shape[-1], self.features))
        return jax.lax.conv_general_dilated(x, _standardise(kernel), (1, 1), self.padding,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))


class StdNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(StdConv(8, (3, 3), padding="SAME", use_bias=False, name="std")(x))
        return nn.Dense(3, name="head")(x.reshape(x.shape[0], -1))


class NnxStdConv(nnx.Conv):
    """The same in NNX: standardises its kernel, then runs Flax's own convolution (super().__call__)."""

    def __call__(self, x):
        raw = self.kernel[...]
        self.kernel[...] = _standardise(raw)
        try:
            return super().__call__(x)
        finally:
            self.kernel[...] = raw


class NnxStdNet(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.std = NnxStdConv(1, 8, (3, 3), padding="SAME", use_bias=False, rngs=rngs)
        self.head = nnx.Linear(8 * 8 * 8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.std(x)).reshape(x.shape[0], -1))


def _to_linen(params):
    return {"params": flax_adapter._unflatten({tuple(k.split("/")): v for k, v in params.items()})}


def test_a_conv_subclass_with_its_own_call_runs_its_own_code():
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 8, 1))
    model = from_flax(StdNet(), (8, 8, 1))
    variables = model.init(jax.random.PRNGKey(0))
    assert [layer.name for layer in model.layers] == ["std", "head"]  # still a weight layer the algorithms act on
    want = StdNet().apply(_to_linen(variables["params"]), x)
    np.testing.assert_allclose(np.asarray(model.apply(variables, x)[0]), np.asarray(want), rtol=1e-5, atol=1e-5)

    module = NnxStdNet()
    want = module(x)
    model = from_flax(module, (8, 8, 1))
    assert [layer.name for layer in model.layers] == ["std", "head"]  # super().__call__ is the same use
    got = model.apply(model.init(jax.random.PRNGKey(0)), x)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_an_adapter_that_computes_something_else_is_refused(monkeypatch):
    real = flax_adapter._fast_conv

    def wrong(x, kernel, conv, impl):
        out = real(x, kernel, conv, impl)
        return None if out is None else out * 1.5
    monkeypatch.setattr(flax_adapter, "_fast_conv", wrong)
    with pytest.raises(ValueError) as refused:
        from_flax(LeNet5Caffe(), SHAPE)
    message = str(refused.value)
    assert "\n" not in message
    assert "differs from the module's own" in message and "first at layer conv1" in message
    assert "conv_impl='xla'" in message


# ------------------------------------------------------------------ the user's module is not consumed
def test_runs_do_not_consume_the_users_nnx_module():
    module = NnxLeNet5Caffe(flat_features=50)
    x = jax.random.uniform(jax.random.PRNGKey(2), (3,) + SHAPE)
    before = np.asarray(module(x))
    model = from_flax(module, SHAPE)
    rng = np.random.default_rng(0)
    data = fjs.data.from_arrays(rng.integers(0, 255, (48,) + SHAPE, dtype=np.uint8), rng.integers(0, 10, 48),
                                rng.integers(0, 255, (12,) + SHAPE, dtype=np.uint8), rng.integers(0, 10, 12),
                                partition="iid", num_clients=3, num_classes=10)
    for algorithm in ("fedavg", "spafl", "fedavg"):
        config = fjs.RunConfig(algorithm=algorithm, rounds=1, clients_per_round=2, local_epochs=1, batch_size=16,
                               lr=0.05, preprocess="unit")
        fjs.run(config, model=model, data=data, progress=False)
    np.testing.assert_array_equal(np.asarray(module(x)), before)


# ------------------------------------------------------------------ errors at from_flax, in the user's words
def test_what_is_not_a_flax_module_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="not a function .*wrap the function in a flax.linen.Module"):
        from_flax(lambda x: x, SHAPE)
    with pytest.raises(TypeError, match=r"not the class LeNet5Caffe: pass LeNet5Caffe\(...\)"):
        from_flax(LeNet5Caffe, SHAPE)


def test_a_wrong_input_rank_says_what_the_conv_takes():
    with pytest.raises(ValueError) as refused:
        from_flax(LeNet5Caffe(), (16, 16))
    message = str(refused.value)
    assert "\n" not in message and "ZeroDivisionError" not in message.split(";")[1]
    assert "rank 4" in message and "input_shape=(16, 16) gives rank 3" in message and "(28, 28, 1)" in message


class Broken(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4)(x)
        raise RuntimeError("lookup table missing\nsecond line")


def test_an_error_in_the_users_code_names_it_and_its_line():
    with pytest.raises(ValueError) as refused:
        from_flax(Broken(), (6,))
    message = str(refused.value)
    line = 1 + next(i for i, text in enumerate(Path(__file__).read_text().splitlines()) if "lookup table missing" in text)
    assert "\n" not in message
    assert "RuntimeError: lookup table missing" in message and f"test_flax_honesty.py:{line}" in message
    assert "input_shape" not in message and "second line" not in message


def test_an_nnx_call_that_needs_more_than_the_input_is_refused():
    class NeedsRngs(nnx.Module):
        def __init__(self):
            self.fc = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

        def __call__(self, x, rngs):
            return self.fc(x)
    with pytest.raises(TypeError, match="requires the argument 'rngs', but from_flax passes only the input and "
                                        "the train flag"):
        from_flax(NeedsRngs(), (4,))

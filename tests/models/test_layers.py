"""Layers: im2col conv == XLA conv, pooling, masked BatchNorm, model shapes and costs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.core import accounting
from fedjax_sparse.models import Hooks, make_model, model_names
from fedjax_sparse.models import layers as L


@pytest.mark.parametrize("padding,stride,k", [("VALID", 1, 5), ("SAME", 1, 3), ("SAME", 2, 3), ("VALID", 2, 1)])
def test_im2col_conv_matches_xla_conv_values_and_gradients(padding, stride, k):
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (3, 11, 10, 4))
    w = jax.random.normal(jax.random.PRNGKey(1), (k, k, 4, 6))

    def f(impl):
        return lambda w, x: (L.conv2d(x, w, stride=stride, padding=padding, impl=impl) ** 2).sum()
    a = L.conv2d(x, w, stride=stride, padding=padding, impl="im2col")
    b = L.conv2d(x, w, stride=stride, padding=padding, impl="xla")
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    ga = jax.grad(f("im2col"), argnums=(0, 1))(w, x)
    gb = jax.grad(f("xla"), argnums=(0, 1))(w, x)
    for u, v in zip(ga, gb):
        np.testing.assert_allclose(u, v, rtol=1e-3, atol=1e-2)


def test_max_pool_matches_reduce_window_including_gradient():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 9, 8, 3))
    ref = lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")  # noqa
    np.testing.assert_allclose(L.max_pool(x, 2), ref(x))
    np.testing.assert_allclose(jax.grad(lambda x: (L.max_pool(x) ** 2).sum())(x),
                               jax.grad(lambda x: (ref(x) ** 2).sum())(x))


def test_masked_batch_norm_ignores_padding():
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 4, 4, 3)) * 3 + 1
    stats = {"mean": jnp.zeros(3), "var": jnp.ones(3)}
    scale, bias = jnp.ones(3) * 2, jnp.ones(3) * 0.5
    y_real, s_real = L.batch_norm(x[:4], scale, bias, stats, train=True)
    padded = x.at[4:].set(100.0)
    y_pad, s_pad = L.batch_norm(padded, scale, bias, stats, train=True, sample_mask=jnp.array([1, 1, 1, 1, 0, 0.]))
    np.testing.assert_allclose(y_pad[:4], y_real, rtol=1e-5, atol=1e-5)
    for key in ("mean", "var"):
        np.testing.assert_allclose(s_pad[key], s_real[key], rtol=1e-5)
    # Hand-computed statistics (PyTorch: biased var to normalise, unbiased for running var).
    m = np.asarray(x[:4]).reshape(-1, 3)
    np.testing.assert_allclose(s_real["mean"], 0.1 * m.mean(0), rtol=1e-5)
    np.testing.assert_allclose(s_real["var"], 0.9 + 0.1 * m.var(0, ddof=1), rtol=1e-5)


@pytest.mark.fast
def test_lenet5_caffe_shapes_costs_and_rows():
    model = make_model("lenet5_caffe", (28, 28, 1), 10)
    # Hand count: conv1 24*24*20*25, conv2 8*8*50*(20*25), fc1 800*500, fc2 500*10.
    assert [l.macs for l in model.layers] == [288000, 1600000, 400000, 5000]
    assert sum(l.out_units for l in model.layers) == 580  # SpaFL's 580 thresholds
    assert model.num_params == 500 + 25000 + 400000 + 5000
    v = model.init(jax.random.PRNGKey(0))
    logits, _ = model.apply(v, jnp.zeros((3, 28, 28, 1)))
    assert logits.shape == (3, 10)
    per_example = 2 * 2293000
    assert accounting.forward_flops(model) == per_example
    assert accounting.training_flops(model, 7).total() == 3 * per_example * 7
    half = accounting.forward_flops(model, jnp.array([1.0, 0.5, 0.5, 1.0]))
    assert float(half) == pytest.approx(2 * (288000 + 800000 + 200000 + 5000))
    # Per-row and per-weight training FLOPs are exact integers that add up to the dense count.
    rows = accounting.row_training_flops(model)
    assert rows == (6 * 14400, 6 * 32000, 6 * 800, 6 * 500)
    assert sum(r * l.out_units for r, l in zip(rows, model.layers)) == 3 * per_example
    weights = accounting.weight_training_flops(model)
    assert weights == (6 * 576, 6 * 64, 6, 6)
    assert sum(w * l.num_weights for w, l in zip(weights, model.layers)) == 3 * per_example
    assert accounting.tree_bits(v["params"]) == 32 * model.num_params


def test_hooks_reach_every_weight_layer_and_activation():
    model = make_model("lenet5_caffe", (28, 28, 1), 10)
    seen_kernels, seen_acts = [], []
    hooks = Hooks(kernel=lambda n, k: seen_kernels.append(n) or k * 0,
                  activation=lambda n, h: seen_acts.append(n) or h)
    logits, _ = model.apply(model.init(jax.random.PRNGKey(0)), jnp.ones((1, 28, 28, 1)), hooks=hooks)
    assert seen_kernels == ["conv1", "conv2", "fc1", "fc2"] == seen_acts
    np.testing.assert_allclose(logits, 0.0)  # zeroed kernels, no biases


def test_every_registered_model_builds_and_runs():
    shapes = {"digits": (8, 8, 1), "mnist": (28, 28, 1), "cifar": (32, 32, 3)}
    for name in model_names():
        for shape in shapes.values():
            try:
                model = make_model(name, shape, 10)
            except ValueError:
                continue  # a model may not support every input size
            # Shapes only (no compilation): keeps this sweep over every model cheap.
            v = jax.eval_shape(model.init, jax.random.PRNGKey(0))
            logits, _ = jax.eval_shape(
                lambda v, x: model.apply(v, x, train=True, sample_mask=jnp.ones(2)), v,
                jax.ShapeDtypeStruct((2,) + shape, jnp.float32))
            assert logits.shape == (2, 10), name
            break
        else:
            pytest.fail(f"model {name} built for none of {list(shapes)}")

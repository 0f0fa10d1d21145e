"""Row masks and straight-through estimators (fedjax_sparse.mechanisms.threshold_masks) against hand-derived values."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.mechanisms import threshold_masks as masks

pytestmark = pytest.mark.fast   # the whole file is in the fast tier (python -m pytest -m fast)


def test_step_forward_is_strict_heaviside():
    x = jnp.array([-2.0, -1e-7, 0.0, 1e-7, 3.0])
    for estimator in masks.STE_ESTIMATORS:
        np.testing.assert_array_equal(masks.step_ste(x, estimator), [0, 0, 0, 1, 1])


def test_step_gradients_identity_and_truncated():
    x = jnp.array([-2.0, -0.5, 0.0, 0.7, 1.5])
    upstream = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
    _, vjp = jax.vjp(lambda v: masks.step_ste(v, "identity"), x)
    np.testing.assert_array_equal(vjp(upstream)[0], upstream)
    _, vjp = jax.vjp(lambda v: masks.step_ste(v, "truncated"), x)
    np.testing.assert_array_equal(vjp(upstream)[0], [1.0, 0.0, 0.0, 0.0, 5.0])  # only |x| > 1 passes
    with pytest.raises(ValueError, match="unknown straight-through"):
        masks.step_ste(x, "sigmoid")


def test_row_mask_prunes_whole_rows_of_a_conv_kernel():
    # HWIO kernel [2, 2, 3, 4]: row i = kernel[..., i]; its mean |w| is set to exactly r_i.
    row_means = np.array([0.125, 0.5, 0.25, 0.0625], np.float32)  # exact in binary
    signs = np.where(np.random.default_rng(0).random((2, 2, 3, 4)) < 0.5, -1.0, 1.0)
    kernel = jnp.asarray(signs * row_means, jnp.float32)
    tau = jnp.array([0.0625, 0.375, 0.25, 0.0])  # row 2: equality -> pruned (step(0) = 0)
    np.testing.assert_allclose(masks.row_mean_abs(kernel), row_means, rtol=1e-6)
    mask = masks.threshold_row_mask(kernel, tau)
    np.testing.assert_array_equal(mask, [1, 1, 0, 1])
    masked = masks.apply_row_mask(kernel, mask)
    np.testing.assert_array_equal(masked[..., 2], 0.0)
    for i in (0, 1, 3):
        np.testing.assert_array_equal(masked[..., i], kernel[..., i])
    assert float(masks.kept_fraction(mask)) == 0.75


def test_ste_gradients_of_a_tiny_dense_layer_match_hand_derivation():
    """L = sum_b sum_i r_i * (x_b @ (W * m))_i with m_i = step(mean_j |w_ji| - tau_i).

    With g_ji = dL/d(W*m)_ji = (sum_b x_bj) r_i and the identity STE:
      dL/dtau_i = -sum_j g_ji w_ji
      dL/dw_ji  = g_ji m_i + (sum_j' g_j'i w_j'i) sign(w_ji) / n_in
    (kernels are [in, out]: column i is row i of the paper's W [out, in])."""
    w = jnp.array([[0.30, -0.10], [-0.20, 0.05], [0.40, -0.60]])  # [in=3, out=2]; row means 0.3, 0.25
    tau = jnp.array([0.1, 0.3])                                    # -> mask [1, 0]
    x = jnp.array([[1.0, 2.0, -1.0], [0.5, -1.0, 2.0]])
    r = jnp.array([1.5, -2.0])

    def loss(w_, tau_, estimator):
        m = masks.threshold_row_mask(w_, tau_, estimator)
        return jnp.sum((x @ masks.apply_row_mask(w_, m)) * r)

    g = np.outer(np.asarray(x.sum(0)), np.asarray(r))  # [in, out]
    wn, m, n_in = np.asarray(w), np.array([1.0, 0.0]), 3
    row_dot = (g * wn).sum(0)  # sum_j g_ji w_ji per row i
    dtau_hand = -row_dot
    dw_hand = g * m[None, :] + row_dot[None, :] * np.sign(wn) / n_in
    dw, dtau = jax.grad(loss, argnums=(0, 1))(w, tau, "identity")
    np.testing.assert_allclose(dtau, dtau_hand, rtol=1e-6)
    np.testing.assert_allclose(dw, dw_hand, rtol=1e-6, atol=1e-7)
    # Truncated STE: |mean|w| - tau| < 1 everywhere, so only the direct path survives.
    dw_t, dtau_t = jax.grad(loss, argnums=(0, 1))(w, tau, "truncated")
    np.testing.assert_array_equal(dtau_t, [0.0, 0.0])
    np.testing.assert_allclose(dw_t, g * m[None, :], rtol=1e-6)


def test_reset_rule():
    tau = jnp.array([0.3, 0.7])
    np.testing.assert_array_equal(masks.reset_thresholds(tau, jnp.float32(0.0)), [0, 0])
    np.testing.assert_array_equal(masks.reset_thresholds(tau, jnp.float32(0.01)), [0, 0])  # "<= 1%"
    np.testing.assert_array_equal(masks.reset_thresholds(tau, jnp.float32(0.0101)), tau)
    np.testing.assert_array_equal(masks.reset_thresholds(tau, jnp.float32(1.0)), tau)


def test_masks_work_under_vmap():
    kernels = jnp.stack([jnp.full((3, 2), 0.2), jnp.full((3, 2), 0.4)])
    out = jax.vmap(masks.threshold_row_mask)(kernels, jnp.array([[0.3, 0.1], [0.3, 0.5]]))
    np.testing.assert_array_equal(out, [[0, 1], [1, 0]])


def test_truncated_estimator_boundary_and_default_estimator():
    # The CIFAR code passes gradient only where |x| > 1 (strictly): |x| = 1 gets none.
    x = jnp.array([-1.0, 1.0, 1.0000001])
    _, vjp = jax.vjp(lambda v: masks.step_ste(v, "truncated"), x)
    np.testing.assert_array_equal(vjp(jnp.ones(3))[0], [0.0, 0.0, 1.0])
    # Without an estimator the step is the identity STE (the paper and its FMNIST code).
    np.testing.assert_array_equal(jax.grad(lambda v: masks.step_ste(v).sum())(jnp.array([-2.0, 0.3])), [1.0, 1.0])


def test_masks_keep_the_kernels_low_precision_dtype():
    """step_ste has the dtype of its input and apply_row_mask the kernel's,
    also in bfloat16 (no silent promotion to float32), gradients included."""
    x = jnp.array([-2.0, 0.5, 1.5], jnp.bfloat16)
    for estimator in masks.STE_ESTIMATORS:
        assert masks.step_ste(x, estimator).dtype == jnp.bfloat16
        grad = jax.grad(lambda v: masks.step_ste(v, estimator).astype(jnp.float32).sum())(x)
        assert grad.dtype == jnp.bfloat16
    kernel = jnp.ones((2, 3), jnp.bfloat16)
    out = masks.apply_row_mask(kernel, jnp.array([True, False, True]))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), [[1, 0, 1], [1, 0, 1]])


def test_row_sum_is_the_signed_sum_over_each_rows_incoming_weights():
    kernel = jnp.arange(24, dtype=jnp.float32).reshape(2, 3, 4) - 10.0   # [in..., out = 4]
    want = np.asarray(kernel).reshape(6, 4).sum(0)                       # [-36, -30, -24, -18]
    np.testing.assert_array_equal(masks.row_sum(kernel), want)
    np.testing.assert_array_equal(masks.row_sum(jnp.array([[1.0, -2.0], [3.0, 5.0]])), [4.0, 3.0])

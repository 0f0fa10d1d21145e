"""SpaFL's threshold row masks with straight-through gradients.

Kernels follow the models' layout (HWIO convs, ``[in, out]`` dense), so
"row i" of a layer -- one output neuron or conv filter, together with all its
incoming weights -- is ``kernel[..., i]`` and a row mask has shape ``[out]``.

SpaFL (Kim et al.) prunes whole rows with one trainable threshold per row::

    mask_i = step(mean_j |w_ij| - tau_i)         (eq. 1 of the paper)

The step has zero derivative almost everywhere, so its backward pass is
replaced by a straight-through estimator (STE); gradients then reach both the
weights (through ``mean |w|``) and the thresholds (docs/spafl.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# "identity": d step(x)/dx := 1 (the SpaFL paper and its FMNIST code).
# "truncated": d step(x)/dx := 1[|x| > 1] (SpaFL's CIFAR code). Row means of
# |w| and thresholds are far below 1, so this passes almost no loss gradient
# to the thresholds, which then move by the regulariser alone.
STE_ESTIMATORS = ("identity", "truncated")

# SpaFL's reset rule: a layer keeping at most this fraction of its rows gets
# its thresholds set back to 0 (Appendix A.1, following Liu et al. 2020).
RESET_KEPT_FRACTION = 0.01


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _step(x, estimator: str):
    # step(0) = 0, as in the reference code ((x > 0).float()).
    return (x > 0).astype(x.dtype)


def _step_fwd(x, estimator):
    return _step(x, estimator), (x if estimator == "truncated" else None)


def _step_bwd(estimator, x, g):
    return (g if estimator == "identity" else g * (jnp.abs(x) > 1.0).astype(g.dtype),)


_step.defvjp(_step_fwd, _step_bwd)


def step_ste(x: jax.Array, estimator: str = "identity") -> jax.Array:
    """Unit step ``1[x > 0]`` (same shape and dtype as ``x``) whose gradient is
    the straight-through ``estimator`` (one of :data:`STE_ESTIMATORS`)."""
    if estimator not in STE_ESTIMATORS:
        raise ValueError(f"unknown straight-through estimator {estimator!r}; valid: {STE_ESTIMATORS}")
    return _step(x, estimator)


def _trailing_axes(shape: tuple, out_units: int) -> int:
    """How many trailing axes of ``shape`` make ``out_units`` rows (a kernel with several output axes,
    such as an attention projection's ``[in, heads, head_dim]``, has heads*head_dim rows)."""
    size = 1
    for k in range(1, len(shape) + 1):
        size *= int(shape[-k])
        if size == out_units:
            return k
    raise ValueError(f"a kernel of shape {tuple(shape)} has no {out_units} rows over its trailing axes")


def _rows(kernel: jax.Array, out_units: int | None) -> jax.Array:
    """``[..., out]`` (``out_units`` = the last axis, the default) or ``[..., *out axes]`` -> ``[fan_in, out]``."""
    if out_units is None or out_units == kernel.shape[-1]:
        return kernel
    return kernel.reshape((-1, out_units))


def broadcast_rows(values: jax.Array, kernel_shape: tuple) -> jax.Array:
    """``[out]`` per-row values shaped to broadcast against a kernel of ``kernel_shape`` (over its trailing
    output axes)."""
    if values.shape[-1] == kernel_shape[-1]:
        return values
    return values.reshape(tuple(kernel_shape[-_trailing_axes(kernel_shape, values.shape[-1]):]))


def row_mean_abs(kernel: jax.Array, out_units: int | None = None) -> jax.Array:
    """``[..., out]`` kernel -> ``[out]`` mean |w| over each row (in*kh*kw weights); ``out_units``
    for a kernel whose rows span several trailing axes (their product)."""
    rows = _rows(kernel, out_units)
    return jnp.mean(jnp.abs(rows), axis=tuple(range(rows.ndim - 1)))


def row_sum(kernel: jax.Array, out_units: int | None = None) -> jax.Array:
    """``[..., out]`` kernel -> ``[out]`` signed sum of each row's weights (``out_units``: as above)."""
    rows = _rows(kernel, out_units)
    return jnp.sum(rows, axis=tuple(range(rows.ndim - 1)))


def threshold_row_mask(kernel: jax.Array, tau: jax.Array, estimator: str = "identity") -> jax.Array:
    """SpaFL's row mask ``step(mean_j |w_ij| - tau_i)``: kernel ``[..., out]``,
    tau ``[out]`` -> ``[out]`` in {0, 1}, differentiable in both arguments
    through the straight-through ``estimator``. A kernel whose rows span several trailing axes
    (``[in, heads, head_dim]``) has one threshold per output unit (heads*head_dim)."""
    return step_ste(row_mean_abs(kernel, tau.shape[-1]) - tau, estimator)


def apply_row_mask(kernel: jax.Array, mask: jax.Array) -> jax.Array:
    """Multiplies every row ``kernel[..., i]`` by ``mask[i]`` (``mask``: ``[out]``; rows over several
    trailing axes as in :func:`threshold_row_mask`)."""
    return kernel * broadcast_rows(mask, kernel.shape).astype(kernel.dtype)


def kept_fraction(mask: jax.Array) -> jax.Array:
    """[] fraction of kept rows (= kept weights, as whole rows are pruned)."""
    return jnp.mean(mask.astype(jnp.float32))


def reset_thresholds(tau: jax.Array, previous_kept: jax.Array,
                     min_fraction: float = RESET_KEPT_FRACTION) -> jax.Array:
    """SpaFL's reset rule: all of a layer's thresholds become 0 when the layer
    kept ``<= min_fraction`` of its rows in the previous forward pass.
    ``tau``: ``[out]``, ``previous_kept``: [] scalar."""
    return jnp.where(previous_kept <= min_fraction, jnp.zeros_like(tau), tau)


__all__ = ["RESET_KEPT_FRACTION", "STE_ESTIMATORS", "apply_row_mask", "broadcast_rows", "kept_fraction",
           "reset_thresholds",
           "row_mean_abs", "row_sum", "step_ste", "threshold_row_mask"]

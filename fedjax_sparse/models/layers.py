"""Pure layer functions shared by every model.

All activations are NHWC (images) or [batch, features]; conv kernels are HWIO
``[kh, kw, in, out]`` and dense kernels ``[in, out]``, so "row i" of a layer
(one output neuron / filter, the unit SpaFL thresholds and FedDrop drops) is
always ``kernel[..., i]``.

Convolutions have two implementations:

* ``"xla"``: ``lax.conv_general_dilated`` (cuDNN on GPU).
* ``"im2col"``: shifted slices concatenated into patches, then one matmul.
  XLA:CPU runs convolutions inside ``lax.scan``/``while`` several times slower
  than outside (measured: shared/notes/performance-facts.md) while matmuls do not suffer,
  so on CPU the round engine's scanned local steps use this form.

``"auto"`` (default) picks im2col on CPU and xla elsewhere, at trace time; inside
``with outside_loops():`` (code traced outside any scan/while, e.g. the per-client
evaluation) it picks xla everywhere, XLA:CPU's native convolution being the faster one there.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax

CONV_IMPLS = ("auto", "xla", "im2col")


# Set while tracing code that runs outside scan/while loops (a trace-time choice of program, not state).
_OUTSIDE_LOOPS = contextvars.ContextVar("fedjax_sparse_outside_loops", default=False)


@contextlib.contextmanager
def outside_loops():
    """Functions traced in this block run outside scan/while loops: ``"auto"`` convolutions use
    XLA's native convolution on every backend (same numbers to float rounding). The choice is made
    at trace time, so a ``jax.jit`` nested inside a model would keep whichever form it was first
    traced with (the models here have none)."""
    token = _OUTSIDE_LOOPS.set(True)
    try:
        yield
    finally:
        _OUTSIDE_LOOPS.reset(token)


def resolve_conv_impl(impl: str) -> str:
    if impl not in CONV_IMPLS:
        raise ValueError(f"unknown conv implementation {impl!r}; valid: {CONV_IMPLS}")
    if impl == "auto":
        return "im2col" if jax.default_backend() == "cpu" and not _OUTSIDE_LOOPS.get() else "xla"
    return impl


def _same_padding(size: int, k: int, stride: int) -> tuple[int, int]:
    out = -(-size // stride)
    total = max((out - 1) * stride + k - size, 0)
    return total // 2, total - total // 2


def conv2d(x: jax.Array, kernel: jax.Array, *, stride: int = 1,
           padding: str = "VALID", impl: str = "auto") -> jax.Array:
    """x: [B, H, W, C], kernel: [kh, kw, C, O] -> [B, H', W', O]."""
    impl = resolve_conv_impl(impl)
    if impl == "xla":
        return lax.conv_general_dilated(
            x, kernel, (stride, stride), padding,
            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    kh, kw, c, o = kernel.shape
    if padding == "SAME":
        ph = _same_padding(x.shape[1], kh, stride)
        pw = _same_padding(x.shape[2], kw, stride)
        x = jnp.pad(x, ((0, 0), ph, pw, (0, 0)))
    elif padding != "VALID":
        raise ValueError(f"padding must be 'SAME' or 'VALID', got {padding!r}")
    if kh == 1 and kw == 1:
        patches = x[:, ::stride, ::stride, :]
    else:
        ho = (x.shape[1] - kh) // stride + 1
        wo = (x.shape[2] - kw) // stride + 1
        # Patch channel order (i, j, c) matches kernel.reshape(kh * kw * c, o).
        patches = jnp.concatenate(
            [x[:, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride, :]
             for i in range(kh) for j in range(kw)], axis=-1)
    return patches @ kernel.reshape(kh * kw * c, o)


def dense(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x: [B, in], kernel: [in, out] -> [B, out]."""
    return x @ kernel


def max_pool(x: jax.Array, window: int = 2, stride: int | None = None) -> jax.Array:
    """Max pool over H, W of an NHWC tensor (floor mode, like PyTorch)."""
    stride = window if stride is None else stride
    b, h, w, c = x.shape
    if stride == window:
        # A reshape + max differentiates to a cheap equality mask; the generic
        # reduce_window gradient (select_and_scatter) is slow on XLA:CPU.
        ho, wo = h // window, w // window
        x = x[:, :ho * window, :wo * window, :]
        return x.reshape(b, ho, window, wo, window, c).max(axis=(2, 4))
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, window, window, 1),
                             (1, stride, stride, 1), "VALID")


def avg_pool(x: jax.Array, window: int, stride: int | None = None) -> jax.Array:
    """Average pool over H, W of an NHWC tensor (floor mode, like PyTorch)."""
    b, h, w, c = x.shape
    if stride is not None and stride != window:
        # Overlapping windows as a sum of shifted strided slices (cheap gradient on CPU).
        ho, wo = (h - window) // stride + 1, (w - window) // stride + 1
        total = sum(x[:, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride, :]
                    for i in range(window) for j in range(window))
        return jnp.asarray(total) / (window * window)
    ho, wo = h // window, w // window
    x = x[:, :ho * window, :wo * window, :]
    return x.reshape(b, ho, window, wo, window, c).mean(axis=(2, 4))


def batch_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, stats: dict,
               *, train: bool, sample_mask: jax.Array | None = None,
               momentum: float = 0.1, eps: float = 1e-5):
    """BatchNorm over all axes but the last (PyTorch semantics and momentum).

    In training, statistics come from the batch; ``sample_mask`` ([B], 0/1)
    keeps padded samples out of them, so a padded batch normalises exactly
    like the unpadded one. Returns (y, new_stats).
    """
    if not train:
        mean, var = stats["mean"], stats["var"]
        y = (x - mean) * lax.rsqrt(var + eps)
        return y * scale + bias, stats
    axes = tuple(range(x.ndim - 1))
    if sample_mask is None:
        weights = jnp.ones(x.shape[:-1], x.dtype)
    else:
        weights = jnp.broadcast_to(
            sample_mask.reshape((-1,) + (1,) * (x.ndim - 2)).astype(x.dtype), x.shape[:-1])
    w = weights[..., None]
    n = jnp.maximum(weights.sum(), 1.0)
    mean = (x * w).sum(axes) / n
    var = (jnp.square(x - mean) * w).sum(axes) / n
    y = (x - mean) * lax.rsqrt(var + eps) * scale + bias
    unbiased = var * n / jnp.maximum(n - 1.0, 1.0)
    has_data = n > 1.0  # an all-padding step must not move the running stats
    new_stats = {
        "mean": jnp.where(has_data, (1 - momentum) * stats["mean"] + momentum * lax.stop_gradient(mean), stats["mean"]),
        "var": jnp.where(has_data, (1 - momentum) * stats["var"] + momentum * lax.stop_gradient(unbiased),
                         stats["var"]),
    }
    return y, new_stats


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * scale + bias

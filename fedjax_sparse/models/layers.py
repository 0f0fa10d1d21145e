"""Pure layer functions shared by every model.

All activations are NHWC (images) or [batch, features]; conv kernels are HWIO
``[kh, kw, in, out]`` and dense kernels ``[in, out]``, so "row i" of a layer
(one output neuron / filter, the unit SpaFL thresholds and FedDrop drops) is
always ``kernel[..., i]``.

Convolutions (``impl``; why each exists: docs/design.md, "Convolutions: where the program is lowered"):

* ``"xla"``: ``lax.conv_general_dilated`` as is (under a ``vmap`` over per-client kernels JAX makes it
  a grouped convolution, which cuDNN runs about group by group);
* ``"im2col"``: shifted slices concatenated into patches, then one matmul (XLA:CPU runs convolutions
  inside ``scan``/``while`` several times slower than matmuls);
* ``"batched_im2col"``: XLA's convolution where the kernel is shared, im2col's batched matmuls wherever
  a ``vmap`` gives the kernel its own axis (a ``custom_vmap`` rule, for the forward pass and both
  gradients); reverse mode only (``jax.hessian`` works), forward mode (``jax.jvp``) is refused;
* ``"auto"`` (default), chosen where the program is lowered (``lax.platform_dependent``): on CPU
  ``"im2col"`` (``"batched_im2col"`` inside ``with outside_loops():``), elsewhere ``"batched_im2col"``.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

CONV_IMPLS = ("auto", "xla", "im2col", "batched_im2col")


# Set while tracing code that runs outside scan/while loops (a trace-time choice of program, not state).
_OUTSIDE_LOOPS = contextvars.ContextVar("fedjax_sparse_outside_loops", default=False)


@contextlib.contextmanager
def outside_loops():
    """Functions traced in this block run outside scan/while loops: on CPU ``"auto"`` convolutions
    use XLA's native convolution (same numbers to float rounding). The choice is made at trace time,
    so a ``jax.jit`` nested inside a model would keep whichever form it was first traced with (the
    models here have none)."""
    token = _OUTSIDE_LOOPS.set(True)
    try:
        yield
    finally:
        _OUTSIDE_LOOPS.reset(token)


def resolve_conv_impl(impl: str, platform: str | None = None) -> str:
    """The concrete form ``impl`` takes on ``platform`` (default: this process's backend), in the
    current tracing context. Raises ValueError for an unknown name."""
    if impl not in CONV_IMPLS:
        raise ValueError(f"unknown conv implementation {impl!r}; valid: {CONV_IMPLS}")
    if impl == "auto":
        platform = platform or jax.default_backend()
        return "im2col" if platform == "cpu" and not _OUTSIDE_LOOPS.get() else "batched_im2col"
    return impl


Pads = tuple  # ((top, bottom), (left, right))


def _native_conv(x, kernel, stride: int, pads: Pads):
    return lax.conv_general_dilated(x, kernel, (stride, stride), pads, dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _im2col_conv(x, kernel, stride: int, pads: Pads):
    kh, kw, c, o = kernel.shape
    if any(p for pair in pads for p in pair):
        x = jnp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    if kh == 1 and kw == 1:
        patches = x[:, ::stride, ::stride, :]
    else:
        # Patch channel order (i, j, c) matches kernel.reshape(kh * kw * c, o).
        patches = jnp.concatenate(_shifted(x, kh, kw, stride), axis=-1)
    return patches @ kernel.reshape(kh * kw * c, o)


def _shifted(x, kh: int, kw: int, stride: int) -> list:
    """The ``kh * kw`` strided slices of x [B, H, W, C] that a VALID window of that size reads, in (i, j) order."""
    ho, wo = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
    return [x[:, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride, :]
            for i in range(kh) for j in range(kw)]


def _in_axes(batched) -> tuple:
    return tuple(0 if b else None for b in batched)


@functools.lru_cache(maxsize=None)
def _batched_im2col_conv(stride: int, pads: Pads):
    """``conv(x [B, H, W, C], kernel [kh, kw, C, O])`` for one (stride, padding): XLA's convolution,
    except that under a ``vmap`` giving the kernel (or, in the backward pass, the output gradient) an
    axis of its own, the batched program is im2col's batched matmuls instead of the grouped
    convolution JAX's batching rule would make. A vmap over the input alone folds it into the batch
    and calls this function again, so an outer vmap (seeds around clients) meets the same rule."""
    native = functools.partial(_native_conv, stride=stride, pads=pads)
    patches = functools.partial(_im2col_conv, stride=stride, pads=pads)

    @custom_vmap
    def forward(x, kernel):
        return native(x, kernel)

    @forward.def_vmap
    def forward_rule(axis_size, in_batched, x, kernel):
        x_batched, kernel_batched = in_batched
        if not (x_batched or kernel_batched):
            # A vmap that batches neither operand (forward mode batches only tangents): nothing per entry.
            return native(x, kernel), False
        if kernel_batched:
            return jax.vmap(patches, in_axes=_in_axes(in_batched))(x, kernel), True
        n, b = x.shape[:2]
        y = forward(x.reshape((n * b,) + x.shape[2:]), kernel)
        return y.reshape((n, b) + y.shape[1:]), True

    @custom_vmap
    def backward(x, kernel, g):
        return jax.vjp(native, x, kernel)[1](g)

    @backward.def_vmap
    def backward_rule(axis_size, in_batched, x, kernel, g):
        if not any(in_batched):
            return jax.vjp(native, x, kernel)[1](g), (False, False)
        # Whatever is batched, the kernel gradient is per batch entry (a grouped convolution for XLA):
        # the patches' transpose as batched matmuls.
        out = jax.vmap(lambda x, k, g: jax.vjp(patches, x, k)[1](g), in_axes=_in_axes(in_batched))(x, kernel, g)
        return out, (True, True)

    @jax.custom_vjp
    def conv(x, kernel):
        return forward(x, kernel)

    conv.defvjp(lambda x, kernel: (forward(x, kernel), (x, kernel)), lambda res, g: backward(*res, g))
    return conv


def conv2d(x: jax.Array, kernel: jax.Array, *, stride: int = 1,
           padding: str = "VALID", impl: str = "auto", name: str | None = None) -> jax.Array:
    """x: [B, H, W, C], kernel: [kh, kw, C, O] -> [B, H', W', O] (``impl``: module docstring; ``name``: the
    layer's, for messages)."""
    if impl not in CONV_IMPLS:
        raise ValueError(f"unknown conv implementation {impl!r}; valid: {CONV_IMPLS}")
    if padding not in ("SAME", "VALID"):
        raise ValueError(f"padding must be 'SAME' or 'VALID', got {padding!r}")
    # XLA's own pads ("SAME": the odd one at the bottom/right, as lax.conv pads it).
    pads = tuple(lax.padtype_to_pads(x.shape[1:3], kernel.shape[:2], (stride, stride), padding))
    if impl == "auto":
        # Both forms are traced; lowering keeps the target platform's alone.
        form = functools.partial(conv2d, stride=stride, padding=padding, name=name)
        return lax.platform_dependent(x, kernel, cpu=functools.partial(form, impl=resolve_conv_impl(impl, "cpu")),
                                      default=functools.partial(form, impl="batched_im2col"))
    if impl == "xla":
        return _native_conv(x, kernel, stride, pads)
    if impl == "im2col":
        return _im2col_conv(x, kernel, stride, pads)
    try:
        return _batched_im2col_conv(stride, pads)(x, kernel)
    except TypeError as e:
        if "forward-mode" not in str(e):
            raise
        layer = f"layer {name}" if name else f"the convolution with kernel {tuple(kernel.shape)}"
        raise TypeError(f"forward-mode differentiation (jax.jvp, jax.jacfwd; jax.hessian works) reached {layer}, "
                        f"whose conv_impl {impl!r} has a reverse-mode rule only (batched matmuls for per-client "
                        "kernels): build the model with model option conv_impl='xla' (or 'im2col')") from None


def dense(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x: [B, in], kernel: [in, out] -> [B, out]."""
    return x @ kernel


def _tiles(x, window: int):
    """x [B, H, W, C] as [B, H // window, window, W // window, window, C] (floor mode: the remainder dropped)."""
    b, h, w, c = x.shape
    ho, wo = h // window, w // window
    return x[:, :ho * window, :wo * window, :].reshape(b, ho, window, wo, window, c)


def max_pool(x: jax.Array, window: int = 2, stride: int | None = None) -> jax.Array:
    """Max pool over H, W of an NHWC tensor (floor mode, like PyTorch)."""
    if stride is None or stride == window:
        # A reshape + max differentiates to a cheap equality mask; the generic
        # reduce_window gradient (select_and_scatter) is slow on XLA:CPU.
        return _tiles(x, window).max(axis=(2, 4))
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, window, window, 1),
                             (1, stride, stride, 1), "VALID")


def avg_pool(x: jax.Array, window: int, stride: int | None = None) -> jax.Array:
    """Average pool over H, W of an NHWC tensor (floor mode, like PyTorch)."""
    if stride is not None and stride != window:
        # Overlapping windows as a sum of shifted strided slices (cheap gradient on CPU).
        return jnp.asarray(sum(_shifted(x, window, window, stride))) / (window * window)
    return _tiles(x, window).mean(axis=(2, 4))


def batch_norm_variables(features: int) -> tuple[dict, dict]:
    """A fresh BatchNorm over ``features`` channels: ({"bn_scale": 1, "bn_bias": 0}, {"mean": 0, "var": 1})."""
    params = {"bn_scale": jnp.ones((features,), jnp.float32), "bn_bias": jnp.zeros((features,), jnp.float32)}
    return params, {"mean": jnp.zeros((features,), jnp.float32), "var": jnp.ones((features,), jnp.float32)}


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

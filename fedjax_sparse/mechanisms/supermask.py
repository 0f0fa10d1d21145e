"""Supermasks (edge-popup) and the rank arithmetic of FSL, as pure functions.

A *supernetwork* is a model whose weights stay frozen at random values; what
is learnt is a real *score* per edge (weight), and the forward pass uses
``w * mask`` where the mask keeps the top ``k`` fraction of each layer's edges
by score (Ramanujan et al. 2020). The mask is a step function, so its gradient
is replaced by the identity (straight-through estimator): ``d loss / d score =
d loss / d mask``.

FSL (seed 003) federates *rankings*: the ranking of a layer's scores is
``argsort(scores)`` (edge ids from least to most important, int32, a
permutation of ``[0, n)``). Everything here works on one layer's flat vector;
an algorithm maps it over layers (``jax.tree_util.tree_map``) and clients
(``jax.vmap``).

* ``reputations(ranking)``: the position of every edge in a ranking (the
  inverse permutation): ``rep[ranking[i]] = i``.
* ``vote(rankings [K, n])``: FSL's VOTE: sum the K clients' reputations per
  edge, argsort the sums -> the new global ranking.
* ``sparse_reputations(top [m], n)``: Sparse-FSL: a client sends only its
  ``m`` most important edge ids (the last ``m`` of its ranking); those keep
  their reputation ``n - m + j`` and every other edge gets 0.
* ``reorder_scores(sorted_scores, ranking)``: ``out[ranking[i]] =
  sorted_scores[i]`` - the client's (and server's) "theta_s[R_g] =
  SORT(theta_s)" of Algorithm 2, so the i-th least important edge receives
  the i-th smallest initial score.

Speed: XLA:CPU sorts float arrays (and argsorts anything) with a comparator
callback, several times slower than numpy on the 1.6M-edge LeNet layer
(measured in the FSL benchmarks); numpy sorts each key packed with its index
into one uint64 (distinct values, so the order is the stable one). ``argsort``
therefore calls numpy through ``jax.pure_callback`` on the CPU and ``jnp.argsort``
elsewhere (chosen where the program is lowered, like the convolutions' ``"auto"``);
both are stable and order floats totally (-0.0 before +0.0), so
results are identical. Top-k masks never sort: ``topk_mask`` finds
the k-th largest value over the values' order-preserving integer keys by a
radix select (two 65536-bin histograms, a few ms for 1.6M values) or, on
small layers, a 32-step bisection of the key, and breaks ties by index, so
it keeps exactly ``n - int((1 - k) n)`` edges like edge-popup.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

WEIGHT_INITS = ("signed_constant", "kaiming_normal", "glorot_normal")
MASK_BY = ("abs", "raw")


# ---------------------------------------------------------------- initialisation
def frozen_weights(key: jax.Array, shape: Sequence[int], init: str = "signed_constant",
                   fan_in: int | None = None) -> jax.Array:
    """Frozen supernetwork weights of one layer (kernel shape HWIO or [in, out]).

    ``signed_constant`` (the paper's default, App. C.1): every weight is
    +-sqrt(2 / fan_in) with a random sign; ``kaiming_normal``: N(0, 2 / fan_in);
    ``glorot_normal``: N(0, 2 / (fan_in + fan_out)) (fan_out = out * kh * kw).
    ``fan_in``: the entries each output sums over (``LayerInfo.fan_in``: an attention projection's or a
    fused qkv Einsum's is not its kernel's shape); default kh * kw * in.
    """
    shape = tuple(int(s) for s in shape)
    fan_in = int(fan_in) if fan_in is not None else math.prod(shape[:-1])
    if init == "signed_constant":
        sign = jnp.where(jax.random.bernoulli(key, 0.5, shape), 1.0, -1.0)
        return (sign * math.sqrt(2.0 / fan_in)).astype(jnp.float32)
    if init == "kaiming_normal":
        return jax.random.normal(key, shape, jnp.float32) * math.sqrt(2.0 / fan_in)
    if init == "glorot_normal":
        fan_out = shape[-1] * math.prod(shape[:-2]) if len(shape) > 2 else shape[-1]
        return jax.random.normal(key, shape, jnp.float32) * math.sqrt(2.0 / (fan_in + fan_out))
    raise ValueError(f"unknown weight init {init!r}; valid: {WEIGHT_INITS}")


def initial_scores(key: jax.Array, shape: Sequence[int], fan_in: int | None = None) -> jax.Array:
    """Kaiming-uniform scores, PyTorch's ``kaiming_uniform_(a=sqrt(5))``: U(+-1/sqrt(fan_in))
    (``fan_in`` as in :func:`frozen_weights`)."""
    shape = tuple(int(s) for s in shape)
    bound = 1.0 / math.sqrt(int(fan_in) if fan_in is not None else math.prod(shape[:-1]))
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def supernet_from_seed(seed_key: jax.Array, kernel_shapes: dict[str, Sequence[int]],
                       weight_init: str = "signed_constant",
                       fan_ins: dict[str, int] | None = None) -> tuple[dict, dict]:
    """The frozen weights and initial scores of every layer from one shared seed.

    ``kernel_shapes`` maps layer name -> kernel shape (in the model's layer
    order); ``fan_ins`` layer name -> its fan-in where the shape's is not it (``LayerInfo.fan_in``).
    Server and clients call this with the same key and get the same
    supernetwork. Returns ({name: weights}, {name: scores}).
    """
    fan_ins = fan_ins or {}
    layers = tuple((name, tuple(int(s) for s in shape), fan_ins.get(name)) for name, shape in kernel_shapes.items())
    return _supernet(layers, weight_init)(seed_key)


@functools.lru_cache(maxsize=None)
def _supernet(layers: tuple, weight_init: str):
    """One jitted generator per (layers, init): eager random ops would compile one by one."""
    def build(seed_key):
        weights, scores = {}, {}
        for i, (name, shape, fan_in) in enumerate(layers):
            key_w, key_s = jax.random.split(jax.random.fold_in(seed_key, i))
            weights[name] = frozen_weights(key_w, shape, weight_init, fan_in)
            scores[name] = initial_scores(key_s, shape, fan_in)
        return weights, scores
    return jax.jit(build)


# ---------------------------------------------------------------- sorting
def _numpy_order_keys(x: np.ndarray) -> np.ndarray:
    """uint32 keys ordered like ``x`` (float32 as in ``order_keys``; int32 with the sign bit flipped)."""
    if x.dtype == np.float32:
        bits = (x + np.float32(0.0)).view(np.uint32)   # -0.0 + 0.0 = +0.0: the two zeros tie
        # Negative floats (sign bit set) get every bit flipped, the others only the sign bit:
        # the arithmetic shift turns the sign bit into an all-ones or all-zeros word.
        return bits ^ ((bits.view(np.int32) >> 31).view(np.uint32) | np.uint32(0x80000000))
    if x.dtype == np.int32:
        return x.view(np.uint32) ^ np.uint32(0x80000000)
    raise TypeError(f"argsort supports float32 and int32, got {x.dtype}")


def _numpy_argsort(x: np.ndarray) -> np.ndarray:
    """Stable argsort along the last axis: each key and its index packed into one uint64
    (key in the high word, index in the low word) and sorted. The packed values are distinct, so
    any sort gives the stable order, and numpy sorts uint64 with its SIMD sort (x86-simd-sort), faster
    than two stable 16-bit radix passes (docs/design.md, "Constants and the measurements behind them")."""
    keys = _numpy_order_keys(np.ascontiguousarray(x)).reshape(-1, x.shape[-1])
    n = keys.shape[-1]
    out = np.empty(keys.shape, np.int32)
    index = np.arange(n, dtype=np.uint32)
    if sys.byteorder == "little":
        pairs = np.empty((n, 2), np.uint32)       # as uint64: low word [:, 0], high word [:, 1]
        packed = pairs.view(np.uint64).reshape(n)
        for i, row in enumerate(keys):
            pairs[:, 0], pairs[:, 1] = index, row
            packed.sort()
            out[i] = pairs[:, 0]
    else:
        for i, row in enumerate(keys):
            packed = (row.astype(np.uint64) << np.uint64(32)) | index
            packed.sort()
            out[i] = (packed & np.uint64(0xFFFFFFFF)).astype(np.int32)
    return out.reshape(x.shape)


def argsort(x: jax.Array) -> jax.Array:
    """Stable argsort along the last axis (int32). Jittable and vmappable.

    On CPU: numpy through ``pure_callback`` (faster than XLA:CPU's comparator
    sort on large layers); elsewhere: ``jnp.argsort``. Chosen where the program is lowered, so a
    program exported for a GPU on a CPU-only host sorts as the GPU would.
    """
    def host_sort(x):
        return jax.pure_callback(_numpy_argsort, jax.ShapeDtypeStruct(x.shape, jnp.int32), x,
                                 vmap_method="expand_dims")

    def device_sort(x):
        return jnp.argsort(x, axis=-1, stable=True).astype(jnp.int32)

    return jax.lax.platform_dependent(x, cpu=host_sort, default=device_sort)


def ranking(scores: jax.Array) -> jax.Array:
    """[...] scores -> [n] int32 edge ids from the lowest to the highest score."""
    return argsort(scores.reshape(-1))


# ---------------------------------------------------------------- rank arithmetic
def reputations(ranking_: jax.Array) -> jax.Array:
    """[n] ranking -> [n] int32 positions: ``rep[ranking[i]] = i`` (inverse permutation)."""
    n = ranking_.shape[-1]
    return jnp.zeros((n,), jnp.int32).at[ranking_].set(jnp.arange(n, dtype=jnp.int32))


def sparse_reputations(top: jax.Array, n: int) -> jax.Array:
    """Sparse-FSL: [m] top edge ids (least to most important of the top m) ->
    [n] reputations, ``n - m + j`` for the j-th sent edge and 0 for the rest."""
    m = top.shape[-1]
    return jnp.zeros((n,), jnp.int32).at[top].set(jnp.arange(n - m, n, dtype=jnp.int32))


def _check_sum_fits(k: int, n: int) -> None:
    if k * n >= 2 ** 31:
        raise ValueError(f"reputation sums of {k} clients over {n} edges overflow int32")


def vote(rankings: jax.Array, include: jax.Array | None = None) -> jax.Array:
    """FSL's VOTE: [K, n] client rankings -> [n] global ranking.

    An edge's reputation from a client is its position in that client's
    ranking; reputations are summed over the clients (only those with
    ``include`` true, [K] bool, when given) and the sums argsorted (stable).
    """
    k, n = rankings.shape
    _check_sum_fits(k, n)
    reps = jax.vmap(reputations)(rankings)
    if include is not None:
        reps = reps * include[:, None].astype(jnp.int32)
    return argsort(reps.sum(0))


def vote_sparse(tops: jax.Array, n: int, include: jax.Array | None = None) -> jax.Array:
    """Sparse-FSL's VOTE: [K, m] top edge ids per client -> [n] global ranking."""
    k = tops.shape[0]
    _check_sum_fits(k, n)
    reps = jax.vmap(lambda t: sparse_reputations(t, n))(tops)
    if include is not None:
        reps = reps * include[:, None].astype(jnp.int32)
    return argsort(reps.sum(0))


def reorder_scores(sorted_scores: jax.Array, ranking_: jax.Array) -> jax.Array:
    """[n] ascending initial scores, [n] ranking -> [n] scores with
    ``out[ranking[i]] = sorted_scores[i]`` (the i-th ranked edge gets the i-th smallest)."""
    return jnp.zeros_like(sorted_scores).at[ranking_].set(sorted_scores)


def reverse_ranking(ranking_: jax.Array) -> jax.Array:
    """The reverse-ranking attack's output: most important first becomes least important."""
    return ranking_[..., ::-1]


def top_of_ranking(ranking_: jax.Array, fraction: float) -> jax.Array:
    """The ``kept_count(n, fraction)`` most important edge ids (the tail of the ranking)."""
    n = ranking_.shape[-1]
    return ranking_[..., n - kept_count(n, fraction):]


# ---------------------------------------------------------------- top-k masks
def kept_count(n: int, fraction: float) -> int:
    """Edges kept by edge-popup's ``j = int((1 - k) n)``: ``n - j`` (at least 1)."""
    return max(n - int((1.0 - fraction) * n), 1)


def order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys with the same order (negative floats reversed, sign
    bit flipped); -0.0 and +0.0 get the same key, as they compare equal."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32) + 0.0, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _suffix_counts(hist: jax.Array) -> jax.Array:
    """suffix[b] = hist[b] + hist[b + 1] + ... (counts at or above bin b)."""
    return jnp.cumsum(hist[::-1])[::-1]


# Up to this many keys, 32 compare-and-count passes beat building two 65536-bin histograms (whose
# fixed cost dominates on small layers); on large layers the radix select wins (docs/design.md,
# "Constants and the measurements behind them").
BISECT_MAX_KEYS = 1 << 16


def kth_largest_key(keys: jax.Array, kept: int, method: str = "auto") -> jax.Array:
    """The largest uint32 ``t`` with ``count(keys >= t) >= kept``, i.e. the ``kept``-th largest
    key. ``radix``: a two-pass radix select (a 65536-bin histogram of the high 16 bits picks the
    bin, a histogram of the low 16 bits inside that bin picks the value; two scatter-adds instead
    of a sort). ``bisect``: the answer's 32 bits set from the top, each kept when enough keys reach
    it (32 compare-and-count passes). ``sort``: the keys sorted, the ``kept``-th from the top (one
    library sort). ``auto``: up to ``BISECT_MAX_KEYS`` keys, bisect on the CPU and sort elsewhere (a
    GPU launches a bisection's 32 iterations one after another, a sort as one call; chosen where the
    program is lowered), else radix. All give the same key."""
    if method == "auto":
        if keys.shape[-1] > BISECT_MAX_KEYS:
            return kth_largest_key(keys, kept, "radix")
        return jax.lax.platform_dependent(keys, cpu=functools.partial(kth_largest_key, kept=kept, method="bisect"),
                                          default=functools.partial(kth_largest_key, kept=kept, method="sort"))
    if method == "sort":
        return jnp.sort(keys)[keys.shape[-1] - kept]
    if method == "bisect":
        def set_bit(i, t):
            candidate = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
            return jnp.where((keys >= candidate).sum() >= kept, candidate, t)
        return jax.lax.fori_loop(0, 32, set_bit, jnp.uint32(0))
    if method != "radix":
        raise ValueError(f"unknown k-th key method {method!r}; valid: auto, radix, bisect, sort")
    high = (keys >> 16).astype(jnp.int32)
    low = (keys & jnp.uint32(0xFFFF)).astype(jnp.int32)
    hist_high = jnp.zeros((1 << 16,), jnp.int32).at[high].add(1)
    suffix_high = _suffix_counts(hist_high)
    bin_high = (suffix_high >= kept).sum() - 1                 # suffix counts fall with the bin
    above = suffix_high[bin_high] - hist_high[bin_high]        # keys in higher bins
    # Keys outside the chosen bin go to an index past the end and are dropped: a scalar update, no [n] array
    # of 0/1 updates to write and read.
    hist_low = jnp.zeros((1 << 16,), jnp.int32).at[jnp.where(high == bin_high, low, 1 << 16)].add(1, mode="drop")
    bin_low = (above + _suffix_counts(hist_low) >= kept).sum() - 1
    return (bin_high.astype(jnp.uint32) << 16) | bin_low.astype(jnp.uint32)


def topk_mask(values: jax.Array, fraction: float) -> jax.Array:
    """0/1 float32 mask (same shape) keeping the ``kept_count`` largest values.

    Exact without sorting: ``kth_largest_key`` finds the threshold; ties at
    the threshold are broken by flat index, lowest first.
    """
    flat = values.reshape(-1)
    kept = kept_count(flat.shape[0], fraction)
    keys = order_keys(flat)
    threshold = kth_largest_key(keys, kept)
    above = keys > threshold
    at = keys == threshold
    room = kept - above.sum()
    cut = _tie_cut(at, room)
    mask = above | (at & (jnp.arange(flat.shape[0]) < cut))
    return mask.astype(jnp.float32).reshape(values.shape)


def _lowest_ties_cut(at: jax.Array, room: jax.Array) -> jax.Array:
    """The index before which ``at`` holds ``room`` entries (a prefix count: a whole-layer pass)."""
    n = at.shape[-1]
    over = jnp.cumsum(at, axis=-1) > room[..., None]
    return jnp.where(over.any(-1), jnp.argmax(over, axis=-1), n).astype(jnp.int32)


@custom_vmap
def _tie_cut(at: jax.Array, room: jax.Array) -> jax.Array:
    """[] int32: ties (``at``) at indices below it are kept, ``room`` of them, the lowest first. Usually
    every tie fits (``at.sum() == room``, e.g. a single key at the threshold) and the prefix count is
    skipped. Under ``vmap`` a ``lax.cond`` on a per-client predicate becomes a select that runs the
    prefix count every time (every local step of every FSL client, a pass over each layer), so the
    batched rule asks once whether any client needs it. The conditional returns a count per client,
    not a mask: XLA:CPU copies a conditional's operands and results."""
    n = at.shape[-1]
    return jax.lax.cond(at.sum() == room, lambda: jnp.int32(n), lambda: _lowest_ties_cut(at, room))


@_tie_cut.def_vmap
def _tie_cut_vmap(axis_size, in_batched, at, room):
    at, room = (x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
                for x, batched in zip((at, room), in_batched))
    n = at.shape[-1]
    fits = at.sum(axis=-1) == room
    cut = jax.lax.cond(fits.all(), lambda: jnp.full(fits.shape, n, jnp.int32),
                       lambda: jnp.where(fits, n, _lowest_ties_cut(at, room)))
    return cut, True


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def straight_through_topk(values: jax.Array, fraction: float) -> jax.Array:
    """``topk_mask`` forward; identity gradient backward (edge-popup's STE)."""
    return topk_mask(values, fraction)


def _ste_fwd(values, fraction):
    return topk_mask(values, fraction), None


def _ste_bwd(fraction, residual, g):
    return (g,)


straight_through_topk.defvjp(_ste_fwd, _ste_bwd)


def supermask(scores: jax.Array, fraction: float, mask_by: str = "abs") -> jax.Array:
    """Differentiable supermask of one layer's scores.

    ``abs`` (the authors' code, ``GetSubnet(scores.abs(), k)``): the top
    ``fraction`` by |score|, gradient ``g * sign(score)``. ``raw``: the top by
    score itself (the paper's eq. 6: the mask is the top of the ranking).
    """
    if mask_by == "abs":
        return straight_through_topk(jnp.abs(scores), fraction)
    if mask_by == "raw":
        return straight_through_topk(scores, fraction)
    raise ValueError(f"unknown mask_by {mask_by!r}; valid: {MASK_BY}")


def mask_from_ranking(ranking_: jax.Array, fraction: float) -> jax.Array:
    """[n] float32 mask of the ``kept_count`` top-ranked edges (eq. 6)."""
    n = ranking_.shape[-1]
    keep = (jnp.arange(n) >= n - kept_count(n, fraction)).astype(jnp.float32)
    return jnp.zeros((n,), jnp.float32).at[ranking_].set(keep)


# ---------------------------------------------------------------- communication
MIB_BITS = 8 * 2 ** 20


def rank_bits(n: int) -> int:
    """Bits of one rank (an edge id in [0, n)) in the paper's naive coding: ceil(log2 n)."""
    return max(int(math.ceil(math.log2(n))), 1) if n > 1 else 1


def ranking_bits(layer_sizes: Sequence[int], fraction: float = 1.0) -> int:
    """Bits of one client's per-layer rankings: sum_l m_l * ceil(log2 n_l), with
    m_l = n_l for a full ranking and ``kept_count(n_l, fraction)`` for Sparse-FSL."""
    total = 0
    for n in layer_sizes:
        m = n if fraction >= 1.0 else kept_count(n, fraction)
        total += m * rank_bits(n)
    return total


def mebibytes(bits: float) -> float:
    """Bits -> the paper's "MB" (2^20 bytes: FedAvg's MNIST LeNet is 6.20 MB)."""
    return bits / MIB_BITS


__all__ = ["BISECT_MAX_KEYS", "MASK_BY", "MIB_BITS", "WEIGHT_INITS", "argsort", "frozen_weights", "initial_scores",
           "kept_count", "kth_largest_key", "mask_from_ranking", "mebibytes", "order_keys", "rank_bits", "ranking",
           "ranking_bits", "reorder_scores", "reputations", "reverse_ranking", "sparse_reputations",
           "straight_through_topk", "supermask", "supernet_from_seed", "top_of_ranking", "topk_mask", "vote",
           "vote_sparse"]

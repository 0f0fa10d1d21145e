"""Supermasks (edge-popup) and the rank arithmetic of FSL, as pure functions.

A *supernetwork* is a model whose weights stay frozen at random values; what
is learnt is a real *score* per edge (weight), and the forward pass uses
``w * mask`` where the mask keeps the top ``k`` fraction of each layer's edges
by score (Ramanujan et al. 2020). The mask is a step function, so its gradient
is replaced by the identity (straight-through estimator): ``d loss / d score =
d loss / d mask``.

FSL (seed 003) federates *rankings*: the ranking of a layer's scores is
``argsort(scores)`` (edge ids from least to most important, int32, a
permutation of ``[0, n)``), which the server combines by ``vote`` over the clients' ``reputations``
(``vote_sparse``: Sparse-FSL's top ids) and the clients turn back into scores by ``reorder_scores``
(Algorithm 2's "theta_s[R_g] = SORT(theta_s)"; docs/fsl.md, "FSL round"). Everything here works on one
layer's flat vector; an algorithm maps it over layers (``jax.tree_util.tree_map``) and clients
(``jax.vmap``).

Sorting: ``argsort`` calls numpy through ``jax.pure_callback`` on the CPU (XLA:CPU's comparator sort is
several times slower; docs/fsl.md) and ``jnp.argsort`` elsewhere, both stable with floats ordered
totally, so results are identical. Top-k masks never sort: ``topk_mask`` finds the k-th largest value
over order-preserving integer keys (a radix select or a bisection, by layer size and platform:
``kth_largest_key``) and breaks ties by index, keeping exactly ``n - int((1 - k) n)`` edges like edge-popup.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from fedjax_sparse.models.base import glorot_normal_init, he_normal_init, torch_default_init

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
        return he_normal_init(key, shape, fan_in)
    if init == "glorot_normal":
        return glorot_normal_init(key, shape, fan_in)
    raise ValueError(f"unknown weight init {init!r}; valid: {WEIGHT_INITS}")


def initial_scores(key: jax.Array, shape: Sequence[int], fan_in: int | None = None) -> jax.Array:
    """Kaiming-uniform scores, PyTorch's ``kaiming_uniform_(a=sqrt(5))``: U(+-1/sqrt(fan_in))
    (``fan_in`` as in :func:`frozen_weights`)."""
    shape = tuple(int(s) for s in shape)
    return torch_default_init(key, shape, int(fan_in) if fan_in is not None else math.prod(shape[:-1]))


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
    """Stable argsort along the last axis: each key (high word) and its index (low word) packed into one
    uint64 and sorted; the packed values are distinct, so any sort gives the stable order (why: docs/design.md)."""
    keys = _numpy_order_keys(np.ascontiguousarray(x)).reshape(-1, x.shape[-1])
    n = keys.shape[-1]
    out = np.empty(keys.shape, np.int32)
    index = np.arange(n, dtype=np.uint32)
    # Little-endian words whatever the host's byte order: as a uint64, [:, 0] is the low word, [:, 1] the high.
    pairs = np.empty((n, 2), "<u4")
    packed = pairs.view("<u8").reshape(n)
    for i, row in enumerate(keys):
        pairs[:, 0], pairs[:, 1] = index, row
        packed.sort()
        out[i] = pairs[:, 0]
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
    return _summed_ranking(jax.vmap(reputations)(rankings), include)


def vote_sparse(tops: jax.Array, n: int, include: jax.Array | None = None) -> jax.Array:
    """Sparse-FSL's VOTE: [K, m] top edge ids per client -> [n] global ranking."""
    _check_sum_fits(tops.shape[0], n)
    return _summed_ranking(jax.vmap(lambda t: sparse_reputations(t, n))(tops), include)


def _summed_ranking(reps: jax.Array, include: jax.Array | None) -> jax.Array:
    """[K, n] reputations -> [n] the argsort of their sums over the clients ``include``s (all: None)."""
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
    x = x.astype(jnp.float32)
    # -0.0 -> +0.0 by a select: XLA simplifies ``x + 0.0`` to ``x`` under jit, which kept the two zeros apart.
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _suffix_counts(hist: jax.Array) -> jax.Array:
    """suffix[b] = hist[b] + hist[b + 1] + ... (counts at or above bin b)."""
    return jnp.cumsum(hist[::-1])[::-1]


_COUNT_DNUMS = jax.lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                               scatter_dims_to_operand_dims=(0,))


def _scatter_count(bins: jax.Array, size: int) -> jax.Array:
    """[size] int32 counts of the uint32 ``bins`` (every one in [0, size)): one scatter-add, no index
    normalisation (``.at[].add`` would add passes for negative and out-of-range indices)."""
    return jax.lax.scatter_add(jnp.zeros((size,), jnp.int32), bins.reshape(-1, 1), jnp.ones((bins.size,), jnp.int32),
                               _COUNT_DNUMS, indices_are_sorted=False, unique_indices=False,
                               mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@functools.lru_cache(maxsize=None)
def _histogram(size: int):
    """[n] uint32 bins in [0, size) -> [size] int32 counts. Under ``vmap`` one scatter over every row's bins
    offset by row * size (JAX's own batching rule would concatenate a row index to every index: an [n, 2]
    index array per row to write and read)."""
    @custom_vmap
    def histogram(bins):
        return _scatter_count(bins, size)

    @histogram.def_vmap
    def histogram_vmap(axis_size, in_batched, bins):
        if not in_batched[0]:
            return histogram(bins), False
        lead = bins.shape[:-1]
        rows = math.prod(lead)
        offset = (jnp.arange(rows, dtype=jnp.uint32) * size).reshape(lead + (1,))
        return _scatter_count(bins + offset, rows * size).reshape(lead + (size,)), True

    return histogram


# On the CPU, up to this many keys, 32 compare-and-count passes beat building two 65536-bin histograms
# (whose fixed cost dominates on small layers); on large layers the radix select wins (docs/design.md,
# "Constants and the measurements behind them"). Off the CPU a large layer bisects: a GPU's scatter-add
# serialises the histograms' atomics on a few bins (one H200: 25 x 1.18 M keys, 1.5 ms by bisection
# against 24.9 ms by radix; perf/fsl_topk_gpu.json).
BISECT_MAX_KEYS = 1 << 16


def _radix_select(keys: jax.Array, kept: int) -> tuple[jax.Array, jax.Array]:
    """(the ``kept``-th largest key, how many keys exceed it) by a two-pass radix select: a 65536-bin
    histogram of the high 16 bits picks the bin, a histogram of the low 16 bits inside that bin picks the
    value; the count comes from the two histograms (no pass over the keys)."""
    hist_high = _histogram(1 << 16)(keys >> 16)
    suffix_high = _suffix_counts(hist_high)
    bin_high = (suffix_high >= kept).sum() - 1                 # suffix counts fall with the bin
    above = suffix_high[bin_high] - hist_high[bin_high]        # keys in higher bins
    # Keys outside the chosen bin (below it, the uint32 difference wraps) count in an extra bin 65536,
    # dropped after.
    hist_low = _histogram((1 << 16) + 1)(jnp.minimum(keys - (bin_high.astype(jnp.uint32) << 16),
                                                     jnp.uint32(1 << 16)))[:1 << 16]
    suffix_low = _suffix_counts(hist_low)
    bin_low = (above + suffix_low >= kept).sum() - 1
    threshold = (bin_high.astype(jnp.uint32) << 16) | bin_low.astype(jnp.uint32)
    return threshold, above + suffix_low[bin_low] - hist_low[bin_low]


def _bisect_select(keys: jax.Array, kept: int) -> tuple[jax.Array, jax.Array]:
    """``_radix_select``'s (threshold, count above it) by bisection and one counting pass."""
    threshold = kth_largest_key(keys, kept, "bisect")
    return threshold, (keys > threshold).sum()


def _large_layer_select(keys: jax.Array, kept: int) -> tuple[jax.Array, jax.Array]:
    """(threshold, count above it) of a layer over ``BISECT_MAX_KEYS`` keys: radix on the CPU, bisection
    elsewhere (chosen where the program is lowered)."""
    return jax.lax.platform_dependent(keys, cpu=functools.partial(_radix_select, kept=kept),
                                      default=functools.partial(_bisect_select, kept=kept))


def kth_largest_key(keys: jax.Array, kept: int, method: str = "auto") -> jax.Array:
    """The largest uint32 ``t`` with ``count(keys >= t) >= kept``, i.e. the ``kept``-th largest key.
    ``radix``: ``_radix_select``. ``bisect``: the answer's 32 bits set from the top, each kept when enough
    keys reach it. ``sort``: the ``kept``-th of the sorted keys from the top. ``auto`` (chosen where the
    program is lowered): up to ``BISECT_MAX_KEYS`` keys, bisect on the CPU and sort elsewhere (one kernel
    for a small layer, where bisection is 32 dependent iterations; not measured against it on a GPU);
    above, radix on the CPU and bisect elsewhere (``BISECT_MAX_KEYS``). All give the same key."""
    if method == "auto":
        if keys.shape[-1] > BISECT_MAX_KEYS:
            return _large_layer_select(keys, kept)[0]
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
    return _radix_select(keys, kept)[0]


def topk_mask(values: jax.Array, fraction: float, nonnegative: bool = False) -> jax.Array:
    """0/1 float32 mask (same shape) keeping the ``kept_count`` largest values.

    Exact without sorting: ``kth_largest_key`` finds the threshold; ties at
    the threshold are broken by flat index, lowest first. ``nonnegative``: the values are >= 0 and
    none is -0.0 (``jnp.abs``'s output), so their bits order them (one op instead of ``order_keys``).
    """
    flat = values.reshape(-1)
    n = flat.shape[0]
    kept = kept_count(n, fraction)
    keys = jax.lax.bitcast_convert_type(flat, jnp.uint32) if nonnegative else order_keys(flat)
    if n > BISECT_MAX_KEYS:
        threshold, above_count = _large_layer_select(keys, kept)
    else:
        threshold = kth_largest_key(keys, kept)
        above_count = (keys > threshold).sum()
    at = keys == threshold
    cut = _tie_cut(at, kept - above_count)
    mask = (keys > threshold) | (at & (jnp.arange(n) < cut))
    return mask.astype(jnp.float32).reshape(values.shape)


# Ties are counted per block of this many entries; the prefix count runs over the block counts and
# inside one block, not over the layer.
TIE_BLOCK = 1024


def _tie_cut(at: jax.Array, room: jax.Array) -> jax.Array:
    """[] int32: the ties (``at``) at indices below it are the ``room`` lowest (``n`` when every tie fits).
    On a large layer without a prefix count over the layer: ties counted per ``TIE_BLOCK`` entries (one
    reduction over ``at``), the prefix count over the block counts finds the block holding tie
    ``room + 1``, and a prefix count inside that block its index (no conditional on whether any tie needs
    cutting: docs/design.md)."""
    n = at.shape[-1]
    if n <= TIE_BLOCK:
        over = jnp.cumsum(at, dtype=jnp.int32) > room
        return jnp.where(over.any(), jnp.argmax(over), n).astype(jnp.int32)
    num_blocks = -(-n // TIE_BLOCK)
    blocks = at if n == num_blocks * TIE_BLOCK else jnp.pad(at, (0, num_blocks * TIE_BLOCK - n))
    blocks = blocks.reshape(num_blocks, TIE_BLOCK)
    through = jnp.cumsum(blocks.sum(-1, dtype=jnp.int32))      # ties in blocks 0..b
    block = jnp.minimum((through <= room).sum(), num_blocks - 1)
    before = jnp.where(block > 0, through[block - 1], 0)
    over = jnp.cumsum(jax.lax.dynamic_index_in_dim(blocks, block, keepdims=False), dtype=jnp.int32) > room - before
    return jnp.where(over.any(), block * TIE_BLOCK + jnp.argmax(over), n).astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def straight_through_topk(values: jax.Array, fraction: float, nonnegative: bool = False) -> jax.Array:
    """``topk_mask`` forward; identity gradient backward (edge-popup's STE)."""
    return topk_mask(values, fraction, nonnegative)


def _ste_fwd(values, fraction, nonnegative):
    return topk_mask(values, fraction, nonnegative), None


def _ste_bwd(fraction, nonnegative, residual, g):
    return (g,)


straight_through_topk.defvjp(_ste_fwd, _ste_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _abs_straight_through(scores: jax.Array, fraction: float) -> jax.Array:
    """``straight_through_topk(jnp.abs(scores), fraction)`` with its gradient in one select,
    ``where(scores >= 0, g, -g)`` (``jnp.abs``'s own JVP, whose transpose adds a select's two branches)."""
    return topk_mask(jnp.abs(scores), fraction, nonnegative=True)


def _abs_ste_fwd(scores, fraction):
    return topk_mask(jnp.abs(scores), fraction, nonnegative=True), scores


def _abs_ste_bwd(fraction, scores, g):
    return (jnp.where(scores >= 0, g, -g),)


_abs_straight_through.defvjp(_abs_ste_fwd, _abs_ste_bwd)


def supermask(scores: jax.Array, fraction: float, mask_by: str = "abs") -> jax.Array:
    """Differentiable supermask of one layer's scores.

    ``abs`` (the authors' code, ``GetSubnet(scores.abs(), k)``): the top
    ``fraction`` by |score|, gradient ``g * sign(score)``. ``raw``: the top by
    score itself (the paper's eq. 6: the mask is the top of the ranking).
    """
    if mask_by == "abs":
        return _abs_straight_through(scores, fraction)
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
    return sum((n if fraction >= 1.0 else kept_count(n, fraction)) * rank_bits(n) for n in layer_sizes)


def mebibytes(bits: float) -> float:
    """Bits -> the paper's "MB" (2^20 bytes: FedAvg's MNIST LeNet is 6.20 MB)."""
    return bits / MIB_BITS


__all__ = ["BISECT_MAX_KEYS", "MASK_BY", "MIB_BITS", "WEIGHT_INITS", "argsort", "frozen_weights", "initial_scores",
           "kept_count", "kth_largest_key", "mask_from_ranking", "mebibytes", "order_keys", "rank_bits", "ranking",
           "ranking_bits", "reorder_scores", "reputations", "reverse_ranking", "sparse_reputations",
           "straight_through_topk", "supermask", "supernet_from_seed", "top_of_ranking", "topk_mask", "vote",
           "vote_sparse"]

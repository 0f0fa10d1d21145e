"""Robust aggregation of K client updates ``[K, P]`` (the FSL paper's baselines, seed 003): Trimmed-mean
(Yin et al. 2018: ``trimmed_mean``; ``trimmed_mean_with_copies``, what the DYN-OPT attack on it
evaluates), Multi-Krum (Blanchard et al. 2017: ``multi_krum``), SignSGD's majority vote (Bernstein et
al. 2019: ``sign_majority``) and TopK sparsification (Aji & Heafield 2017: ``topk_sparsify``).

Pure array functions (jit/vmap-friendly; ``f``, ``trim`` and ``num_select``
may be traced); the wrappers using them are in
``fedjax_sparse.algorithms.compose``, the FSL paper's baselines in
``fedjax_sparse.algorithms.robust``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sparse.mechanisms.supermask import order_keys, topk_mask


def masked_mean(x: jax.Array, include: jax.Array) -> jax.Array:
    """Mean over the rows of [K, P] with ``include`` [K] true (0 if none)."""
    w = include.astype(x.dtype)
    return (w @ x) / jnp.maximum(w.sum(), 1.0)


def _keys_to_floats(keys: jax.Array) -> jax.Array:
    positive = (keys >> 31) == 1
    bits = jnp.where(positive, keys & jnp.uint32(0x7FFFFFFF), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def sort_rows(x: jax.Array, include: jax.Array | None = None) -> jax.Array:
    """Sorts [K, P] float32 along axis 0 through order-preserving integer keys
    (XLA:CPU sorts plain integers much faster than floats). With ``include``
    [K] bool, only those rows are sorted: the first ``include.sum()`` rows of the
    result are their sorted values, the rows after them are NaN."""
    keys = order_keys(x)
    if include is not None:
        keys = jnp.where(include[:, None], keys, jnp.uint32(0xFFFFFFFF))   # the largest key: a NaN, sorted last
    return _keys_to_floats(jnp.sort(keys, axis=0))


def trimmed_mean(x: jax.Array, trim) -> jax.Array:
    """Coordinate-wise mean of [K, P] after dropping the ``trim`` largest and
    ``trim`` smallest values of each coordinate (``trim`` may be traced)."""
    k = x.shape[0]
    trim = jnp.clip(trim, 0, (k - 1) // 2)
    ranks = jnp.arange(k)
    keep = ((ranks >= trim) & (ranks < k - trim)).astype(x.dtype)
    return (keep @ sort_rows(x)) / (k - 2 * trim).astype(x.dtype)


def trimmed_mean_with_copies(sorted_rows, prefix, count, value, copies, trim):
    """Trimmed mean (trimming ``trim`` each side) of ``count`` rows plus ``copies``
    copies of the row ``value`` [P], per coordinate, from the rows sorted along
    axis 0 (``sort_rows(x, include)``; rows >= ``count`` are not read) and their
    prefix sums (``prefix[j]`` = sum of the j smallest, [count + 1, P] at least).
    O(K P) per call and no sort, so a search over many ``value`` s sorts once."""
    k = sorted_rows.shape[0]
    rows = jnp.arange(k)[:, None]
    below = ((sorted_rows < value[None, :]) & (rows < count)).sum(0)   # [P]

    def smallest_of_merged(j):   # the j smallest of the merged list: (rows' sum, copies), per coordinate
        j = jnp.broadcast_to(j, below.shape)
        take_b = jnp.where(j <= below, j, jnp.where(j <= below + copies, below, j - copies))
        return jnp.take_along_axis(prefix, take_b[None, :], axis=0)[0], jnp.clip(j - below, 0, copies)

    total = count + copies
    rows_high, copies_high = smallest_of_merged(total - trim)
    rows_low, copies_low = smallest_of_merged(trim)
    # The copies kept are counted, not summed and subtracted: once every copy is trimmed the
    # result is the same float for every value, so the attack's strict loss comparison sees the
    # exact tie the sorted trimmed mean gives (a subtraction of value's multiples would not).
    kept = (rows_high - rows_low) + (copies_high - copies_low) * value
    return kept / jnp.maximum(total - 2 * trim, 1).astype(value.dtype)


def pairwise_sq_distances(x: jax.Array) -> jax.Array:
    """[K, P] -> [K, K] squared Euclidean distances (Gram form, clamped at 0)."""
    sq = jnp.sum(x * x, axis=1)
    return jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * (x @ x.T), 0.0)


def multi_krum_select(d2: jax.Array, f, num_select) -> jax.Array:
    """[K, K] squared distances -> [K] bool, the ``num_select`` updates Multi-Krum keeps.

    Repeatedly picks the remaining update whose sum of squared distances to
    its ``r - f - 2`` nearest remaining neighbours (r = remaining count, at
    least 1 neighbour) is smallest. ``f`` and ``num_select`` may be traced.
    """
    k = d2.shape[0]
    eye = jnp.eye(k, dtype=bool)

    def body(t, state):
        selected, remaining = state
        r = remaining.sum()
        neighbours = jnp.clip(r - f - 2, 1, k - 1)
        d = jnp.where(remaining[None, :] & ~eye, d2, jnp.inf)
        nearest = jnp.sort(d, axis=1)
        ranks = jnp.arange(k)[None, :]
        score = jnp.where(ranks < neighbours, jnp.where(jnp.isfinite(nearest), nearest, 0.0), 0.0).sum(1)
        score = jnp.where(remaining, score, jnp.inf)
        pick = jnp.argmin(score)
        active = t < num_select
        selected = selected.at[pick].set(selected[pick] | active)
        remaining = remaining.at[pick].set(remaining[pick] & ~active)
        return selected, remaining

    selected, _ = jax.lax.fori_loop(0, k, body, (jnp.zeros(k, bool), jnp.ones(k, bool)))
    return selected


def krum_count(k: int, f, krum_select: int = -1):
    """How many updates Multi-Krum averages: ``K - 2f - 2`` (>= 1) unless overridden."""
    if krum_select > 0:
        return jnp.int32(min(krum_select, k))
    return jnp.clip(k - 2 * f - 2, 1, k)


def multi_krum(x: jax.Array, f, num_select=None) -> tuple[jax.Array, jax.Array]:
    """Mean of the Multi-Krum selection of [K, P]; returns (aggregate [P], selected [K])."""
    num_select = krum_count(x.shape[0], f) if num_select is None else num_select
    selected = multi_krum_select(pairwise_sq_distances(x), f, num_select)
    return masked_mean(x, selected), selected


def sign_majority(signs: jax.Array) -> jax.Array:
    """[K, P] signs (+-1, int8) -> [P] float32 majority sign (0 on a tie)."""
    return jnp.sign(signs.astype(jnp.int32).sum(0)).astype(jnp.float32)


def topk_sparsify(x: jax.Array, fraction: float) -> jax.Array:
    """Keeps the ``kept_count(P, fraction)`` largest-magnitude coordinates of [P]."""
    return x * topk_mask(jnp.abs(x), fraction)


__all__ = ["krum_count", "masked_mean", "multi_krum", "multi_krum_select", "pairwise_sq_distances", "sign_majority",
           "sort_rows", "topk_sparsify", "trimmed_mean", "trimmed_mean_with_copies"]

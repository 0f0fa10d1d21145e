"""Tests written for the mutmut survivors of ``mechanisms/supermask.py`` (docs/testing.md)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.mechanisms import supermask as sm
from fedjax_sparse.mechanisms import supermask as sm_impl


# ---------------------------------------------------------------- communication (no test reached these)
def test_rank_bits_are_ceil_log2_of_the_layer_size():
    # an edge id in [0, n) needs ceil(log2 n) bits; a single-edge layer still sends 1 bit
    assert [sm.rank_bits(n) for n in (1, 2, 3, 4, 5, 1024, 1025)] == [1, 1, 2, 2, 3, 10, 11]


def test_ranking_bits_full_and_sparse_by_hand():
    # full rankings: 4 edges x 2 bits + 10 edges x 4 bits
    assert sm.ranking_bits([4, 10]) == 4 * 2 + 10 * 4 == 48
    assert sm.ranking_bits([4, 10], 1.0) == 48
    # Sparse-FSL top half: int((1 - 0.5) * 4) = 2 dropped of 4, 5 of 10 -> 2 x 2 + 5 x 4 bits
    assert sm.ranking_bits([4, 10], 0.5) == 2 * 2 + 5 * 4 == 24
    # top 25 %: 10 - int(0.75 * 10) = 3 edges of 10, 4 bits each
    assert sm.ranking_bits([10], 0.25) == 3 * 4


def test_mebibytes_are_two_to_the_twenty_bytes():
    # the paper's MB is 2^20 bytes = 2^23 bits
    assert sm.mebibytes(8 * 2 ** 20) == 1.0
    assert sm.mebibytes(12 * 2 ** 20) == 1.5


# ---------------------------------------------------------------- error messages and guards
def test_unknown_mask_by_and_init_name_the_valid_choices():
    with pytest.raises(ValueError, match="unknown mask_by 'top'"):
        sm.supermask(jnp.ones(4), 0.5, "top")
    with pytest.raises(ValueError, match="unknown weight init 'xavier'"):
        sm.frozen_weights(jax.random.PRNGKey(0), (2, 3), "xavier")


def test_vote_refuses_reputation_sums_that_overflow_int32():
    # 2048 clients x reputations up to n - 1 = 2^20 sum to 2^31 > int32 max: must be refused
    n = 2 ** 20 + 1
    with pytest.raises(ValueError, match="overflow int32"):
        jax.eval_shape(sm.vote, jax.ShapeDtypeStruct((2048, n), jnp.int32))
    # Sparse-FSL: the client count is the first axis of the [K, m] tops, whatever m is
    with pytest.raises(ValueError, match="overflow int32"):
        jax.eval_shape(lambda t: sm.vote_sparse(t, n), jax.ShapeDtypeStruct((2048, 4), jnp.int32))
    # well inside int32: fine
    jax.eval_shape(sm.vote, jax.ShapeDtypeStruct((1024, n), jnp.int32))


# ---------------------------------------------------------------- integer reputations
def test_reputations_are_int32():
    r = jnp.array([4, 0, 2, 3, 5, 1], jnp.int32)
    assert sm.reputations(r).dtype == jnp.int32
    assert sm.sparse_reputations(r[3:], 6).dtype == jnp.int32


def test_vote_with_include_sums_reputations_exactly_beyond_float32():
    """Two clients, n = 2^23 + 8 edges: the sums reach 2^24 + 13, where float32 has a
    spacing of 2. The last four edges get sums 2^24 + (9, 11, 13, 11); exact integer
    sums rank them [n-4, n-3, n-1, n-2], float32 sums (all but the first round to
    2^24 + 12) would tie the last three and keep index order."""
    n = 2 ** 23 + 8
    identity = np.arange(n, dtype=np.int32)
    rep_b = identity.copy()
    rep_b[n - 4:] = [n - 3, n - 2, n - 1, n - 4]
    ranking_b = np.empty(n, np.int32)
    ranking_b[rep_b] = identity                        # the ranking whose reputations are rep_b
    rankings = jnp.asarray(np.stack([identity, ranking_b]))
    want_tail = [n - 4, n - 3, n - 1, n - 2]
    sums = identity.astype(np.int64) + rep_b
    np.testing.assert_array_equal(np.argsort(sums, kind="stable")[-4:], want_tail)
    include = jnp.array([True, True])
    np.testing.assert_array_equal(np.asarray(sm.vote(rankings, include=include))[-4:], want_tail)
    np.testing.assert_array_equal(np.asarray(sm.vote_sparse(rankings, n, include=include))[-4:], want_tail)


# ---------------------------------------------------------------- float order keys
def test_argsort_keeps_differences_below_float32_spacing_at_one():
    # 1e-8 apart: indistinguishable after adding 1.0, distinct as they are
    x = jnp.array([2e-8, 0.0, 1e-8, -1e-8], jnp.float32)
    np.testing.assert_array_equal(sm.argsort(x), [3, 1, 2, 0])
    np.testing.assert_array_equal(sm.ranking(x), np.argsort(np.asarray(x), kind="stable"))


def test_argsort_separates_positive_floats_one_ulp_apart():
    # 1.0 and the next float32 differ only in the last mantissa bit
    up = np.nextafter(np.float32(1.0), np.float32(2.0))
    x = jnp.array([up, 1.0, -up, -1.0], jnp.float32)
    np.testing.assert_array_equal(sm.argsort(x), [2, 3, 1, 0])


def test_numpy_argsort_refuses_other_dtypes():
    with pytest.raises(TypeError, match="float32 and int32, got int64"):
        sm_impl._numpy_argsort(np.array([3, 1, 2], np.int64))


def test_argsort_off_the_cpu_is_the_same_stable_int32_argsort(monkeypatch):
    """Off the CPU ``argsort`` is ``jnp.argsort``: run that branch here by reporting another backend."""
    x = jnp.array([[[3, 1, 3, 0], [2, 2, -2, 2]], [[0, 0, 5, 1], [7, 6, 6, 7]]], jnp.int32)   # [2, 2, 4], ties
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    many_ties = jax.random.randint(jax.random.PRNGKey(0), (2000,), 0, 3, jnp.int32)   # an unstable sort reorders ties
    for a in (x, x[0], x[0, 1], many_ties):                          # 3-D, 2-D, 1-D
        got = sm.argsort(a)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, np.argsort(np.asarray(a), axis=-1, kind="stable"))


# ---------------------------------------------------------------- frozen weights and initial scores
@pytest.mark.parametrize("shape", [(3, 3, 16, 32), (256, 64)])
def test_frozen_weight_inits_have_their_documented_scale(shape):
    """signed_constant: exactly +-sqrt(2 / fan_in); kaiming_normal: N(0, 2 / fan_in); glorot_normal:
    N(0, 2 / (fan_in + fan_out)) with fan_out = out x kh x kw. ~16k draws: std within 3 %."""
    fan_in = int(np.prod(shape[:-1]))
    fan_out = shape[-1] * int(np.prod(shape[:-2])) if len(shape) > 2 else shape[-1]
    key = jax.random.PRNGKey(3)
    signed = np.asarray(sm_impl.frozen_weights(key, shape))
    assert signed.shape == shape and signed.dtype == np.float32
    np.testing.assert_allclose(np.abs(signed), np.sqrt(2.0 / fan_in), rtol=1e-6)
    assert 0.45 < (signed > 0).mean() < 0.55
    for init, var in (("kaiming_normal", 2.0 / fan_in), ("glorot_normal", 2.0 / (fan_in + fan_out))):
        w = np.asarray(sm_impl.frozen_weights(key, shape, init))
        assert w.shape == shape and w.dtype == np.float32
        assert abs(w.std() / np.sqrt(var) - 1) < 0.03, init
        assert abs(w.mean()) < 0.05 * np.sqrt(var), init


def test_unknown_frozen_weight_init_names_the_choices():
    with pytest.raises(ValueError, match="unknown weight init 'xavier'; valid: .*glorot_normal"):
        sm_impl.frozen_weights(jax.random.PRNGKey(0), (4, 4), "xavier")


def test_initial_scores_are_uniform_over_plus_minus_one_over_sqrt_fan_in():
    shape = (3, 3, 16, 32)
    bound = 1.0 / np.sqrt(3 * 3 * 16)
    s = np.asarray(sm_impl.initial_scores(jax.random.PRNGKey(1), shape))
    assert s.shape == shape and s.dtype == np.float32
    assert s.min() >= -bound and s.max() <= bound
    assert s.min() < -0.99 * bound and s.max() > 0.99 * bound
    assert abs(s.std() / (bound / np.sqrt(3)) - 1) < 0.03             # U(-b, b) has std b / sqrt(3)


# ---------------------------------------------------------------- radix selection
def test_order_keys_keep_the_order_of_tiny_and_one_ulp_apart_floats():
    """Keys must order exactly as the floats do, however close: values far below float32's
    spacing at 1 (no offset may be added before the bitcast), and positive floats one ulp
    apart (the sign-bit flip may not touch the low bit)."""
    one = np.float32(1.0)
    x = np.array([-2.0, -1e-9, 0.0, 1e-9, 2e-9, one, np.nextafter(one, np.float32(2)), 3.0], np.float32)
    keys = np.asarray(sm_impl.order_keys(jnp.asarray(x)))
    assert (np.diff(keys.astype(np.int64)) > 0).all()
    assert sm_impl.order_keys(jnp.float32(-0.0)) == sm_impl.order_keys(jnp.float32(0.0))


@pytest.mark.parametrize("method", ["radix", "bisect", "sort"])
def test_kth_largest_key_is_the_kth_largest_at_a_bin_boundary(method):
    """Keys 0x10000 (high bin 1, alone) and 5 (bin 0): the largest key is 0x10000 itself. A
    select that needs the suffix count to exceed ``kept`` would settle in bin 0 and return
    0xFFFF, a value no key has."""
    keys = jnp.array([0x10000, 5], jnp.uint32)
    assert int(sm_impl.kth_largest_key(keys, 1, method)) == 0x10000
    assert int(sm_impl.kth_largest_key(keys, 2, method)) == 5
    keys = jnp.array([0x30002, 0x30002, 0x20007, 0x20001, 9], jnp.uint32)
    assert [int(sm_impl.kth_largest_key(keys, k, method)) for k in range(1, 6)] == [
        0x30002, 0x30002, 0x20007, 0x20001, 9]
    extremes = jnp.array([0xFFFFFFFF, 0, 0x80000000, 0xFFFFFFFF], jnp.uint32)
    assert [int(sm_impl.kth_largest_key(extremes, k, method)) for k in range(1, 5)] == [
        0xFFFFFFFF, 0xFFFFFFFF, 0x80000000, 0]


def test_kth_largest_key_methods_agree_with_a_sort_on_both_sides_of_the_switch():
    """``auto`` bisects up to BISECT_MAX_KEYS keys and radix-selects above; every method returns
    the key a descending sort puts at position kept - 1, with ties (keys from rounded normals)."""
    for n in (7, sm_impl.BISECT_MAX_KEYS, sm_impl.BISECT_MAX_KEYS + 1):
        values = jax.random.normal(jax.random.PRNGKey(n), (n,)).round(2)
        keys = sm_impl.order_keys(values)
        descending = np.sort(np.asarray(keys))[::-1]
        for kept in (1, n // 3 + 1, n):
            got = {m: int(sm_impl.kth_largest_key(keys, kept, m)) for m in ("auto", "radix", "bisect", "sort")}
            assert set(got.values()) == {int(descending[kept - 1])}, (n, kept, got)
    with pytest.raises(ValueError, match="valid: auto, radix, bisect, sort"):
        sm_impl.kth_largest_key(keys, 1, "heap")


def test_small_layers_select_by_sort_off_the_cpu():
    """``auto`` on a small layer: the program lowered for CUDA sorts once (no 32-iteration bisection loop
    a GPU would launch step after step); the CPU's program bisects."""
    from fedjax_sparse.tools import programs
    keys = jnp.arange(5000, dtype=jnp.uint32)
    select = jax.jit(lambda k: sm_impl.kth_largest_key(k, 100))
    cuda = programs.stablehlo_op_counts(programs.lowered_text(select, keys, platform="cuda"))
    cpu = programs.stablehlo_op_counts(programs.lowered_text(select, keys, platform="cpu"))
    assert cuda["sort"] == 1 and cuda["while"] == 0
    assert cpu["sort"] == 0 and cpu["while"] == 1
    assert int(select(keys)) == 4900


def test_large_layers_bisect_off_the_cpu_and_radix_select_on_it():
    """A layer over BISECT_MAX_KEYS: the program lowered for CUDA bisects (a loop, no scatter: a GPU's
    scatter-add serialises the radix histograms' atomics, perf/fsl_topk_gpu.json), the CPU's builds the
    two histograms (scatters, no loop); both selections give the same threshold and count above it,
    ties included."""
    from fedjax_sparse.tools import programs
    n = sm_impl.BISECT_MAX_KEYS + 5000
    mask = jax.jit(lambda v: sm_impl.topk_mask(v, 0.5, nonnegative=True))
    values = jnp.abs(jax.random.normal(jax.random.PRNGKey(0), (n,))).round(2)   # many ties
    cuda = programs.stablehlo_op_counts(programs.lowered_text(mask, values, platform="cuda"))
    cpu = programs.stablehlo_op_counts(programs.lowered_text(mask, values, platform="cpu"))
    assert cuda["while"] == 1 and cuda["scatter"] == 0
    assert cpu["while"] == 0 and cpu["scatter"] == 2
    keys = jax.lax.bitcast_convert_type(values, jnp.uint32)
    for kept in (1, n // 2, n):
        radix = [int(x) for x in sm_impl._radix_select(keys, kept)]
        assert [int(x) for x in sm_impl._bisect_select(keys, kept)] == radix
        assert radix[1] < kept <= radix[1] + int((keys == radix[0]).sum())
    assert int(mask(values).sum()) == sm_impl.kept_count(n, 0.5)


@pytest.mark.parametrize("byteorder", ["little", "big"])
def test_numpy_argsort_packs_key_and_index_into_a_stable_order(monkeypatch, byteorder):
    """The packing (uint32 halves of an explicitly little-endian uint64, whatever the host's byte order)
    gives numpy's stable argsort, ties by index, over the int32 and float32 extremes and rows of a 2-D input."""
    monkeypatch.setattr(sys, "byteorder", byteorder)
    rng = np.random.default_rng(0)
    ints = np.concatenate([rng.integers(-3, 3, 500), [np.iinfo(np.int32).min, np.iinfo(np.int32).max, -1, 0]])
    floats = np.concatenate([rng.standard_normal(500).round(1), [-np.inf, np.inf, -0.0, 0.0, 1e-40, -1e-40]])
    for x in (ints.astype(np.int32), floats.astype(np.float32)):
        want = np.argsort(np.where(x == 0, 0, x), kind="stable")   # -0.0 and 0.0 tie
        np.testing.assert_array_equal(sm_impl._numpy_argsort(x), want)
        np.testing.assert_array_equal(sm_impl._numpy_argsort(np.stack([x, x[::-1]]))[1],
                                      np.argsort(np.where(x[::-1] == 0, 0, x[::-1]), kind="stable"))

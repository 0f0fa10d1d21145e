"""Tests written for the mutmut survivors of ``accounting.py`` (docs/testing.md)."""
import jax
import jax.numpy as jnp
import pytest

from fedjax_sparse.core.accounting import Cost, as_cost, cost_per_round, row_training_flops, weight_training_flops
from fedjax_sparse.models.base import LayerInfo, Model


@pytest.mark.fast
def test_terms_count_per_unit_factors_exactly():
    # 6 FLOPs x 2 + 10 FLOPs x 3, an exact Python int
    total = Cost.terms([6, 10], jnp.array([2, 3])).total()
    assert total == 42 and type(total) is int
    assert Cost.terms([6, 10], jnp.array([2, 3]), jnp.array([4, 5])).total() == 6 * 2 * 4 + 10 * 3 * 5
    assert Cost.terms([6, 10], jnp.array([2, 3]), 2).total() == 2 * 42          # a scalar b is broadcast
    # any float factor makes the term an expectation (float): 2 x 3 x 0.25 = 1.5
    assert Cost.terms([2], jnp.array([3]), jnp.array([0.25])).total() == 1.5
    assert Cost.terms([2], jnp.array([0.25]), jnp.array([3])).total() == 1.5
    assert Cost.terms([1.5, 2], jnp.array([0.5, 1.0])).total() == 0.75 + 2.0
    assert Cost.terms([6, 10], jnp.array([2, 3])).units == (6, 10)


def test_adding_an_exact_and_an_expected_cost_keeps_both():
    exact = Cost.term(2, jnp.int32(3))            # 6
    expected = Cost.term(1, jnp.float32(0.5))     # 0.5
    assert (exact + expected).total() == 6.5
    assert (expected + exact).total() == 6.5
    both_exact = exact + Cost.constant(7)
    assert both_exact.factors.dtype == jnp.int32
    assert both_exact.total() == 13 and type(both_exact.total()) is int
    assert (Cost.constant(7) + exact).total() == 13            # a constant is one term


def test_int_and_float_of_a_cost_are_its_total():
    cost = Cost.term(6, jnp.int32(400_000), jnp.int32(30_000))
    assert int(cost) == 6 * 400_000 * 30_000
    assert float(Cost.term(1.5, jnp.int32(3))) == 4.5


def test_costs_stacked_over_clients_add_term_by_term():
    """Costs gain leading client axes (vmap); adding two stacked costs adds each client's terms:
    client 0 pays 10 x 1 + 3 x 1, client 1 pays 10 x 2 + 3 x 1."""
    a = Cost(jnp.array([[[1, 1]], [[2, 1]]], jnp.int32), (10,))     # [K=2, T=1, 2]
    b = Cost(jnp.array([[[1, 1]], [[1, 1]]], jnp.int32), (3,))
    s = a + b
    assert s.factors.shape == (2, 2, 2) and s.units == (10, 3)
    assert s.total() == (10 + 3) + (20 + 3)


def test_as_cost_keeps_static_numbers_exact_and_traced_counts_traced():
    cost = Cost.term(3, jnp.int32(2))
    assert as_cost(cost) is cost
    assert as_cost(2 ** 31 + 5).total() == 2 ** 31 + 5          # beyond int32: a static Python int
    assert as_cost(0.1).total() == 0.1                          # not float32(0.1)
    assert as_cost(jnp.int32(5)).total() == 5
    assert as_cost(True).total() == 1                           # a bool is a count, not a unit
    # inside jit a count is a tracer: it must become a traced factor, not a static unit
    factors = jax.jit(lambda n: as_cost(n).factors)(jnp.int32(5))
    assert factors.tolist() == [[5, 1]]


@pytest.mark.fast
def test_per_round_products_are_exact_beyond_float64():
    """(2^31 - 1)^2 needs 62 bits: a float64 product (53-bit mantissa) would round it."""
    big = 2 ** 31 - 1
    cost = Cost(jnp.array([[[[big, big]], [[big, 3]]]], jnp.int32), (5,))    # [R=1, K=2, T=1, 2]
    assert cost_per_round(cost) == [5 * (big * big + big * 3)]
    assert float(big * big) != big * big                                     # float64 cannot hold it


def test_per_round_without_a_round_axis():
    """``leading_axes=0``: factors [K, T, 2] are one round."""
    factors = jnp.array([[[2, 3]], [[4, 5]]], jnp.int32)                     # [K=2, T=1, 2]
    assert cost_per_round(Cost(factors, (7,)), leading_axes=0) == [7 * (6 + 20)]


def test_integral_float_units_count_exactly():
    """A unit given as 6.0 is the integer 6: the total stays a Python int, exact beyond 2^53."""
    big = 2 ** 31 - 1
    total = Cost.terms([6.0], jnp.array([big]), jnp.array([big])).total()
    assert type(total) is int and total == 6 * big * big


def test_a_bool_unit_is_refused_by_name():
    with pytest.raises(TypeError, match=r"^a cost unit must be a number, not a bool$"):
        Cost.terms([True], jnp.array([1]))


def _model(*layers):
    return Model("toy", (1,), 2, tuple(layers), init_fn=lambda key: {}, apply_fn=lambda *a, **k: None)


def test_per_row_and_per_weight_training_flops_are_ints():
    # conv 3x3, 2 -> 4 channels on a 5x5 output: 25 positions x 18 fan-in x 4 rows MACs
    conv = LayerInfo("c", "conv", (3, 3, 2, 4), 2, 4, 25 * 18 * 4)
    rows, weights = row_training_flops(_model(conv)), weight_training_flops(_model(conv))
    assert rows == (6 * 25 * 18,) and weights == (6 * 25,)
    assert all(type(v) is int for v in rows + weights)


def test_training_flops_refuse_macs_that_do_not_split_by_name():
    odd = LayerInfo("odd", "dense", (3, 4), 3, 4, 13)
    with pytest.raises(ValueError, match="odd: 13 MACs do not split into 4 rows"):
        row_training_flops(_model(odd))
    with pytest.raises(ValueError, match="odd: 13 MACs are not a multiple of its 12 weights"):
        weight_training_flops(_model(odd))

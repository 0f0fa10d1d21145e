"""Tests written for the mutmut survivors of ``mechanisms/robust_aggregation.py`` (docs/testing.md)."""
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.mechanisms import robust_aggregation as ra


def test_multi_krum_scores_at_least_one_neighbour():
    """K = 3, f = 1: Krum's r - f - 2 = 0 neighbours, raised to 1 (Multi-Krum needs a
    neighbour to score). Squared distances to the nearest other update: 0 -> 100,
    10 -> 1, 11 -> 1, so update 1 is picked (the first of the tie), not update 0."""
    x = jnp.array([[0.0], [10.0], [11.0]])
    agg, selected = ra.multi_krum(x, 1, 1)
    np.testing.assert_array_equal(selected, [False, True, False])
    np.testing.assert_allclose(agg, [10.0])


def test_multi_krum_choice_does_not_depend_on_the_updates_scale():
    """Krum compares sums of squared distances, so scaling every update by 1e-4
    (squared distances ~1e-8) must pick the same updates as the hand case of
    test_robust.py::test_multi_krum_by_hand."""
    x = jnp.array([[0.], [1.], [2.], [10.], [11.]])
    for scale in (1.0, 1e-4):
        _, selected = ra.multi_krum(x * scale, 1)
        np.testing.assert_array_equal(selected, [False, True, False, False, False])
        _, selected = ra.multi_krum(x * scale, 1, 3)
        np.testing.assert_array_equal(selected, [True, True, False, True, False])


def test_krum_count_default_and_override():
    # Blanchard et al.'s m = K - 2f - 2 picks, at least one
    assert int(ra.krum_count(10, 2)) == 4
    assert int(ra.krum_count(10, 5)) == 1
    # ``krum_select`` > 0 overrides (capped at K); 0 or the default -1 do not
    assert int(ra.krum_count(10, 2, 3)) == 3
    assert int(ra.krum_count(10, 2, 1)) == 1
    assert int(ra.krum_count(10, 2, 20)) == 10
    assert int(ra.krum_count(10, 2, 0)) == 4
    assert int(ra.krum_count(10, 2, -1)) == 4


def test_trimmed_mean_clips_the_trim_to_what_the_clients_allow():
    """K = 4 values of one coordinate, 1 < 2 < 4 < 8: trim 1 keeps the middle two (mean 3); a trim
    above (K - 1) // 2 = 1 is that trim, not an empty selection; a negative trim is no trim."""
    x = jnp.array([[8.0], [1.0], [4.0], [2.0]])
    assert float(ra.trimmed_mean(x, 1)[0]) == 3.0
    assert float(ra.trimmed_mean(x, 2)[0]) == 3.0
    assert float(ra.trimmed_mean(x, jnp.int32(7))[0]) == 3.0
    assert float(ra.trimmed_mean(x, -1)[0]) == 15.0 / 4
    assert float(ra.trimmed_mean(x, 0)[0]) == 15.0 / 4

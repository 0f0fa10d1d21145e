"""Tests written for the mutmut survivors of ``mechanisms/attacks.py`` (docs/testing.md)."""
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import robust as R


def test_malicious_fraction_is_in_zero_to_one_half_open():
    none = R.malicious_clients(10, 0.0, 0)            # no attacker is a valid setting
    assert none.dtype == bool and not none.any()
    some = R.malicious_clients(10, 0.3, 0)
    assert some.dtype == bool and some.sum() == 3
    for bad in (1.0, 1.5, -0.1):                      # every client malicious is not
        with pytest.raises(ValueError, match=r"malicious_fraction must be in \[0, 1\)"):
            R.malicious_clients(10, bad, 0)


def test_sign_reverse_attack_uses_only_known_votes_and_keeps_int8():
    """Four clients, two coordinates; the attacker (row 3) knows rows 0 and 3 only.
    Known votes: [1 + 1, -1 + 1] = [2, 0] -> it sends [-1, -1] (a tie reverses to -1);
    with row 1 (unknown) counted the second coordinate would be -1 -> +1."""
    signs = jnp.array([[1, -1], [-1, -1], [1, 1], [1, 1]], jnp.int8)
    is_mal = jnp.array([False, False, False, True])
    known = jnp.array([True, False, False, True])
    out = R.sign_reverse_attack(signs, is_mal, known)
    assert out.dtype == jnp.int8
    np.testing.assert_array_equal(out, [[1, -1], [-1, -1], [1, 1], [-1, -1]])


def test_min_max_attack_defaults_std_direction_and_gamma_search():
    """Defaults: dev = the coordinate-wise std (ddof 1) and Shejwalkar & Houmansadr's
    gamma_init = 10 with 20 halvings. When every gamma is admissible (identical benign
    updates: std 0) each test accepts and gamma climbs 10 + 5 + ... + 10 / 2^19 = 20 - 10 / 2^19."""
    same = jnp.ones((4, 3), jnp.float32)
    is_mal = jnp.array([False, False, False, True])
    _, gamma = R.min_max_attack(same, is_mal, jnp.ones(4, bool))
    np.testing.assert_allclose(float(gamma), 20.0 - 10.0 / 2 ** 19, rtol=0, atol=1e-6)
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (5, 6)).astype(np.float32)
    is_mal = jnp.array([False, False, False, False, True])
    out, gamma = R.min_max_attack(jnp.asarray(x), is_mal, jnp.ones(5, bool))
    np.testing.assert_allclose(out[4], x.mean(0) - float(gamma) * x.std(0, ddof=1), rtol=1e-4, atol=1e-5)


def test_min_max_bound_is_the_largest_distance_between_known_updates():
    """1-D: the attacker knows 0 and 0.5 (not its own update 100). Known mean 0.25, std
    (ddof 1) s = 0.5 / sqrt(2); the bound is 0.5^2 and the farthest known update from
    0.25 - gamma s is 0.5 away at gamma s = 0.25: gamma = 1 / sqrt(2)."""
    x = jnp.array([[0.0], [0.5], [100.0]])
    is_mal = jnp.array([False, False, True])
    known = jnp.array([True, True, False])
    out, gamma = R.min_max_attack(x, is_mal, known, kind="std", steps=40)
    np.testing.assert_allclose(float(gamma), 1 / np.sqrt(2), rtol=1e-4)
    np.testing.assert_allclose(out[2], [0.25 - 0.25], atol=1e-4)

"""Tests written for the mutmut survivors of ``mechanisms/attacks.py`` (docs/testing.md)."""
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.mechanisms import attacks
from fedjax_sparse.mechanisms import robust_aggregation as ra
from fedjax_sparse.mechanisms import supermask as sm


def test_malicious_fraction_is_in_zero_to_one_half_open():
    none = attacks.malicious_clients(10, 0.0, 0)            # no attacker is a valid setting
    assert none.dtype == bool and not none.any()
    some = attacks.malicious_clients(10, 0.3, 0)
    assert some.dtype == bool and some.sum() == 3
    for bad in (1.0, 1.5, -0.1):                      # every client malicious is not
        with pytest.raises(ValueError, match=r"malicious_fraction must be in \[0, 1\)"):
            attacks.malicious_clients(10, bad, 0)


def test_sign_reverse_attack_uses_only_known_votes_and_keeps_int8():
    """Four clients, two coordinates; the attacker (row 3) knows rows 0 and 3 only.
    Known votes: [1 + 1, -1 + 1] = [2, 0] -> it sends [-1, -1] (a tie reverses to -1);
    with row 1 (unknown) counted the second coordinate would be -1 -> +1."""
    signs = jnp.array([[1, -1], [-1, -1], [1, 1], [1, 1]], jnp.int8)
    is_mal = jnp.array([False, False, False, True])
    known = jnp.array([True, False, False, True])
    out = attacks.sign_reverse_attack(signs, is_mal, known)
    assert out.dtype == jnp.int8
    np.testing.assert_array_equal(out, [[1, -1], [-1, -1], [1, 1], [-1, -1]])


def test_min_max_attack_defaults_std_direction_and_gamma_search():
    """Defaults: dev = the coordinate-wise std (ddof 1) and Shejwalkar & Houmansadr's
    gamma_init = 10 with 20 halvings. When every gamma is admissible (identical benign
    updates: std 0) each test accepts and gamma climbs 10 + 5 + ... + 10 / 2^19 = 20 - 10 / 2^19."""
    same = jnp.ones((4, 3), jnp.float32)
    is_mal = jnp.array([False, False, False, True])
    _, gamma = attacks.min_max_attack(same, is_mal, jnp.ones(4, bool))
    np.testing.assert_allclose(float(gamma), 20.0 - 10.0 / 2 ** 19, rtol=0, atol=1e-6)
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (5, 6)).astype(np.float32)
    is_mal = jnp.array([False, False, False, False, True])
    out, gamma = attacks.min_max_attack(jnp.asarray(x), is_mal, jnp.ones(5, bool))
    np.testing.assert_allclose(out[4], x.mean(0) - float(gamma) * x.std(0, ddof=1), rtol=1e-4, atol=1e-5)


def test_min_max_bound_is_the_largest_distance_between_known_updates():
    """1-D: the attacker knows 0 and 0.5 (not its own update 100). Known mean 0.25, std
    (ddof 1) s = 0.5 / sqrt(2); the bound is 0.5^2 and the farthest known update from
    0.25 - gamma s is 0.5 away at gamma s = 0.25: gamma = 1 / sqrt(2)."""
    x = jnp.array([[0.0], [0.5], [100.0]])
    is_mal = jnp.array([False, False, True])
    known = jnp.array([True, True, False])
    out, gamma = attacks.min_max_attack(x, is_mal, known, kind="std", steps=40)
    np.testing.assert_allclose(float(gamma), 1 / np.sqrt(2), rtol=1e-4)
    np.testing.assert_allclose(out[2], [0.25 - 0.25], atol=1e-4)


def _tailored_trimmed_mean_reference(updates, is_mal, known, trim, gamma_init=10.0, steps=20):
    """The DYN-OPT search written out: the benign rows plus ``copies`` copies of mean - gamma dev,
    trimmed-mean by sorting; gamma moves up while |TrMean - mean| grows over the previous test
    (strictly), by a step halving every time."""
    mean = ra.masked_mean(updates, known)
    dev = attacks.deviation(updates, known, "std")
    benign, copies = updates[~is_mal], int(is_mal.sum())
    gamma, step, best, previous = gamma_init, gamma_init / 2, 0.0, -1.0
    for _ in range(steps):
        messages = jnp.concatenate([benign, jnp.repeat((mean - gamma * dev)[None], copies, 0)])
        loss = float(jnp.linalg.norm(ra.trimmed_mean(messages, trim) - mean))
        accepted = loss > previous
        best = gamma if accepted else best
        gamma, step, previous = (gamma + step if accepted else gamma - step), step / 2, loss
    return best


@pytest.mark.parametrize("trim, gamma_init, offset",
                         [(1, 10.0, 0.0), (2, 10.0, 0.0), (3, 10.0, 0.0), (2, 1.0, 0.0), (3, 0.8, 0.0), (2, 1.0, 5.0)])
def test_tailored_trimmed_mean_attack_is_the_dyn_opt_search(trim, gamma_init, offset):
    """gamma equal to the written-out search: with 2 malicious clients among 10, trims of 1
    (copies outnumber the trim: the loss grows without end), 2 and 3 (the copies are trimmed away
    once extreme: ties of the loss stop the search) from gamma 10, and from small gammas, where the
    loss first grows and the search has to find where the copies leave the kept window; the
    malicious rows are mean - gamma dev, the benign ones untouched. The offset moves the mean far
    from 0 (the loss is the distance to the mean, not the norm of anything else)."""
    rng = np.random.default_rng(7)
    updates = jnp.asarray(rng.normal(0, 1, (10, 6)) + offset, jnp.float32)
    is_mal = jnp.asarray(np.isin(np.arange(10), [2, 7]))
    known = jnp.ones(10, bool)
    out, gamma = attacks.tailored_trimmed_mean_attack(updates, is_mal, known, trim, gamma_init=gamma_init)
    expected = _tailored_trimmed_mean_reference(updates, np.asarray(is_mal), known, trim, gamma_init)
    assert float(gamma) == pytest.approx(expected, rel=0, abs=1e-6)   # one more halving moves it 1e-5
    mean, dev = ra.masked_mean(updates, known), attacks.deviation(updates, known, "std")
    np.testing.assert_allclose(out[2], mean - gamma * dev, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[~np.asarray(is_mal)], updates[~np.asarray(is_mal)])


def test_reverse_attack_votes_only_over_what_the_attacker_knows():
    """Client 0 is malicious and knows rankings 0 and 1 only (full and Sparse-FSL uploads); client 2's
    ranking, the opposite of theirs, must not enter its vote. Given ``knowledge``, the vote is over
    those rankings instead of the round's messages."""
    a, b, c = [0, 1, 2, 3, 4, 5], [1, 0, 2, 3, 5, 4], [5, 4, 3, 2, 1, 0]
    messages = {"layer": jnp.array([a, b, c], jnp.int32)}
    is_mal = jnp.array([True, False, False])
    known = jnp.array([True, True, False])
    full = attacks.reverse_attack(messages, {"layer": 6}, is_mal, known, 1.0)["layer"]
    np.testing.assert_array_equal(full[0], sm.reverse_ranking(sm.vote(jnp.array([a, b], jnp.int32))))
    tops = {"layer": messages["layer"][:, 3:]}
    sparse = attacks.reverse_attack(tops, {"layer": 6}, is_mal, known, 0.5)["layer"]
    expected = sm.top_of_ranking(sm.reverse_ranking(sm.vote_sparse(tops["layer"][:2], 6)), 0.5)
    np.testing.assert_array_equal(sparse[0], expected)
    assert not np.array_equal(sparse[0], sm.top_of_ranking(sm.reverse_ranking(sm.vote_sparse(tops["layer"], 6)), 0.5))
    knowledge = {"layer": jnp.array([c, c], jnp.int32)}
    told = attacks.reverse_attack(messages, {"layer": 6}, is_mal, known, 1.0, knowledge)["layer"]
    np.testing.assert_array_equal(told[0], c[::-1])
    np.testing.assert_array_equal(told[1:], messages["layer"][1:])


def _tailored_multi_krum_reference(updates, is_mal, known, f, num_select, gamma_init=10.0, steps=20):
    """DYN-OPT against Multi-Krum written out: gamma moves up while Multi-Krum, run on the full
    message matrix, selects every malicious row."""
    mean = ra.masked_mean(updates, known)
    dev = attacks.deviation(updates, known, "std")
    gamma, step, best = gamma_init, gamma_init / 2, 0.0
    for _ in range(steps):
        messages = jnp.where(is_mal[:, None], (mean - gamma * dev)[None], updates)
        selected = ra.multi_krum_select(ra.pairwise_sq_distances(messages), f, num_select)
        accepted = bool((selected & is_mal).sum() == is_mal.sum())
        best = gamma if accepted else best
        gamma, step = (gamma + step if accepted else gamma - step), step / 2
    return best


@pytest.mark.parametrize("seed, scale", [(0, 1.0), (1, 1.0), (2, 1.0), (0, 0.1)])
def test_tailored_multi_krum_attack_is_the_dyn_opt_search(seed, scale):
    """gamma equal to the written-out search (distances to the malicious rows from a, b, c, not
    recomputed), 3 malicious of 12, f = 3, and updates scaled down so that squared distances are
    well below 1; the malicious rows are mean - gamma dev."""
    rng = np.random.default_rng(seed)
    updates = jnp.asarray(scale * (rng.normal(0, 1, (12, 5)) + rng.normal(0, 0.3, (1, 5))), jnp.float32)
    is_mal = jnp.asarray(np.isin(np.arange(12), [0, 5, 9]))
    known = jnp.ones(12, bool)
    num_select = ra.krum_count(12, 3)
    out, gamma = attacks.tailored_multi_krum_attack(updates, is_mal, known, 3, num_select)
    expected = _tailored_multi_krum_reference(updates, is_mal, known, 3, num_select)
    assert float(gamma) == pytest.approx(expected, rel=0, abs=1e-6) and expected > 0
    np.testing.assert_allclose(out[5], ra.masked_mean(updates, known) - gamma * attacks.deviation(updates, known, "std"),
                               rtol=1e-5, atol=1e-6)


def test_deviation_kinds_by_hand_over_the_known_rows_only():
    """Three clients, two coordinates; the attacker knows rows 0 and 2 (row 1, far away, is
    not known). Known mean [2, -1]; std (ddof 1) of {1, 3} and {-2, 0} = sqrt 2 each; unit
    vector [2, -1] / sqrt 5; sign [1, -1]. An unknown kind is refused by name."""
    updates = jnp.array([[1.0, -2.0], [100.0, 100.0], [3.0, 0.0]])
    known = jnp.array([True, False, True])
    np.testing.assert_allclose(attacks.deviation(updates, known, "std"), [np.sqrt(2), np.sqrt(2)], rtol=1e-6)
    np.testing.assert_allclose(attacks.deviation(updates, known, "unit_vec"), np.array([2.0, -1.0]) / np.sqrt(5),
                               rtol=1e-6)
    np.testing.assert_array_equal(attacks.deviation(updates, known, "sign"), [1.0, -1.0])
    # a mean shorter than 1 still becomes a unit vector (the floor only guards a zero mean)
    np.testing.assert_allclose(attacks.deviation(updates / 100, known, "unit_vec"),
                               np.array([2.0, -1.0]) / np.sqrt(5), rtol=1e-6)
    # one known row: its std is 0 (the divisor is floored at 1, not 0); a zero mean has no direction
    one = jnp.array([True, False, False])
    np.testing.assert_array_equal(attacks.deviation(updates, one, "std"), [0.0, 0.0])
    np.testing.assert_array_equal(attacks.deviation(jnp.zeros((2, 3)), jnp.ones(2, bool), "unit_vec"), [0, 0, 0])
    with pytest.raises(ValueError, match="unknown deviation 'l2'"):
        attacks.deviation(updates, known, "l2")


def test_halving_search_by_hand():
    """accept(g) = g <= 7 from gamma_init 10: tests 10 (no), 5 (yes), 7.5 (no), 6.25 (yes),
    6.875 (yes), 7.1875 (no): the last accepted gamma after k tests is 0, 5, 5, 6.25, 6.875,
    6.875. A carry goes through the tests; never accepted -> 0."""
    def upto7(gamma, calls):
        return gamma <= 7.0, calls + 1

    for steps, best in [(1, 0.0), (2, 5.0), (3, 5.0), (4, 6.25), (5, 6.875), (6, 6.875)]:
        assert float(attacks.halving_search(upto7, 10.0, steps, carry_init=jnp.int32(0))) == best, steps
    assert float(attacks.halving_search(lambda g, c: (g < 0.0, c), 10.0, 8)) == 0.0


def test_trimmed_mean_with_copies_ignores_rows_past_the_benign_count():
    """Rows >= benign_count are unused whatever they hold: 3 benign values 1, 2, 3 then two
    rows of -100 (not NaN, as the attack's own sort leaves them); with 2 copies of 2.5 and
    trim 1 the merged list 1, 2, 2.5, 2.5, 3 keeps 2, 2.5, 2.5 -> 7 / 3."""
    sorted_benign = jnp.array([[1.0], [2.0], [3.0], [-100.0], [-100.0]])
    prefix = jnp.concatenate([jnp.zeros((1, 1)), jnp.cumsum(sorted_benign, 0)])
    got = ra.trimmed_mean_with_copies(sorted_benign, prefix, 3, jnp.array([2.5]), 2, 1)
    np.testing.assert_allclose(got, [7.0 / 3.0], rtol=1e-6)

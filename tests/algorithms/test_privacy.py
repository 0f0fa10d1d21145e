"""Client-level differential privacy: DP-FedAvg's mechanism and wrapper (algorithms/private.py) and
its accounting with dp_accounting (privacy.py), against published values and hand computations."""
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import optimize, stats

from fedjax_sparse.driver import privacy
from fedjax_sparse.algorithms import Algorithm, ServerContext, make_algorithm
from fedjax_sparse.algorithms.compose import UpdateServer
from fedjax_sparse.algorithms.baselines import CaldasServerState, ScaffoldServerState
from fedjax_sparse.algorithms.feddrop_family import FedDropServerState
from fedjax_sparse.algorithms.private import (DP_NOISE_STREAM, DpMechanism, accounting_keys, clip_rows, dp_refusal,
                                              noisy_sum, update_reference, with_dp)
from fedjax_sparse.algorithms.spafl_family import SpaflServerState
from fedjax_sparse.core.engine import Engine
from helpers import make_task, tiny_federated

INF = float("inf")


# ---------------------------------------------------------------- accounting: published values
# TF Privacy's moments accountant (compute_dp_sgd_privacy): RDP at these orders, steps = ceil(epochs * n / batch),
# and the classic conversion eps = min_a rdp(a) + log(1/delta) / (a - 1) (Mironov 2017, Prop. 3).
TF_PRIVACY_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def classic_epsilon(orders, rdp, delta):
    orders = np.asarray(orders)
    return float(np.min(np.asarray(rdp) - math.log(delta) / (orders - 1)))


# (noise multiplier, epochs, published epsilon): MNIST, 60000 examples, batch 256, delta 1e-5, Poisson sampling.
PUBLISHED = [
    (1.3, 20, 1.34),   # Bu, Dong, Long, Su, HDSR 2020, Fig. 4 (top): moments accountant, 20th epoch
    (0.7, 70, 8.68),   # same figure (bottom), epoch 70
    (1.3, 15, 1.19),   # TF Privacy tutorials/README.md (2019), sample parameters
    (0.7, 45, 7.10),   # idem
    (1.1, 60, 3.01),   # idem, default run after 60 epochs
]


@pytest.mark.fast
@pytest.mark.parametrize("z, epochs, published", PUBLISHED)
def test_published_moments_accountant_values(z, epochs, published):
    """Our one-round RDP (dp_accounting's Poisson subsampled Gaussian) times the steps, converted as
    TF Privacy did, gives the published epsilons to their two decimals (Bu et al.'s 1.34 is 1.3498:
    truncated, hence the 0.01 tolerance). dp_accounting's own conversion (Canonne et al.'s Prop. 12)
    is tighter than the classic one, and its PLD accountant tighter still."""
    steps = math.ceil(epochs * 60000 / 256)
    one = privacy.round_rdp(z, num_clients=60000, clients_per_round=256, sampling="poisson",
                            orders=TF_PRIVACY_ORDERS)
    eps = classic_epsilon(TF_PRIVACY_ORDERS, steps * one, 1e-5)
    assert abs(eps - published) <= 0.01, eps
    modern = privacy.epsilon(z, steps, 1e-5, num_clients=60000, clients_per_round=256, sampling="poisson")
    assert 0.75 * eps < modern < eps
    if epochs in (20, 70):   # (PLD: 0.3 to 0.8 s a call)
        pld = privacy.epsilon(z, steps, 1e-5, num_clients=60000, clients_per_round=256, sampling="poisson",
                              accountant="pld")
        assert 0.8 * modern < pld < modern


# ---------------------------------------------------------------- accounting: the replace-one convention
def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of a Gaussian mechanism with sensitivity / stddev = mu (Balle & Wang 2018):
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    def gap(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta
    return optimize.brentq(gap, 0.0, 100.0, xtol=1e-12)


@pytest.mark.fast
def test_fixed_size_sampling_accounts_for_the_replace_one_sensitivity_2c():
    """Replace-one: one clipped update u replaced by u' moves the sum by up to 2C. With every client
    sampled (K = N) a run is R Gaussian mechanisms of stddev zC and sensitivity 2C: mu = 2 sqrt(R) / z.
    RDP's epsilon must lie above the exact one (it is an upper bound) and near it; the 2C enters as
    GaussianDpEvent(z / 2) because dp_accounting normalises the fixed-size bound by the sensitivity
    (pinned below: if a new dp_accounting fixes google/differential-privacy#378, this fails)."""
    z, rounds, delta = 4.0, 50, 1e-5
    exact = exact_gaussian_epsilon(2 * math.sqrt(rounds) / z, delta)
    ours = privacy.epsilon(z, rounds, delta, num_clients=10, clients_per_round=10)
    assert exact <= ours <= 1.25 * exact, (exact, ours)
    # dp_accounting's PLD, whose REPLACE_ONE shifts the Gaussian by +-1 (distance 2) per unit multiplier,
    # agrees with the closed form (so the closed form is the right yardstick).
    pld = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    pld.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), rounds))
    assert pld.get_epsilon(delta) == pytest.approx(exact, rel=2e-3)
    # The library convention the z / 2 relies on: the fixed-size RDP with q = 1 is a / (2 s^2) for the
    # event's multiplier s, i.e. s is taken relative to the replace-one sensitivity.
    s = 1.7
    acc = rdp_lib.RdpAccountant([2.0, 8.0, 32.0], dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(7, 7, dp_accounting.GaussianDpEvent(s)))
    np.testing.assert_allclose(acc.rdp, np.array([2.0, 8.0, 32.0]) / (2 * s**2), rtol=1e-12)
    # K = N: fixed-size sampling at z is Poisson (add/remove, sensitivity C) at z / 2, order by order.
    np.testing.assert_array_equal(privacy.round_rdp(z, num_clients=10, clients_per_round=10),
                                  privacy.round_rdp(z / 2, num_clients=10, clients_per_round=10, sampling="poisson"))


def test_pld_is_tighter_than_rdp_and_fixed_size_sampling_costs_more_than_poisson():
    """Same Poisson event: PLD <= RDP. Same q and z: fixed-size sampling under replace-one (sensitivity
    2C) costs more epsilon than Poisson under add/remove (sensitivity C). PLD does not take fixed-size
    sampling; z = 0 is no privacy; 0 rounds none spent."""
    common = dict(num_clients=1000, clients_per_round=10)
    rdp_eps = privacy.epsilon(1.0, 300, 1e-5, sampling="poisson", **common)
    pld_eps = privacy.epsilon(1.0, 300, 1e-5, sampling="poisson", accountant="pld", **common)
    assert pld_eps < rdp_eps
    assert privacy.epsilon(1.0, 300, 1e-5, **common) > rdp_eps
    assert privacy.neighboring_relation("without_replacement") == dp_accounting.NeighboringRelation.REPLACE_ONE
    assert privacy.neighboring_relation("poisson") == dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    with pytest.raises(ValueError, match="PLD accountant does not support sampling without replacement.*'rdp'"):
        privacy.epsilon(1.0, 10, 1e-5, accountant="pld", **common)
    assert privacy.epsilon(0.0, 10, 1e-5, **common) == INF
    assert privacy.epsilon(0.0, 10, 1e-5, sampling="poisson", accountant="pld", **common) == INF
    assert privacy.epsilon(1.0, 0, 1e-5, **common) == 0.0
    with pytest.raises(ValueError, match="unknown sampling"):
        privacy.dp_event(1.0, 10, num_clients=10, clients_per_round=2, sampling="shuffle")
    with pytest.raises(ValueError, match="unknown accountant"):
        privacy.epsilon(1.0, 10, 1e-5, accountant="prv", **common)
    with pytest.raises(ValueError, match="between 1 and num_clients"):
        privacy.dp_event(1.0, 10, num_clients=10, clients_per_round=11)
    event = privacy.dp_event(1.0, 10, num_clients=10, clients_per_round=2)
    assert event == dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(10, 2, dp_accounting.GaussianDpEvent(0.5)), 10)


@pytest.mark.fast
@pytest.mark.parametrize("sampling", ["without_replacement", "poisson"])
def test_epsilon_curve_is_the_accountant_after_every_round_from_one_call(sampling, monkeypatch):
    """Entry r - 1 of the curve is the accountant's epsilon after r rounds; the whole curve of 1000
    rounds costs one accountant (RDP composes additively over rounds)."""
    common = dict(num_clients=50, clients_per_round=5, sampling=sampling)
    built = []

    class Counting(rdp_lib.RdpAccountant):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(privacy.rdp_lib, "RdpAccountant", Counting)
        curve = privacy.epsilon_curve(1.1, 1000, 1e-5, **common)
    assert len(built) == 1 and curve.shape == (1000,)
    for r in (1, 2, 37, 1000):
        assert curve[r - 1] == pytest.approx(privacy.epsilon(1.1, r, 1e-5, **common), rel=1e-12), r
    assert np.all(np.diff(curve) >= 0) and curve[0] > 0
    assert np.all(privacy.epsilon_curve(0.0, 3, 1e-5, **common) == INF)


@pytest.mark.fast
def test_rdp_to_epsilon_is_dp_accountings_conversion():
    rng = np.random.default_rng(0)
    orders = np.asarray(privacy.DEFAULT_ORDERS)
    cases = [rng.uniform(0, 5, orders.size), rng.uniform(0, 1e-12, orders.size), np.zeros(orders.size),
             np.where(orders < 3, np.inf, rng.uniform(0, 2, orders.size)), np.full(orders.size, np.inf)]
    for delta in (1e-5, 1e-9, 0.3):
        got = privacy.rdp_to_epsilon(orders, np.stack(cases), delta)
        expected = [rdp_lib.compute_epsilon(orders, case, delta)[0] for case in cases]
        np.testing.assert_allclose(got, expected, rtol=1e-12)


@pytest.mark.parametrize("sampling, n, k, rounds, target", [("without_replacement", 100, 10, 50, 5.0),
                                                             ("poisson", 1000, 10, 200, 1.0)])
def test_calibrated_noise_is_the_smallest_that_meets_the_target(sampling, n, k, rounds, target):
    common = dict(num_clients=n, clients_per_round=k, sampling=sampling)
    z = privacy.calibrate_noise_multiplier(target, rounds, 1e-5, **common)
    assert privacy.epsilon(z, rounds, 1e-5, **common) <= target
    assert privacy.epsilon(0.99 * z, rounds, 1e-5, **common) > target


# (q, z, rounds): the digits run of docs/privacy.md (q 0.1, 20 rounds, around epsilon 8), a small epsilon, a long run.
PLD_SETTINGS = [(0.1, 0.68, 20), (0.1, 2.1, 20), (0.01, 1.0, 300), (0.05, 0.8, 100), (0.5, 5.0, 10)]


@pytest.mark.parametrize("q, z, rounds", PLD_SETTINGS)
def test_pld_on_the_coarser_grid_is_an_upper_bound_within_1e_3_of_the_finer_one(q, z, rounds):
    """privacy.PLD_VALUE_INTERVAL (1e-3) against dp_accounting's default grid (1e-4): both pessimistic
    estimates, so both bound the mechanism's epsilon from above; the coarser must never say less than the
    finer (it would be the one that lost its pessimism) and stay within 1e-3 (relative) of it."""
    assert privacy.PLD_VALUE_INTERVAL == 1e-3
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)),
                                              rounds)
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    fine = dp_accounting.pld.PLDAccountant(relation, value_discretization_interval=1e-4).compose(event)
    n = 1000
    coarse = privacy.epsilon(z, rounds, 1e-5, num_clients=n, clients_per_round=round(q * n), sampling="poisson",
                             accountant="pld")
    assert fine.get_epsilon(1e-5) <= coarse <= fine.get_epsilon(1e-5) * (1 + 1e-3)
    # What the PLD accountant itself computes on that grid (the module builds one round's PLD and self-composes it).
    same_grid = dp_accounting.pld.PLDAccountant(relation, value_discretization_interval=privacy.PLD_VALUE_INTERVAL)
    assert coarse == pytest.approx(same_grid.compose(event).get_epsilon(1e-5), rel=1e-9)


@pytest.mark.fast
def test_a_pld_run_builds_one_rounds_pld_once_for_all_its_rows(monkeypatch):
    """A run's rows ask epsilon after every round; the summary asks again: one round's PLD is built once
    (before: once per row, about 0.7 s each on the 1e-4 grid) and every answer is cached."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    built = []
    original = pld_lib.from_gaussian_mechanism
    monkeypatch.setattr(pld_lib, "from_gaussian_mechanism", lambda *a, **k: built.append(k) or original(*a, **k))
    common = dict(num_clients=100, clients_per_round=10, sampling="poisson", accountant="pld")
    by_round = privacy.epsilon_by_round(0.6543, 20, 1e-5, **common)
    curve = [by_round(r) for r in range(1, 21)]
    assert privacy.epsilon(0.6543, 20, 1e-5, **common) == curve[-1] and by_round(25) == curve[-1]
    assert len(built) == 1 and built[0]["value_discretization_interval"] == privacy.PLD_VALUE_INTERVAL
    assert all(a < b for a, b in zip(curve, curve[1:]))
    rdp = privacy.epsilon_by_round(0.6543, 20, 1e-5, **{**common, "accountant": "rdp"})
    assert rdp(7) == pytest.approx(privacy.epsilon(0.6543, 7, 1e-5, **{**common, "accountant": "rdp"}), rel=1e-12)
    assert curve[6] < rdp(7)   # PLD, the tighter


@pytest.mark.fast
def test_accounting_asks_nothing_of_the_user(caplog):
    """dp_accounting's RDP series logs "failed to converge ... Excluding this order" for Poisson sampling at
    orders near 1 (the order is left out of the minimum: the bound stays valid, and the user can do nothing
    about it): the calls here keep it out of the user's log. Other records still pass."""
    common = dict(num_clients=100, clients_per_round=10, sampling="poisson")
    with caplog.at_level("WARNING"):
        privacy.epsilon(0.6321, 20, 1e-5, **common)
        privacy.round_rdp(0.6321, **common)
        privacy.calibrate_noise_multiplier(7.5, 20, 1e-5, **common)
        import logging
        logging.getLogger("absl").warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


# ---------------------------------------------------------------- the mechanism
@pytest.mark.fast
def test_clip_rows_by_hand():
    """A row longer than C is scaled to norm C; a row within it (norm exactly C included) is returned
    bit for bit; inf clips nothing."""
    x = jnp.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [6.0, 8.0], [-30.0, 40.0]])
    clipped, norms = clip_rows(x, 5.0)
    np.testing.assert_allclose(norms, [5.0, 0.5, 0.0, 10.0, 50.0], rtol=1e-6)
    np.testing.assert_array_equal(clipped[:3], x[:3])
    np.testing.assert_allclose(clipped[3:], [[3.0, 4.0], [-3.0, 4.0]], rtol=1e-6)
    rng = np.random.default_rng(1)
    big = jnp.asarray(rng.normal(size=(16, 1000)) * rng.uniform(0, 3, (16, 1)), jnp.float32)
    clipped, norms = clip_rows(big, 50.0)
    assert 0 < int((norms > 50.0).sum()) < 16
    assert float(jnp.linalg.norm(clipped, axis=1).max()) <= 50.0 * (1 + 1e-6)
    np.testing.assert_array_equal(clip_rows(big, INF)[0], big)
    np.testing.assert_array_equal(noisy_sum(big, 0.0, jax.random.PRNGKey(0)), big.sum(0))


def recording(payload):
    """A server that stores the messages it receives (and broadcasts ``payload``)."""
    def server_update(server, messages, ctx):
        return {"seen": messages}, {}
    return Algorithm("rec", lambda key: ({"seen": None}, ()), lambda s, r: payload, lambda *a: None, server_update)


def ctx_for(k, key=0, weights=None):
    weights = jnp.arange(1.0, k + 1) if weights is None else weights   # unequal: the DP mean must ignore them
    return ServerContext(jnp.int32(0), jnp.arange(k, dtype=jnp.int32), weights, jax.random.PRNGKey(key))


def hand_clip(updates: np.ndarray, c: float) -> np.ndarray:
    norms = np.linalg.norm(updates, axis=1, keepdims=True)
    return updates * np.minimum(1.0, c / np.maximum(norms, 1e-30))


@pytest.mark.fast
def test_the_server_receives_k_copies_of_the_reference_plus_the_clipped_mean():
    """Messages shaped like the payload (FedAvg's models): the updates are message - payload; two of
    four exceed C = 5 (one has norm exactly 5: not clipped); the mean divides by K = 4 whatever the
    weights; the metrics are the clipped fraction and the mean pre-clip norm."""
    payload = {"a": jnp.array([1.0, -2.0]), "b": jnp.array([[0.5], [3.0]])}
    updates = np.array([[3.0, 0.0, 0.0, 4.0], [30.0, 0.0, 40.0, 0.0], [1.0, 2.0, 0.0, -1.0], [0.0, -20.0, 0.0, 0.0]],
                       np.float32)
    flat_payload = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    messages = {"a": jnp.asarray(flat_payload[:2] + updates[:, :2]),
                "b": jnp.asarray((flat_payload[2:] + updates[:, 2:])[:, :, None])}
    alg = with_dp(recording(payload), clip_norm=5.0, noise_multiplier=0.0, clients_per_round=4)
    new, metrics = alg.server_update({"seen": None}, messages, ctx_for(4))
    expected = flat_payload + hand_clip(updates.astype(np.float64), 5.0).sum(0) / 4
    np.testing.assert_allclose(expected, [1.0 + (3 + 3 + 1) / 4, -2.0 + (2 - 5) / 4, 0.5 + 4 / 4, 3.0 + (4 - 1) / 4])
    np.testing.assert_allclose(new["seen"]["a"], np.broadcast_to(expected[:2], (4, 2)), rtol=1e-6)
    np.testing.assert_allclose(new["seen"]["b"], np.broadcast_to(expected[2:, None], (4, 2, 1)), rtol=1e-6)
    assert float(metrics["dp_clipped_fraction"]) == 0.5 and metrics["dp_clipped_fraction"].dtype == jnp.float32
    np.testing.assert_allclose(metrics["dp_update_norm"], np.linalg.norm(updates, axis=1).mean(), rtol=1e-6)
    assert alg.name == "rec+dp" and alg.hparams["dp_clip_norm"] == 5.0
    with pytest.raises(ValueError, match="received 4 client updates"):
        with_dp(recording(payload), clip_norm=5.0, noise_multiplier=0.0, clients_per_round=5).server_update(
            {"seen": None}, messages, ctx_for(4))


@pytest.mark.fast
def test_the_noise_on_the_mean_has_stddev_z_c_over_k():
    """Zero updates, P = 200 000 coordinates: the aggregate is pure noise of stddev z C / K (estimate
    within 1 %: its relative error is about 1 / sqrt(2 P) = 0.16 %), fresh every round, and drawn from
    a stream of its own (not the server key's own draws). The same around an UpdateServer."""
    z, c, k, p = 1.3, 0.5, 8, 200_000
    payload = {"w": jnp.full((p,), 2.0)}
    messages = {"w": jnp.full((k, p), 2.0)}
    alg = with_dp(recording(payload), clip_norm=c, noise_multiplier=z, clients_per_round=k)
    noise = np.asarray(alg.server_update({"seen": None}, messages, ctx_for(k))[0]["seen"]["w"] - 2.0, np.float64)
    assert np.all(noise == noise[0])                                           # K copies of one aggregate
    assert noise[0].std() == pytest.approx(z * c / k, rel=0.01)
    assert abs(noise[0].mean()) < 5 * z * c / k / math.sqrt(p)
    other = np.asarray(alg.server_update({"seen": None}, messages, ctx_for(k, key=1))[0]["seen"]["w"][0] - 2.0)
    assert abs(np.corrcoef(noise[0], other)[0, 1]) < 0.02                       # a fresh draw each round
    own = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (p,)))
    assert abs(np.corrcoef(noise[0], own)[0, 1]) < 0.02                         # not the algorithm's draws
    expected = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(0), DP_NOISE_STREAM), (p,)) * z * c / k
    np.testing.assert_allclose(noise[0], expected, rtol=1e-4, atol=1e-6)
    # An UpdateServer (flat updates [K, P], the server adds their mean): the private mean replaces its own.
    server = UpdateServer(mean=lambda u, ctx: u.mean(0), apply=lambda w, a: w + a, model=lambda w: w)
    flat = Algorithm("upd", lambda key: (jnp.zeros(p), ()), lambda w, r: w, lambda *a: None, server)
    new, metrics = with_dp(flat, clip_norm=c, noise_multiplier=z, clients_per_round=k).server_update(
        jnp.zeros(p), jnp.zeros((k, p)), ctx_for(k))
    assert float(new.std()) == pytest.approx(z * c / k, rel=0.01)
    assert float(metrics["dp_clipped_fraction"]) == 0.0


@pytest.mark.fast
def test_running_statistics_are_averaged_outside_the_noise_and_the_clip():
    """FedAvg-shaped messages with BatchNorm statistics: the parameters' updates are clipped and noised (the
    clip's norm counts them alone), the statistics reach the server as the clients' plain mean (no noise that
    could drive a variance below 0: here the noise is 50x the variances), said once in a warning; under a
    Poisson mask the mean is over the real clients and an empty round keeps the broadcast statistics."""
    k = 4
    payload = {"params": {"w": jnp.zeros(3)}, "batch_stats": {"bn": {"mean": jnp.zeros(2), "var": jnp.ones(2)}}}
    rng = np.random.default_rng(0)
    var = rng.uniform(0.01, 0.2, (k, 2)).astype(np.float32)
    mean = rng.normal(size=(k, 2)).astype(np.float32)
    messages = {"params": {"w": jnp.asarray(np.tile([[3.0, 4.0, 0.0]], (k, 1)), jnp.float32)},
                "batch_stats": {"bn": {"mean": jnp.asarray(mean), "var": jnp.asarray(var)}}}
    alg = with_dp(recording(payload), clip_norm=1.0, noise_multiplier=40.0, clients_per_round=k)
    with pytest.warns(UserWarning, match=r"^with_dp: rec's clients send 4 BatchNorm running statistics; they are "
                                         r"averaged without noise .* use GroupNorm or LayerNorm$"):
        new, metrics = alg.server_update({"seen": None}, messages, ctx_for(k))
    seen = new["seen"]
    np.testing.assert_allclose(seen["batch_stats"]["bn"]["var"], np.broadcast_to(var.mean(0), (k, 2)), rtol=1e-6)
    np.testing.assert_allclose(seen["batch_stats"]["bn"]["mean"], np.broadcast_to(mean.mean(0), (k, 2)), rtol=1e-6)
    assert float(metrics["dp_update_norm"]) == pytest.approx(5.0)   # ||(3, 4, 0)||: the statistics not counted
    assert float(np.std(np.asarray(seen["params"]["w"][0]) - 0.6 * np.array([3.0, 4.0, 0.0]))) > 1.0   # noised
    from fedjax_sparse.algorithms.private import released_statistics
    assert released_statistics(alg) == 4
    mask = jnp.array([True, False, True, False])
    poisson = ServerContext(jnp.int32(0), jnp.arange(k, dtype=jnp.int32), jnp.ones(k), jax.random.PRNGKey(0), mask=mask)
    seen = alg.server_update({"seen": None}, messages, poisson)[0]["seen"]
    np.testing.assert_allclose(seen["batch_stats"]["bn"]["var"][0], var[[0, 2]].mean(0), rtol=1e-6)
    empty = poisson._replace(mask=jnp.zeros(k, bool))
    seen = alg.server_update({"seen": None}, messages, empty)[0]["seen"]
    np.testing.assert_array_equal(seen["batch_stats"]["bn"]["var"][0], [1.0, 1.0])


@pytest.mark.fast
def test_robust_aggregators_and_attacks_leave_running_statistics_alone():
    """--aggregator multi_krum selects by the parameters' distances alone (a client with outlying statistics
    but honest parameters is not the one dropped) and averages the statistics of the clients it selected;
    trimmed_mean trims the statistics coordinate-wise like the rest; the min-max attack perturbs the
    parameters only: the malicious clients' running variances stay theirs (before: mean - gamma * std, < 0)."""
    from fedjax_sparse.algorithms.compose import with_aggregator, with_attack
    from fedjax_sparse.mechanisms.attacks import Threat
    k = 5
    payload = {"params": {"w": jnp.zeros(2)}, "batch_stats": {"bn": {"var": jnp.ones(2)}}}
    w = np.array([[0.0, 0.1], [0.1, 0.0], [0.05, 0.05], [0.0, 0.0], [9.0, 9.0]], np.float32)   # client 4: outlier
    var = np.array([[1.0, 1.0], [50.0, 50.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], np.float32)  # client 1's stats odd
    messages = {"params": {"w": jnp.asarray(w)}, "batch_stats": {"bn": {"var": jnp.asarray(var)}}}
    from fedjax_sparse.mechanisms.robust_aggregation import multi_krum_select, pairwise_sq_distances
    by_params = np.asarray(multi_krum_select(pairwise_sq_distances(jnp.asarray(w)), 1, 3))
    by_everything = np.asarray(multi_krum_select(pairwise_sq_distances(jnp.asarray(np.hstack([w, var]))), 1, 3))
    assert by_params[1] and not by_everything[1] and not by_params[4]   # the case tells the two apart
    krum = with_aggregator(recording(payload), "multi_krum", trim_fraction=0.2, krum_select=3)
    new, metrics = krum.server_update({"seen": None}, messages, ctx_for(k))
    assert int(metrics["krum_selected"]) == 3
    np.testing.assert_allclose(new["seen"]["params"]["w"][0], w[by_params].mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(new["seen"]["batch_stats"]["bn"]["var"][0], var[by_params].mean(0), rtol=1e-5)
    trimmed = with_aggregator(recording(payload), "trimmed_mean", trim_fraction=0.2)
    new, _ = trimmed.server_update({"seen": None}, messages, ctx_for(k))
    np.testing.assert_allclose(new["seen"]["batch_stats"]["bn"]["var"][0], [1.0, 1.0])
    threat = Threat(k, 0.4, "all", 0)
    attacked = with_attack(recording(payload), "min_max", threat=threat)
    new, metrics = attacked.server_update({"seen": None}, messages, ctx_for(k))
    assert int(metrics["malicious_clients"]) == 2 and float(metrics["attack_gamma"]) > 0
    np.testing.assert_array_equal(new["seen"]["batch_stats"]["bn"]["var"], var)   # as the clients sent them
    assert not np.allclose(new["seen"]["params"]["w"], w)                           # the parameters attacked


@pytest.mark.fast
def test_algorithms_without_float_updates_are_refused_in_one_line():
    _, data = tiny_federated((12,) * 6)
    task = make_task(data)
    for name in ("fsl", "fedpm"):
        with pytest.raises(TypeError, match=f"with_dp cannot wrap {name}: .*no DP mechanism for rankings, masks") as err:
            with_dp(make_algorithm(name, task), clip_norm=1.0, noise_multiplier=1.0, clients_per_round=3)
        assert "\n" not in str(err.value)
    for name in ("signsgd", "heterofl", "local", "spafl_local", "feddrop"):
        assert dp_refusal(name).startswith(f"with_dp cannot wrap {name}: "), name
    assert dp_refusal("spafl", {"share_thresholds": False}) is not None
    for name in ("fedavg", "spafl", "fedprox", "scaffold", "caldas", "fedavgm", "topk", "fedavg_robust", "unidrop"):
        assert dp_refusal(name) is None, name
    # An unregistered algorithm with integer messages: refused when its server runs.
    alg = with_dp(recording(None), clip_norm=1.0, noise_multiplier=1.0, clients_per_round=3)
    with pytest.raises(TypeError, match="with_dp cannot wrap rec: its clients send int32 values"):
        alg.server_update({"seen": None}, {"r": jnp.zeros((3, 5), jnp.int32)}, ctx_for(3))
    with pytest.raises(ValueError, match="needs a finite clip_norm"):
        DpMechanism(INF, 1.0, 3)
    with pytest.raises(ValueError, match="clip_norm must be > 0"):
        DpMechanism(0.0, 1.0, 3)


@pytest.mark.fast
def test_what_each_algorithms_messages_are_relative_to():
    """The reference an update is measured from: the model for model-shaped messages; SpaFL's global
    thresholds tau (not delta, which has the same structure); Caldas et al.'s global model; SCAFFOLD's
    global model and zero for its delta_control (a change already); zero for flat updates; UniDrop's and
    FedDrop's global model for their variables, their sampled FLOPs being accounting that passes through."""
    model = {"params": {"w": jnp.ones(3)}}
    assert update_reference(model, {"params": {"w": jnp.zeros(3)}}) is model
    tau, delta = {"conv": jnp.full(4, 0.1)}, {"conv": jnp.full(4, -0.2)}
    assert update_reference(SpaflServerState(delta, None, None, tau), {"conv": jnp.zeros(4)}) is tau
    assert update_reference(CaldasServerState(jax.random.PRNGKey(0), model), {"params": {"w": jnp.zeros(3)}}) is model
    row = {"variables": {"params": {"w": jnp.full(3, 5.0)}}, "delta_control": {"w": jnp.full(3, 7.0)}}
    ref = update_reference(ScaffoldServerState(control={"w": jnp.full(3, 9.0)}, variables=model), row)
    assert ref["variables"] is model and np.all(np.asarray(ref["delta_control"]["w"]) == 0)
    assert update_reference(model, jnp.zeros(3)) is None
    dropout = FedDropServerState(jnp.ones((2, 3)), model)
    message = {"variables": {"params": {"w": jnp.zeros(3)}}, "sampled_flops": jnp.float32(1e6)}
    assert accounting_keys(dropout, message) == ("sampled_flops",)
    ref = update_reference(dropout, {"variables": message["variables"]})
    assert set(ref) == {"variables"} and ref["variables"] is model
    assert accounting_keys(model, {"params": model["params"], "sampled_flops": 1.0}) == ()   # only FedDrop's
    assert accounting_keys(dropout, {"variables": model}) == ()


@pytest.mark.fast
def test_feddrop_is_refused_only_when_its_server_optimises_from_each_clients_model():
    """FedDrop's default server re-optimises each sampled client's keep probabilities from that client's
    own model: refused, in one line that says why and the fix. optimize=false (also as the CLI's string)
    and UniDrop are wrapped, from the options make_algorithm records."""
    reason = dp_refusal("feddrop")
    assert reason == dp_refusal("feddrop", {"optimize": True}) and "\n" not in reason
    assert reason.startswith("with_dp cannot wrap feddrop: ")
    for needle in ("keep probabilities", "own returned model", "per-client", "private mean",
                   "--option optimize=false", "unidrop"):
        assert needle in reason, needle
    for options in ({"optimize": False}, {"optimize": "false"}, {"optimize": False, "budget": 0.3}):
        assert dp_refusal("feddrop", options) is None, options
    assert dp_refusal("unidrop") is None and dp_refusal("unidrop", {"synchronized": True}) is None
    _, data = tiny_federated((12,) * 6)
    task = make_task(data)
    with pytest.raises(TypeError) as err:
        with_dp(make_algorithm("feddrop", task), clip_norm=1.0, noise_multiplier=1.0, clients_per_round=3)
    assert str(err.value) == reason
    for name, options in (("feddrop", {"optimize": False}), ("unidrop", {})):
        alg = with_dp(make_algorithm(name, task, options), clip_norm=1.0, noise_multiplier=1.0, clients_per_round=3)
        assert alg.name == f"{name}+dp"


@pytest.mark.parametrize("name", ["scaffold", "caldas", "topk"])
def test_no_noise_and_no_clipping_is_the_plain_algorithm(name):
    """SCAFFOLD (dict messages), Caldas et al. (a payload with the model inside) and TopK (an
    UpdateServer) with noise 0 and C = inf: the plain run, to float rounding (equal client sizes)."""
    _, data = tiny_federated((12,) * 10)
    task = make_task(data, clients_per_round=5, rounds=2)
    runs = []
    for alg in (make_algorithm(name, task), with_dp(make_algorithm(name, task), clip_norm=INF, noise_multiplier=0.0,
                                                    clients_per_round=5)):
        engine = Engine(alg, 10, 5)
        runs.append(engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 2))
    (plain, plain_metrics), (private, metrics) = runs
    for a, b in zip(jax.tree_util.tree_leaves(plain.server), jax.tree_util.tree_leaves(private.server)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(plain_metrics["loss"], metrics["loss"], rtol=1e-5)
    assert np.all(metrics["server_dp_update_norm"] > 0)


# ---------------------------------------------------------------- the wrapper on real messages (the engine)
def recorder(alg, log):
    """``alg`` whose server logs, every round, (payload, messages, new server state) to ``log`` on the host."""
    inner = alg.server_update

    def server_update(state, messages, ctx):
        new, metrics = inner(state, messages, ctx)
        jax.debug.callback(lambda *tree: log.append(jax.tree_util.tree_map(np.asarray, tree)),
                           alg.broadcast(state, ctx.round), messages, new, ordered=True)
        return new, metrics
    return Algorithm(alg.name, alg.init, alg.broadcast, alg.client_update, server_update)


def logged_run(alg, data, rounds: int = 3):
    """(final state, metrics, the server's log) of ``alg`` on 10 clients, 5 per round, ``rounds`` rounds."""
    log: list = []
    engine = Engine(recorder(alg, log), 10, 5)
    state, metrics = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, rounds)
    return state, metrics, log


# name -> (reference of the messages in the payload, the server state's aggregate)
REAL = {"fedavg": (lambda payload: payload, lambda state: state.variables),
        "spafl": (lambda payload: payload.tau, lambda state: state.tau)}


def flat_rows(tree):
    return np.concatenate([np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in jax.tree_util.tree_leaves(tree)],
                          axis=1)


def flat_one(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(tree)])


@pytest.mark.parametrize("name", ["fedavg", "spafl"])
def test_dp_fedavg_on_real_messages(name):
    """Equal client sizes, K = 5 of 10, 3 rounds. (1) noise 0 and C = inf: the plain run, to float
    rounding. (2) C between the 2nd and 3rd largest round-0 update norms, noise 0: every round the new
    global (model / thresholds) is reference + the mean of the hand-clipped updates (message - the
    reference the clients started from: SpaFL's global thresholds, not zero), every clipped update is
    within C, and dp_clipped_fraction is the fraction of updates longer than C (round 0: 2 of 5)."""
    reference_of, aggregate_of = REAL[name]
    _, data = tiny_federated((12,) * 10)
    task = make_task(data, clients_per_round=5, rounds=3)

    def run(alg):
        return logged_run(alg, data)

    plain, plain_metrics, plain_log = run(make_algorithm(name, task))
    same, same_metrics, _ = run(with_dp(make_algorithm(name, task), clip_norm=INF, noise_multiplier=0.0,
                                        clients_per_round=5))
    for a, b in zip(jax.tree_util.tree_leaves(plain.server), jax.tree_util.tree_leaves(same.server)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(plain_metrics["loss"], same_metrics["loss"], rtol=1e-5)
    np.testing.assert_array_equal(same_metrics["server_dp_clipped_fraction"], 0.0)

    payload, messages, _ = plain_log[0]
    norms0 = np.sort(np.linalg.norm(flat_rows(messages) - flat_one(reference_of(payload)), axis=1))
    c = float((norms0[-2] + norms0[-3]) / 2)
    _, metrics, log = run(with_dp(make_algorithm(name, task), clip_norm=c, noise_multiplier=0.0, clients_per_round=5))
    assert len(log) == 3 and float(metrics["server_dp_clipped_fraction"][0]) == pytest.approx(0.4)
    for r, (payload, messages, new_state) in enumerate(log):
        reference = flat_one(reference_of(payload))
        updates = flat_rows(messages) - reference
        if r > 0 and name == "spafl":
            assert np.abs(reference).max() > 0   # the reference matters from round 1 on (it starts at 0)
        clipped = hand_clip(updates, c)
        assert np.linalg.norm(clipped, axis=1).max() <= c * (1 + 1e-6)
        np.testing.assert_allclose(flat_one(aggregate_of(new_state)), reference + clipped.mean(0), rtol=1e-5,
                                   atol=1e-6)
        hand_fraction = np.mean(np.linalg.norm(updates, axis=1) > c)
        assert float(metrics["server_dp_clipped_fraction"][r]) == pytest.approx(hand_fraction), r
        np.testing.assert_allclose(metrics["server_dp_update_norm"][r], np.linalg.norm(updates, axis=1).mean(),
                                   rtol=1e-4)


@pytest.mark.parametrize("name, options", [("unidrop", {}), ("feddrop", {"optimize": False})])
def test_dp_fedavg_on_dropout_messages(name, options):
    """UniDrop and FedDrop without the optimiser (cnn_small's conv channels dropped), equal client sizes,
    K = 5 of 10, 3 rounds. (1) noise 0 and C = inf: the plain run to float rounding, its sampled_flops
    metric included. (2) C between the 2nd and 3rd largest round-0 update norms, noise 0: every round the
    new global model is the broadcast model + the mean of the hand-clipped (variables - broadcast
    variables), every clipped update is within C, dp_update_norm is the norm of the variables' updates
    alone, and the sampled_flops metric is the sum of the clients' sampled FLOPs as they sent them (not
    clipped, not in the norm: it is the simulation's cost accounting); the keep probabilities stay."""
    _, data = tiny_federated((12,) * 10)
    task = make_task(data, clients_per_round=5, rounds=3)

    def run(alg):
        return logged_run(alg, data)

    def private(c):
        return with_dp(make_algorithm(name, task, options), clip_norm=c, noise_multiplier=0.0, clients_per_round=5)

    plain, plain_metrics, plain_log = run(make_algorithm(name, task, options))
    same, same_metrics, _ = run(private(INF))
    for a, b in zip(jax.tree_util.tree_leaves(plain.server), jax.tree_util.tree_leaves(same.server)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(plain_metrics["loss"], same_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(plain_metrics["server_sampled_flops"], same_metrics["server_sampled_flops"], rtol=1e-6)
    assert np.all(plain_metrics["server_sampled_flops"] > 0)
    np.testing.assert_array_equal(same_metrics["server_dp_clipped_fraction"], 0.0)

    payload, messages, _ = plain_log[0]
    norms0 = np.sort(np.linalg.norm(flat_rows(messages["variables"]) - flat_one(payload.variables), axis=1))
    assert np.all(np.asarray(messages["sampled_flops"]) > 100 * norms0[-1])   # it would dominate any norm
    c = float((norms0[-2] + norms0[-3]) / 2)
    _, metrics, log = run(private(c))
    assert len(log) == 3 and float(metrics["server_dp_clipped_fraction"][0]) == pytest.approx(0.4)
    for r, (payload, messages, new_state) in enumerate(log):
        reference = flat_one(payload.variables)
        updates = flat_rows(messages["variables"]) - reference
        clipped = hand_clip(updates, c)
        assert np.linalg.norm(clipped, axis=1).max() <= c * (1 + 1e-6)
        np.testing.assert_allclose(flat_one(new_state.variables), reference + clipped.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(new_state.keep_probs, payload.keep_probs)
        np.testing.assert_allclose(metrics["server_dp_update_norm"][r], np.linalg.norm(updates, axis=1).mean(),
                                   rtol=1e-4)
        assert float(metrics["server_dp_clipped_fraction"][r]) == pytest.approx(np.mean(
            np.linalg.norm(updates, axis=1) > c)), r
        np.testing.assert_allclose(metrics["server_sampled_flops"][r], np.asarray(messages["sampled_flops"],
                                                                                  np.float64).sum(), rtol=1e-6)

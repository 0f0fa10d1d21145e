"""Poisson client sampling (issue 43): cohort sizes ~ Binomial(N, q), the capacity, the engine's
masking (map and vmap, empty rounds, costs, client states), the servers' masked means, refusals,
DP accounted as PoissonSampledDpEvent(q, GaussianDpEvent(z)) and --resume."""
import dataclasses
import json
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.driver import privacy
from fedjax_sparse.algorithms import Algorithm, make_algorithm
from fedjax_sparse.core.algorithm import ServerContext, client_metrics, cohort_mean
from fedjax_sparse.core.engine import Engine, poisson_capacity, sample_poisson_clients
from fedjax_sparse.errors import RunError
from tests.helpers import flat_config, make_task, tiny_federated


def _tail(n, q, k):
    """P(Binomial(n, q) > k), exactly (small n)."""
    return sum(math.comb(n, j) * q ** j * (1 - q) ** (n - j) for j in range(k + 1, n + 1))


@pytest.mark.parametrize("n,q", [(20, 0.25), (60, 0.1), (200, 0.05), (10, 1.0)])
def test_capacity_is_the_smallest_k_whose_binomial_tail_is_below_1e_9(n, q):
    k = poisson_capacity(n, q)
    assert _tail(n, q, k) <= 1e-9
    assert k == 0 or _tail(n, q, k - 1) > 1e-9


def test_cohort_sizes_follow_binomial_n_q_over_many_rounds():
    n, q, rounds = 100, 0.1, 4000
    cap = poisson_capacity(n, q)
    keys = jax.random.split(jax.random.PRNGKey(3), rounds)
    ids, mask, overflow = jax.jit(jax.vmap(lambda k: sample_poisson_clients(k, n, q, cap)))(keys)
    sizes = np.asarray(mask.sum(1))
    mean, var = n * q, n * q * (1 - q)
    # the sample mean within 4 standard errors; the sample variance within 10 % (its s.e. is ~2.4 % here)
    assert abs(sizes.mean() - mean) < 4 * math.sqrt(var / rounds)
    assert abs(sizes.var() - var) < 0.1 * var
    assert int(np.asarray(overflow).sum()) == 0
    ids = np.asarray(ids)
    for row, m in zip(ids[:50], np.asarray(mask)[:50]):       # real ids sorted and distinct, padding = N
        assert np.all(np.diff(row[m]) > 0) and np.all(row[~m] == n)


def test_overflow_is_counted_and_leaves_out_the_highest_ids():
    ids, mask, overflow = sample_poisson_clients(jax.random.PRNGKey(0), 50, 1.0, 10)
    assert np.asarray(ids).tolist() == list(range(10)) and bool(mask.all()) and int(overflow) == 40


def _toy(varying=True):
    """Messages = the client's id; the server keeps the weighted masked mean of them; each client
    counts its participations; uplink 32 bits a client."""
    def init(key):
        return jnp.float32(-1.0), jnp.zeros((6,), jnp.int32)

    def client_update(payload, state, data, ctx):
        return state + 1, ctx.client_id.astype(jnp.float32), client_metrics(
            loss=0.0, num_examples=data.count, uplink_bits=32, density=1.0)

    def server_update(server, messages, ctx):
        if ctx.mask is None:
            return jnp.mean(messages), {}
        return cohort_mean(messages, jnp.ones_like(ctx.weights), ctx.mask, server), {}

    return Algorithm("toy", init, lambda s, r: s, client_update, server_update, varying_cohort=varying)


@pytest.mark.parametrize("mode", ["map", "vmap", "packed"])
def test_engine_masks_padded_slots_and_keeps_the_model_in_an_empty_round(mode):
    _, data = tiny_federated()
    engine = Engine(_toy(), 6, 2, client_parallelism=mode, client_sampling="poisson",
                    local_epochs=1, batch_size=8)
    if mode == "packed":   # padded slots (size 0) sort first; pairs of slots in lockstep
        engine = dataclasses.replace(engine, pack_width=engine.cohort_capacity // 2 if engine.cohort_capacity % 2 == 0
                                     else 1)
        assert engine.pack_width > 1
    state = engine.init(jax.random.PRNGKey(1))
    participations, server, saw_empty = np.zeros(6, int), -1.0, False
    for r in range(12):
        ids, mask, _ = engine.poisson_cohort(state.key, state.round)
        real = np.asarray(ids)[np.asarray(mask)]
        state, metrics = engine.round_fn(state, data)
        participations[real] += 1
        server = float(real.mean()) if len(real) else server      # the hand-checked masked mean
        saw_empty |= len(real) == 0
        assert float(state.server) == pytest.approx(server)
        assert int(metrics["clients"]) == len(real) and int(metrics["cohort_overflow"]) == 0
        assert int(metrics["num_examples"].sum()) == int(np.asarray(data.train_count)[real].sum())
        bits = metrics["uplink_bits"]   # a Cost: unit 32 times [K] per-client factors
        assert bits.units == (32,) and int(jnp.sum(bits.factors.prod(-1))) == len(real)
        steps = np.ceil(np.asarray(data.train_count)[real] / 8).sum()
        assert int(metrics["client_steps"]) == steps
        if len(real):
            assert float(metrics["density"]) == 1.0
        else:   # no client trained: no density or loss to report (null in metrics.jsonl), not 0
            assert np.isnan(float(metrics["density"])) and np.isnan(float(metrics["loss"]))
    assert saw_empty, "q = 1/3 over 6 clients: some of 12 rounds are empty"
    assert np.asarray(state.clients).tolist() == participations.tolist()


def test_fedavg_and_spafl_servers_take_the_masked_mean():
    _, data = tiny_federated()
    for name in ("fedavg", "spafl"):
        alg = make_algorithm(name, make_task(data), {"weighted": "true"} if name == "fedavg" else {})
        server, _ = alg.init(jax.random.PRNGKey(0))
        row = alg.broadcast(server, jnp.int32(0))
        if name == "spafl":
            row = server.tau
        msgs = jax.tree_util.tree_map(lambda x: jnp.stack([x + 1.0, x + 2.0, x + 50.0, x + 70.0]), row)
        weights, mask = jnp.array([1.0, 3.0, 5.0, 0.0]), jnp.array([True, True, False, False])
        ctx = ServerContext(jnp.int32(0), jnp.array([0, 4, 6, 6]), weights, jax.random.PRNGKey(1), mask=mask)
        new, _ = alg.server_update(server, msgs, ctx)
        new_row = new.variables if name == "fedavg" else new.tau
        shift = (1 * 1 + 3 * 2) / 4 if name == "fedavg" else 1.5       # weighted / uniform over the real two
        jax.tree_util.tree_map(lambda n, o: np.testing.assert_allclose(n, o + shift, rtol=1e-6, atol=1e-6),
                               new_row, row)
        empty, _ = alg.server_update(server, msgs, ctx._replace(mask=jnp.zeros(4, bool)))
        empty_row = empty.variables if name == "fedavg" else empty.tau
        jax.tree_util.tree_map(np.testing.assert_array_equal, empty_row, row)


def test_algorithms_that_need_a_fixed_cohort_are_refused_in_one_line():
    from fedjax_sparse.driver import experiment
    from fedjax_sparse.driver.config import validate
    with pytest.raises(ValueError, match="cannot take poisson client sampling"):
        Engine(_toy(varying=False), 6, 2, client_sampling="poisson")
    for name in ("scaffold", "fsl"):
        config = flat_config(algorithm=name, dataset="digits", num_clients=6, clients_per_round=2, rounds=1,
                             client_sampling="poisson")
        with pytest.raises(RunError) as refused:
            experiment.build(config)
        message = str(refused.value)
        assert "\n" not in message and f"{name}'s server assumes a fixed cohort" in message
    config = flat_config(algorithm="fedavg", dataset="digits", aggregator="trimmed_mean", client_sampling="poisson")
    with pytest.raises(RunError, match="--aggregator cannot take"):
        validate(config)
    with pytest.raises(RunError, match="pld accounts Poisson sampling only"):
        validate(flat_config(dp_clip=1.0, dp_target_epsilon=4.0, dp_accountant="pld"))


def test_dp_run_accounts_poisson_sampled_gaussian_as_dp_accounting_does(tmp_path):
    from fedjax_sparse.driver import runner
    n, k, rounds, delta = 20, 5, 3, 1e-5
    config = flat_config(algorithm="fedavg", dataset="digits", num_clients=n, clients_per_round=k, rounds=rounds,
                         local_epochs=1, options={"weighted": "false"}, dp_clip=0.5, dp_noise_multiplier=1.0,
                         client_sampling="poisson", eval_every=rounds, out=str(tmp_path / "run"))
    summary = runner.run(config, progress=False).summary
    z = summary["dp_noise_multiplier"]
    assert z == 1.0
    # Computed here independently: add-or-remove adjacency, q = K / N, the Gaussian's z unscaled.
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(k / n, dp_accounting.GaussianDpEvent(z)), rounds)
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    rdp = dp_accounting.rdp.RdpAccountant(list(privacy.DEFAULT_ORDERS), relation).compose(event).get_epsilon(delta)
    # PLD on the module's grid (1e-3: an upper bound at most 1e-3 above dp_accounting's default 1e-4 grid's).
    pld = dp_accounting.pld.PLDAccountant(relation, privacy.PLD_VALUE_INTERVAL).compose(event).get_epsilon(delta)
    fine = dp_accounting.pld.PLDAccountant(relation).compose(event).get_epsilon(delta)
    assert summary["dp_epsilon_rdp"] == pytest.approx(rdp, rel=1e-9)
    assert summary["dp_epsilon_pld"] == pytest.approx(pld, rel=1e-9) and fine <= pld <= fine * (1 + 1e-3)
    # The rows and dp_epsilon say PLD's, the tighter, by default (--dp-accountant auto) for Poisson sampling.
    assert summary["dp_epsilon"] == pytest.approx(pld, rel=1e-9) and pld < rdp and summary["dp_accountant"] == "pld"
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert all("clients" in row for row in rows) and rows[-1]["dp_epsilon"] == pytest.approx(pld, rel=1e-9)


def test_target_epsilon_calibrates_for_poisson_sampling_with_the_asked_accountant(monkeypatch):
    from fedjax_sparse.driver import experiment
    asked = []
    monkeypatch.setattr(privacy, "calibrate_noise_multiplier", lambda *a, **k: asked.append(k) or 1.0)
    for sampling, accountant, used in (("poisson", "pld", "pld"), ("poisson", "rdp", "rdp"), ("fixed", "rdp", "rdp"),
                                       ("poisson", "auto", "pld"), ("fixed", "auto", "rdp")):
        experiment.noise_multiplier(flat_config(dp_clip=1.0, dp_target_epsilon=4.0, client_sampling=sampling,
                                                dp_accountant=accountant))
        expected = "poisson" if sampling == "poisson" else "without_replacement"
        assert asked[-1]["sampling"] == expected and asked[-1]["accountant"] == used


def test_poisson_accounting_matches_a_published_value():
    # Abadi et al. / TF Privacy's tutorial setting (q = 256 / 60000, z = 1.1, 60 epochs, delta = 1e-5): TF Privacy's
    # RDP accountant reports 3.01 (its orders and conversion); dp-accounting's tighter conversion must stay below it
    # and PLD below that, all by the event this module builds for the run's Poisson sampling.
    steps = 60 * 60000 // 256
    event = privacy.round_event(1.1, num_clients=60000, clients_per_round=256, sampling="poisson")
    assert event == dp_accounting.PoissonSampledDpEvent(256 / 60000, dp_accounting.GaussianDpEvent(1.1))
    rdp = privacy.epsilon(1.1, steps, 1e-5, num_clients=60000, clients_per_round=256, sampling="poisson")
    pld = privacy.epsilon(1.1, steps, 1e-5, num_clients=60000, clients_per_round=256, sampling="poisson",
                          accountant="pld")
    assert pld < rdp <= 3.01 and rdp > 2.5


def test_resume_of_a_poisson_run_ends_as_the_uninterrupted_one(tmp_path):
    from fedjax_sparse.driver import runner
    base = dict(algorithm="spafl", dataset="digits", num_clients=8, clients_per_round=3, local_epochs=1,
                client_sampling="poisson", eval_every=2)

    def rows(out):
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in open(out / "metrics.jsonl")]
    whole = tmp_path / "whole"
    runner.run(flat_config(**base, rounds=4, out=str(whole)), progress=False)
    part = tmp_path / "part"
    runner.run(flat_config(**base, rounds=2, out=str(part)), progress=False)
    runner.run(flat_config(**base, rounds=4, out=str(part)), resume=True, progress=False)
    assert rows(part) == rows(whole)
    assert [row["clients"] for row in rows(whole)] != [3, 3]

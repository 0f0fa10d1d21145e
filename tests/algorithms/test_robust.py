"""Robust aggregators, model-poisoning attacks, SignSGD and TopK (FSL paper baselines)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import Task, make_algorithm
from fedjax_sparse.algorithms import robust as R
from fedjax_sparse.mechanisms import attacks
from fedjax_sparse.mechanisms import robust_aggregation as ra
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.models import Dense, Flatten, sequential

from helpers import tiny_federated


# ---------------------------------------------------------------- aggregators
def test_trimmed_mean_by_hand():
    x = jnp.array([[1., 10.], [2., -5.], [3., 0.], [100., 1.], [-50., 2.]])
    # column 0 sorted [-50, 1, 2, 3, 100] -> mean(1, 2, 3) = 2; column 1 [-5, 0, 1, 2, 10] -> 1
    np.testing.assert_allclose(ra.trimmed_mean(x, 1), [2.0, 1.0])
    np.testing.assert_allclose(ra.trimmed_mean(x, 2), [2.0, 1.0])             # the medians
    np.testing.assert_allclose(ra.trimmed_mean(x, 0), x.mean(0), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(ra.trimmed_mean)(x, jnp.int32(1)), [2.0, 1.0])   # traced trim


def test_sort_rows_handles_signs_and_zeros():
    x = jnp.array([[0.5, -0.0, -3.0], [-1.5, 0.0, 1e-30], [2.0, -1e-30, -np.inf]], jnp.float32)
    np.testing.assert_array_equal(ra.sort_rows(x), np.sort(np.asarray(x), axis=0))


def test_multi_krum_by_hand():
    x = jnp.array([[0.], [1.], [2.], [10.], [11.]])
    # f = 1, r = 5: sums of squared distances to the 2 nearest: [1+4, 1+1, 1+4, 1+64, 1+81] -> pick 1
    agg, selected = ra.multi_krum(x, 1)           # K - 2f - 2 = 1 pick
    np.testing.assert_array_equal(selected, [False, True, False, False, False])
    np.testing.assert_allclose(agg, [1.0])
    # three picks: then r = 4, 1 neighbour: [4, 4, 1, 1] -> client 3 (first of the tie);
    # then r = 3: [4 (0 to 2), 4 (2 to 0), 81 (11 to 2)] -> client 0
    agg, selected = ra.multi_krum(x, 1, 3)
    np.testing.assert_array_equal(selected, [True, True, False, True, False])
    np.testing.assert_allclose(agg, [11.0 / 3.0], rtol=1e-6)


def test_multi_krum_discards_outliers():
    rng = np.random.default_rng(0)
    benign = rng.normal(0, 0.1, (8, 20))
    x = jnp.asarray(np.concatenate([benign, 50 + benign[:2]]), jnp.float32)
    agg, selected = ra.multi_krum(x, 2)            # K - 2f - 2 = 4 picks, all benign
    assert selected.sum() == 4 and not selected[8:].any()


def test_sign_majority_and_reverse_attack():
    signs = jnp.array([[1, -1, 1], [1, 1, -1], [-1, 1, -1]], jnp.int8)
    np.testing.assert_array_equal(ra.sign_majority(signs), [1, 1, -1])
    np.testing.assert_array_equal(ra.sign_majority(signs[:2]), [1, 0, 0])
    is_mal = jnp.array([False, False, True])
    # attackers know everyone: votes [1, 1, -1] -> they send [-1, -1, 1]
    attacked = attacks.sign_reverse_attack(signs, is_mal, jnp.ones(3, bool))
    np.testing.assert_array_equal(attacked, [[1, -1, 1], [1, 1, -1], [-1, -1, 1]])
    np.testing.assert_array_equal(ra.sign_majority(attacked), [1, -1, 1])


def test_topk_sparsify_and_bits():
    np.testing.assert_array_equal(ra.topk_sparsify(jnp.array([0.1, -3.0, 2.0, -0.5]), 0.5), [0, -3, 2, 0])
    np.testing.assert_array_equal(ra.topk_sparsify(jnp.array([0.1, -3.0, 2.0, -0.5]), 0.25), [0, -3, 0, 0])
    assert R.topk_uplink_bits(10, 5, "bitmap") == 5 * 32 + 10
    assert R.topk_uplink_bits(10, 5, "indices") == 5 * (32 + 4)


# ---------------------------------------------------------------- attacks
def test_min_max_attack_finds_the_largest_admissible_gamma():
    rng = np.random.default_rng(1)
    updates = jnp.asarray(rng.normal(0, 1, (5, 7)), jnp.float32)
    is_mal = jnp.array([False, False, False, True, True])
    known = jnp.ones(5, bool)
    for kind in ("std", "sign", "unit_vec"):
        out, gamma = attacks.min_max_attack(updates, is_mal, known, kind=kind, gamma_init=10.0, steps=40)
        x = np.asarray(updates, np.float64)
        mean = x.mean(0)
        dev = {"std": x.std(0, ddof=1), "sign": np.sign(mean), "unit_vec": mean / np.linalg.norm(mean)}[kind]
        bound = max(np.sum((a - b) ** 2) for a in x for b in x)

        def worst(g):
            return max(np.sum((mean - g * dev - u) ** 2) for u in x)
        # the admissible gammas form an interval [0, g*]; bisection for g* independently
        lo, hi = 0.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if worst(mid) <= bound else (lo, mid)
        assert abs(float(gamma) - lo) < 1e-3 * max(lo, 1.0), (kind, float(gamma), lo)
        np.testing.assert_allclose(out[3], mean - float(gamma) * dev, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(out[:3], updates[:3])


def test_trimmed_mean_with_copies_matches_direct_computation():
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, (7, 9)).astype(np.float32)
    is_mal = np.array([False, True, False, False, True, False, False])
    value = rng.normal(0, 3, 9).astype(np.float32)
    benign = x[~is_mal]
    sorted_benign = ra.sort_rows(jnp.asarray(x), jnp.asarray(~is_mal))
    np.testing.assert_array_equal(sorted_benign[:5], np.sort(benign, axis=0))   # the benign rows, sorted
    assert np.isnan(np.asarray(sorted_benign[5:])).all()                       # then the excluded rows
    valid = (np.arange(7) < 5)[:, None]
    prefix = jnp.concatenate([jnp.zeros((1, 9)), jnp.cumsum(jnp.where(valid, sorted_benign, 0.0), 0)])
    for trim in (0, 1, 2, 3):
        got = ra.trimmed_mean_with_copies(sorted_benign, prefix, 5, jnp.asarray(value), 2, trim)
        direct = ra.trimmed_mean(jnp.asarray(np.concatenate([benign, value[None], value[None]])), trim)
        np.testing.assert_allclose(got, direct, rtol=1e-5, atol=1e-6)


def test_tailored_attacks_stay_within_their_aggregator():
    rng = np.random.default_rng(3)
    updates = jnp.asarray(rng.normal(0, 1, (10, 30)), jnp.float32)
    is_mal = jnp.arange(10) >= 8
    known = jnp.ones(10, bool)
    out, gamma = attacks.tailored_multi_krum_attack(updates, is_mal, known, 2, ra.krum_count(10, 2))
    _, selected = ra.multi_krum(out, 2)
    assert float(gamma) > 0 and bool(selected[8:].all())
    mean = updates.mean(0)
    out, gamma = attacks.tailored_trimmed_mean_attack(updates, is_mal, known, 2)
    assert float(gamma) > 0
    np.testing.assert_allclose(out[9], mean - gamma * attacks.deviation(updates, known, "std"), rtol=1e-5, atol=1e-6)
    # the attack moves the trimmed mean away from the benign mean more than no attack does
    assert jnp.linalg.norm(ra.trimmed_mean(out, 2) - mean) > jnp.linalg.norm(ra.trimmed_mean(updates, 2) - mean)


def test_malicious_clients_fixed_seeded_subset():
    a = attacks.malicious_clients(1000, 0.1, 0)
    assert a.sum() == 100 and np.array_equal(a, attacks.malicious_clients(1000, 0.1, 0))
    assert not np.array_equal(a, attacks.malicious_clients(1000, 0.1, 1))
    assert attacks.malicious_clients(1000, 0.2, 0).sum() == 200 and attacks.malicious_clients(7, 0.2, 0).sum() == 1


def test_local_lr_schedules():
    lr = lambda step, schedule, rnd=0: float(R.local_lr(0.4, 0.999, rnd, jnp.int32(step), jnp.int32(10), 2, schedule))
    # CosineAnnealingLR(T_max=2 epochs) stepped per epoch: epoch 0 at lr, epoch 1 at lr / 2
    assert [lr(s, "cosine_epoch") for s in (0, 4, 5, 9)] == pytest.approx([0.4, 0.4, 0.2, 0.2])
    assert lr(5, "cosine_step") == pytest.approx(0.2) and lr(0, "cosine_step") == pytest.approx(0.4)
    assert lr(7, "constant", rnd=3) == pytest.approx(0.4 * 0.999 ** 3)


# ---------------------------------------------------------------- engine runs
@pytest.fixture(scope="module")
def tiny():
    _, data = tiny_federated()
    model = sequential("tiny_mlp", data.input_shape, data.num_classes,
                       [Flatten(), Dense("fc1", 8), Dense("fc2", data.num_classes, relu=False)])
    task = Task(model=model, num_clients=6, clients_per_round=6, local_epochs=1, batch_size=8, lr=0.05, rounds=2,
                preprocess=data.preprocess, seed=0)
    return data, task


def _run(task, data, name, options, rounds=2):
    engine = Engine(make_algorithm(name, task, options), task.num_clients, task.clients_per_round)
    state = engine.init(jax.random.PRNGKey(0))
    return engine.run_rounds(state, data, rounds)


@pytest.mark.parametrize("name,options,up_bits", [
    ("fedavg_robust", {"malicious_fraction": 0.34}, lambda p: 32 * p),
    ("trimmed_mean", {"malicious_fraction": 0.34}, lambda p: 32 * p),
    ("multi_krum", {"malicious_fraction": 0.34}, lambda p: 32 * p),
    ("signsgd", {"malicious_fraction": 0.34}, lambda p: p),
    ("topk", {"fraction": 0.1, "error_feedback": True}, lambda p: 32 * (p - int(0.9 * p)) + p),
])
def test_engine_runs(tiny, name, options, up_bits):
    data, task = tiny
    p = 64 * 8 + 8 * 4
    state, metrics = _run(task, data, name, options)
    assert np.isfinite(metrics["loss"]).all()
    np.testing.assert_allclose(metrics["uplink_bits"], 6 * up_bits(p))
    np.testing.assert_allclose(metrics["downlink_bits"], 6 * 32 * p)
    if "malicious_fraction" in options:
        np.testing.assert_array_equal(metrics["server_malicious_clients"], [2, 2])
    leaves = jax.tree_util.tree_leaves(state.server)
    assert all(np.isfinite(np.asarray(x)).all() for x in leaves)


def test_scale_attack_replaces_malicious_updates(tiny):
    """The authors' FedAvg attack: every sampled malicious client sends 1e5 x the global parameters."""
    from jax.flatten_util import ravel_pytree
    from fedjax_sparse.algorithms import ServerContext
    data, task = tiny
    alg = make_algorithm("fedavg_robust", task, {"attack": "scale", "malicious_fraction": 0.34})
    server, _ = alg.init(jax.random.PRNGKey(0))
    flat = ravel_pytree(server.variables["params"])[0]
    mask = attacks.malicious_clients(6, 0.34, 0)
    updates = jnp.zeros((6, flat.shape[0]))
    new, metrics = alg.server_update(server, updates, ServerContext(jnp.int32(0), jnp.arange(6), jnp.ones(6),
                                                                    jax.random.PRNGKey(0)))
    # mean of four zero updates and two copies of 1e5 * w: w + (2 / 6) * 1e5 * w
    np.testing.assert_allclose(ravel_pytree(new.variables["params"])[0], flat * (1 + 2e5 / 6), rtol=1e-5)
    assert int(metrics["malicious_clients"]) == mask.sum() == 2


def test_mean_aggregator_equals_plain_fedavg(tiny):
    """Without attackers, fedavg_robust's mean with plain SGD is FedAvg (uniform weights)."""
    data, task = tiny
    plain = dict(momentum=0.0, weight_decay=0.0, lr_decay=1.0, lr_schedule="constant")
    ours, _ = _run(task, data, "fedavg_robust", plain, rounds=1)
    ref, _ = _run(task, data, "fedavg", {"weighted": False}, rounds=1)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           ours.server.variables["params"], ref.server.variables["params"])


@pytest.mark.parametrize("name, options", [
    ("trimmed_mean", {"malicious_fraction": 0.34}),
    ("multi_krum", {"malicious_fraction": 0.34}),
    ("multi_krum", {"malicious_fraction": 0.34, "attacker_knowledge": "malicious", "trim_fraction": 0.2,
                    "krum_select": 3}),
    ("trimmed_mean", {"malicious_fraction": 0.34, "attack": "min_max", "deviation": "sign"}),
    ("fedavg_robust", {"malicious_fraction": 0.34, "weighted": True, "server_lr": 0.5}),
    ("fedavg_robust", {"malicious_fraction": 0.34, "attack": "tailored"}),
    ("fedavg_robust", {"malicious_fraction": 0.34, "attack": "scale", "attack_scale": 7.0}),
    ("multi_krum", {}),
])
def test_wrapped_fedavg_is_the_robust_server_update_written_out(tiny, name, options):
    """fedavg_robust and its aliases are paper_fedavg wrapped by with_aggregator and with_attack;
    their server update is, bit for bit, the FSL baseline's written out: the sampled malicious
    clients' updates replaced by the attack on the updates they know (tailored: against the
    aggregator, with f = the sampled malicious clients unless trim_fraction >= 0), the aggregate
    of the attacked updates, w + server_lr * aggregate."""
    from jax.flatten_util import ravel_pytree
    from fedjax_sparse.algorithms import ServerContext, algorithm_defaults
    data, task = tiny
    o = {**algorithm_defaults(name), **options}
    aggregator = {"trimmed_mean": "trimmed_mean", "multi_krum": "multi_krum"}.get(name, o.get("aggregator"))
    alg = make_algorithm(name, task, options)
    assert alg.name == name
    server, _ = alg.init(jax.random.PRNGKey(0))
    flat = ravel_pytree(server.variables["params"])[0]
    updates = jnp.asarray(np.random.default_rng(8).normal(0, 0.01, (6, flat.shape[0])), jnp.float32)
    weights = jnp.array([3.0, 1.0, 4.0, 1.0, 5.0, 9.0])
    ctx = ServerContext(jnp.int32(0), jnp.arange(6), weights, jax.random.PRNGKey(0))
    new, metrics = alg.server_update(server, updates, ctx)

    is_mal = jnp.asarray(attacks.malicious_clients(6, o["malicious_fraction"], 0))
    known = is_mal if o["attacker_knowledge"] == "malicious" else jnp.ones(6, bool)
    f = is_mal.sum() if o["trim_fraction"] < 0 else jnp.int32(int(6 * o["trim_fraction"]))
    num_select = ra.krum_count(6, f, o["krum_select"])
    search = dict(kind=o["deviation"], gamma_init=o["gamma_init"], steps=o["search_steps"])
    attacked, gamma = updates, 0.0
    if o["malicious_fraction"] > 0:
        if o["attack"] == "scale":
            attacked = jnp.where(is_mal[:, None], o["attack_scale"] * flat[None], updates)
        elif o["attack"] == "tailored" and aggregator == "trimmed_mean":
            attacked, gamma = attacks.tailored_trimmed_mean_attack(updates, is_mal, known, f, **search)
        elif o["attack"] == "tailored" and aggregator == "multi_krum":
            attacked, gamma = attacks.tailored_multi_krum_attack(updates, is_mal, known, f, num_select, **search)
        else:
            attacked, gamma = attacks.min_max_attack(updates, is_mal, known, **search)
    if aggregator == "trimmed_mean":
        aggregate = ra.trimmed_mean(attacked, f)
    elif aggregator == "multi_krum":
        aggregate, selected = ra.multi_krum(attacked, f, num_select)
        assert int(metrics["malicious_selected"]) == int((selected & is_mal).sum())
    else:
        w = weights if o["weighted"] else jnp.ones(6)
        aggregate = (w / w.sum()) @ attacked
    np.testing.assert_array_equal(ravel_pytree(new.variables["params"])[0], flat + o["server_lr"] * aggregate)
    assert int(metrics["malicious_clients"]) == int(is_mal.sum()) == (2 if o["malicious_fraction"] else 0)
    assert float(metrics["attack_gamma"]) == float(gamma)
    # Multi-Krum picks K - 2f - 2 = 1 of 6 here, so DYN-OPT can never get both malicious updates picked.
    tailored_krum = aggregator == "multi_krum" and o["attack"] == "tailored" and o["krum_select"] < 2
    assert (gamma != 0.0) == (o["malicious_fraction"] > 0 and o["attack"] != "scale" and not tailored_krum)

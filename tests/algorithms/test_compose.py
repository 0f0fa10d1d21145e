"""Robust aggregators and attacks as wrappers: any attack meets any aggregator, SpaFL and
FedDrop included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import Algorithm, ServerContext, Task, make_algorithm
from fedjax_sparse.algorithms.compose import Aggregator, UpdateServer, with_aggregator, with_attack
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.mechanisms import attacks
from fedjax_sparse.mechanisms import robust_aggregation as ra
from fedjax_sparse.mechanisms.attacks import Threat, malicious_clients
from fedjax_sparse.models import make_model
from helpers import tiny_federated


def recording(payload):
    """A server that stores the messages it receives (and broadcasts ``payload``)."""
    def server_update(server, messages, ctx):
        return {"seen": messages}, {}
    return Algorithm("rec", lambda key: ({"seen": None}, ()), lambda s, r: payload,
                     lambda *a: None, server_update)


def ctx_for(ids):
    return ServerContext(jnp.int32(0), jnp.asarray(ids, jnp.int32), jnp.ones(len(ids)), jax.random.PRNGKey(0))


def test_trimmed_mean_wrapper_hands_the_server_k_copies_of_the_trimmed_mean():
    rng = np.random.default_rng(0)
    messages = {"a": jnp.asarray(rng.normal(size=(10, 3, 2)), jnp.float32),
                "b": jnp.asarray(rng.normal(size=(10, 4)), jnp.float32)}
    alg = with_aggregator(recording(None), "trimmed_mean", trim_fraction=0.2)
    seen = alg.server_update({"seen": None}, messages, ctx_for(range(10)))[0]["seen"]
    for name, x in messages.items():
        s = np.sort(np.asarray(x), axis=0)[2:8]       # drop 2 largest and 2 smallest per coordinate
        expected = s.mean(0)
        np.testing.assert_allclose(np.asarray(seen[name]), np.broadcast_to(expected, x.shape), rtol=1e-5, atol=1e-6)


def test_min_max_wrapper_keeps_malicious_updates_within_the_benign_spread():
    rng = np.random.default_rng(1)
    k, p = 8, 20
    payload = {"w": jnp.asarray(rng.normal(size=p), jnp.float32)}
    updates = rng.normal(size=(k, p)).astype(np.float32)
    messages = {"w": jnp.asarray(np.asarray(payload["w"])[None] + updates)}
    mask = malicious_clients(20, 0.25, 3)
    ids = np.concatenate([np.flatnonzero(mask)[:2], np.flatnonzero(~mask)[:6]])
    alg = with_attack(recording(payload), "min_max", num_clients=20, malicious_fraction=0.25, seed=3)
    new, metrics = alg.server_update({"seen": None}, messages, ctx_for(ids))
    seen = np.asarray(new["seen"]["w"]) - np.asarray(payload["w"])[None]
    assert int(metrics["malicious_clients"]) == 2 and float(metrics["attack_gamma"]) > 0
    np.testing.assert_allclose(seen[2:], updates[2:], rtol=1e-5, atol=1e-6)      # benign rows untouched
    np.testing.assert_allclose(seen[0], seen[1], rtol=1e-5, atol=1e-6)           # colluders send one update
    assert np.abs(seen[0] - updates[:2].mean(0)).max() > 1e-3                     # it is not benign
    spread = max(np.sum((updates[i] - updates[j]) ** 2) for i in range(k) for j in range(k))
    assert max(np.sum((seen[0] - updates[j]) ** 2) for j in range(k)) <= spread * (1 + 1e-4)


def test_float_messages_only():
    alg = with_aggregator(recording(None), "mean")
    with pytest.raises(TypeError, match="float client messages"):
        alg.server_update({"seen": None}, {"r": jnp.zeros((3, 5), jnp.int32)}, ctx_for(range(3)))


@pytest.mark.parametrize("name, aggregator", [("spafl", "multi_krum"), ("fedavg", "trimmed_mean"),
                                              ("feddrop", None)])
def test_any_attack_meets_any_aggregator_on_the_engine(name, aggregator):
    _, data = tiny_federated((12,) * 10)
    model = make_model("cnn_small", data.input_shape, data.num_classes)
    task = Task(model=model, num_clients=10, clients_per_round=5, local_epochs=1, batch_size=8, lr=0.05,
                rounds=2, preprocess=data.preprocess, seed=0)
    alg = make_algorithm(name, task)
    if aggregator:
        alg = with_aggregator(alg, aggregator, trim_fraction=0.2)
    alg = with_attack(alg, "min_max", num_clients=10, malicious_fraction=0.3, seed=0)
    engine = Engine(alg, 10, 5)
    state, metrics = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 2)
    assert np.isfinite(metrics["loss"]).all()
    assert metrics["server_malicious_clients"].sum() > 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state.server)
               if jnp.issubdtype(np.asarray(x).dtype, jnp.floating))


def test_cli_flags_wrap_any_algorithm(tmp_path, capsys):
    import json

    from fedjax_sparse.cli import main
    out = tmp_path / "run"
    code = main(["run", "--algorithm", "spafl", "--dataset", "digits", "--num-clients", "10", "--clients-per-round",
                 "5", "--rounds", "2", "--local-epochs", "1", "--aggregator", "trimmed_mean", "--trim-fraction", "0.2",
                 "--attack", "min_max", "--malicious-fraction", "0.3", "--quiet", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "server_malicious_clients" in rows[-1] and "server_attack_gamma" in rows[-1]
    hparams = json.loads((out / "config.json").read_text())["algorithm_options"]
    assert hparams["aggregator"] == "trimmed_mean" and hparams["attack"] == "min_max"
    assert main(["run", "--dataset", "digits", "--aggregator", "median", "--rounds", "1", "--quiet"]) == 2
    assert "unknown --aggregator 'median'" in capsys.readouterr().err


# ---------------------------------------------------------------- UpdateServer, the threat, the paper's attacks
def update_algorithm():
    """FedAvg on a flat model: the server state is the global model w [P]; the clients send
    updates [P]; the server adds their uniform mean (an ``UpdateServer``, which the wrappers see into)."""
    server = UpdateServer(mean=lambda u, ctx: u.mean(0), apply=lambda w, a: w + a, model=lambda w: w)
    return Algorithm("upd", lambda key: (jnp.zeros(2), ()), lambda w, r: w, lambda *a: None, server)


THREAT = Threat(20, 0.25, "all", seed=3)
MAL, BENIGN = np.flatnonzero(THREAT.mask), np.flatnonzero(~THREAT.mask)


def ids_with(malicious: int, k: int = 5):
    """k sampled ids, the first ``malicious`` of them malicious under THREAT."""
    return np.concatenate([MAL[:malicious], BENIGN[:k - malicious]])


def test_update_server_applies_the_robust_aggregate_exactly():
    """Around an UpdateServer the aggregate replaces the mean (no K copies averaged again):
    w + trimmed_mean, bit for bit, for 25 clients (1/25 is not a float, so copies would round)."""
    rng = np.random.default_rng(5)
    updates = jnp.asarray(rng.normal(size=(25, 40)), jnp.float32)
    w = jnp.asarray(rng.normal(size=40), jnp.float32)
    for name, expected in [("trimmed_mean", ra.trimmed_mean(updates, 5)),
                           ("multi_krum", ra.multi_krum(updates, 5)[0])]:
        alg = with_aggregator(update_algorithm(), name, trim_fraction=0.2)
        new, metrics = alg.server_update(w, updates, ctx_for(range(25)))
        np.testing.assert_array_equal(new, w + expected)
    assert int(metrics["krum_selected"]) == 25 - 2 * 5 - 2


def test_aggregator_trims_the_number_of_sampled_malicious_clients():
    """trim_fraction < 0 with a threat: f = the malicious clients sampled this round. One
    coordinate 0, 1, 2, 9, 100: f = 0 -> mean 22.4; f = 1 -> (1 + 2 + 9) / 3 = 4; f = 2 -> the median 2."""
    x = jnp.array([[9.0], [0.0], [100.0], [2.0], [1.0]])
    for aggregator in ("trimmed_mean", "multi_krum"):
        alg = with_aggregator(update_algorithm(), aggregator, trim_fraction=-1, threat=THREAT)
        for malicious, trimmed in [(0, 22.4), (1, 4.0), (2, 2.0)]:
            new, metrics = alg.server_update(jnp.zeros(1), x, ctx_for(ids_with(malicious)))
            if aggregator == "trimmed_mean":
                np.testing.assert_allclose(new, [trimmed], rtol=1e-6)
            else:   # f malicious assumed: K - 2f - 2 picks (at least 1), and how many malicious were picked
                _, selected = ra.multi_krum(x, malicious)
                np.testing.assert_array_equal(new, ra.masked_mean(x, selected))
                assert int(metrics["malicious_selected"]) == int((selected[:malicious]).sum())
    with pytest.raises(ValueError, match="needs the threat"):
        with_aggregator(update_algorithm(), "trimmed_mean", trim_fraction=-1)
    assert Aggregator("multi_krum", 0.2).num_select(10, 2) == 4


def test_scale_attack_sends_a_multiple_of_the_global_model():
    """Two malicious of five send 10 w; three benign send 0: w + (2 * 10 w) / 5 = 5 w. Around a
    model-shaped message (FedAvg's models) the malicious update is 10 w: the message is w + 10 w."""
    w = jnp.array([1.0, -2.0])
    alg = with_attack(update_algorithm(), "scale", threat=THREAT, attack_scale=10.0)
    new, metrics = alg.server_update(w, jnp.zeros((5, 2)), ctx_for(ids_with(2)))
    np.testing.assert_allclose(new, 5 * w, rtol=1e-6)
    assert int(metrics["malicious_clients"]) == 2 and float(metrics["attack_gamma"]) == 0.0
    payload = {"w": w}
    alg = with_attack(recording(payload), "scale", threat=THREAT, attack_scale=10.0)
    seen = alg.server_update({"seen": None}, {"w": jnp.broadcast_to(w, (5, 2))}, ctx_for(ids_with(2)))[0]["seen"]
    np.testing.assert_allclose(seen["w"][:2], np.broadcast_to(11 * w, (2, 2)), rtol=1e-6)
    np.testing.assert_array_equal(seen["w"][2:], np.broadcast_to(w, (3, 2)))
    alg = with_attack(recording(None), "scale", threat=THREAT)
    with pytest.raises(TypeError, match="scale attack needs"):
        alg.server_update({"seen": None}, {"t": jnp.zeros((5, 2))}, ctx_for(ids_with(2)))


def test_tailored_attack_targets_the_aggregator_it_wraps():
    """``tailored`` is DYN-OPT against the with_aggregator inside (with its f and Multi-Krum
    count), and min-max around a plain mean; the wrapper's gamma is the mechanism's."""
    rng = np.random.default_rng(6)
    updates = jnp.asarray(rng.normal(size=(10, 12)), jnp.float32)
    ids = ids_with(3, 10)
    is_mal, known = THREAT.split(jnp.asarray(ids))
    f = jnp.int32(3)
    expected = {
        "trimmed_mean": attacks.tailored_trimmed_mean_attack(updates, is_mal, known, f)[1],
        "multi_krum": attacks.tailored_multi_krum_attack(updates, is_mal, known, f, ra.krum_count(10, f))[1],
        None: attacks.min_max_attack(updates, is_mal, known)[1],
    }
    assert len({float(g) for g in expected.values()}) == 3
    for aggregator, gamma in expected.items():
        alg = update_algorithm()
        if aggregator:
            alg = with_aggregator(alg, aggregator, trim_fraction=-1, threat=THREAT)
        alg = with_attack(alg, "tailored", threat=THREAT)
        _, metrics = alg.server_update(jnp.zeros(12), updates, ctx_for(ids))
        assert float(metrics["attack_gamma"]) == float(gamma), aggregator


def test_attacker_knowledge_and_the_none_attack():
    """knowledge='malicious': the attack uses only the sampled malicious clients' own updates;
    'none': nothing changes, the sampled malicious clients are only counted; an inactive threat
    (fraction 0) never attacks."""
    rng = np.random.default_rng(7)
    updates = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    ids = jnp.asarray(ids_with(2))
    is_mal = jnp.asarray(THREAT.mask)[ids]
    gammas = {}
    for knowledge in ("all", "malicious"):
        threat = Threat(20, 0.25, knowledge, seed=3)
        np.testing.assert_array_equal(threat.mask, THREAT.mask)
        _, metrics = with_attack(update_algorithm(), "min_max", threat=threat).server_update(
            jnp.zeros(4), updates, ctx_for(ids))
        gammas[knowledge] = float(metrics["attack_gamma"])
    assert gammas["all"] == float(attacks.min_max_attack(updates, is_mal, jnp.ones(5, bool))[1])
    assert gammas["malicious"] == float(attacks.min_max_attack(updates, is_mal, is_mal)[1]) != gammas["all"]
    for attack, threat in [("none", THREAT), ("min_max", Threat(20, 0.0))]:
        new, metrics = with_attack(update_algorithm(), attack, threat=threat).server_update(
            jnp.zeros(4), updates, ctx_for(ids))
        np.testing.assert_array_equal(new, updates.mean(0))
        assert int(metrics["malicious_clients"]) == int(threat.mask[np.asarray(ids)].sum())
        assert float(metrics["attack_gamma"]) == 0.0
    with pytest.raises(ValueError, match="attacker_knowledge"):
        Threat(20, 0.25, "everyone")
    with pytest.raises(ValueError, match="makes no client malicious"):
        with_attack(update_algorithm(), "min_max", num_clients=3, malicious_fraction=0.2)

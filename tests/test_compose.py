"""Robust aggregators and attacks as wrappers: any attack meets any aggregator, SpaFL and
FedDrop included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import Algorithm, ServerContext, Task, make_algorithm
from fedjax_sparse.algorithms.compose import with_aggregator, with_attack
from fedjax_sparse.engine import Engine
from fedjax_sparse.mechanisms.attacks import malicious_clients
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

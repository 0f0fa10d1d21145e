"""SpaFL: eq. (13), aggregation, reset rule, variants, cost accounting, engine runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import ClientContext, ServerContext, Task, make_algorithm
from fedjax_sparse.data.federated import ClientData
from fedjax_sparse.core.engine import Engine, reduce_client_metrics
from fedjax_sparse.models import make_model
from fedjax_sparse.algorithms import spafl_family as spafl  # fjs.algorithms.spafl is the builder

from helpers import hand_accuracies, tiny_dataset, tiny_federated

SIZES = (10, 37, 64, 23, 50, 41)


def make_task(data, model_name="cnn_small", epochs=1, batch_size=8, lr=0.05, k=3, rounds=3, num_classes=None):
    model = make_model(model_name, data.input_shape, num_classes or data.num_classes)
    return Task(model=model, num_clients=data.num_clients, clients_per_round=k, local_epochs=epochs,
                batch_size=batch_size, lr=lr, rounds=rounds, preprocess=data.preprocess)


def ctx(round_=0, cid=1):
    return ClientContext(jnp.int32(round_), jnp.int32(cid), jax.random.PRNGKey(5), jax.random.PRNGKey(6))


def client_data(data, cid, extra_padding=0):
    count = int(data.train_count[cid])
    rows = np.asarray(data.train_idx[cid])[:count]
    rows = np.concatenate([rows, np.full(extra_padding, 3, np.int32)])  # junk in the padding
    return ClientData(data.train_x, data.train_y, jnp.asarray(rows), jnp.int32(count))


def one_client(alg, cid=1, round_=0, data=None, server=None, client=None, extra_padding=0):
    server0, clients = alg.init(jax.random.PRNGKey(0))
    server = server0 if server is None else server
    client = jax.tree_util.tree_map(lambda x: x[cid], clients) if client is None else client
    return jax.jit(alg.client_update)(alg.broadcast(server, round_), client,
                                      client_data(data, cid, extra_padding), ctx(round_, cid))


def flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


# ---------------------------------------------------------------------------- eq. (13)
@pytest.mark.fast
def test_eq13_on_a_hand_computed_2x3_layer():
    # Paper layout W [out=2, in=3]; our kernel is [in, out] = W.T.
    W = np.array([[0.5, -0.2, 0.1],     # row sum +0.4
                  [-0.4, 0.1, -0.3]])   # row sum -0.6
    dtau = {"fc": jnp.array([0.3, 0.6])}
    params = {"fc": {"kernel": jnp.asarray(W.T, jnp.float32)}}
    new = spafl.eq13_update(params, dtau, {"fc": 3.0})["fc"]["kernel"]
    # Row 0: w -= (+1) * 0.3 / 3; row 1: w -= (-1) * 0.6 / 3.
    want = np.array([[0.4, -0.3, 0.0], [-0.2, 0.3, -0.1]])
    np.testing.assert_allclose(np.asarray(new).T, want, atol=1e-7)
    # A globally more important row (dtau < 0) grows in magnitude, a less important one shrinks.
    grown = spafl.eq13_update(params, {"fc": jnp.array([-0.3, 0.0])}, {"fc": 3.0})["fc"]["kernel"]
    np.testing.assert_allclose(np.asarray(grown).T[0], [0.6, -0.1, 0.2], atol=1e-7)


@pytest.mark.fast
def test_eq13_divisors_paper_vs_code():
    layers = spafl.thresholded_layers(make_model("lenet5_caffe", (28, 28, 1), 10))
    assert spafl.eq13_divisors(layers, "fan_in") == {"conv1": 25.0, "conv2": 500.0, "fc1": 800.0, "fc2": 500.0}
    assert spafl.eq13_divisors(layers, "kernel_area") == {"conv1": 25.0, "conv2": 25.0, "fc1": 800.0, "fc2": 500.0}


def test_all_after_replay_equals_updating_every_round():
    layers = spafl.thresholded_layers(make_model("cnn_small", (8, 8, 1), 4))
    setup = spafl.make_setup(make_model("cnn_small", (8, 8, 1), 4), {"eq13_apply": "all_after"})
    rng = np.random.default_rng(0)
    params = {l.name: {"kernel": jnp.asarray(rng.normal(0, 0.1, l.kernel_shape), jnp.float32)} for l in layers}
    deltas = [{l.name: jnp.asarray(rng.normal(0, 0.05, l.out_units), jnp.float32) for l in layers}
              for _ in range(4)]
    history = jnp.stack([spafl.flatten_thresholds(d, layers) for d in deltas])
    step_by_step = params
    for d in deltas[1:3]:
        step_by_step = spafl.eq13_update(step_by_step, d, setup.divisors)
    replayed = spafl.replay_eq13(setup, params, history, jnp.int32(1), jnp.int32(3))
    np.testing.assert_allclose(flat(replayed), flat(step_by_step), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------- server
@pytest.mark.fast
def test_server_averages_thresholds_uniformly_and_records_the_change():
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("spafl", make_task(data))
    server, _ = alg.init(jax.random.PRNGKey(0))
    server = server._replace(tau=jax.tree_util.tree_map(lambda t: t + 0.1, server.tau))
    messages = {name: jnp.stack([jnp.full_like(t, v) for v in (0.2, 0.5, 1.1)]) for name, t in server.tau.items()}
    sctx = ServerContext(jnp.int32(0), jnp.array([0, 1, 2]), jnp.array([10.0, 500.0, 1.0]), jax.random.PRNGKey(0))
    new, _ = alg.server_update(server, messages, sctx)
    for name in server.tau:
        np.testing.assert_allclose(new.tau[name], 0.6, rtol=1e-6)   # eq. (7): not data-weighted
        np.testing.assert_allclose(new.delta[name], 0.5, rtol=1e-6)


# ---------------------------------------------------------------------------- client
def test_padded_and_unpadded_client_give_the_same_update():
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("spafl", make_task(data, epochs=2), {"alpha": 0.1})
    state_a, msg_a, m_a = one_client(alg, data=data)
    state_b, msg_b, m_b = one_client(alg, data=data, extra_padding=40)
    np.testing.assert_allclose(flat(msg_a), flat(msg_b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flat(state_a), flat(state_b), rtol=1e-5, atol=1e-6)
    for key in ("loss", "flops", "density", "num_examples"):
        assert float(m_a[key]) == pytest.approx(float(m_b[key]), rel=1e-5)
    assert float(m_a["num_examples"]) == 2 * int(data.train_count[1])


def test_truncated_ste_leaves_thresholds_to_the_regulariser_with_lr_decay_and_ramp():
    """One step (all 10 samples in one batch): with the truncated STE the loss
    sends no gradient to tau (|mean|w| - tau| < 1), so SGD's first step moves
    every threshold by exactly lr_t * alpha * c(t) * exp(-0)."""
    _, data = tiny_federated(SIZES)
    task = make_task(data, batch_size=16, lr=0.2)
    opts = {"alpha": 0.3, "ste": "truncated", "lr_decay": 0.5, "lr_min": 0.01, "ramp": True, "eq13": False}
    alg = make_algorithm("spafl", task, opts)
    _, msg, _ = one_client(alg, cid=0, round_=1, data=data)  # client 0 has 10 samples
    lr_t, c_t = 0.2 * 0.5, 1 / (1 + np.exp(-5.0))
    np.testing.assert_allclose(flat(msg), lr_t * 0.3 * c_t, rtol=1e-5)
    _, msg, _ = one_client(alg, cid=0, round_=6, data=data)  # 0.2 * 0.5**6 < lr_min
    np.testing.assert_allclose(flat(msg), 0.01 * 0.3 * 1 / (1 + np.exp(-55.0)), rtol=1e-5)
    # With clamping, a huge step is clipped into [0, 1].
    clamped = make_algorithm("spafl", task, {**opts, "alpha": 1e3, "clamp": True, "lr_decay": 1.0})
    state, msg, _ = one_client(clamped, cid=0, round_=1, data=data)
    np.testing.assert_allclose(flat(msg), 1.0)
    assert all(float(jnp.abs(state.params[n]["kernel"]).max()) <= 1.0 for n in msg)


def test_reset_rule_revives_a_fully_pruned_layer():
    """Global fc2 thresholds of 10 prune every fc2 row in the first forward;
    the next forward sees a kept fraction of 0 <= 1% and resets them to 0."""
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("spafl", make_task(data, epochs=2, batch_size=8), {"alpha": 0.0, "eq13": False})
    server, _ = alg.init(jax.random.PRNGKey(0))
    server = server._replace(tau={**server.tau, "fc2": jnp.full_like(server.tau["fc2"], 10.0)})
    state, msg, metrics = one_client(alg, cid=1, data=data, server=server)
    assert float(jnp.abs(msg["fc2"]).max()) < 1.0 and float(state.kept["fc2"]) > 0.01
    assert float(metrics["threshold_resets"]) == 1.0
    no_reset = make_algorithm("spafl", make_task(data, epochs=2, batch_size=8),
                              {"alpha": 0.0, "eq13": False, "reset_threshold": False})
    state, msg, metrics = one_client(no_reset, cid=1, data=data, server=server)
    # (the identity STE still moves pruned rows' thresholds a little, but nowhere near 0)
    assert float(jnp.abs(msg["fc2"] - 10.0).max()) < 0.1 and float(state.kept["fc2"]) == 0.0
    assert float(metrics["threshold_resets"]) == 0.0


def test_client_applies_eq13_with_the_broadcast_change_before_training():
    """With lr = 0 local training changes nothing, so the client's new weights
    are exactly eq. (13) of its old weights with the server's dtau (round > 0),
    and untouched without eq. (13)."""
    _, data = tiny_federated(SIZES)
    task = make_task(data, lr=0.0)
    alg = make_algorithm("spafl", task, {"alpha": 0.0})
    server, clients = alg.init(jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)
    delta = {n: jnp.asarray(rng.normal(0, 0.01, t.shape), jnp.float32) for n, t in server.delta.items()}
    server = server._replace(delta=delta)
    before = jax.tree_util.tree_map(lambda x: x[3], clients.params)
    state, _, _ = one_client(alg, cid=3, round_=2, data=data, server=server)
    want = spafl.eq13_update(before, delta, spafl.eq13_divisors(alg_layers(task), "fan_in"))
    np.testing.assert_allclose(flat(state.params), flat(want), rtol=1e-6, atol=1e-8)
    assert float(np.abs(flat(state.params) - flat(before)).max()) > 1e-5
    state, _, _ = one_client(make_algorithm("spafl_no_eq13", task, {"alpha": 0.0}), cid=3, round_=2,
                             data=data, server=server)
    np.testing.assert_array_equal(flat(state.params), flat(before))


def alg_layers(task):
    return spafl.thresholded_layers(task.model)


def test_thresholds_only_keeps_weights_frozen():
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("spafl_thresholds_only", make_task(data, epochs=2), {"alpha": 0.05})
    _, clients = alg.init(jax.random.PRNGKey(0))
    state, msg, _ = one_client(alg, cid=2, data=data)
    np.testing.assert_array_equal(flat(state.params), flat(jax.tree_util.tree_map(lambda x: x[2], clients.params)))
    assert float(np.abs(flat(msg)).max()) > 0
    with pytest.raises(ValueError, match="eq13=false"):
        make_algorithm("spafl", make_task(data), {"train_weights": False})


def test_lenet_accounting_bits_and_flops_with_density():
    """Bits: 32 x 580 thresholds, each way, per sampled client (Appendix A.3).
    FLOPs of one step on n samples with fixed masks: 3 x n x sum_l 2 MACs_l x kept_l,
    plus 1.5 x 430,500 for one eq. (13) update (Appendix A.4)."""
    ds = tiny_dataset(n_train=40, n_test=10, shape=(28, 28, 1))
    from fedjax_sparse.data.federated import build_federated_data
    from helpers import split_partition
    data = build_federated_data(ds, split_partition(ds, (12, 28)))
    task = make_task(data, "lenet5_caffe", epochs=1, batch_size=16, lr=1e-4, k=1, num_classes=10)
    alg = make_algorithm("spafl", task, {"alpha": 0.0})
    assert alg.hparams["num_thresholds"] == 580
    server, _ = alg.init(jax.random.PRNGKey(0))
    tau = dict(server.tau)
    tau["conv2"] = tau["conv2"].at[:10].set(5.0)     # 40 of 50 filters kept
    tau["fc1"] = tau["fc1"].at[::2].set(5.0)         # 250 of 500 neurons kept
    server = server._replace(tau=tau)
    _, _, m = one_client(alg, cid=0, round_=1, data=data, server=server)   # 12 samples, one step
    macs = {"conv1": 24 * 24 * 25 * 20, "conv2": 8 * 8 * 500 * 50, "fc1": 800 * 500, "fc2": 500 * 10}
    kept = {"conv1": 1.0, "conv2": 0.8, "fc1": 0.5, "fc2": 1.0}
    want = 3 * 12 * sum(2 * macs[n] * kept[n] for n in macs) + 1.5 * 430_500
    assert float(m["flops"]) == pytest.approx(want, rel=1e-5)
    assert float(m["uplink_bits"]) == float(m["downlink_bits"]) == 32 * 580
    round_ = reduce_client_metrics(jax.tree_util.tree_map(lambda x: jnp.stack([x] * 10), m))
    assert float(round_["uplink_bits"] + round_["downlink_bits"]) == 32 * 580 * 10 * 2
    assert 500 * 32 * 580 * 10 * 2 / 1e9 == pytest.approx(0.1856)  # the paper's 0.1856 Gbit


# ---------------------------------------------------------------------------- engine
def test_engine_run_moves_thresholds_prunes_and_agrees_across_parallelism_modes():
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("spafl", make_task(data, epochs=1, batch_size=16), {"alpha": 0.2})
    results = {}
    for mode in ("map", "vmap"):
        engine = Engine(alg, data.num_clients, 3, client_parallelism=mode)
        state, metrics = engine.run_rounds(engine.init(jax.random.PRNGKey(1)), data, 3)
        results[mode] = (state, metrics)
    state, metrics = results["map"]
    np.testing.assert_allclose(flat(state.server.tau), flat(results["vmap"][0].server.tau), rtol=1e-4, atol=1e-6)
    assert float(np.abs(flat(state.server.tau)).min()) > 0          # every threshold moved
    assert float(metrics["density"][-1]) < 1.0                         # rows were pruned
    np.testing.assert_allclose(metrics["uplink_bits"], 3 * 32 * alg.hparams["num_thresholds"])
    evaluation = engine.evaluate(state, data)
    per_client, glob = hand_accuracies(alg, state, data)
    np.testing.assert_allclose(evaluation["client_accuracies"], per_client)
    assert evaluation["accuracy"] == pytest.approx(per_client.mean())
    assert glob is None and evaluation["global_accuracy"] is None
    # Learning: 4 classes (chance 0.25), 0.23 before training and 0.48 after these 3 rounds (measured).
    assert evaluation["accuracy"] > 0.4


@pytest.mark.parametrize("name,options", [("spafl_local", {}), ("spafl", {"eq13_apply": "all_after",
                                                                          "eval_thresholds": "global",
                                                                          "keep_optimizer_state": False})])
def test_variants_run_in_the_engine(name, options):
    _, data = tiny_federated(SIZES)
    alg = make_algorithm(name, make_task(data, epochs=1, batch_size=16), {"alpha": 0.2, **options})
    engine = Engine(alg, data.num_clients, 2)
    state, metrics = engine.run_rounds(engine.init(jax.random.PRNGKey(2)), data, 2)
    assert np.isfinite(metrics["loss"]).all()
    if name == "spafl_local":
        assert float(metrics["uplink_bits"].sum() + metrics["downlink_bits"].sum()) == 0.0
        assert state.server == spafl.SpaflServerState(None, None, None, None)
    else:
        assert int(state.server.num_deltas) == 2
        assert float(np.abs(np.asarray(state.server.history[:2])).max()) > 0
    evaluation = engine.evaluate(state, data)
    per_client, _ = hand_accuracies(alg, state, data)   # own vs global thresholds, replayed eq. (13)
    np.testing.assert_allclose(evaluation["client_accuracies"], per_client)
    assert evaluation["accuracy"] == pytest.approx(per_client.mean())

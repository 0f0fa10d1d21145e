"""Round engine: padding, parallelism modes, scan vs per-round, sampling, FedAvg, Local."""
import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import Algorithm, ClientContext, Task, client_metrics, make_algorithm
from fedjax_sparse.data.federated import ClientData
from fedjax_sparse.core.accounting import Cost
from fedjax_sparse.driver.progress import format_summary
from fedjax_sparse.core.engine import Engine, metrics_to_host, reduce_client_metrics, sample_clients
from fedjax_sparse.models import make_model
from fedjax_sparse.core.training import run_local_epochs

from helpers import tiny_federated

SIZES = (10, 37, 64, 23, 50, 41)


def make_task(data, model_name="cnn_small", epochs=2, batch_size=8, lr=0.1, k=3):
    model = make_model(model_name, data.input_shape, data.num_classes)
    return Task(model=model, num_clients=data.num_clients, clients_per_round=k, local_epochs=epochs,
                batch_size=batch_size, lr=lr, rounds=3, preprocess=data.preprocess)


def leaves_close(a, b, atol=1e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-5)


def test_padded_client_gives_same_update_as_unpadded():
    _, data = tiny_federated(SIZES)
    task = make_task(data)
    alg = make_algorithm("fedavg", task, {"momentum": 0.9})
    server, _ = alg.init(jax.random.PRNGKey(0))
    payload = alg.broadcast(server, 0)
    cid = 1
    count = int(data.train_count[cid])
    rows = np.asarray(data.train_idx[cid])[:count]
    ctx = ClientContext(jnp.int32(0), jnp.int32(cid), jax.random.PRNGKey(5), jax.random.PRNGKey(6))
    exact = ClientData(data.train_x, data.train_y, jnp.asarray(rows), jnp.int32(count))
    padded_rows = np.concatenate([rows, np.full(3 * count, 7, np.int32)])  # junk in the padding
    padded = ClientData(data.train_x, data.train_y, jnp.asarray(padded_rows), jnp.int32(count))
    _, msg_a, m_a = jax.jit(alg.client_update)(payload, (), exact, ctx)
    _, msg_b, m_b = jax.jit(alg.client_update)(payload, (), padded, ctx)
    leaves_close(msg_a, msg_b, atol=1e-6)
    assert float(m_a["loss"]) == pytest.approx(float(m_b["loss"]), rel=1e-6)
    assert float(m_a["num_examples"]) == float(m_b["num_examples"]) == 2 * count


def test_local_loop_runs_each_client_for_its_own_number_of_steps():
    """E * ceil(n / B) steps per client, every real sample seen once per epoch, no padding."""
    _, data = tiny_federated(SIZES)
    epochs, batch = 3, 8

    def count_client(cid):
        def step(carry, batch_, step_index, num_steps, key):
            seen, steps = carry
            return (seen + batch_.mask.sum(), steps + 1), 0.0
        cd = ClientData(data.train_x, data.train_y, data.train_idx[cid], data.train_count[cid])
        (seen, steps), stats = run_local_epochs(step, (0.0, 0), cd, jax.random.PRNGKey(cid),
                                                     epochs=epochs, batch_size=batch, preprocess=data.preprocess)
        return seen, steps, stats
    for cid, n in enumerate(SIZES):
        seen, steps, stats = jax.jit(count_client, static_argnums=0)(cid)
        assert int(steps) == epochs * -(-n // batch) == int(stats.num_steps)
        assert float(seen) == epochs * n == int(stats.num_examples)


@pytest.mark.fast
def test_each_epoch_visits_every_sample_exactly_once():
    _, data = tiny_federated(SIZES)
    cid, batch = 2, 8
    n = SIZES[cid]
    cd = ClientData(jnp.arange(len(data.train_y)), data.train_y, data.train_idx[cid], data.train_count[cid])

    def step(carry, b, step_index, num_steps, key):
        # x is the pool index itself (identity preprocess): record which samples were used.
        hist = carry.at[b.x.astype(jnp.int32)].add(b.mask)
        return hist, 0.0
    hist, _ = run_local_epochs(step, jnp.zeros(len(data.train_y)), cd, jax.random.PRNGKey(0), epochs=2,
                               batch_size=batch, preprocess=lambda x: x)
    hist = np.asarray(hist)
    members = np.asarray(data.train_idx[cid])[:n]
    assert (hist[members] == 2).all() and hist.sum() == 2 * n


@pytest.mark.parametrize("algorithm", ["fedavg", "local"])
def test_vmap_and_map_parallelism_agree(algorithm):
    """Local keeps personal state: a schedule that put results back in the wrong order would
    write one client's model into another's row, and FedAvg would weight them wrong."""
    _, data = tiny_federated(SIZES)
    alg = make_algorithm(algorithm, make_task(data), {})
    results = []
    for mode in ("vmap", "map"):
        engine = Engine(alg, data.num_clients, 3, client_parallelism=mode)
        state, metrics = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 2)
        results.append((state, metrics))
    for other in results[1:]:
        leaves_close(results[0][0], other[0], atol=1e-5)
        leaves_close(results[0][1], other[1], atol=1e-4)


@pytest.mark.fast
def test_executed_client_steps_by_hand():
    from fedjax_sparse.core.engine import executed_client_steps
    steps = jnp.asarray([5, 1, 3, 2, 8], jnp.int32)
    assert int(executed_client_steps(steps, "map")) == 19          # exactly what the clients need
    assert int(executed_client_steps(steps, "vmap")) == 5 * 8      # everyone runs the longest
    # packed: sorted [1, 2, 3, 4, 5, 8]; in pairs (1, 2) (3, 4) (5, 8) -> 2 x (2 + 4 + 8); in threes 3 x (3 + 8)
    six = jnp.asarray([5, 1, 3, 2, 8, 4], jnp.int32)
    assert int(executed_client_steps(six, "packed", 2)) == 28
    assert int(executed_client_steps(six, "packed", 3)) == 33
    assert int(executed_client_steps(six, "packed", 1)) == 23


@pytest.mark.fast
def test_pack_width_is_the_widest_group_within_the_padding_target():
    from fedjax_sparse.core.engine import choose_pack_width
    # One pinned cohort, steps 1, 1, 10, 10: all four in lockstep run 40 for 22 useful (1.82); pairs of
    # equal clients pad nothing.
    assert choose_pack_width(np.array([1, 10, 1, 10]), 4, cohorts=np.array([[0, 1, 2, 3]])) == (2, 1.0)
    # Equal clients: the whole cohort at once (vmap's width), padding nothing.
    assert choose_pack_width(np.full(20, 7), 5) == (5, 1.0)
    # No group of two within 1.2 (1 and 3 steps: 6 / 4 = 1.5): one client after another.
    assert choose_pack_width(np.array([1, 3]), 2, cohorts=np.array([[0, 1]])) == (1, 1.0)
    width, ratio = choose_pack_width(np.array([3, 4, 1, 9, 9, 2, 5, 30]), 4)
    assert width in (1, 2, 4) and ratio <= 1.2


@pytest.mark.parametrize("algorithm", ["fedavg", "local"])
def test_packed_clients_compute_what_map_computes(algorithm):
    """Clients sorted by size, in lockstep pairs: a wrong permutation back would write one client's
    model into another's row (Local) or weight messages wrongly (FedAvg); the executed steps are the
    pairs' longest members'."""
    _, data = tiny_federated(SIZES)
    task = make_task(data)
    alg = make_algorithm(algorithm, task, {})
    results = {}
    for mode, width in (("map", 1), ("packed", 3)):
        engine = Engine(alg, data.num_clients, 6, client_parallelism=mode, pack_width=width,
                        local_epochs=task.local_epochs, batch_size=task.batch_size)
        results[mode] = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 2)
    # Bitwise, client by client (XLA:CPU's batched matmuls round as its single ones here).
    for a, b in zip(jax.tree_util.tree_leaves(results["map"][0]), jax.tree_util.tree_leaves(results["packed"][0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for key in set(results["map"][1]) - {"client_steps_executed"}:
        np.testing.assert_array_equal(results["map"][1][key], results["packed"][1][key], err_msg=key)
    steps = np.sort(task.local_epochs * -(-np.asarray(SIZES) // task.batch_size))
    assert results["packed"][1]["client_steps_executed"].tolist() == [3 * (steps[2] + steps[5])] * 2


def test_round_metrics_count_useful_and_executed_client_steps():
    _, data = tiny_federated(SIZES)
    task = make_task(data)
    alg = make_algorithm("fedavg", task, {})
    counts = np.asarray(data.train_count)
    for mode in ("map", "vmap"):
        engine = Engine(alg, data.num_clients, data.num_clients, client_parallelism=mode,
                        local_epochs=task.local_epochs, batch_size=task.batch_size)
        _, metrics = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 1)
        steps = task.local_epochs * -(-counts // task.batch_size)
        assert metrics["client_steps"].tolist() == [int(steps.sum())]
        expected = steps.sum() if mode == "map" else len(steps) * steps.max()
        assert metrics["client_steps_executed"].tolist() == [int(expected)]


def test_scan_and_per_round_paths_agree():
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("fedavg", make_task(data), {})
    engine = Engine(alg, data.num_clients, 3)
    scanned, m_scan = engine.run_rounds(engine.init(jax.random.PRNGKey(1)), data, 3)
    state = engine.init(jax.random.PRNGKey(1))
    losses = []
    for _ in range(3):
        state, m = engine.round_fn(state, data)
        losses.append(float(m["loss"]))
    leaves_close(scanned, state, atol=1e-5)
    np.testing.assert_allclose(np.asarray(m_scan["loss"]), losses, rtol=1e-5)
    assert int(state.round) == 3


def test_client_sampling_is_deterministic_distinct_and_uniform():
    key = jax.random.PRNGKey(0)
    a, b = sample_clients(key, 100, 10), sample_clients(key, 100, 10)
    np.testing.assert_array_equal(a, b)
    assert len(set(np.asarray(a).tolist())) == 10
    assert not np.array_equal(a, sample_clients(jax.random.PRNGKey(1), 100, 10))
    np.testing.assert_array_equal(sample_clients(key, 7, 7), np.arange(7))
    counts = np.zeros(20)
    for i in range(400):
        counts[np.asarray(sample_clients(jax.random.PRNGKey(i), 20, 5))] += 1
    # Each client is picked with probability 1/4: 100 expected, sd ~ 8.7.
    assert counts.min() > 60 and counts.max() < 140


def test_engine_rejects_more_sampled_than_clients():
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("fedavg", make_task(data), {})
    with pytest.raises(ValueError, match="clients per round"):
        Engine(alg, data.num_clients, data.num_clients + 1)


@pytest.mark.fast
def test_fedavg_server_is_data_weighted_mean():
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("fedavg", make_task(data), {})
    server, _ = alg.init(jax.random.PRNGKey(0))
    a = jax.tree_util.tree_map(jnp.ones_like, server.variables)
    b = jax.tree_util.tree_map(lambda x: 5 * jnp.ones_like(x), server.variables)
    msgs = jax.tree_util.tree_map(lambda x, y: jnp.stack([x, y]), a, b)
    ctx = dataclasses.make_dataclass("C", ["weights"])(jnp.array([10.0, 30.0]))
    new, _ = alg.server_update(server, msgs, ctx)
    for leaf in jax.tree_util.tree_leaves(new.variables):
        np.testing.assert_allclose(np.asarray(leaf), 4.0)  # (1*10 + 5*30) / 40
    unweighted = make_algorithm("fedavg", make_task(data), {"weighted": False})
    new, _ = unweighted.server_update(server, msgs, ctx)
    np.testing.assert_allclose(np.asarray(jax.tree_util.tree_leaves(new)[0]), 3.0)


@pytest.mark.fast
def test_fedavg_single_step_matches_hand_computed_gradient():
    """One client, one full batch, one epoch of logistic regression: w - lr * grad by hand."""
    _, data = tiny_federated((12, 12))
    model = make_model("logreg", data.input_shape, data.num_classes)
    task = Task(model=model, num_clients=2, clients_per_round=1, local_epochs=1, batch_size=12, lr=0.5,
                rounds=1, preprocess=data.preprocess)
    alg = make_algorithm("fedavg", task, {})
    server, _ = alg.init(jax.random.PRNGKey(0))
    ctx = ClientContext(jnp.int32(0), jnp.int32(0), jax.random.PRNGKey(1), jax.random.PRNGKey(2))
    cd = ClientData(data.train_x, data.train_y, data.train_idx[0], data.train_count[0])
    _, msg, _ = alg.client_update(server.variables, (), cd, ctx)
    rows = np.asarray(data.train_idx[0])
    x = np.asarray(data.train_x)[rows].reshape(12, -1).astype(np.float64) / 255.0
    y = np.asarray(data.train_y)[rows]
    w = np.asarray(server.variables["params"]["fc"]["kernel"], np.float64)
    bias = np.asarray(server.variables["params"]["fc"]["bias"], np.float64)
    logits = x @ w + bias
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(12), y] -= 1.0
    grad_w, grad_b = x.T @ p / 12, p.mean(0)
    np.testing.assert_allclose(np.asarray(msg["params"]["fc"]["kernel"]), w - 0.5 * grad_w, atol=1e-5)
    np.testing.assert_allclose(np.asarray(msg["params"]["fc"]["bias"]), bias - 0.5 * grad_b, atol=1e-5)


def test_local_only_sampled_clients_change_and_nothing_is_communicated():
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("local", make_task(data), {})
    engine = Engine(alg, data.num_clients, 2)
    state0 = engine.init(jax.random.PRNGKey(0))
    before = jax.device_get(state0.clients)
    state1, metrics = engine.round_fn(state0, data)
    ids = np.asarray(sample_clients(jax.random.split(jax.random.fold_in(state1.key, 0), 4)[0],
                                    data.num_clients, 2))
    kernel_before = before.variables["params"]["conv1"]["kernel"]
    kernel_after = np.asarray(state1.clients.variables["params"]["conv1"]["kernel"])
    changed = [i for i in range(data.num_clients) if not np.array_equal(kernel_before[i], kernel_after[i])]
    assert sorted(changed) == sorted(ids.tolist())
    assert metrics["uplink_bits"].total() == metrics["downlink_bits"].total() == 0


def test_cohort_is_kept_for_resample_every_rounds():
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("local", make_task(data), {})
    every_round = Engine(alg, data.num_clients, 2)
    every_two = Engine(alg, data.num_clients, 2, resample_every=2)
    key = jax.random.PRNGKey(3)
    cohorts = [tuple(np.asarray(every_two.cohort(key, jnp.int32(r))).tolist()) for r in range(16)]
    assert all(cohorts[2 * j] == cohorts[2 * j + 1] for j in range(8))
    assert len(set(cohorts)) > 2
    # A cohort is drawn exactly as the every-round engine draws its first round's clients.
    for r in range(0, 16, 2):
        np.testing.assert_array_equal(every_two.cohort(key, jnp.int32(r)), every_round.cohort(key, jnp.int32(r)))
    # The engine trains exactly the cohort: with Local, rounds 0 and 1 touch the same two clients.
    state = every_two.init(jax.random.PRNGKey(0))
    before = np.asarray(state.clients.variables["params"]["conv1"]["kernel"])
    state, _ = every_two.run_rounds(state, data, 2)
    after = np.asarray(state.clients.variables["params"]["conv1"]["kernel"])
    changed = [i for i in range(data.num_clients) if not np.array_equal(before[i], after[i])]
    assert sorted(changed) == sorted(np.asarray(every_two.cohort(state.key, jnp.int32(0))).tolist())
    with pytest.raises(ValueError, match="resample_every"):
        Engine(alg, data.num_clients, 2, resample_every=0)


def test_fedavg_learns_and_evaluates_both_ways():
    _, data = tiny_federated(SIZES)
    alg = make_algorithm("fedavg", make_task(data, epochs=3, lr=0.2), {})
    engine = Engine(alg, data.num_clients, 3)
    state, _ = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 8)
    ev = engine.evaluate(state, data)
    assert ev["accuracy"] > 0.6 and ev["global_accuracy"] > 0.6
    # Personalised mean with one global model == per-client accuracy of that model, recomputed here.
    accs = []
    for c in range(data.num_clients):
        n = int(data.test_count[c])
        rows = np.asarray(data.test_idx[c])[:n]
        logits = alg.global_predict(state.server, data.preprocess(data.test_x[rows]))
        accs.append(float((np.argmax(np.asarray(logits), -1) == np.asarray(data.test_y)[rows]).mean()))
    assert ev["accuracy"] == pytest.approx(np.mean(accs), abs=1e-6)
    assert ev["accuracy_std"] == pytest.approx(np.std(accs), abs=1e-6)


def test_one_shared_global_pass_evaluates_exactly_like_per_client_passes():
    _, data = tiny_federated(SIZES)
    # Clients 1 and 2 share client 0's test rows (overlapping test sets are allowed).
    test_idx = np.asarray(data.test_idx).copy()
    test_count = np.asarray(data.test_count).copy()
    n0 = min(int(test_count[0]), test_idx.shape[1])
    test_idx[1, :n0] = test_idx[2, :n0] = test_idx[0, :n0]
    test_count[1] = test_count[2] = n0
    data = data.replace(test_idx=jnp.asarray(test_idx), test_count=jnp.asarray(test_count))
    alg = make_algorithm("fedavg", make_task(data, epochs=1, lr=0.2), {})
    shared = Engine(alg, data.num_clients, 3, eval_batch_size=4)
    separate = dataclasses.replace(shared, eval_shared_global_pass=False)
    state, _ = shared.run_rounds(shared.init(jax.random.PRNGKey(0)), data, 2)
    a, b = shared.evaluate(state, data), separate.evaluate(state, data)
    np.testing.assert_array_equal(a["client_accuracies"], b["client_accuracies"])
    for key in ("accuracy", "accuracy_std", "global_accuracy"):
        assert a[key] == b[key]
    for key in ("test_loss", "global_test_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-5)
    assert a["client_accuracies"][1] == a["client_accuracies"][2] == a["client_accuracies"][0]


def test_reduce_client_metrics():
    m = {"loss": jnp.array([1.0, 3.0]), "num_examples": jnp.array([10, 30], jnp.int32),
         "flops": Cost.terms([1], jnp.array([[10**9], [2 * 10**9]], jnp.int32)),
         "uplink_bits": Cost(jnp.ones((2, 1, 2), jnp.int32), (32,)),
         "downlink_bits": Cost(jnp.ones((2, 1, 2), jnp.int32), (64,)), "density": jnp.array([0.5, 1.0])}
    r = reduce_client_metrics(m)
    assert float(r["loss"]) == pytest.approx(2.5)
    assert float(r["density"]) == pytest.approx(0.75)
    # Costs and examples stay per client on the device; the host sums them exactly.
    host = metrics_to_host(jax.tree_util.tree_map(lambda x: x[None], r))
    assert host["flops"].tolist() == [3 * 10**9]
    assert host["uplink_bits"].tolist() == [64] and host["downlink_bits"].tolist() == [128]
    assert host["num_examples"].tolist() == [40]


def test_a_new_algorithm_needs_only_the_interface():
    """A minimal algorithm defined right here runs on the engine unchanged."""
    _, data = tiny_federated(SIZES)

    def init(key):
        return {"rounds_seen": jnp.int32(0)}, {"visits": jnp.zeros((data.num_clients,), jnp.int32)}

    def client_update(payload, state, cd, ctx):
        # Cost accounting is optional: this algorithm reports only what it must.
        return {"visits": state["visits"] + 1}, cd.count, client_metrics(loss=0.0, num_examples=cd.count)

    def server_update(server, messages, ctx):
        return {"rounds_seen": server["rounds_seen"] + 1}, {"examples": messages.sum()}

    alg = Algorithm("counter", init, lambda s, r: (), client_update, server_update,
                    global_predict=lambda s, x: jnp.zeros((x.shape[0], data.num_classes)))
    engine = Engine(alg, data.num_clients, 2)
    state, metrics = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 5)
    assert int(state.server["rounds_seen"]) == 5
    assert int(state.clients["visits"].sum()) == 10
    assert "server_examples" in metrics and "uplink_bits" not in metrics and "flops" not in metrics


def test_sharding_clients_over_two_devices_gives_the_same_round(tmp_path):
    """Two fake CPU devices (XLA flag, in a subprocess): sharded and unsharded rounds agree."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent("""
        import jax, numpy as np, sys
        sys.path.insert(0, %r)
        from helpers import tiny_federated
        from fedjax_sparse.algorithms import Task, make_algorithm
        from fedjax_sparse.core.engine import Engine
        from fedjax_sparse.models import make_model
        assert jax.local_device_count() == 2
        _, data = tiny_federated((10, 37, 64, 23, 50, 41))
        model = make_model("cnn_small", data.input_shape, data.num_classes)
        task = Task(model=model, num_clients=6, clients_per_round=4, local_epochs=1, batch_size=8, lr=0.1,
                    rounds=2, preprocess=data.preprocess)
        alg = make_algorithm("fedavg", task, {})
        out = []
        for shard in (True, False):
            engine = Engine(alg, 6, 4, client_parallelism="vmap", shard_clients=shard)
            assert (engine.client_sharding is not None) == shard
            state, m = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 2)
            out.append(np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(state.server)]))
        np.testing.assert_allclose(out[0], out[1], atol=1e-5)
        print("OK")
    """ % str(Path(__file__).resolve().parents[1]))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


def test_time_rounds_runs_one_compile_round_plus_the_timed_ones():
    from fedjax_sparse.tools.timing import time_rounds
    _, data = tiny_federated(SIZES)
    engine = Engine(make_algorithm("fedavg", make_task(data), {}), data.num_clients, 2)
    state, first, times, metrics = time_rounds(engine, engine.init(jax.random.PRNGKey(0)), data, 2)
    assert int(state.round) == 3 and len(times) == 2 and first > 0 and all(t > 0 for t in times)
    assert "loss" in metrics


def test_an_algorithm_without_cost_accounting_reports_unknown_not_zero(tmp_path):
    """metrics.jsonl and summary.json say null (unknown) for costs an algorithm does not count."""
    import json

    from fedjax_sparse.driver import runner
    config = runner.RunConfig(algorithm="fedavg", dataset="digits", num_clients=6, clients_per_round=3,
                              local_epochs=1, batch_size=32, rounds=2, partition="iid", out=str(tmp_path / "r"))
    exp = runner.build(config)
    counted = exp.engine.algorithm

    def client_update(payload, state, cd, ctx):
        new_state, message, metrics = counted.client_update(payload, state, cd, ctx)
        return new_state, message, {k: v for k, v in metrics.items() if k not in ("flops", "uplink_bits")}

    uncounted = dataclasses.replace(counted, client_update=client_update)
    exp = dataclasses.replace(exp, engine=dataclasses.replace(exp.engine, algorithm=uncounted))
    summary = runner.run(config, progress=False, experiment=exp).summary
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["flops"] is None and rows[-1]["total_flops"] is None and rows[-1]["uplink_bits"] is None
    assert rows[-1]["downlink_bits"] > 0 and rows[-1]["total_downlink_bits"] == 2 * rows[0]["downlink_bits"]
    assert summary["total_flops"] is None and summary["total_gbit"] is None
    assert "not counted" in format_summary(summary)


@pytest.mark.fast
def test_auto_schedule_follows_the_recorded_measurements(monkeypatch):
    """map on a CPU; packed on one accelerator (the H100 record: docs/design.md); vmap across several
    accelerators or processes (the schedule that shards the cohort)."""
    from fedjax_sparse.core import engine as engine_module
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    for backend, devices, expected in (("cpu", 1, "map"), ("cpu", 4, "map"), ("gpu", 1, "packed"),
                                       ("gpu", 2, "vmap"), ("tpu", 1, "packed")):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        monkeypatch.setattr(jax, "local_device_count", lambda d=devices: d)
        assert engine_module.resolve_parallelism("auto") == expected, (backend, devices)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert engine_module.resolve_parallelism("auto") == "vmap"
    assert engine_module.resolve_parallelism("packed") == "packed"

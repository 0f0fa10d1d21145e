"""Personalised evaluation (one call per client) gives the same per-client counts as the references
experiments/bench/bench_eval.py times it against: a ``lax.map`` over clients and a ``vmap`` over
chunks of clients, for personal and global models."""
import dataclasses

import jax
import numpy as np
import pytest

from fedjax_sparse.algorithms import Task, make_algorithm
from fedjax_sparse.data.federated import build_federated_data
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.core.evaluation import Evaluator, personal_summary
from fedjax_sparse.models import make_model
from helpers import load_script, split_partition, tiny_dataset

BENCH = load_script("bench/bench_eval.py")


@pytest.mark.fast
def test_chunks_group_clients_by_test_size_within_the_budget():
    counts = np.array([5, 0, 30, 7, 16, 3, 64])
    chunks = BENCH.plan_chunks(counts, chunk_examples=40)
    # Sorted by count (client 1 has no test data and is skipped), widths are powers of two.
    assert [ids.tolist() for ids, _ in chunks] == [[5, 0, 3], [4], [2], [6]]
    assert [w for _, w in chunks] == [8, 16, 32, 64]
    assert all(len(ids) * w <= 40 or len(ids) == 1 for ids, w in chunks)
    assert sorted(c for ids, _ in chunks for c in ids.tolist()) == [0, 2, 3, 4, 5, 6]


def _uneven_data():
    ds = tiny_dataset(n_train=240, n_test=90)
    part = split_partition(ds, (10, 37, 64, 23, 50, 41))
    rng = np.random.default_rng(1)
    perm = rng.permutation(90)
    bounds = np.cumsum([0, 3, 30, 9, 17, 0, 31])   # unequal test sets, one client without any
    part.test_indices = [np.sort(perm[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return build_federated_data(ds, part)


@pytest.mark.parametrize("algorithm, options", [("local", {}), ("spafl", {}), ("fedavg", {})])
def test_per_client_references_and_shared_pass_agree(algorithm, options):
    data = _uneven_data()
    model = make_model("cnn_small", data.input_shape, data.num_classes)
    task = Task(model=model, num_clients=6, clients_per_round=3, local_epochs=1, batch_size=16, lr=0.05,
                rounds=2, preprocess=data.preprocess, seed=0)
    alg = make_algorithm(algorithm, task, options)
    engine = Engine(alg, 6, 3, eval_batch_size=8)
    state, _ = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 2)
    evaluator = Evaluator(alg, 6, eval_batch_size=8, eval_shared_global_pass=False)
    a = BENCH.loop_stats(evaluator)(state, data)
    b = BENCH.batched_stats(evaluator, chunk_examples=40)(state, data)
    np.testing.assert_array_equal(np.asarray(a.count), np.asarray(b.count))
    np.testing.assert_array_equal(np.asarray(a.correct), np.asarray(b.correct))
    np.testing.assert_allclose(np.asarray(a.loss_sum), np.asarray(b.loss_sum), rtol=2e-5, atol=1e-5)
    # One call per client (granularity 16: test sets of 3..31 examples padded to 16 or 32).
    per_client = dataclasses.replace(evaluator, per_client_granularity=16)
    c = per_client.personal_stats(state, data)
    np.testing.assert_array_equal(np.asarray(a.count), np.asarray(c.count))
    np.testing.assert_array_equal(np.asarray(a.correct), np.asarray(c.correct))
    np.testing.assert_allclose(np.asarray(a.loss_sum), np.asarray(c.loss_sum), rtol=2e-5, atol=1e-5)
    ev_loop, ev_batched = (personal_summary(s.correct, s.loss_sum, s.count) for s in (a, b))
    ev_per_client = per_client.evaluate(state, data)
    for key in ("accuracy", "accuracy_std", "accuracy_min", "accuracy_max"):
        assert ev_loop[key] == ev_batched[key] == ev_per_client[key], key
    if algorithm == "fedavg":   # the shared global pass gives the same personalised numbers too
        shared = dataclasses.replace(evaluator, eval_shared_global_pass=True).evaluate(state, data)
        assert shared["accuracy"] == pytest.approx(ev_batched["accuracy"], abs=1e-12)
        assert shared["global_accuracy"] == ev_per_client["global_accuracy"]
    # Not a trivial agreement: some but not all test examples are right, and clients differ.
    assert 0 < float(np.sum(b.correct)) < float(np.sum(b.count))
    assert ev_batched["accuracy_max"] > ev_batched["accuracy_min"]


def test_global_pass_in_batches_equals_one_direct_forward():
    """The batched host loop of the global model (3 batches of 32 over 90 rows, the last one
    partial) against one eager forward over all rows; per-client numbers of the shared pass
    against a direct per-client count."""
    data = _uneven_data()
    model = make_model("cnn_small", data.input_shape, data.num_classes)
    task = Task(model=model, num_clients=6, clients_per_round=3, local_epochs=1, batch_size=16, lr=0.05,
                rounds=2, preprocess=data.preprocess, seed=0)
    alg = make_algorithm("fedavg", task, {})
    engine = Engine(alg, 6, 3, eval_batch_size=8)
    state, _ = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 2)
    evaluator = Evaluator(alg, 6, eval_batch_size=8, global_batch_size=32)
    rows = np.asarray(data.global_test_idx)
    assert len(rows) == 90 and len(rows) % 32
    logits = np.asarray(alg.global_predict(state.server, data.preprocess(data.test_x[rows])))
    y = np.asarray(data.test_y)[rows]
    hits = (logits.argmax(-1) == y)
    g = evaluator.global_stats(state, data)
    assert g.count == 90 and g.correct == hits.sum()
    assert 0 < hits.sum() < 90
    losses = -jax.nn.log_softmax(logits)[np.arange(90), y]
    assert g.loss_sum == pytest.approx(float(np.sum(losses)), rel=1e-5)
    personal, _ = evaluator.shared_pass(state, data)
    hit_of_row = dict(zip(rows.tolist(), hits.tolist()))
    idx, counts = np.asarray(data.test_idx), np.asarray(data.test_count)
    expected = [sum(hit_of_row[r] for r in idx[c, :counts[c]]) for c in range(6)]
    np.testing.assert_array_equal(personal.correct, expected)
    np.testing.assert_array_equal(personal.count, counts)

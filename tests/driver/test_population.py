"""Host-resident client populations: the same numbers as the all-resident engine, memory that
grows with the clients touched, bf16 storage, and refusals."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.driver import population, runner


@pytest.fixture(scope="module")
def spafl():
    # 12 clients, 3 per round, 7 rounds in chunks of 3: consecutive chunks share clients (the
    # prefetched rows must be refreshed after the write-back) and the last chunk is shorter.
    config = runner.RunConfig(algorithm="spafl", dataset="digits", num_clients=12, clients_per_round=3,
                              local_epochs=1, batch_size=16, rounds=7, partition="iid")
    exp = runner.build(config)
    reference, metrics = exp.engine.run_rounds(exp.engine.init(jax.random.PRNGKey(0)), exp.data, 7)
    evaluation = exp.engine.evaluate(reference, exp.data)
    return exp, jax.device_get(reference), metrics, evaluation


@pytest.mark.default_emitters   # bit-identical across differently chunked programs: XLA's default emitters
def test_host_population_is_bit_identical_to_the_resident_engine(spafl):
    exp, reference, metrics, evaluation = spafl
    engine = exp.engine
    cohorts = engine.cohorts(jax.random.split(jax.random.PRNGKey(0))[1], 0, 7)
    chunk_sets = [set(cohorts[i:i + 3].ravel()) for i in (0, 3, 6)]
    assert chunk_sets[0] & chunk_sets[1], "the test needs chunks that share clients"
    state, pop = population.init(engine, jax.random.PRNGKey(0))
    state, chunk_metrics = population.run_rounds(engine, state, pop, exp.data, 7, chunk_rounds=3)
    assert int(state.round) == 7 and len(chunk_metrics) == 3
    np.testing.assert_array_equal(np.concatenate([m["loss"] for m in chunk_metrics]), metrics["loss"])
    assert sum(sum(m["uplink_bits"].tolist()) for m in chunk_metrics) == sum(metrics["uplink_bits"].tolist())
    rows = pop.gather(np.arange(12))
    for mine, theirs in zip(jax.tree_util.tree_leaves(rows), jax.tree_util.tree_leaves(reference.clients)):
        np.testing.assert_array_equal(mine, theirs)
    for mine, theirs in zip(jax.tree_util.tree_leaves(jax.device_get(state.server)),
                            jax.tree_util.tree_leaves(reference.server)):
        np.testing.assert_array_equal(mine, theirs)
    # Copy-on-write: exactly the sampled clients hold rows of their own.
    assert pop.touched == len(set(cohorts.ravel()))
    ours = population.evaluate_clients(engine, state, pop, exp.data, np.arange(12), chunk_clients=5)
    for key in ("accuracy", "accuracy_std", "accuracy_min", "accuracy_max", "test_loss"):
        assert ours[key] == evaluation[key], key
    np.testing.assert_array_equal(ours["client_accuracies"], evaluation["client_accuracies"])


def test_untouched_clients_read_the_initial_row_and_padding_is_skipped(spafl):
    exp = spafl[0]
    state, pop = population.init(exp.engine, jax.random.PRNGKey(0))
    initial = jax.device_get(jax.tree_util.tree_map(lambda x: x[5], exp.engine.init(jax.random.PRNGKey(0)).clients))
    changed = jax.tree_util.tree_map(lambda x: np.stack([x + 1, x + 2]), initial)
    pop.scatter(np.array([3, 12]), changed)   # 12 = N: padding, not stored
    assert pop.touched == 1
    rows = pop.gather(np.array([5, 3, 12]))
    for leaf, start in zip(jax.tree_util.tree_leaves(rows), jax.tree_util.tree_leaves(initial)):
        np.testing.assert_array_equal(leaf[0], start)
        np.testing.assert_array_equal(leaf[1], start + 1)
        np.testing.assert_array_equal(leaf[2], start)


@pytest.mark.fast
def test_bfloat16_storage_rounds_floats_and_keeps_integers():
    row = {"w": np.array([1.0, 1 + 2 ** -10, 3.14159], np.float32), "n": np.array(7, np.int32)}
    pop = population.HostPopulation(row, 4, storage_dtype=jnp.bfloat16)
    assert pop.row_bytes == 3 * 2 + 4
    pop.scatter(np.array([1]), {"w": row["w"][None], "n": np.array([9], np.int32)})
    back = pop.gather(np.array([1, 0]))
    assert back["w"].dtype == np.float32 and back["n"].dtype == np.int32
    np.testing.assert_array_equal(back["w"][0], np.asarray(row["w"].astype(jnp.bfloat16), np.float32))
    assert back["w"][0][1] == 1.0 and back["n"].tolist() == [9, 7]


def test_clients_with_different_initial_rows_are_refused(spafl):
    exp = spafl[0]
    alg = exp.engine.algorithm

    def init(key):
        server, clients = alg.init(key)
        n = exp.engine.num_clients
        return server, jax.tree_util.tree_map(
            lambda x: x + jnp.arange(n, dtype=x.dtype).reshape((n,) + (1,) * (x.ndim - 1)), clients)
    engine = dataclasses.replace(exp.engine, algorithm=dataclasses.replace(alg, init=init))
    with pytest.raises(ValueError, match="different rows"):
        population.init(engine, jax.random.PRNGKey(0))
    extra = dataclasses.replace(exp.engine, algorithm=dataclasses.replace(alg, extra_clients=lambda *a: None))
    state, pop = population.init(exp.engine, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="extra clients"):
        population.run_rounds(extra, state, pop, exp.data, 1, 1)


def test_never_trained_clients_are_evaluated_in_one_pass_with_the_same_numbers(spafl, monkeypatch):
    exp, reference, _, _ = spafl
    engine = exp.engine
    state, pop = population.init(engine, jax.random.PRNGKey(0))
    state, _ = population.run_rounds(engine, state, pop, exp.data, 2, chunk_rounds=2)
    assert 0 < pop.touched < 12, "the test needs trained and never-trained clients"
    x = exp.data.preprocess(exp.data.test_x[:1])
    initial = jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf[0]), pop.gather(np.array([12])))
    alg = engine.algorithm
    assert population.ignores_client_id(alg, state.server, initial, x)
    reads_id = dataclasses.replace(alg, personal_predict=lambda s, r, cid, x: alg.personal_predict(s, r, cid, x) + cid)
    assert not population.ignores_client_id(reads_id, state.server, initial, x)
    shared = population.evaluate(engine, state, pop, exp.data)
    # The same evaluation with every client's model run on its own (as when the id is read).
    monkeypatch.setattr(population, "ignores_client_id", lambda *args: False)
    one_by_one = population.evaluate(engine, state, pop, exp.data)
    np.testing.assert_array_equal(shared["client_accuracies"], one_by_one["client_accuracies"])
    assert shared["test_loss"] == pytest.approx(one_by_one["test_loss"], rel=1e-6)
    assert shared["density_all_clients"] == one_by_one["density_all_clients"]
    assert 0 < shared["accuracy"] < 1 and shared["accuracy_max"] > shared["accuracy_min"]

"""Exact cost accounting: bits and FLOPs are integers at sizes where float32 fails.

Hand counts use the papers' conventions (FSL rank bits, LeNet MACs); each test
also shows that a float32 sum of the same values would be wrong, so it guards
the representation and not only the arithmetic.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.core import accounting
from fedjax_sparse.driver import runner
from fedjax_sparse.mechanisms import supermask as sm
from fedjax_sparse.core.accounting import Cost, cost_per_round
from fedjax_sparse.algorithms import Algorithm, Task, client_metrics, make_algorithm
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.models import make_model
from helpers import tiny_federated

# FSL's MNIST LeNet (seed 003, Table 3): one client's full ranking in bits.
FSL_LENET_SIZES = [3 * 3 * 1 * 32, 3 * 3 * 32 * 64, 9216 * 128, 128 * 10]
FSL_LENET_BITS = sum(n * int(np.ceil(np.log2(n))) for n in FSL_LENET_SIZES)


@pytest.mark.fast
def test_fsl_lenet_round_bits_are_exact_where_float32_is_not():
    assert FSL_LENET_BITS == sm.ranking_bits(FSL_LENET_SIZES) == 25_065_760  # > 2^24 for one client
    k = 25
    cost = Cost(np.tile(np.array([[[1, 1]]], np.int32), (1, k, 1, 1)), (FSL_LENET_BITS,))
    assert cost_per_round(cost) == [k * FSL_LENET_BITS]
    # What the old float32 device sum reported: off by a few hundred bits.
    float32_sum = float(np.sum(np.full(k, FSL_LENET_BITS, np.float32), dtype=np.float32))
    assert float32_sum != k * FSL_LENET_BITS


@pytest.mark.fast
def test_costs_add_terms_and_count_factors_exactly():
    model = make_model("lenet5_caffe", (28, 28, 1), 10)
    per_example = accounting.training_flops_per_example(model)
    assert per_example == 6 * 2_293_000
    total = (accounting.training_flops(model, jnp.int32(600)) + Cost.constant(7)).total()
    assert total == 600 * per_example + 7
    # Two traced factors: 400,000 kept weights x 30,000 examples overflows int32 but not the host sum.
    big = Cost.term(6, jnp.int32(400_000), jnp.int32(30_000)).total()
    assert big == 6 * 400_000 * 30_000
    # Fractional units (eq. 13's 1.5 FLOPs per weight of an odd-sized layer) stay exact as floats.
    assert Cost.term(1.5 * 3, jnp.int32(2)).total() == 9.0
    assert Cost.term(1.5 * 4, jnp.int32(2)).units == (6,)   # integral units become Python ints


class _ConstantCostAlgorithm:
    """A no-training algorithm whose clients report LeNet training FLOPs for
    (500 + client id) examples and one FSL ranking each way, and whose server
    records every round's cohort: costs can be hand-counted from the cohorts."""

    def __init__(self, num_clients: int):
        self.flops_per_example = accounting.training_flops_per_example(make_model("lenet5_caffe", (28, 28, 1), 10))
        self.num_clients = num_clients

    def build(self, rounds: int) -> Algorithm:
        def init(key):
            return {"ids": jnp.zeros((rounds, 25), jnp.int32)}, ()

        def client_update(payload, client_state, data, ctx):
            examples = 500 + ctx.client_id
            metrics = client_metrics(loss=0.0, flops=Cost.term(self.flops_per_example, examples),
                                     uplink_bits=FSL_LENET_BITS, downlink_bits=FSL_LENET_BITS, density=1.0,
                                     num_examples=examples)
            return client_state, (), metrics

        def server_update(server, messages, ctx):
            return {"ids": server["ids"].at[ctx.round].set(ctx.client_ids)}, {}

        return Algorithm("constant_cost", init, lambda s, r: (), client_update, server_update)


def test_totals_over_ten_thousand_rounds_match_the_hand_count():
    """10^4 rounds of 25 clients: ~3.4e15 FLOPs and ~1.2e13 bits in total, far past float32
    (and summed per round past 2^24); the engine's host totals equal the hand count."""
    _, data = tiny_federated((5,) * 40)
    rounds = 10_000
    alg = _ConstantCostAlgorithm(40).build(rounds)
    engine = Engine(alg, 40, 25)
    state, metrics = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, rounds)
    ids = np.asarray(state.server["ids"], np.int64)
    examples = (500 + ids).sum(1)                                              # per round
    flops_hand = [int(e) * 6 * 2_293_000 for e in examples]
    assert metrics["flops"].tolist() == flops_hand
    total_flops = sum(metrics["flops"].tolist())
    assert total_flops == int(examples.sum()) * 6 * 2_293_000
    assert metrics["uplink_bits"].tolist() == [25 * FSL_LENET_BITS] * rounds
    total_bits = sum(metrics["uplink_bits"].tolist())
    assert total_bits == rounds * 25 * FSL_LENET_BITS
    np.testing.assert_array_equal(metrics["num_examples"], examples)
    # Neither total (nor a round's bits) is representable in float32: the old device sums were off.
    for exact in (total_flops, total_bits, 25 * FSL_LENET_BITS):
        assert int(np.float32(exact)) != exact


def test_spafl_flops_count_kept_rows_exactly():
    """Round 0 of SpaFL with thresholds 0 keeps every row: exactly dense training FLOPs of the
    examples seen. With one layer's thresholds above every row mean, that layer costs nothing."""
    _, data = tiny_federated((10, 37, 64, 23))
    model = make_model("cnn_small", data.input_shape, data.num_classes)
    task = Task(model=model, num_clients=4, clients_per_round=4, local_epochs=2, batch_size=16, lr=0.01,
                rounds=2, preprocess=data.preprocess)
    alg = make_algorithm("spafl", task, {"reset_threshold": False})
    engine = Engine(alg, 4, 4)
    state = engine.init(jax.random.PRNGKey(0))
    tau = jax.device_get(state.server.tau)  # the run donates the state
    _, metrics = engine.run_rounds(state, data, 1)
    examples = 2 * int(np.asarray(data.train_count).sum())
    assert metrics["flops"].tolist() == [examples * accounting.training_flops_per_example(model)]
    # Prune the first thresholded layer entirely (tau above every row's mean |w|), no eq. (13).
    first = alg.hparams["thresholded_layers"][0]
    pruned_tau = {**tau, first: tau[first] + 1e3}
    alg_no13 = make_algorithm("spafl_no_eq13", task, {"reset_threshold": False, "train_weights": False,
                                                      "alpha": 0.0})
    engine = Engine(alg_no13, 4, 4)
    state = engine.init(jax.random.PRNGKey(0))
    state = state._replace(server=state.server._replace(tau=pruned_tau))
    _, metrics = engine.run_rounds(state, data, 1)
    rows = accounting.row_training_flops(model)
    expected = examples * sum(r * layer.out_units for r, layer in zip(rows, model.layers) if layer.name != first)
    assert metrics["flops"].tolist() == [expected]


def test_metrics_jsonl_holds_exact_integer_costs(tmp_path):
    out = tmp_path / "run"
    config = runner.RunConfig(algorithm="fedavg", dataset="digits", num_clients=6, clients_per_round=3,
                              local_epochs=1, batch_size=32, lr=0.1, partition="iid", rounds=3, eval_every=1,
                              out=str(out))
    exp = runner.build(config)
    runner.run(config, progress=False, experiment=exp)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    bits = accounting.tree_bits(exp.model.init(jax.random.PRNGKey(0)))
    for row in rows:
        assert isinstance(row["uplink_bits"], int) and isinstance(row["flops"], int)
        assert row["uplink_bits"] == row["downlink_bits"] == 3 * bits
        assert row["flops"] % accounting.training_flops_per_example(exp.model) == 0
    assert rows[-1]["total_flops"] == sum(r["flops"] for r in rows)
    assert rows[-1]["total_uplink_bits"] == 3 * 3 * bits
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total_flops"] == rows[-1]["total_flops"]


@pytest.mark.parametrize("value", [FSL_LENET_BITS, 2 ** 31 + 5])
@pytest.mark.fast
def test_static_costs_beyond_int32_stay_exact(value):
    # A static unit is a Python int: no device dtype limits it.
    cost = Cost.constant(value)
    assert cost.total() == value
    assert (cost + cost).total() == 2 * value

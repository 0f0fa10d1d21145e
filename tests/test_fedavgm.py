"""FedAvgM: the server step by hand, FedAvg as its beta = 0 case, and a run through the CLI
(the algorithm is one file: registered by being in the package)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import Task, algorithm_names, make_algorithm
from fedjax_sparse.algorithms.fedavgm import FedAvgMServerState, server_momentum_step
from fedjax_sparse.cli import main
from fedjax_sparse.engine import Engine
from fedjax_sparse.models import make_model
from helpers import tiny_federated


@pytest.mark.fast
def test_server_step_by_hand():
    server = FedAvgMServerState({"params": {"w": jnp.array([1.0, 2.0])}, "batch_stats": {}},
                                {"w": jnp.array([0.5, -1.0])})
    mean = {"params": {"w": jnp.array([1.5, 1.0])}, "batch_stats": {}}
    new = server_momentum_step(server, mean, beta=0.9, server_lr=2.0)
    # delta = (0.5, -1); v = 0.9 (0.5, -1) + (0.5, -1) = (0.95, -1.9); w = (1, 2) + 2 v
    np.testing.assert_allclose(new.velocity["w"], [0.95, -1.9], rtol=1e-6)
    np.testing.assert_allclose(new.variables["params"]["w"], [2.9, -1.8], rtol=1e-6)


def test_zero_momentum_is_fedavg():
    _, data = tiny_federated((10, 37, 64, 23, 50, 41))
    model = make_model("cnn_small", data.input_shape, data.num_classes)
    task = Task(model=model, num_clients=6, clients_per_round=3, local_epochs=1, batch_size=16, lr=0.05,
                rounds=3, preprocess=data.preprocess)
    states = {}
    for name, options in (("fedavg", {}), ("fedavgm", {"server_momentum": 0.0})):
        engine = Engine(make_algorithm(name, task, options), 6, 3)
        state, _ = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 3)
        states[name] = state
    for a, b in zip(jax.tree_util.tree_leaves(states["fedavgm"].server.variables),
                    jax.tree_util.tree_leaves(states["fedavg"].server.variables)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # With momentum the trajectory differs.
    engine = Engine(make_algorithm("fedavgm", task, {"server_momentum": 0.9}), 6, 3)
    state, metrics = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 3)
    assert metrics["server_velocity_norm"][-1] > metrics["server_velocity_norm"][0] > 0
    a = jax.tree_util.tree_leaves(state.server.variables)[0]
    b = jax.tree_util.tree_leaves(states["fedavg"].server.variables)[0]
    assert float(jnp.abs(a - b).max()) > 1e-4


def test_registered_and_runs_from_the_cli(tmp_path, capsys):
    assert "fedavgm" in algorithm_names()
    code = main(["run", "--algorithm", "fedavgm", "--dataset", "digits", "--num-clients", "6", "--clients-per-round",
                 "3", "--rounds", "2", "--local-epochs", "1", "--option", "server_momentum=0.5", "--quiet",
                 "--out", str(tmp_path / "r")])
    assert code == 0 and "fedavgm" in capsys.readouterr().out

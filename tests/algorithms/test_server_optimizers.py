"""The FedAvg family's server optimisers (issue 49 item 3): FedAvgM as ``server_optimizer=momentum``
with today's numbers and checkpoints, and FedAdam, FedYogi, FedAdagrad (Reddi et al., "Adaptive
Federated Optimization", ICLR 2021) as optax's optimisers on the pseudo-gradient, each checked against
its formulas written out here in numpy.

Convention (fedjax_sparse/algorithms/fedavg_family.py says why): optax's optimisers as optax defines them, with
the paper's beta1 = 0.9, beta2 = 0.99 and tau = 1e-3 as defaults. tau is optax's eps of Adam and Yogi
(added to sqrt(v), as the paper's tau); optax's Adagrad adds its eps under the root, so it gets tau**2;
Yogi's accumulators start at tau**2 (the paper's v_{-1}). Where optax and the paper's Algorithm 2
differ, the formulas below are optax's: Adam and Yogi divide by the bias corrections 1 - beta**t, Adagrad
has no first moment."""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sparse.algorithms import ServerContext, algorithm_names, make_algorithm, tree_weighted_mean
from fedjax_sparse.algorithms.fedavg_family import FedAvgMServerState, FedAvgServerState, FedOptServerState
from fedjax_sparse.driver.checkpoint import load_checkpoint, save_checkpoint
from fedjax_sparse.cli import main
from fedjax_sparse.core.engine import Engine
from helpers import make_task, tiny_federated

SIZES = (10, 37, 64, 23, 50, 41)


# ------------------------------------------------------------------ today's FedAvgM, for reference
class TodaysFedAvgMServerState(NamedTuple):
    """FedAvgM's server state before it became an option of FedAvg (fedavgm.py, until 0.2.x)."""
    variables: dict
    velocity: dict


class TodaysFedAvgServerState(NamedTuple):
    """FedAvg's server state before the server optimisers."""
    variables: dict


def todays_fedavgm(algorithm, beta, server_lr):
    """``algorithm`` with the server of fedavgm.py as it was: v <- beta v + delta, w <- w + server_lr v,
    BatchNorm statistics the clients' mean (its code, copied)."""
    def init(key):
        server, clients = algorithm.init(key)
        variables = server.variables
        return TodaysFedAvgMServerState(variables, jax.tree_util.tree_map(jnp.zeros_like, variables["params"])), clients

    def server_update(server, messages, ctx):
        mean = tree_weighted_mean(messages, ctx.weights)
        delta = jax.tree_util.tree_map(jnp.subtract, mean["params"], server.variables["params"])
        velocity = jax.tree_util.tree_map(lambda v, d: beta * v + d, server.velocity, delta)
        params = jax.tree_util.tree_map(lambda w, v: w + server_lr * v, server.variables["params"], velocity)
        new = TodaysFedAvgMServerState({**mean, "params": params}, velocity)
        return new, {"velocity_norm": optax.tree.norm(new.velocity)}
    return dataclasses.replace(algorithm, init=init, server_update=server_update)


@pytest.fixture(scope="module")
def data():
    return tiny_federated(SIZES)[1]


def run(algorithm, data, rounds, state=None):
    engine = Engine(algorithm, data.num_clients, 3)
    state = engine.init(jax.random.PRNGKey(0)) if state is None else state
    return engine.run_rounds(state, data, rounds)


def assert_trees_close(a, b, rtol=1e-6, atol=1e-7):
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_fedavgm_gives_todays_numbers(data):
    """fedavgm (now optax's sgd with momentum on the pseudo-gradient) against fedavgm.py's server, 3 rounds."""
    options = {"server_momentum": 0.9, "server_lr": 0.5}
    new = make_algorithm("fedavgm", make_task(data), options)
    old = todays_fedavgm(new, beta=0.9, server_lr=0.5)
    (new_state, new_metrics), (old_state, old_metrics) = run(new, data, 3), run(old, data, 3)
    assert_trees_close(new_state.server.variables, old_state.server.variables)
    assert_trees_close(new_state.server.velocity, old_state.server.velocity)
    np.testing.assert_allclose(new_metrics["server_velocity_norm"], old_metrics["server_velocity_norm"], rtol=1e-6)
    assert new_state.server._fields == old_state.server._fields   # the layout of its checkpoints


def test_a_fedavgm_checkpoint_of_before_resumes_with_the_same_numbers(data, tmp_path):
    """A checkpoint written with FedAvgMServerState(variables, velocity) loads into today's fedavgm state by
    field name, and the next round is the one the old code computes."""
    new = make_algorithm("fedavgm", make_task(data), {"server_lr": 0.5})
    old = todays_fedavgm(new, beta=0.9, server_lr=0.5)
    old_state, _ = run(old, data, 2)
    save_checkpoint(tmp_path, old_state, {"round": 2})
    template = jax.tree_util.tree_map(jnp.zeros_like, Engine(new, data.num_clients, 3).init(jax.random.PRNGKey(1)))
    loaded, _ = load_checkpoint(tmp_path, template)
    assert_trees_close(loaded.server.velocity, old_state.server.velocity, rtol=0, atol=0)
    (new_next, _), (old_next, _) = run(new, data, 1, loaded), run(old, data, 1, old_state)
    assert_trees_close(new_next.server.variables, old_next.server.variables)


def test_a_fedavg_checkpoint_of_before_loads(data, tmp_path):
    """FedAvg's server state under sgd is FedAvgServerState(variables) as before: its checkpoints still load."""
    alg = make_algorithm("fedavg", make_task(data), {})
    state, _ = run(alg, data, 1)
    save_checkpoint(tmp_path, state._replace(server=TodaysFedAvgServerState(state.server.variables)), {"round": 1})
    loaded, _ = load_checkpoint(tmp_path, jax.tree_util.tree_map(jnp.zeros_like, state))
    assert loaded.server._fields == ("variables",)
    assert_trees_close(loaded.server.variables, state.server.variables, rtol=0, atol=0)


def test_zero_momentum_is_fedavg(data):
    task = make_task(data, lr=0.05)
    (fedavg, _), (zero, _) = run(make_algorithm("fedavg", task, {}), data, 3), \
        run(make_algorithm("fedavgm", task, {"server_momentum": 0.0}), data, 3)
    assert_trees_close(zero.server.variables, fedavg.server.variables)


# ------------------------------------------------------------------ the server step by hand
def server_round(name, options, server, messages, weights):
    """One server_update of algorithm ``name`` on hand-made messages [K, ...]."""
    alg = make_algorithm(name, make_task(tiny_federated(SIZES)[1]), options)
    ctx = ServerContext(round=jnp.int32(0), client_ids=jnp.arange(len(weights)), weights=jnp.asarray(weights),
                        key=jax.random.PRNGKey(0))
    return alg.server_update(server, messages, ctx)


def hand_mean(messages, weights):
    w = np.asarray(weights, np.float64)
    return np.tensordot(w / w.sum(), np.asarray(messages, np.float64), axes=1)


W0 = np.array([1.0, 2.0, -0.5, 0.25], np.float32)
# Two rounds of three clients' models (weights 10, 30, 20): the mean moves coordinate 3 by 0 in round 1.
ROUNDS = [np.array([[1.5, 1.0, -0.5, 0.3], [1.1, 2.2, -0.5, 0.2], [0.9, 1.9, -0.5, 0.3]], np.float32),
          np.array([[1.2, 2.5, 0.5, 0.1], [1.0, 2.1, -0.4, 0.0], [1.3, 2.0, -0.6, 0.2]], np.float32)]
WEIGHTS = [10.0, 30.0, 20.0]


def vars_of(w, batch_stats=None):
    return {"params": {"w": jnp.asarray(w)}, "batch_stats": {} if batch_stats is None else {"m": batch_stats}}


def two_server_rounds(name, options, make_state):
    """The model after each of two server rounds on ROUNDS, from W0, and the last state."""
    server, out = make_state(vars_of(W0)), []
    for messages in ROUNDS:
        server, _ = server_round(name, options, server, vars_of(messages), WEIGHTS)
        out.append(np.asarray(server.variables["params"]["w"], np.float64))
    return out, server


def adam_by_hand(lr, b1, b2, tau):
    w, m, v, out = W0.astype(np.float64), 0.0, 0.0, []
    for t, messages in enumerate(ROUNDS, start=1):
        g = w - hand_mean(messages, WEIGHTS)              # the pseudo-gradient: minus the mean update
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)   # optax's bias correction (not in the paper)
        w = w - lr * m_hat / (np.sqrt(v_hat) + tau)         # tau outside the root: the paper's and optax's eps
        out.append(w)
    return out


def yogi_by_hand(lr, b1, b2, tau):
    w, m, v, out = W0.astype(np.float64), tau ** 2, tau ** 2, []   # optax starts both at the initial value
    for t, messages in enumerate(ROUNDS, start=1):
        g = w - hand_mean(messages, WEIGHTS)
        m = b1 * m + (1 - b1) * g
        v = v - (1 - b2) * np.sign(v - g ** 2) * g ** 2     # Yogi's additive second moment
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        w = w - lr * m_hat / (np.sqrt(v_hat) + tau)
        out.append(w)
    return out


def adagrad_by_hand(lr, tau):
    w, v, out = W0.astype(np.float64), 0.0, []
    for messages in ROUNDS:
        g = w - hand_mean(messages, WEIGHTS)
        v = v + g ** 2
        w = w - lr * g / np.sqrt(v + tau ** 2)              # optax's eps (= tau**2) under the root
        out.append(w)
    return out


def optax_state(optimizer):
    return lambda variables: FedOptServerState(variables, optimizer.init(variables["params"]))


@pytest.mark.fast
@pytest.mark.parametrize("name,options", [("fedadam", {}), ("fedavg", {"server_optimizer": "adam", "server_lr": 0.01})])
def test_adam_server_steps_by_hand(name, options):
    lr, b1, b2, tau = 0.01, 0.9, 0.99, 1e-3   # fedadam's defaults: the paper's beta1, beta2, tau
    got, server = two_server_rounds(name, options, optax_state(optax.adam(lr, b1, b2, eps=tau)))
    for mine, hand in zip(got, adam_by_hand(lr, b1, b2, tau)):
        np.testing.assert_allclose(mine, hand, rtol=1e-5, atol=1e-7)
    # Coordinate 3: the first round's step is lr * sign, whatever the update's size (bias-corrected Adam).
    assert abs(got[0][2] - W0[2]) < 1e-9 and abs(abs(got[0][0] - W0[0]) - lr) < 1e-4


@pytest.mark.fast
def test_yogi_server_steps_by_hand():
    lr, b1, b2, tau = 0.05, 0.8, 0.9, 1e-2
    options = {"server_lr": lr, "server_b1": b1, "server_b2": b2, "server_tau": tau}
    yogi = optax.chain(optax.scale_by_yogi(b1, b2, tau, initial_accumulator_value=tau ** 2), optax.scale_by_learning_rate(lr))
    got, _ = two_server_rounds("fedyogi", options, optax_state(yogi))
    for mine, hand in zip(got, yogi_by_hand(lr, b1, b2, tau)):
        np.testing.assert_allclose(mine, hand, rtol=1e-5, atol=1e-7)


@pytest.mark.fast
def test_adagrad_server_steps_by_hand():
    lr, tau = 0.1, 1e-3
    got, _ = two_server_rounds("fedadagrad", {"server_lr": lr, "server_tau": tau},
                               optax_state(optax.adagrad(lr, initial_accumulator_value=0.0, eps=tau ** 2)))
    for mine, hand in zip(got, adagrad_by_hand(lr, tau)):
        np.testing.assert_allclose(mine, hand, rtol=1e-5, atol=1e-7)


@pytest.mark.fast
def test_momentum_and_sgd_server_steps_by_hand():
    """FedAvgM: v <- beta v + delta, w <- w + eta v (velocity = Hsu et al.'s v, stored with its sign);
    FedAvg: w <- w + eta (mean - w). BatchNorm statistics: the mean (momentum), moved by eta (sgd)."""
    server = FedAvgMServerState(vars_of(W0, np.float32([4.0])), {"w": jnp.asarray([0.5, -1.0, 0.0, 2.0])})
    stats = np.float32([[1.0], [2.0], [6.0]])
    new, metrics = server_round("fedavgm", {"server_momentum": 0.9, "server_lr": 2.0}, server,
                                vars_of(ROUNDS[0], stats), WEIGHTS)
    delta = hand_mean(ROUNDS[0], WEIGHTS) - W0
    v = 0.9 * np.array([0.5, -1.0, 0.0, 2.0]) + delta
    np.testing.assert_allclose(new.velocity["w"], v, rtol=1e-6)
    np.testing.assert_allclose(new.variables["params"]["w"], W0 + 2.0 * v, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(new.variables["batch_stats"]["m"], hand_mean(stats, WEIGHTS), rtol=1e-6)
    np.testing.assert_allclose(metrics["velocity_norm"], np.linalg.norm(v), rtol=1e-6)
    new, _ = server_round("fedavg", {"server_lr": 0.5}, FedAvgServerState(vars_of(W0, np.float32([4.0]))),
                          vars_of(ROUNDS[0], stats), WEIGHTS)
    np.testing.assert_allclose(new.variables["params"]["w"], W0 + 0.5 * delta, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(new.variables["batch_stats"]["m"], 4.0 + 0.5 * (hand_mean(stats, WEIGHTS) - 4.0),
                               rtol=1e-6)


@pytest.mark.fast
@pytest.mark.parametrize("name,options,message", [
    ("fedavg", {"server_optimizer": "lamb"},
     "--option server_optimizer='lamb': expected one of sgd, momentum, adam, yogi, adagrad"),
    ("fedavg", {"server_b2": 0.9}, "--option server_b2=0.9 of algorithm fedavg: server_optimizer=sgd does not read "
                                   "it (only adam, yogi); drop it or choose one of those"),
    ("fedavg", {"server_optimizer": "adagrad", "server_b1": 0.5}, "server_optimizer=adagrad does not read it"),
    ("fedadam", {"server_tau": 0.0}, "--option server_tau=0.0 of algorithm fedadam: expected tau > 0"),
    ("fedyogi", {"server_b2": 1.0}, "--option server_b2=1.0 of algorithm fedyogi: expected 0 <= server_b2 < 1"),
])
def test_server_options_that_would_do_nothing_or_diverge_are_refused_in_one_line(name, options, message):
    with pytest.raises(ValueError) as info:
        make_algorithm(name, make_task(tiny_federated(SIZES)[1]), options)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_registered_and_run_from_the_cli_with_a_server_optimizer(tmp_path, capsys):
    import json
    assert {"fedavgm", "fedadam", "fedyogi", "fedadagrad"} <= set(algorithm_names())
    code = main(["run", "--algorithm", "fedavg", "--dataset", "digits", "--num-clients", "6", "--clients-per-round",
                 "3", "--rounds", "2", "--local-epochs", "1", "--option", "server_optimizer=adam", "--option",
                 "server_lr=0.01", "--quiet", "--out", str(tmp_path / "r")])
    assert code == 0 and "fedavg" in capsys.readouterr().out
    recorded = json.loads((tmp_path / "r" / "config.json").read_text())["algorithm_options"]
    assert recorded["server_optimizer"] == "adam" and recorded["server_lr"] == 0.01

"""Memory known before compiling (fedjax_sparse.core.memory): the estimate against facts counted apart
from it (layer shapes by hand, the built arrays' nbytes, the rows a host population really puts
on the device, XLA's own buffer assignment of the compiled round), and the one-line refusal."""
import dataclasses
import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.core import memory
from fedjax_sparse.driver import runner
from fedjax_sparse.driver import population as host_population
from fedjax_sparse.driver.config import RunConfig

# Digits (8x8x1 inputs, 10 classes), iid, small and quick to build.
from fedjax_sparse.errors import RunError
DIGITS = dict(dataset="digits", partition="iid", rounds=3, local_epochs=1, batch_size=16)
# McMahan's 2NN on 8x8 digits, counted by hand: fc1 64x200 + 200, fc2 200x200 + 200, fc3 200x10 + 10.
MLP_PARAMS = 64 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10


def _config(**fields) -> RunConfig:
    return RunConfig.from_json({**DIGITS, **fields})


def _estimate(**fields):
    return memory.estimate(runner.build(_config(**fields)))


@pytest.mark.fast
def test_peak_live_bytes_frees_values_after_their_last_use():
    x = jax.ShapeDtypeStruct((1000,), jnp.float32)
    # A chain: each value dies at the next equation, so two buffers of 4000 bytes at most.
    chain = jax.make_jaxpr(lambda x: ((x * 2) + 1) * 3)(x)
    assert memory.peak_live_bytes(chain) == 2 * 4000
    # Two values both needed by the last equation, plus its output: three buffers.
    fork = jax.make_jaxpr(lambda x: (x * 2) + (x * 3))(x)
    assert memory.peak_live_bytes(fork) == 3 * 4000
    # Inputs are not counted; a nested jit adds its own intermediates while it runs.
    nested = jax.make_jaxpr(lambda x: jax.jit(lambda y: (y * 2) + (y * 3))(x) + 1)(x)
    assert memory.peak_live_bytes(nested) == 3 * 4000


@pytest.mark.fast
def test_client_state_is_params_and_momentum_counted_by_hand():
    n = 7
    with_momentum = _estimate(algorithm="local", model="mlp", num_clients=n, clients_per_round=2,
                              options={"momentum": 0.9})
    # Local keeps each client's model (float32) and its SGD momentum (one float32 per parameter).
    assert with_momentum.per_client_row_bytes == 2 * 4 * MLP_PARAMS
    assert with_momentum.client_state_bytes == n * 2 * 4 * MLP_PARAMS
    assert with_momentum.device_client_state_bytes == n * 2 * 4 * MLP_PARAMS
    plain = _estimate(algorithm="local", model="mlp", num_clients=n, clients_per_round=2)
    assert plain.client_state_bytes == n * 4 * MLP_PARAMS  # plain SGD keeps no optimizer state
    # FedAvg keeps the model once on the server and nothing per client.
    fedavg = _estimate(algorithm="fedavg", model="mlp", num_clients=n, clients_per_round=2)
    assert fedavg.client_state_bytes == 0 and fedavg.server_state_bytes == 4 * MLP_PARAMS


def test_state_and_data_equal_the_built_arrays():
    exp = runner.build(_config(algorithm="spafl", num_clients=6, clients_per_round=3))
    est = memory.estimate(exp)
    state = exp.engine.init(jax.random.PRNGKey(0))
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    assert est.data_bytes == nbytes(exp.data) > 0
    assert est.client_state_bytes == nbytes(state.clients) > 0
    assert est.server_state_bytes == nbytes(state.server)
    json.dumps(est.as_dict())  # JSON-ready


@pytest.mark.parametrize("mode", ["vmap", "map"])
def test_estimate_is_within_2x_of_xla_buffer_assignment(mode):
    """XLA's own memory analysis of the compiled round (arguments + temporaries + outputs not
    aliased to the donated state) against the estimate of the same round (evaluation apart)."""
    exp = runner.build(_config(algorithm="spafl", num_clients=12, clients_per_round=6, batch_size=32,
                                 client_parallelism=mode))
    est = memory.estimate(exp)
    engine = exp.engine
    shapes = jax.eval_shape(engine.init, jax.eval_shape(lambda: jax.random.PRNGKey(0)))
    analysis = jax.jit(engine.round_step, donate_argnums=0).lower(shapes, exp.data).compile().memory_analysis()
    if analysis is None:
        pytest.skip("this backend reports no memory analysis")
    xla_training = analysis.temp_size_in_bytes
    xla_total = (analysis.argument_size_in_bytes + analysis.temp_size_in_bytes + analysis.output_size_in_bytes
                 - analysis.alias_size_in_bytes)
    training_total = est.server_state_bytes + est.device_client_state_bytes + est.data_bytes + est.activation_bytes
    assert 0.5 * xla_training <= est.activation_bytes <= 2 * xla_training, (est.activation_bytes, xla_training)
    assert 0.5 * xla_total <= training_total <= 2 * xla_total, (training_total, xla_total)


def test_activations_grow_with_the_cohort_under_vmap_not_under_map():
    def build(mode, k):
        return _estimate(algorithm="fedavg", model="cnn_small", num_clients=8, clients_per_round=k,
                         client_parallelism=mode)

    vmap = {k: build("vmap", k) for k in (2, 4, 8)}
    mapped = {k: build("map", k) for k in (2, 4, 8)}
    step = vmap[2].step_bytes
    assert step > 0 and all(e.step_bytes == step for e in [*vmap.values(), *mapped.values()])
    # vmap trains the whole cohort in lockstep: linear in K, each client adding at least its step.
    assert vmap[8].activation_bytes - vmap[4].activation_bytes == 2 * (vmap[4].activation_bytes - vmap[2].activation_bytes)
    assert vmap[4].activation_bytes - vmap[2].activation_bytes >= 2 * step
    assert [vmap[k].lockstep_clients for k in (2, 4, 8)] == [2, 4, 8]
    # map trains one client at a time: only the cohort's stacked rows and messages grow.
    assert [mapped[k].lockstep_clients for k in (2, 4, 8)] == [1, 1, 1]
    assert len({e.activation_bytes - e.cohort_bytes for e in mapped.values()}) == 1
    # What does grow: FedAvg's clients each send a model (the server state's size), stacked [K, ...].
    assert mapped[8].message_bytes == mapped[8].server_state_bytes > 0
    assert mapped[8].cohort_bytes - mapped[2].cohort_bytes == 6 * mapped[8].message_bytes
    assert mapped[8].activation_bytes < vmap[8].activation_bytes - 6 * step


def test_host_client_state_moves_the_rows_off_the_device():
    fields = dict(algorithm="local", model="mlp", num_clients=40, clients_per_round=3, eval_every=2, rounds=4,
                  host_chunk_rounds=2, options={"momentum": 0.9})
    device = _estimate(**fields)
    exp = runner.build(_config(**fields, client_state="host"))
    host = memory.estimate(exp)
    row = 2 * 4 * MLP_PARAMS
    assert device.device_client_state_bytes == 40 * row
    # What the population really brings to the device for a chunk of 2 rounds (padded: 2 x K rows).
    state, population = host_population.init(exp.engine, jax.random.PRNGKey(0))
    resident = host_population._resident(exp.engine, state, 2)
    assert host.device_client_state_bytes == len(resident) * row == 6 * row
    # The device total drops by the rows left on the host (the training/evaluation term as estimated).
    work = lambda e: max(e.activation_bytes, e.host_evaluation_bytes if e.client_state == "host"  # noqa: E731
                         else e.evaluation_bytes)
    assert device.device_total_bytes - host.device_total_bytes == (40 - 6) * row + work(device) - work(host)
    # The host holds at least the population's initial buffers (64 rows and the slot table).
    assert device.host_total_bytes == 0
    assert host.host_total_bytes >= population.nbytes
    _, bf16 = host_population.init(exp.engine, jax.random.PRNGKey(0), storage_dtype=jnp.bfloat16)
    halved = host.with_settings(client_storage="bfloat16")
    assert host.host_total_bytes - halved.host_total_bytes == population.nbytes - bf16.nbytes


def test_a_client_state_that_does_not_fit_names_client_state_host(monkeypatch):
    fields = dict(algorithm="local", model="mlp", num_clients=1000, clients_per_round=2, rounds=2,
                  options={"momentum": 0.9})
    exp = runner.build(_config(**fields))
    limit = 300 * 2 ** 20  # the 1000 clients' rows alone are 421 MiB
    monkeypatch.setenv(memory.LIMIT_ENV, str(limit))
    est = memory.estimate(exp)
    assert est.device_capacity_bytes == limit and est.device_client_state_bytes > limit
    with pytest.raises(RunError) as caught:
        memory.check_fits(est, exp.config)
    message = str(caught.value)
    assert "\n" not in message
    assert "client state" in message and "--client-state host" in message, message
    assert "300.0 MiB" in message  # the capacity, with the estimate
    # The named flag does make it fit.
    memory.check_fits(memory.estimate(runner.build(_config(**fields, client_state="host"))))


def test_training_that_does_not_fit_names_the_largest_cohort_that_does(monkeypatch):
    fields = dict(algorithm="fedavg", model="cnn_small", num_clients=40, clients_per_round=40, batch_size=64,
                  client_parallelism="vmap")
    est = memory.estimate(runner.build(_config(**fields)))
    fixed = est.device_total_bytes - est.activation_bytes
    limit = fixed + est.activation_bytes // 3
    monkeypatch.setenv(memory.LIMIT_ENV, str(limit))
    est = memory.estimate(runner.build(_config(**fields)))
    with pytest.raises(RunError) as caught:
        memory.check_fits(est)
    message = str(caught.value)
    assert "\n" not in message and "training 40 client(s) at once" in message, message
    assert "--client-parallelism map" in message
    k = int(re.search(r"--clients-per-round (\d+)", message).group(1))
    assert 1 <= k < 40
    # Applied, it fits; one more client does not.
    memory.check_fits(memory.estimate(runner.build(_config(**{**fields, "clients_per_round": k}))))
    with pytest.raises(RunError):
        memory.check_fits(memory.estimate(runner.build(_config(**{**fields, "clients_per_round": k + 1}))))


def test_capacity_override_argument_and_fitting_run():
    est = _estimate(algorithm="fedavg", model="mlp", num_clients=5, clients_per_round=2)
    memory.check_fits(est)  # this machine holds a tiny run
    with pytest.raises(RunError, match="exceeds the device's"):
        memory.check_fits(est, capacity_bytes=1024)
    assert memory.estimate(runner.build(_config(algorithm="fedavg", num_clients=5)),
                           capacity_bytes=4096).device_capacity_bytes == 4096
    line = memory.format_estimate(est)
    assert "\n" not in line and line.startswith("memory estimate: device ")


def test_the_estimate_compiles_nothing(caplog):
    exp = runner.build(_config(algorithm="spafl", num_clients=6, clients_per_round=3))
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        memory.estimate(exp)
        estimated = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
        jax.jit(lambda x: x * 3 + 1)(np.float32(2.0))  # the capture does see a compilation
        control = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert estimated == [], estimated
    assert len(control) == 1, control


def test_with_settings_matches_a_fresh_estimate():
    base = dict(algorithm="spafl", model="cnn_small", num_clients=12, clients_per_round=6)
    est = _estimate(**base)
    for change in (dict(clients_per_round=3), dict(client_parallelism="vmap")):
        fresh = _estimate(**{**base, **change})
        derived = est.with_settings(**change)
        keep = {"seconds", "device_capacity_bytes", "host_capacity_bytes"}
        assert {k: v for k, v in dataclasses.asdict(derived).items() if k not in keep} == \
               {k: v for k, v in dataclasses.asdict(fresh).items() if k not in keep}, change


def test_a_run_that_cannot_fit_stops_before_compiling_in_one_line(tmp_path, monkeypatch, capsys):
    from fedjax_sparse.cli import main
    from fedjax_sparse.core.engine import Engine
    compiled = []
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Engine, "advance", lambda *a, **k: compiled.append(1))
        patch.setenv(memory.LIMIT_ENV, str(2 ** 20))   # a 1 MiB "device"
        code = main(["run", "--algorithm", "local", "--dataset", "digits", "--model", "mlp", "--num-clients", "400",
                     "--partition", "iid", "--clients-per-round", "4", "--rounds", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not compiled, err
    error = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(error) == 1 and "exceeds the device's" in error[0] and "--client-state host" in error[0]
    assert not out.exists()   # nothing written: the folder the run made is gone again
    assert main(["run", "--algorithm", "local", "--dataset", "digits", "--model", "mlp", "--num-clients", "8",
                 "--partition", "iid", "--clients-per-round", "4", "--rounds", "1", "--quiet",
                 "--out", str(tmp_path / "fits")]) == 0
    recorded = json.loads((tmp_path / "fits" / "config.json").read_text())["memory_estimate"]
    assert recorded["device_total_bytes"] > recorded["data_bytes"] > 0

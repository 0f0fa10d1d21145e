"""Multi-process runs (jax.distributed): two local CPU processes give the single-process numbers."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fedjax_sparse.driver import distributed
from fedjax_sparse.errors import RunError

from helpers import flat_config

RUN = ["run", "--algorithm", "spafl", "--dataset", "digits", "--num-clients", "8", "--clients-per-round", "4",
       "--local-epochs", "1", "--batch-size", "16", "--eval-every", "1", "--partition", "iid", "--quiet"]


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", FEDJAX_SPARSE_COMPILE_CACHE="off")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    for variable in distributed.ENVIRONMENT.values():
        env.pop(variable, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(out: Path, *extra: str, check: bool = True) -> list[tuple[int, str]]:
    """Process 0 and 1 of one run, 2 CPU devices each (4 in the global mesh): [(exit code, output)]
    of process 1, then process 0."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "fedjax_sparse", *RUN, "--out", str(out), *extra,
                               "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
                              env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (1, 0)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    if check:
        assert all(p.returncode == 0 for p in procs), "\n".join(log[-2000:] for log in logs)
    return [(p.returncode, log) for p, log in zip(procs, logs)]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_resumed_match_one_process_on_the_same_four_devices(tmp_path):
    """SpaFL (personal client state gathered and scattered every round) on 2 processes x 2 devices,
    interrupted after round 2 and resumed to 3, against one process with 4 devices and one with 1."""
    two = tmp_path / "two"
    _two_processes(two, "--rounds", "2")
    _two_processes(two, "--rounds", "3", "--resume")
    single = {}
    for devices in (4, 1):
        out = tmp_path / f"one_{devices}"
        subprocess.run([sys.executable, "-m", "fedjax_sparse", *RUN, "--rounds", "3", "--out", str(out),
                        "--client-parallelism", "vmap"], env=_env(devices), check=True, capture_output=True)
        single[devices] = _rows(out)
    rows = _rows(two)
    assert [r["round"] for r in rows] == [1, 2, 3]
    config = json.loads((two / "config.json").read_text())
    assert config["processes"] == 2 and config["client_devices"] == 4 and len(config["devices"]) == 4
    assert config["population_sharded"]  # each process holds 4 of the 8 clients' rows
    # orbax's own record of the checkpoint: the clients' rows were saved split along the client axis
    # (each process wrote its shards), the rest replicated.
    import base64
    recorded = json.loads((two / "checkpoints" / "3" / "state" / "_sharding").read_text())
    specs = {base64.b64decode(k).decode(): json.loads(v)["partition_spec"] for k, v in recorded.items()}
    client_specs = {spec[0] if spec else None for name, spec in specs.items() if name.startswith("clients.")}
    assert client_specs == {"clients"}, specs
    assert all(not spec for name, spec in specs.items() if not name.startswith("clients.")), specs
    assert all((two / "checkpoints" / "3" / "state" / f"ocdbt.process_{i}").is_dir() for i in (0, 1))
    assert json.loads((tmp_path / "one_1" / "config.json").read_text())["client_devices"] == 1
    for reference in single.values():
        for mine, theirs in zip(rows, reference):
            for key in ("total_uplink_bits", "total_downlink_bits", "total_flops"):
                assert mine[key] == theirs[key], key   # exact integers
            for key in ("accuracy", "loss", "density", "test_loss"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (key, mine["round"])
    # The same devices and reduction order: the same numbers to the bit except float rounding of
    # the cross-process reduction (measured equal for FedAvg; SpaFL's density differs by 1e-7).
    assert [r["accuracy"] for r in rows] == [r["accuracy"] for r in single[4]]
    # Only process 0 wrote files, and the lock is released.
    assert sorted(p.name for p in two.iterdir()) == ["checkpoints", "config.json", "metrics.jsonl", "summary.json"]


def test_when_process_0_cannot_open_the_output_folder_every_process_stops_with_one_line(tmp_path):
    """Process 0 alone checks --out; the others must not wait for it in a collective."""
    out = tmp_path / "busy"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")   # a previous run
    (one, log_one), (zero, log_zero) = _two_processes(out, "--rounds", "1", check=False)
    assert zero == 2 and "is not empty" in log_zero and "Traceback" not in log_zero
    assert one == 2 and "process 0 stopped while opening --out" in log_one and "Traceback" not in log_one
    assert (out / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.fast
def test_initialize_without_settings_is_one_process(monkeypatch):
    for variable in distributed.ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    assert distributed.initialize() == 1
    assert distributed.initialize(num_processes=1) == 1


@pytest.mark.parametrize("kwargs, env, message", [
    ({"coordinator": "localhost:1"}, {}, "--num-processes (or JAX_NUM_PROCESSES), --process-id"),
    ({"num_processes": 2, "process_id": 0}, {}, "--coordinator (or JAX_COORDINATOR_ADDRESS)"),
    ({"coordinator": "localhost:1", "num_processes": 2, "process_id": 2}, {}, "between 0 and"),
    ({"coordinator": "localhost", "num_processes": 2, "process_id": 0}, {}, "HOST:PORT"),
    ({"coordinator": "localhost:1"}, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' is not an integer"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "localhost:1", "JAX_NUM_PROCESSES": "2"}, "--process-id (or JAX_PROCESS_ID)"),
])
@pytest.mark.fast
def test_initialize_names_what_is_missing_or_wrong(monkeypatch, kwargs, env, message):
    for variable in distributed.ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(RunError, match=message.replace("(", r"\(").replace(")", r"\)")):
        distributed.initialize(**kwargs)


def test_a_multi_process_run_refuses_a_cohort_that_does_not_split_over_the_devices(monkeypatch):
    import jax

    from fedjax_sparse.driver import runner
    config = runner.RunConfig(algorithm="fedavg", dataset="digits", num_clients=8, clients_per_round=3,
                              local_epochs=1, batch_size=16, rounds=1, partition="iid")
    exp = runner.build(config)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "device_count", lambda: 4)
    with pytest.raises(RunError, match="--clients-per-round must be a multiple of 4"):
        runner.check_multi_process(config, exp.engine)
    with pytest.raises(RunError, match="measure"):
        runner.check_multi_process(flat_config(**{**config.to_json(), "client_parallelism": "measure"}),
                                    exp.engine)
    mapped = flat_config(**{**config.to_json(), "client_parallelism": "map", "clients_per_round": 4})
    with pytest.raises(RunError, match="would repeat all the work"):
        runner.check_multi_process(mapped, runner.build(mapped).engine)

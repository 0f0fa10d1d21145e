"""``run --client-state host``: a run whose clients' rows live in host memory writes the same
metrics as the all-resident run, resumes exactly, and refuses what it cannot do."""
import dataclasses
import json

import numpy as np
import pytest

from fedjax_sparse.driver import runner
from fedjax_sparse.cli import main
from fedjax_sparse.driver.config import validate
from fedjax_sparse.errors import RunError

from helpers import flat_config

# 10 clients, 3 per round, evaluation every 3 rounds in host chunks of 2: chunks share clients and
# an evaluation chunk (3 rounds) is split into device programs of 2 and 1 rounds.
BASE = dict(dataset="digits", num_clients=10, clients_per_round=3, local_epochs=1, batch_size=16, rounds=6, lr=0.1,
            eval_every=3, partition="iid", host_chunk_rounds=2)
# Keys that differ by construction: wall time, and the host-only counters.
VARYING = {"seconds", "clients_touched", "host_population_bytes"}


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _compare(device_rows, host_rows, exact=True):
    assert len(device_rows) == len(host_rows)
    for d, h in zip(device_rows, host_rows):
        assert set(h) - set(d) == {"clients_touched", "host_population_bytes"}
        for key in set(d) - VARYING:
            if exact or not isinstance(d[key], float):
                assert h[key] == d[key], (d["round"], key, h[key], d[key])
            else:
                assert h[key] == pytest.approx(d[key], rel=1e-6, abs=1e-7), (d["round"], key)


@pytest.fixture(scope="module")
def device_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    for algorithm in ("spafl", "fedavg"):
        runner.run(flat_config(algorithm=algorithm, out=str(root / algorithm), **BASE), progress=False)
    return root


def test_interrupted_host_run_writes_the_device_runs_metrics(tmp_path, device_runs):
    out = tmp_path / "host"
    config = flat_config(algorithm="spafl", out=str(out), client_state="host", **BASE)
    runner.run(dataclasses.replace(config, rounds=3), progress=False)
    # Resumed in a new run: the population is read back from the checkpoint, not kept in memory.
    result = runner.run(config, resume=True, progress=False, given={"rounds"})
    state = result.state
    assert state.clients is None and result.population is not None
    rows = _rows(out)
    # Personal accuracies and losses are bit-identical; density_all_clients is summed on the host in
    # float64 (the device run averages in float32 on the device): float tolerance.
    _compare(_rows(device_runs / "spafl"), rows, exact=False)
    assert rows[0]["accuracy"] == _rows(device_runs / "spafl")[0]["accuracy"]
    assert rows[-1]["density_all_clients"] < 1.0  # thresholds pruned something: the check has teeth
    assert rows[-1]["clients_touched"] == result.population.touched <= 10
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["config"]["client_state"] == "host"
    assert recorded["host_population"]["row_bytes"] == result.population.row_bytes


def test_host_run_without_personal_models_and_its_cli_flags(tmp_path, device_runs, capsys):
    out = tmp_path / "fedavg"
    code = main(["run", "--algorithm", "fedavg", "--dataset", "digits", "--num-clients", "10",
                 "--clients-per-round", "3", "--local-epochs", "1", "--batch-size", "16", "--rounds", "6",
                 "--eval-every", "3", "--partition", "iid", "--client-state", "host", "--host-chunk-rounds", "2",
                 "--quiet", "--out", str(out)])
    assert code == 0
    _compare(_rows(device_runs / "fedavg"), _rows(out), exact=True)
    code = main(["run", "--algorithm", "fedavg", "--dataset", "digits", "--client-state", "host", "--quiet",
                 "--seeds", "0", "1", "--out", str(tmp_path / "seeds")])
    assert code == 2 and "--client-state host one --seed" in capsys.readouterr().err


def test_bfloat16_storage_halves_the_rows_and_stays_close(tmp_path, device_runs):
    out = tmp_path / "bf16"
    result = runner.run(flat_config(algorithm="spafl", out=str(out), client_state="host",
                                         client_storage="bfloat16", **{**BASE, "rounds": 3}), progress=False)
    row, reference = _rows(out)[0], _rows(device_runs / "spafl")[0]
    assert json.loads((out / "config.json").read_text())["host_population"]["storage"] == "bfloat16"
    # The weights are rounded to 8 bits of mantissa between rounds: close, not equal.
    assert row["loss"] != reference["loss"]
    assert abs(row["accuracy"] - reference["accuracy"]) < 0.1
    pop = result.population
    float32_bytes = sum(leaf.size * np.dtype(dtype).itemsize for leaf, dtype in zip(pop.initial, pop.dtypes))
    assert 1.9 < float32_bytes / pop.row_bytes <= 2.0


def test_host_state_refusals(tmp_path):
    with pytest.raises(RunError, match="--client-state host"):
        validate(flat_config(client_storage="bfloat16"))
    with pytest.raises(RunError, match="unknown --client-state"):
        validate(flat_config(client_state="disk"))
    with pytest.raises(RunError, match="host-chunk-rounds"):
        validate(flat_config(client_state="host", host_chunk_rounds=0))
    # A device run cannot be resumed as a host run: the checkpoint holds no population.
    out = tmp_path / "device"
    runner.run(flat_config(algorithm="fedavg", out=str(out), **{**BASE, "rounds": 3}), progress=False)
    with pytest.raises(RunError, match=r"Execution\(client_state='host'\)"):   # the API's words
        runner.run(flat_config(algorithm="fedavg", out=str(out), client_state="host", **BASE), resume=True,
                   progress=False, given={"client_state", "rounds"})

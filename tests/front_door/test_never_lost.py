"""Never lost, round two (issue 50 item 3): what a new user met from a fresh clone, each now one line
or said once, never a traceback or a silent coercion.

* a Flax model with no parameters, and one too large for memory: refused in one line by ``from_flax``,
  the second from the weights' shapes before any weight is initialised;
* ``fjs.sweep(config, {"lr": 0.1})`` and ``seeds="01"``: refused in one line naming the fix;
* an empty Poisson cohort's training loss is null (no client trained), not 0.0, and the run goes on;
* a ``--batch-size`` larger than every client's training set is said once;
* too many clients for the data: the advice names a number of clients that can work, and never
  suggests lowering ``--min-client-samples`` below 1;
* ``bench --json`` to a path that cannot be written is refused before the benchmark runs.
"""
import json
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_sparse as fjs
from fedjax_sparse.core import memory
from fedjax_sparse.cli import main
from fedjax_sparse.data.partitions import partition_dataset
from fedjax_sparse.errors import DataWarning, RunError
from fedjax_sparse.core.engine import reduce_client_metrics

from helpers import tiny_dataset


def one_line(err: str, needle: str) -> None:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


# ---------------------------------------------------------------- models
class NoParams(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.reshape(x, (x.shape[0], -1))[:, :10]


INITIALISED = []   # one entry per kernel initialisation: True when it made real (concrete) weights


def _recording_init(key, shape, dtype=jnp.float32):
    INITIALISED.append(not isinstance(key, jax.core.Tracer))
    return jnp.zeros(shape, dtype)


class Wide(nn.Module):
    """64 -> 4096 -> 10: 1.2 MiB of weights (more than the 256 KiB "device" below)."""
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(4096, kernel_init=_recording_init)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10, kernel_init=_recording_init)(x)


@pytest.mark.fast
def test_a_model_without_parameters_is_refused_in_one_line(capsys):
    with pytest.raises(ValueError, match=r"from_flax: NoParams has no parameters"):
        fjs.models.from_flax(NoParams(), input_shape=(8, 8, 1))
    assert main(["run", "--dataset", "digits", "--model", "test_never_lost:NoParams", "--rounds", "1",
                 "--quiet"]) == 2
    one_line(capsys.readouterr().err, "has no parameters")


@pytest.mark.fast
def test_a_model_too_large_is_refused_from_its_shapes_before_any_weight_is_made(monkeypatch, capsys):
    monkeypatch.setenv(memory.LIMIT_ENV, str(256 * 1024))
    INITIALISED.clear()
    with pytest.raises(RunError, match=r"from_flax: Wide's weights take 1.2 MiB \(307,210 parameters\); "
                                       r"building and checking them holds up to 4 times that \(4.7 MiB\), "
                                       r"which exceeds the device's 256.0 KiB: use a smaller model"):
        fjs.models.from_flax(Wide(), input_shape=(8, 8, 1))
    assert INITIALISED and not any(INITIALISED), "a real weight was initialised before the refusal"
    assert main(["run", "--dataset", "digits", "--model", "test_never_lost:Wide", "--rounds", "1", "--quiet"]) == 2
    one_line(capsys.readouterr().err, "exceeds the device's 256.0 KiB")
    monkeypatch.delenv(memory.LIMIT_ENV)
    INITIALISED.clear()
    fjs.models.from_flax(Wide(), input_shape=(8, 8, 1))   # fits this machine: built, real weights checked
    assert any(INITIALISED)


# ---------------------------------------------------------------- sweeps
CONFIG = dict(dataset="digits", num_clients=4, clients_per_round=2, rounds=1)


@pytest.mark.fast
@pytest.mark.parametrize("axes, said", [
    ({"lr": 0.1}, "sweep axis 'lr' needs a list of values, got the float 0.1: write {'lr': [0.1]}"),
    ({"option.ste": "truncated"}, "sweep axis 'option.ste' needs a list of values, got the str 'truncated': "
                                  "write {'option.ste': ['truncated']}"),
    (["lr"], "a sweep's axes are a dict {key: [values]}, got a list: write e.g. {'lr': [0.01, 0.1]}"),
])
def test_a_scalar_sweep_value_is_refused_naming_the_list(axes, said):
    with pytest.raises(RunError) as e:
        fjs.sweep(fjs.RunConfig(**CONFIG), axes, progress=False)
    assert str(e.value) == said


@pytest.mark.fast
@pytest.mark.parametrize("seeds, said", [
    ("01", "seeds must be a list of integers such as [0, 1, 2], got the str '01'"),
    (3, "seeds must be a list of integers such as [0, 1, 2], got the int 3: write seeds=[3] (one seed) or "
        "seeds=range(3)"),
    ([0, 1.5], "seeds must be integers, got 1.5"),
])
def test_seeds_that_are_not_a_list_of_integers_are_refused(seeds, said, tmp_path):
    config = fjs.RunConfig(**CONFIG, out=str(tmp_path / "sweep"))
    with pytest.raises(RunError) as e:
        fjs.sweep(config, {"lr": [0.1]}, seeds=seeds, progress=False)
    assert str(e.value) == said
    assert not (tmp_path / "sweep").exists()   # refused before anything ran
    from fedjax_sparse.driver.replicas import run_replicas
    with pytest.raises(RunError) as e:
        run_replicas(config, seeds, progress=False)
    assert str(e.value) == said


# ---------------------------------------------------------------- an empty Poisson cohort
@pytest.mark.fast
def test_an_empty_cohort_has_no_loss():
    metrics = {"loss": jnp.array([0.0, 0.0]), "density": jnp.array([0.0, 0.0]),
               "num_examples": jnp.array([0, 0], jnp.int32)}
    empty = reduce_client_metrics(metrics, jnp.array([False, False]))
    assert np.isnan(empty["loss"]) and np.isnan(empty["density"])
    metrics = {"loss": jnp.array([2.0, 0.0]), "density": jnp.array([0.5, 0.0]),
               "num_examples": jnp.array([3, 0], jnp.int32)}
    real = reduce_client_metrics(metrics, jnp.array([True, False]))
    assert float(real["loss"]) == 2.0 and float(real["density"]) == 0.5


def test_an_empty_poisson_round_logs_a_null_loss_and_the_run_goes_on(tmp_path):
    # 4 clients at q = 1/4: 32 % of rounds are empty; seed 0's rounds 1-6 include empty ones (checked below).
    config = fjs.RunConfig(algorithm="fedavg", dataset="digits", num_clients=4, clients_per_round=1,
                           client_sampling="poisson", rounds=6, local_epochs=1, out=str(tmp_path / "run"))
    result = fjs.run(config, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == result.rows and len(rows) == 6
    empty = [r for r in rows if r["clients"] == 0]
    trained = [r for r in rows if r["clients"] > 0]
    assert empty and trained, [r["clients"] for r in rows]
    assert all(r["loss"] is None for r in empty), [r["loss"] for r in empty]
    assert all(r["loss"] > 0 for r in trained), [r["loss"] for r in trained]
    assert result.summary["rounds"] == 6   # not taken for a diverged run


@pytest.mark.fast
def test_a_folder_whose_last_round_was_empty_is_not_called_diverged(tmp_path):
    from fedjax_sparse.driver.checkpoint import CHECKPOINT_DIR, prepare_out_dir
    out = tmp_path / "run"
    (out / CHECKPOINT_DIR / "3").mkdir(parents=True)
    (out / "metrics.jsonl").write_text(json.dumps({"round": 3, "loss": None, "clients": 0}) + "\n")
    with pytest.raises(RunError, match="it holds a run stopped after a checkpoint"):
        prepare_out_dir(out, resume=False, overwrite=False)
    (out / "metrics.jsonl").write_text(json.dumps({"round": 3, "loss": None, "clients": 2}) + "\n")
    with pytest.raises(RunError, match="it holds a run that diverged at round 3"):
        prepare_out_dir(out, resume=False, overwrite=False)


# ---------------------------------------------------------------- a batch larger than every client
@pytest.mark.fast
def test_a_batch_larger_than_every_client_is_said_once():
    config = fjs.RunConfig(dataset="digits", num_clients=20, batch_size=5000, rounds=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        experiment = fjs.build(config)
        fjs.build(config)
    said = [str(w.message) for w in seen if issubclass(w.category, DataWarning)]
    largest = int(np.max(np.asarray(experiment.data.train_count)))
    assert said == [f"RunConfig(batch_size=5000) is larger than every client's training set (the largest holds "
                    f"{largest} examples): each local epoch is one full-batch step, padded to 5000 rows; "
                    f"RunConfig(batch_size={largest}) takes the same steps without the padding"], said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fjs.build(fjs.RunConfig(dataset="digits", num_clients=20, batch_size=largest, rounds=1))


@pytest.mark.fast
def test_the_command_line_says_our_warnings_in_one_line(monkeypatch):
    from fedjax_sparse.cli import one_line_warnings
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)   # restored after the test
    one_line_warnings()
    assert warnings.formatwarning(DataWarning("--batch-size 64 is larger"), DataWarning, "x.py", 3) == \
        "warning: --batch-size 64 is larger\n"
    assert "x.py:3: UserWarning" in warnings.formatwarning(UserWarning("other"), UserWarning, "x.py", 3)


# ---------------------------------------------------------------- too many clients for the data
@pytest.mark.fast
@pytest.mark.parametrize("spec", ["dirichlet:0.5", "iid", "dirichlet_split:0.5:0.8"])
def test_more_clients_than_examples_names_how_many_can_work(spec):
    data = tiny_dataset(n_train=240)
    with pytest.raises(ValueError) as e:
        partition_dataset(data, spec, 5000, seed=0)
    assert str(e.value) == ("5000 clients of at least 1 train example each (--min-client-samples 1) need 5000 "
                            "train examples; the training set has 240: use at most 240 clients (--num-clients)")
    with pytest.raises(ValueError) as e:
        partition_dataset(data, spec, 100, seed=0, min_train_samples=3)
    assert str(e.value).endswith("use at most 80 clients (--num-clients), or a lower --min-client-samples")


@pytest.mark.fast
def test_a_dirichlet_draw_that_fails_at_one_sample_does_not_advise_lowering_it():
    data = tiny_dataset(n_train=240)
    with pytest.raises(ValueError) as e:
        partition_dataset(data, "dirichlet:0.1", 200, seed=0, max_redraws=3)
    assert "lower it" not in str(e.value) and "raise alpha or use fewer clients" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="--min-client-samples \\(min_train_samples\\) is too large for this alpha and "
                                         "number of clients: lower it, raise alpha, or use fewer clients"):
        partition_dataset(data, "dirichlet:0.1", 20, seed=0, min_train_samples=11, max_redraws=3)


# ---------------------------------------------------------------- bench --json
@pytest.mark.fast
def test_bench_refuses_an_unwritable_json_before_benchmarking(tmp_path, monkeypatch, capsys):
    from fedjax_sparse.tools import bench

    def ran(*a, **k):
        raise AssertionError("the benchmark ran")
    monkeypatch.setattr(bench, "bench", ran)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    target = blocker / "result.json"   # a folder that cannot exist: its parent is a file
    assert main(["bench", "--dataset", "digits", "--rounds-timed", "1", "--quiet", "--json", str(target)]) == 2
    one_line(capsys.readouterr().err, f"--json {target}: cannot write there")
    assert main(["bench", "--dataset", "digits", "--quiet", "--json", str(tmp_path)]) == 2
    one_line(capsys.readouterr().err, f"--json {tmp_path} is a folder; give a file name")

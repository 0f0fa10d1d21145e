"""Client-level DP through the CLI and the front door: --dp-* flags, dp_epsilon and dp_clipped_fraction
in every metrics row, the calibrated noise, one-line refusals."""
from __future__ import annotations

import json

import pytest

import fedjax_sparse as fjs
from fedjax_sparse.driver import privacy
from fedjax_sparse.cli import main
from fedjax_sparse.driver.config import RunConfig, validate
from fedjax_sparse.errors import RunError

QUICK = ["--algorithm", "fedavg", "--dataset", "digits", "--num-clients", "20", "--clients-per-round", "5",
         "--local-epochs", "1", "--batch-size", "32", "--rounds", "3", "--quiet"]


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_rows_carry_epsilon_of_the_engines_sampling_and_the_clipped_fraction(tmp_path):
    out = tmp_path / "dp"
    assert main(["run", *QUICK, "--dp-clip", "0.01", "--dp-noise-multiplier", "1.2", "--out", str(out)]) == 0
    expected = privacy.epsilon_curve(1.2, 3, 1e-5, num_clients=20, clients_per_round=5)
    got = rows(out)
    assert [r["dp_epsilon"] for r in got] == pytest.approx(list(expected))
    assert got[0]["dp_epsilon"] < got[1]["dp_epsilon"] < got[2]["dp_epsilon"]
    # FedAvg's updates on digits are far longer than 0.01: every sampled update is clipped.
    assert all(r["dp_clipped_fraction"] == 1.0 and r["server_dp_update_norm"] > 0.01 for r in got)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dp_epsilon"] == pytest.approx(expected[-1]) and summary["dp_noise_multiplier"] == 1.2


def test_target_epsilon_calibrates_the_noise_before_the_run(tmp_path):
    config = RunConfig.from_json({"algorithm": "spafl", "dataset": "digits", "num_clients": 20, "clients_per_round": 5,
                                  "local_epochs": 1, "rounds": 3, "dp_clip": 0.1, "dp_target_epsilon": 4.0,
                                  "out": str(tmp_path / "spafl")})
    result = fjs.run(config, progress=False)
    z = json.loads((tmp_path / "spafl" / "config.json").read_text())["algorithm_options"]["dp_noise_multiplier"]
    final = privacy.epsilon(z, 3, 1e-5, num_clients=20, clients_per_round=5)
    assert final <= 4.0 and final == pytest.approx(4.0, rel=0.02)
    assert result.summary["dp_epsilon"] == pytest.approx(final)
    assert privacy.epsilon(0.97 * z, 3, 1e-5, num_clients=20, clients_per_round=5) > 4.0


@pytest.mark.parametrize("fields,needle", [
    (dict(dp_noise_multiplier=1.0), "need --dp-clip"),
    (dict(dp_clip=1.0), "exactly one of --dp-noise-multiplier"),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_target_epsilon=2.0), "exactly one of"),
    (dict(dp_clip=-1.0, dp_noise_multiplier=1.0), "positive finite"),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_delta=2.0), "--dp-delta must be in"),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, resample_every=2), "fresh cohort"),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, aggregator="trimmed_mean"), "K identical"),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, algorithm="fsl"), "cannot wrap fsl"),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, algorithm="feddrop"),
     "cannot wrap feddrop: .*own returned model.*use --option optimize=false or --algorithm unidrop$"),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, algorithm="feddrop", options={"optimize": "maybe"}),
     "optimize='maybe' of algorithm feddrop: expected a boolean"),
])
@pytest.mark.fast
def test_dp_settings_refused_in_one_line(fields, needle):
    with pytest.raises(RunError, match=needle):
        validate(RunConfig.from_json({"algorithm": "fedavg", **fields}))


@pytest.mark.fast
@pytest.mark.parametrize("algorithm, options", [("unidrop", {}), ("feddrop", {"optimize": "false"})])
def test_dp_settings_accept_the_dropout_algorithms_without_the_per_client_optimiser(algorithm, options):
    """UniDrop and FedDrop with --option optimize=false (the CLI's string) pass the DP checks."""
    validate(RunConfig.from_json({"algorithm": algorithm, "options": options, "dp_clip": 1.0,
                                  "dp_noise_multiplier": 1.0}))


def test_without_dp_flags_nothing_changes(tmp_path):
    """The non-DP path: no dp keys in rows or summary."""
    out = tmp_path / "plain"
    assert main(["run", *QUICK, "--out", str(out)]) == 0
    assert not any(k.startswith("dp_") or "server_dp" in k for r in rows(out) for k in r)
    assert "dp_epsilon" not in json.loads((out / "summary.json").read_text())


def test_a_dp_run_shows_its_privacy_in_the_run_table_report_and_plot(tmp_path, capsys):
    """epsilon, delta, the accountant and z where a user reads results: the run's table, ``report`` (a column
    only when some run is private) and the plots' legends; Poisson sampling is accounted by PLD by default."""
    out, plain = tmp_path / "dp", tmp_path / "plain"
    poisson = ["--client-sampling", "poisson", "--rounds", "2"]
    assert main(["run", *QUICK, *poisson, "--dp-clip", "0.5", "--dp-target-epsilon", "4", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    z = summary["dp_noise_multiplier"]
    assert summary["dp_accountant"] == "pld" and summary["dp_calibrated_with"] == "pld"
    assert summary["dp_epsilon"] == privacy.epsilon(z, 2, 1e-5, num_clients=20, clients_per_round=5,
                                                    sampling="poisson", accountant="pld") <= 4.0
    shown = f"ε {summary['dp_epsilon']:#.4g} at δ 1e-05 (PLD), z {z:.4g}, clip 0.5"
    assert "client-level DP" in table and shown in table
    assert main(["run", *QUICK, "--rounds", "1", "--out", str(plain)]) == 0
    capsys.readouterr()
    assert main(["report", str(out), str(plain)]) == 0
    report = capsys.readouterr().out.splitlines()
    assert report[0].endswith("| DP: ε at δ (accountant), z, clip |")
    assert report[2].endswith(f"| {shown} |") and report[3].endswith("| – |")
    assert "DP:" not in fjs.report_table([plain])   # a table without DP runs keeps its columns
    pytest.importorskip("matplotlib")
    figure = fjs.plot_runs([out, plain])
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert legend[0].endswith(f"({shown})") and "ε" not in legend[1]


@pytest.mark.fast
def test_resuming_a_run_recorded_before_auto_accounting_keeps_its_accountant():
    """Runs before --dp-accountant auto recorded "rdp" by default: auto resolves to it for fixed K (the same
    experiment: a resume goes on), but to PLD for Poisson sampling (another calibration: refused in one line)."""
    from fedjax_sparse.driver.runner import resumed_config
    dp = dict(dp_clip=1.0, dp_target_epsilon=4.0)
    recorded = RunConfig(**dp, dp_accountant="rdp")
    config, _ = resumed_config(RunConfig(**dp), recorded, None)
    assert config.dp_accountant == "rdp"
    with pytest.raises(RunError, match=r"--dp-accountant 'auto' \(recorded: 'rdp'\)"):
        resumed_config(RunConfig(**dp, client_sampling="poisson"),
                       RunConfig(**dp, dp_accountant="rdp", client_sampling="poisson"), None)


def test_dp_never_noises_running_statistics_so_a_batchnorm_model_evaluates(tmp_path):
    """Issue 47 item 3: DP-FedAvg noised BatchNorm running variances like weights; with this noise they went
    negative by round 2 (min -4.5 at round 3) and every evaluation was NaN (test loss null) while a 11.7 %
    accuracy was reported. Now the statistics are averaged without noise (said in summary.json)."""
    import flax.linen as nn
    import jax.numpy as jnp

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.Conv(8, (3, 3), padding="SAME", name="conv")(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.5, name="bn")(x))
            return nn.Dense(10, name="out")(x.reshape(x.shape[0], -1))

    config = RunConfig(algorithm="fedavg", dataset="digits", num_clients=20, clients_per_round=5, rounds=3,
                       local_epochs=1, dp_clip=0.5, dp_noise_multiplier=50.0, out=str(tmp_path / "bn"))
    with pytest.warns(UserWarning, match="16 BatchNorm running statistics; they are averaged without noise"):
        result = fjs.run(config, model=Net(), progress=False)
    assert all(row["test_loss"] is not None and row["accuracy"] is not None for row in result.rows)
    assert float(jnp.min(result.state.server.variables["batch_stats"]["bn"]["var"])) >= 0
    assert result.summary["dp_statistics"] == ("16 BatchNorm running statistics per client message, averaged "
                                               "without noise: not covered by dp_epsilon")


def test_a_nan_evaluation_ends_the_run_in_one_line_without_an_accuracy(tmp_path):
    """Non-finite outputs give a NaN test loss and an argmax accuracy that means nothing: the run stops at that
    evaluation with one line, and its row says null for every accuracy."""
    import dataclasses

    import jax.numpy as jnp

    from fedjax_sparse.models import make_model
    model = make_model("cnn_small", (8, 8, 1), 10)

    def apply(variables, x, *, train, **kwargs):   # NaN outputs in evaluation only: training goes on
        logits, stats = model.apply_fn(variables, x, train=train, **kwargs)
        return (logits if train else logits * jnp.nan), stats
    broken = dataclasses.replace(model, apply_fn=apply)
    config = RunConfig(algorithm="fedavg", dataset="digits", num_clients=10, clients_per_round=3, rounds=3,
                       local_epochs=1, out=str(tmp_path / "nan"))
    with pytest.raises(RunError) as stopped:
        fjs.run(config, model=broken, progress=False)
    message = str(stopped.value)
    assert "\n" not in message and message.startswith("evaluation diverged: the test loss is NaN/inf at round 1 ")
    assert "no accuracy is reported" in message
    row, = rows(tmp_path / "nan")
    assert row["round"] == 1 and row["test_loss"] is None and row["loss"] is not None
    assert row["accuracy"] is None and row["accuracy_std"] is None and row["global_accuracy"] is None

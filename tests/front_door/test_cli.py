"""CLI and runner: outputs, resume, and one-line errors for bad input."""
import gzip
import os
import json
import subprocess
import sys

import pytest

from fedjax_sparse.driver import runner
from fedjax_sparse.cli import main

from helpers import flat_config

QUICK = ["--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3", "--local-epochs", "1",
         "--batch-size", "32", "--lr", "0.1", "--partition", "iid", "--quiet"]
METRIC_KEYS = {"round", "accuracy", "accuracy_std", "global_accuracy", "loss", "uplink_bits", "downlink_bits",
               "flops", "density", "seconds", "total_uplink_bits", "total_downlink_bits", "total_flops"}


def run_cli(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.fast
def test_run_writes_the_documented_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, _ = run_cli(["run", "--algorithm", "fedavg", *QUICK, "--rounds", "4", "--eval-every", "2",
                               "--out", str(out)], capsys)
    assert code == 0
    assert "final accuracy" in stdout
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [2, 4]
    assert METRIC_KEYS <= set(rows[0])
    assert rows[1]["total_uplink_bits"] == pytest.approx(2 * rows[0]["total_uplink_bits"])
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["algorithm"] == "fedavg" and config["num_params"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["final_accuracy"] == rows[-1]["accuracy"]
    assert summary["peak_rss_mib"] > 0 and "peak_device_memory_mib" in summary


def test_interrupted_run_resumes_to_identical_results(tmp_path):
    base = dict(algorithm="fedavg", dataset="digits", num_clients=6, clients_per_round=3, local_epochs=1,
                batch_size=32, lr=0.1, partition="iid", eval_every=1)
    straight = runner.run(runner.RunConfig(**base, rounds=4, out=str(tmp_path / "a")), progress=False)
    runner.run(runner.RunConfig(**base, rounds=2, out=str(tmp_path / "b")), progress=False)
    # Simulate a crash after round 2 that left a stray metrics row behind the checkpoint.
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"round": 3, "accuracy": -1}) + "\n")
    resumed = runner.run(runner.RunConfig(**base, rounds=4, out=str(tmp_path / "b")), resume=True, progress=False)
    rows_a = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows_b] == [1, 2, 3, 4]
    for ra, rb in zip(rows_a, rows_b):
        assert ra["accuracy"] == pytest.approx(rb["accuracy"], abs=1e-6)
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["total_flops"] == pytest.approx(rb["total_flops"])
    assert straight.summary["final_accuracy"] == pytest.approx(resumed.summary["final_accuracy"], abs=1e-6)


@pytest.mark.parametrize("args,needle", [
    (["--algorithm", "nope"], "unknown algorithm 'nope'; valid algorithms:"),
    (["--dataset", "nope"], "unknown dataset 'nope'; valid datasets:"),
    (["--model", "nope"], "unknown model 'nope'; valid models:"),
    (["--clients-per-round", "50"], "--clients-per-round (50) is larger than --num-clients (6)"),
    (["--rounds", "0"], "--rounds must be a positive integer"),
    (["--batch-size", "-3"], "--batch-size must be a positive integer"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--option", "momentum=fast"], "--option momentum='fast' of algorithm fedavg: expected a number"),
    (["--option", "bogus=1"], "unknown option(s) ['bogus'] for algorithm 'fedavg'"),
    (["--partition", "dirichlet:-1"], "ALPHA must be > 0"),
])
@pytest.mark.fast
def test_bad_input_gives_one_line_error(args, needle, capsys, tmp_path):
    base = ["run", "--algorithm", "fedavg", *QUICK, "--rounds", "1", "--out", str(tmp_path / "x")]
    # Later flags override earlier ones (argparse keeps the last value).
    code, _, err = run_cli(base + args, capsys)
    assert code == 2
    assert needle in err, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_occupied_output_directory_is_never_overwritten_silently(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "--algorithm", "fedavg", *QUICK, "--rounds", "1", "--out", str(out)]
    assert run_cli(args, capsys)[0] == 0
    before = (out / "metrics.jsonl").read_text()
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "is not empty" in err and "--resume" in err and "--overwrite" in err
    assert (out / "metrics.jsonl").read_text() == before
    assert run_cli(args + ["--overwrite"], capsys)[0] == 0


def test_missing_and_corrupt_data_files(tmp_path, capsys):
    code, _, err = run_cli(["run", "--algorithm", "fedavg", "--dataset", "mnist", "--data-dir",
                            str(tmp_path / "nowhere"), "--quiet"], capsys)
    assert code == 2 and "train-images-idx3-ubyte" in err and "Traceback" not in err
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                 "t10k-labels-idx1-ubyte.gz"):
        (bad / name).write_bytes(gzip.compress(b"\x00\x00\x08\x03not an idx file"))
    code, _, err = run_cli(["run", "--algorithm", "fedavg", "--dataset", "mnist", "--data-dir", str(bad),
                            "--quiet"], capsys)
    assert code == 2 and "ubyte" in err and err.count("\n") == 1


def test_nan_loss_stops_with_a_clear_error(tmp_path, capsys):
    code, _, err = run_cli(["run", "--algorithm", "fedavg", *QUICK, "--rounds", "3", "--lr", "1e30",
                            "--out", str(tmp_path / "nan")], capsys)
    assert code == 2 and "diverged" in err and "--lr" in err
    assert (tmp_path / "nan" / "metrics.jsonl").exists()  # what ran is kept


def test_config_file_and_list_and_partition_commands(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"algorithm": "local", "dataset": "digits", "num_clients": 4,
                               "clients_per_round": 2, "rounds": 1, "partition": "iid"}))
    code, stdout, _ = run_cli(["run", "--config", str(cfg), "--quiet", "--batch-size", "64"], capsys)
    assert code == 0 and "local / digits" in stdout
    code, stdout, _ = run_cli(["list"], capsys)
    assert code == 0 and "fedavg" in stdout and "lenet5_caffe" in stdout
    code, stdout, _ = run_cli(["partition", "--dataset", "digits", "--num-clients", "5", "--partition",
                               "dirichlet:0.3", "--out", str(tmp_path / "p")], capsys)
    assert code == 0
    report = json.loads((tmp_path / "p" / "partition.json").read_text())
    assert report["num_clients"] == 5 and len(report["clients"]) == 5 and "client" in stdout


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "fedjax_sparse", "list"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "algorithms:" in proc.stdout


def test_compile_cache_is_written_once_and_reused_by_a_rerun(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    args = [sys.executable, "-m", "fedjax_sparse", "run", "--algorithm", "fedavg", *QUICK, "--rounds", "1",
            "--compile-cache", str(cache)]

    def entries():
        return {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if p.name.startswith("jit_run")}
    first = subprocess.run(args + ["--out", str(tmp_path / "a")], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    written = entries()
    assert len(written) == 1, sorted(cache.iterdir())   # the round chunk's program
    second = subprocess.run(args + ["--out", str(tmp_path / "b")], capture_output=True, text=True, env=env,
                            timeout=300)
    assert second.returncode == 0, second.stderr
    assert entries() == written   # read back, not compiled and written again
    off = subprocess.run(args[:-1] + ["off", "--out", str(tmp_path / "c")], capture_output=True, text=True,
                         env={**env, "XDG_CACHE_HOME": str(tmp_path / "xdg")}, timeout=300)
    assert off.returncode == 0 and not (tmp_path / "xdg").exists()


def test_measured_client_parallelism_is_recorded_kept_on_resume_and_changes_no_number(tmp_path, capsys):
    base = dict(algorithm="fedavg", dataset="digits", num_clients=6, clients_per_round=3, local_epochs=1,
                batch_size=32, lr=0.1, partition="iid", eval_every=1)
    runner.run(flat_config(**base, rounds=1, client_parallelism="measure", out=str(tmp_path / "m")),
               progress=False)
    recorded = json.loads((tmp_path / "m" / "config.json").read_text())
    chosen, seconds = recorded["client_parallelism"], recorded["client_parallelism_measured"]["seconds_per_round"]
    # packed too: 6 equal IID clients pack 3 to a group (a width above 1, so not map again)
    assert set(seconds) == {"map", "vmap", "packed"} and all(t > 0 for t in seconds.values())
    assert chosen == min(seconds, key=seconds.get)
    assert "using " + chosen in capsys.readouterr().err
    runner.run(flat_config(**base, rounds=2, client_parallelism="measure", out=str(tmp_path / "m")),
               resume=True, progress=False)
    resumed = json.loads((tmp_path / "m" / "config.json").read_text())
    assert resumed["client_parallelism"] == chosen and resumed["client_parallelism_measured"]["seconds_per_round"] \
        == seconds
    # The measurement ran on a copy: the run equals one started with the chosen schedule.
    runner.run(flat_config(**base, rounds=2, client_parallelism=chosen, out=str(tmp_path / "fixed")),
               progress=False)
    strip = lambda path: [{k: v for k, v in json.loads(l).items() if k != "seconds"}  # noqa: E731
                          for l in path.read_text().splitlines()]
    assert strip(tmp_path / "m" / "metrics.jsonl") == strip(tmp_path / "fixed" / "metrics.jsonl")

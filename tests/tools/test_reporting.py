"""plot / report commands, --log csv|tensorboard, and the progress output."""
import csv
import json
from pathlib import Path

import pytest

from fedjax_sparse.cli import main
from fedjax_sparse.tools.reporting import legend_labels, report_table
from fedjax_sparse.driver.progress import Progress
from fedjax_sparse.driver.sinks import MetricSinks, parse_log

from helpers import fake_run


def row(round_, acc, up, down, flops, density=1.0):
    return {"round": round_, "accuracy": acc, "accuracy_std": 0.1, "total_uplink_bits": up,
            "total_downlink_bits": down, "total_flops": flops, "density": density}


@pytest.mark.fast
def test_legend_names_the_fields_that_differ():
    configs = [dict(algorithm="spafl", seed=1, lr=0.001), dict(algorithm="spafl", seed=2, lr=0.001),
               dict(algorithm="fedavg", seed=1, lr=0.001, options={"momentum": 0.9})]
    assert legend_labels(configs, [Path("a"), Path("b"), Path("c")]) == [
        "spafl seed=1", "spafl seed=2", "fedavg seed=1 momentum=0.9"]
    assert legend_labels([{}], [Path("runs/x")]) == ["x"]


@pytest.mark.fast
def test_report_table_by_hand(tmp_path):
    a = fake_run(tmp_path / "a", dict(algorithm="spafl", seed=1),
                 [row(1, 0.50, 1e9, 2e9, 3e12, 0.8), row(2, 0.70, 2e9, 4e9, 6e12, 0.6),
                  row(3, 0.65, 3e9, 6e9, 9e12, 0.5)], {"rounds_per_second_after_first_chunk": 2.5})
    b = fake_run(tmp_path / "b", dict(algorithm="spafl", seed=2), [])
    table = report_table([a, b])
    lines = table.splitlines()
    assert lines[2] == "| spafl seed=1 | 3 | 65.00 (10.00) | 70.00 (2) | 9 | 9 | 0.500 | 2.5 |"
    # No summary.json: still running, stopped or failed (not "0 rounds, final").
    assert lines[3] == "| spafl seed=2 | round 0 (running or stopped) | – | – | – | – | – | – |"


def test_plot_and_report_commands(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = fake_run(tmp_path / "a", dict(algorithm="spafl", seed=1), [row(1, 0.5, 1e6, 1e6, 1e12, 0.7)])
    b = fake_run(tmp_path / "b", dict(algorithm="fedavg", seed=1), [row(1, 0.6, 1e9, 1e9, 2e12)])
    assert main(["plot", str(a), str(b), "--out", str(tmp_path / "fig.png")]) == 0
    assert (tmp_path / "fig.png").stat().st_size > 10_000
    assert main(["plot", str(a), "--x", "tflops", "--y", "density", "--out", str(tmp_path / "one.svg")]) == 0
    assert "<svg" in (tmp_path / "one.svg").read_text()[:500]
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text() == capsys.readouterr().out.split("wrote")[-1].split("\n", 1)[-1]
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


@pytest.mark.fast
def test_csv_log_is_the_rows_with_the_union_of_keys(tmp_path):
    sinks = MetricSinks(tmp_path, "csv")
    rows = [{"round": 1, "accuracy": 0.5}, {"round": 2, "accuracy": 0.6, "global_accuracy": None, "extra": 3}]
    sinks.write(rows[:1])
    sinks.write(rows)
    with open(tmp_path / "metrics.csv") as f:
        got = list(csv.DictReader(f))
    assert got == [{"round": "1", "accuracy": "0.5", "global_accuracy": "", "extra": ""},
                   {"round": "2", "accuracy": "0.6", "global_accuracy": "", "extra": "3"}]


def test_tensorboard_log_writes_event_files(tmp_path):
    pytest.importorskip("tensorboardX")
    sinks = MetricSinks(tmp_path, "tensorboard")
    sinks.write([{"round": 1, "accuracy": 0.5, "note": "text"}])
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    size = files[0].stat().st_size
    sinks.write([{"round": 1, "accuracy": 0.5}, {"round": 2, "accuracy": 0.6}])
    sinks.close()
    assert len(files) == 1 and files[0].stat().st_size > size  # one more scalar record


@pytest.mark.fast
def test_log_kinds_are_checked():
    assert parse_log("csv, tensorboard") == ("csv", "tensorboard") and parse_log("") == ()
    with pytest.raises(ValueError, match="unknown --log parquet; valid: csv, tensorboard"):
        parse_log("csv,parquet")


def test_run_with_csv_log(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--dataset", "digits", "--num-clients", "4", "--clients-per-round", "2", "--rounds", "2",
                 "--local-epochs", "1", "--quiet", "--log", "csv", "--out", str(out)]) == 0
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["round"]) for r in rows] == [1, 2]
    assert float(rows[-1]["accuracy"]) == pytest.approx(jsonl[-1]["accuracy"])


@pytest.mark.fast
def test_progress_off_a_terminal_prints_one_line_per_tenth(capsys):
    bar = Progress(100, 0, enabled=True)
    bar.restart(0)
    for r in range(1, 101):
        bar.update(r, 0.5)
    bar.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("round 100/100 | acc 50.00%")


def test_plot_runs_leaves_the_process_backend_alone(tmp_path):
    # A notebook's inline backend must survive fjs.plot_runs (matplotlib.use("Agg") used to replace it).
    matplotlib = pytest.importorskip("matplotlib")
    from fedjax_sparse.tools.reporting import plot_runs
    a = fake_run(tmp_path / "a", dict(algorithm="spafl", seed=1), [row(1, 0.5, 1e6, 1e6, 1e12, 0.7)])
    matplotlib.use("svg")
    try:
        plot_runs([a], tmp_path / "fig.png")
        assert matplotlib.get_backend().lower() == "svg" and (tmp_path / "fig.png").stat().st_size > 5_000
    finally:
        matplotlib.use("Agg")

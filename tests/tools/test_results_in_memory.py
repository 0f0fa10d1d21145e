"""Results and plots in memory (issue 42 item 2): ``RunResult.rows``, short reprs, ``plot_runs`` of results."""
import dataclasses
import json

import pytest

import fedjax_sparse as fjs

CONFIG = fjs.RunConfig(dataset="digits", model="cnn_small", rounds=2, num_clients=4, clients_per_round=2,
                       local_epochs=1, partition="iid")
WALL_CLOCK = ("seconds",)


def _plain(rows):
    return [{k: v for k, v in row.items() if k not in WALL_CLOCK} for row in rows]


@pytest.fixture(scope="module")
def two_runs():
    return {"fedavg": fjs.run(CONFIG, progress=False),
            "fedavg lr=0.3": fjs.run(dataclasses.replace(CONFIG, lr=0.3), progress=False)}


def test_rows_in_memory_are_the_metrics_file(two_runs, tmp_path):
    memory = two_runs["fedavg"]
    written = fjs.run(dataclasses.replace(CONFIG, out=str(tmp_path / "run")), progress=False)
    on_disk = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in memory.rows] == [1, 2]
    assert _plain(memory.rows) == _plain(on_disk) == _plain(written.rows)
    # A complete run "resumed" reads its whole run back.
    again = fjs.run(dataclasses.replace(CONFIG, out=str(tmp_path / "run")), resume=True, progress=False)
    assert _plain(again.rows) == _plain(on_disk)


def test_run_result_repr_is_a_short_table(two_runs):
    text = repr(two_runs["fedavg"])
    assert len(text) < 2000 and str(two_runs["fedavg"]) == text
    assert "Array(" not in text and "array(" not in text and "EngineState" not in text
    assert "final accuracy" in text and "fedavg / digits" in text


def test_sweep_result_by_point_and_short_repr():
    result = fjs.sweep(CONFIG, {"lr": [0.1, 0.3]}, seeds=[0, 1], progress=False)
    assert list(result.by_point) == ["lr=0.1", "lr=0.3"] and set(result.by_point["lr=0.1"]) == {0, 1}
    assert [r["round"] for r in result.by_point["lr=0.3"][1].rows] == [1, 2]
    text = repr(result)
    assert len(text) < 2000 and "Array(" not in text and "array(" not in text and "lr=0.3" in text
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    fig = fjs.plot_runs([result])
    assert isinstance(fig, Figure)
    assert [len(ax.get_lines()) for ax in fig.axes[:3]] == [2, 2, 2]    # one mean curve per point


def test_plot_runs_of_results_returns_a_figure_and_saves_only_when_asked(two_runs, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    monkeypatch.chdir(tmp_path)
    fig = fjs.plot_runs(two_runs)
    assert isinstance(fig, Figure) and list(tmp_path.iterdir()) == []
    views = [ax for ax in fig.axes if ax.axison]
    assert len(views) == 3      # accuracy vs round, Gbit, TFLOPs (dense runs: no density panel)
    assert all(len(ax.get_lines()) == 2 for ax in views)
    assert [t.get_text() for t in views[0].get_legend().get_texts()] == ["fedavg", "fedavg lr=0.3"]
    saved = fjs.plot_runs(list(two_runs.values()), tmp_path / "f.png", x="round", y="loss")
    assert isinstance(saved, Figure) and (tmp_path / "f.png").stat().st_size > 5_000
    assert "| fedavg lr=0.3 | 2 |" in fjs.report_table(two_runs)

"""Resuming a sweep (issue 42 item 1, "sweeps never lose or hide a point"): the grid, seeds and
configuration left out are the recorded ones; a larger grid or more seeds extend the sweep (old points
kept and listed); anything else is refused in one line, the folder untouched."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import fedjax_sparse as fjs
from fedjax_sparse.cli import main
from fedjax_sparse.driver.config import RunConfig
from fedjax_sparse.errors import RunError

# Not the defaults (fedavg, 30 rounds, 20 clients, seed 0): a resume that fell back on them would show.
FLAGS = ["run", "--algorithm", "fedprox", "--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3",
         "--local-epochs", "1", "--batch-size", "32", "--partition", "iid", "--eval-every", "1", "--rounds", "2",
         "--seeds", "1", "--quiet"]


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-point sweep (fedprox, 2 rounds, seed 1)."""
    out = tmp_path_factory.mktemp("sweep") / "SW"
    assert main([*FLAGS, "--sweep", "lr=0.05,0.1", "--out", str(out)]) == 0
    return out


@pytest.fixture
def sweep_copy(finished, tmp_path) -> Path:
    out = tmp_path / "SW"
    shutil.copytree(finished, out)
    return out


def test_resume_with_no_flags_reruns_nothing_and_leaves_the_files_byte_identical(sweep_copy, capsys):
    before = files(sweep_copy)
    assert main(["run", "--resume", "--out", str(sweep_copy), "--quiet"]) == 0
    assert files(sweep_copy) == before
    assert "| lr=0.05 | 1/1 |" in capsys.readouterr().out


def test_resume_with_a_larger_grid_extends_it_and_keeps_the_old_points(sweep_copy, capsys):
    old = {name: data for name, data in files(sweep_copy).items() if name.startswith("lr=")}
    assert main(["run", "--resume", "--out", str(sweep_copy), "--sweep", "lr=0.05,0.1,0.2", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "notice: extending the sweep" in err and "1 new point (lr=0.2)" in err and "2 recorded points" in err
    now = files(sweep_copy)
    assert {name: now[name] for name in old} == old          # the old members' files untouched
    assert "lr=0.2/seed1/summary.json" in now                # the new point ran with the recorded seed
    record = json.loads(now["sweep.json"])
    assert [p["point"] for p in record["points"]] == ["lr=0.05", "lr=0.1", "lr=0.2"]
    assert all(p["finished"] == 1 for p in record["points"]) and record["axes"] == {"lr": [0.05, 0.1, 0.2]}
    table = now["sweep.md"].decode()
    assert all(f"| lr={v} | 1/1 |" in table for v in ("0.05", "0.1", "0.2"))


def test_resume_that_would_change_the_sweep_is_refused_in_one_line(sweep_copy, capsys):
    before = files(sweep_copy)
    for flags, needle in ((["--algorithm", "fedavg", "--sweep", "lr=0.05,0.1"],
                           "--algorithm 'fedavg' (recorded: 'fedprox')"),
                          (["--sweep", "local_epochs=1,2"], "swept keys ['local_epochs'] (recorded: ['lr'])"),
                          (["--batch-size", "16"], "--batch-size 16 (recorded: 32)")):
        assert main(["run", "--resume", "--out", str(sweep_copy), *flags, "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and needle in err and "--overwrite" in err and "new --out" in err, err
        assert files(sweep_copy) == before


def test_resume_with_a_sweep_flag_alone_uses_the_recorded_configuration(sweep_copy, capsys):
    """The bug: `--resume --sweep lr=0.2,0.3` ran a new sweep of fedavg, 30 rounds, seed 0 and rewrote
    the index. The recorded algorithm, rounds and seed run; flags equal to the recorded ones are fine."""
    assert main(["run", "--resume", "--out", str(sweep_copy), "--dataset", "digits", "--sweep", "lr=0.2,0.3",
                 "--quiet"]) == 0
    assert "2 new points (lr=0.2, lr=0.3)" in capsys.readouterr().err
    for lr in ("0.2", "0.3"):
        config = json.loads((sweep_copy / f"lr={lr}" / "seed1" / "config.json").read_text())["config"]
        assert (config["algorithm"], config["rounds"], config["num_clients"], config["lr"]) == ("fedprox", 2, 6,
                                                                                                float(lr))
    record = json.loads((sweep_copy / "sweep.json").read_text())
    assert (record["algorithm"], record["rounds"], record["seeds"]) == ("fedprox", 2, [1])
    assert [p["point"] for p in record["points"]] == ["lr=0.05", "lr=0.1", "lr=0.2", "lr=0.3"]
    assert not (sweep_copy / "lr=0.2" / "seed0").exists()


def test_the_api_resumes_extends_and_refuses_in_its_own_words(sweep_copy, capsys):
    recorded = RunConfig.from_json(json.loads((sweep_copy / "sweep.json").read_text())["config"])
    before = files(sweep_copy)
    result = fjs.sweep(recorded, resume=True, progress=False)    # the recorded grid and seeds
    assert [p["point"] for p in result.rows] == ["lr=0.05", "lr=0.1"] and files(sweep_copy) == before
    with pytest.raises(RunError, match=r"algorithm='fedavg' \(recorded: 'fedprox'\).*overwrite=True"):
        fjs.sweep(RunConfig.from_json({**recorded.to_json(), "algorithm": "fedavg"}), {"lr": [0.05]}, resume=True,
                  progress=False)
    assert files(sweep_copy) == before
    result = fjs.sweep(recorded, {"lr": [0.1]}, seeds=[2], resume=True, progress=False)   # one more seed
    assert "new seeds [2] for every point" in capsys.readouterr().err
    assert [p["seeds"] for p in result.rows] == [[1, 2], [1, 2]] and all(p["finished"] == 2 for p in result.rows)


def test_finished_members_without_checkpoints_or_index_are_kept_never_rerun_over(sweep_copy, capsys):
    # The recorded results delete checkpoints (and a stopped sweep may have no sweep.json): a resume must keep
    # each finished member's files as they are, not rerun it from scratch over them.
    for folder in sweep_copy.glob("*/seed1/checkpoints"):
        shutil.rmtree(folder)
    for name in ("sweep.json", "sweep.md"):
        (sweep_copy / name).unlink()
    members = {p: p.read_bytes() for p in sweep_copy.glob("*/seed1/*") if p.is_file()}
    assert main([*FLAGS, "--sweep", "lr=0.05,0.1,0.2", "--out", str(sweep_copy), "--resume"]) == 0
    assert {p: p.read_bytes() for p in members} == members
    assert (sweep_copy / "lr=0.2" / "seed1" / "summary.json").exists()
    assert len(json.loads((sweep_copy / "sweep.json").read_text())["points"]) == 3


def test_a_member_folder_holding_another_experiment_is_refused_not_overwritten(sweep_copy, capsys):
    member = sweep_copy / "lr=0.05" / "seed1"
    shutil.rmtree(member / "checkpoints")
    (sweep_copy / "sweep.json").unlink()
    record = json.loads((member / "config.json").read_text())
    record["config"]["batch_size"] = 16
    (member / "config.json").write_text(json.dumps(record))
    before = files(member)
    assert main([*FLAGS, "--sweep", "lr=0.05,0.1", "--out", str(sweep_copy), "--resume"]) == 2
    assert "batch" in capsys.readouterr().err
    assert files(member) == before

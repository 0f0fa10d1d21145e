"""Hand-checked facts of modules that the fast tier (``python -m pytest -m fast``) reaches nowhere else:
the ``python -m fedjax_sparse`` entry point, the stop exception's exit codes, the robust aggregators,
the papers' named settings, the seed-study report and the side-by-side curve readers. (The longer
tests of these modules are in test_robust.py, test_mutation_robust.py and test_experiment_scripts.py.)"""
import json
import math
import runpy
import signal
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse import papers
from fedjax_sparse.tools import sidebyside
from fedjax_sparse.papers import studies
from fedjax_sparse.driver.config import RunConfig, validate
from fedjax_sparse.errors import DataError, PinningError, RunError, RunStopped
from fedjax_sparse.mechanisms import robust_aggregation as ra
from helpers import fake_run

pytestmark = pytest.mark.fast


def _main(argv, monkeypatch):
    """``python -m fedjax_sparse ARGV`` in this process: the exit code."""
    monkeypatch.setattr(sys, "argv", ["fedjax_sparse", *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("fedjax_sparse", run_name="__main__")
    return exit_info.value.code


def test_python_dash_m_runs_the_cli_and_exits_with_its_code(monkeypatch, capsys):
    assert _main(["list"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "algorithms:" in out and "spafl" in out and "lenet5_caffe" in out
    assert _main(["run", "--algorithm", "nope", "--quiet"], monkeypatch) == 2
    err = capsys.readouterr().err
    assert "unknown algorithm 'nope'" in err and "Traceback" not in err


def test_a_stopped_run_exits_128_plus_the_signal_and_says_how_to_go_on():
    term = RunStopped(signal.SIGTERM, 3, Path("runs/a"))
    assert (term.exit_code, term.round, term.signal) == (143, 3, signal.SIGTERM)
    assert str(term) == "SIGTERM: stopped at round 3; continue with: python -m fedjax_sparse run --out runs/a --resume"
    first = RunStopped(signal.SIGINT, 0, Path("runs/a"))
    assert first.exit_code == 130 and str(first).endswith("no round had finished, nothing to resume: run the same "
                                                          "command again")
    assert str(RunStopped(signal.SIGINT, 5, None)) == "SIGINT: stopped at round 5; nothing was saved (no --out)"
    # Every other error is a user error: `except ValueError` catches them, not a stop.
    assert all(issubclass(e, ValueError) for e in (RunError, DataError, PinningError))
    assert not isinstance(term, ValueError)


def test_trimmed_mean_drops_the_extremes_of_each_coordinate_by_hand():
    x = jnp.array([[1.0, 10.0], [2.0, -5.0], [3.0, 0.0], [100.0, 1.0]])
    np.testing.assert_allclose(ra.trimmed_mean(x, 1), [2.5, 0.5])          # (2 + 3) / 2, (0 + 1) / 2
    np.testing.assert_allclose(ra.trimmed_mean(x, 0), [26.5, 1.5])         # the plain mean
    np.testing.assert_allclose(ra.trimmed_mean(x, 5), [2.5, 0.5])          # at most (K - 1) // 2 each side
    np.testing.assert_allclose(ra.sort_rows(x), [[1, -5], [2, 0], [3, 1], [100, 10]])
    # Only the included rows are sorted; the rest are NaN, after them.
    part = np.asarray(ra.sort_rows(x, jnp.array([True, False, True, False])))
    np.testing.assert_array_equal(part[:2], [[1, 0], [3, 10]])
    assert np.isnan(part[2:]).all()
    np.testing.assert_allclose(ra.masked_mean(x, jnp.array([True, True, False, False])), [1.5, 2.5])
    np.testing.assert_allclose(ra.masked_mean(x, jnp.zeros(4, bool)), [0.0, 0.0])


def test_multi_krum_keeps_the_cluster_and_drops_the_outliers_by_hand():
    """Points 0, 1, 2, 50, -40 on a line, f = 1. First pick (2 neighbours each): squared-distance
    scores 0: 1 + 4, 1: 1 + 1, 2: 1 + 4 -> point 1. Then 1 neighbour each among {0, 2, 50, -40}:
    0 and 2 tie at 4, the first wins; then 2 (1764 = 42^2, tied with -40, first wins)."""
    x = jnp.array([[0.0], [1.0], [2.0], [50.0], [-40.0]])
    assert int(ra.krum_count(5, 1)) == 1 and int(ra.krum_count(5, 1, krum_select=3)) == 3
    assert int(ra.krum_count(5, 3)) == 1                                     # K - 2f - 2 < 1: at least one
    one, selected = ra.multi_krum(x, 1)
    np.testing.assert_array_equal(selected, [False, True, False, False, False])
    np.testing.assert_allclose(one, [1.0])
    three, selected = ra.multi_krum(x, 1, num_select=3)
    np.testing.assert_array_equal(selected, [True, True, True, False, False])
    np.testing.assert_allclose(three, [1.0])                                 # the plain mean would be 2.6
    np.testing.assert_allclose(ra.pairwise_sq_distances(x)[3], [2500, 2401, 2304, 0, 8100])


def test_sign_majority_and_topk_by_hand():
    signs = jnp.array([[1, -1, 1, 1], [1, 1, -1, -1], [-1, 1, -1, 1], [1, -1, 1, -1]], jnp.int8)
    np.testing.assert_array_equal(ra.sign_majority(signs), [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(ra.sign_majority(signs[:3]), [1.0, 1.0, -1.0, 1.0])
    np.testing.assert_array_equal(ra.topk_sparsify(jnp.array([0.5, -3.0, 2.0, -0.1]), 0.5), [0.0, -3.0, 2.0, 0.0])


def test_every_named_paper_setting_passes_the_run_checks():
    """Every method of the SpaFL study and of the FSL MNIST table, and every round benchmark, is a
    configuration the CLI accepts (algorithm, model, data set, options and their types)."""
    args, study = studies.parse_args(["--out", "x", "--methods", *papers.SPAFL_FMNIST_METHODS, "--seeds", "4",
                                      "--num-clients", "10"],
                                     {"spafl_fmnist": papers.SPAFL_FMNIST_STUDY}, "spafl_fmnist")
    assert args.rounds == 500 and args.seeds == [4] and args.overrides == {"num_clients": 10}
    for method, spec in papers.SPAFL_FMNIST_METHODS.items():
        config = studies.method_config(study, method, 4, args, "runs/x")
        assert (config.algorithm, config.lr, config.seed, config.num_clients) == (spec["algorithm"], spec["lr"], 4, 10)
        assert config.preprocess == spec.get("base", {}).get("preprocess", "raw")   # FedPM: unit-scaled inputs
        validate(config)
    for method, spec in papers.FSL_MNIST_METHODS.items():
        validate(RunConfig.from_json(dict(papers.FSL_MNIST_BASE, algorithm=spec["algorithm"], lr=spec["lr"],
                                          options=dict(spec.get("options", {})))))
    for name, settings in papers.ROUND_BENCHMARKS.items():
        validate(RunConfig.from_json(settings))
    assert set(papers.SPAFL_FMNIST_STUDY["default_methods"]) <= set(papers.SPAFL_FMNIST_METHODS)


def _study_run(path, accuracies, densities, num_clients=4, diverged=None):
    rows = [{"round": r + 1, "accuracy": a, "density": d, "total_uplink_bits": (r + 1) * 10 ** 9,
             "total_downlink_bits": (r + 2) * 10 ** 9, "total_flops": (r + 1) * 8 * 10 ** 9}
            for r, (a, d) in enumerate(zip(accuracies, densities))]
    fake_run(path, {"num_clients": num_clients}, rows)
    if diverged:
        (path / studies.DIVERGED).write_text(json.dumps({"error": diverged}))


def test_seed_study_statistics_by_hand(tmp_path):
    _study_run(tmp_path / "spafl" / "seed0", [0.5, 0.7, 0.6], [0.9, 0.6, 0.5])
    _study_run(tmp_path / "spafl" / "seed1", [0.4, 0.5, 0.8], [0.9, 0.8, 0.7])
    _study_run(tmp_path / "spafl" / "seed2", [0.1], [1.0], diverged="training diverged at round 1")
    stats = studies.run_stats(studies.load_run(tmp_path / "spafl" / "seed0"))
    assert stats == dict(rounds=3, best_acc=0.7, best_round=2, final_acc=0.6, density_at_best=0.6, final_density=0.5,
                         gbit=3.0 + 4.0, flops=24e9, flops_paper_convention=24e9 / (2 * 4))
    runs, diverged = studies.collect(tmp_path, ["spafl", "fedavg"], [0, 1, 2])
    assert sorted(runs) == ["spafl"] and sorted(runs["spafl"]) == [0, 1] and diverged == {"spafl": [2]}
    assert studies.load_run(tmp_path / "fedavg" / "seed0") is None                # nothing recorded yet
    assert studies.mean_std([0.7, 0.8], 100) == "75.00 ± 5.00"                    # population std over seeds
    assert studies.mean_std([0.7], 100) == "70.00" and studies.mean_std([]) == "n/a"
    assert studies.mean_std([float("nan")] * 2) == "n/a"
    assert studies.seeds_cell(2, 1) == "2 (+1 diverged)" and studies.seeds_cell(3, 0) == "3"
    assert studies.is_spafl("spafl_local") and not studies.is_spafl("fedavg")


def test_side_by_side_curves_by_hand(tmp_path):
    ours = fake_run(tmp_path / "ours", {"seed": 3},
                    [{"round": 1, "accuracy": 0.5, "density": 0.8, "density_all_clients": 0.7, "seconds": 2.0},
                     {"round": 2, "accuracy": 0.75, "density": 0.6, "density_all_clients": 0.5, "seconds": 5.0}])
    run = sidebyside.read_ours(ours)
    assert run["seed"] == 3 and not run["finished"] and run["density_key"] == "density_all_clients"
    assert [(r["accuracy"], r["density"], r["density_sampled"], r["seconds"]) for r in run["rows"]] == \
        [(50.0, 0.7, 0.8, 2.0), (75.0, 0.5, 0.6, 3.0)]                             # percent; per-round seconds
    assert sidebyside.at_round(run, 2) == 75.0 and sidebyside.at_round(run, 9) is None
    assert sidebyside.at_round(run, 1, "density") == 0.7
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "curve.json").write_text(json.dumps({"seed": 1, "finished": True,
                                                   "rounds": [{"round": 1, "accuracy": 51.0, "density": 0.9}]}))
    authors = sidebyside.read_authors(theirs)
    assert authors["finished"] and authors["rows"][0]["accuracy"] == 51.0 and math.isnan(authors["rows"][0]["seconds"])
    assert sidebyside.summarise([1.0, 2.0, 3.0]) == {"n": 3, "mean": 2.0, "std": 1.0}   # sample std
    assert sidebyside.summarise([4.0]) == {"n": 1, "mean": 4.0, "std": None}
    assert sidebyside.summarise([]) == {"n": 0, "mean": None, "std": None}

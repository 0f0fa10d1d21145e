"""Replicas (``--seeds``): each seed's files equal the run of that seed started alone."""
import dataclasses
import json
import logging

import jax
import numpy as np
import pytest

from fedjax_sparse.driver import replicas, runner
from fedjax_sparse.cli import main
from fedjax_sparse.driver.config import RunConfig
from fedjax_sparse.errors import RunError
from fedjax_sparse.core.evaluation import Evaluator

# Dirichlet partitions differ by seed, so the replicas' client index rows have different widths.
BASE = RunConfig(algorithm="spafl", dataset="digits", model="cnn_small", num_clients=6, clients_per_round=3,
                 rounds=2, local_epochs=1, batch_size=32, lr=0.05, eval_every=1, partition="dirichlet:0.5")
SEEDS = [1, 2]
# Cheaper runs for the bookkeeping tests (resume, fallback): the mechanism does not matter there.
CHEAP = dataclasses.replace(BASE, algorithm="fedavg", model="mlp")


def rows(path):
    """metrics.jsonl rows without the wall-clock key."""
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in open(path)]


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    out = tmp_path_factory.mktemp("alone")
    for seed in SEEDS:
        runner.run(dataclasses.replace(BASE, seed=seed, out=str(out / f"seed{seed}")), progress=False)
    return out


def test_partitions_differ_between_the_seeds():
    # So the replicas' index rows are padded to a common width (the path the tests below check).
    widths = {int(runner.build(dataclasses.replace(BASE, seed=s)).data.train_idx.shape[1]) for s in SEEDS}
    assert len(widths) == len(SEEDS)


def test_sequential_replicas_are_bit_identical_to_separate_runs(alone, tmp_path, caplog):
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        results = replicas.run_replicas(dataclasses.replace(BASE, out=str(tmp_path)), SEEDS,
                                        parallelism="sequential", progress=False)
    compiled = [r.getMessage().split(" with ")[0] for r in caplog.records if r.getMessage().startswith("Compiling")]
    # One program for all seeds: the round chunk compiles once, and the personalised evaluation
    # (per_client on CPU: one program per padded test-set width) once per width over all seeds,
    # not once per seed.
    assert compiled.count("Compiling jit(run)") == 1, compiled
    if jax.default_backend() == "cpu":
        g = Evaluator.per_client_granularity
        widths = [{int(-(-c // g) * g) for c in np.asarray(runner.build(dataclasses.replace(BASE, seed=s)).data.test_count)
                   if c > 0} for s in SEEDS]
        assert len(set.union(*widths)) < sum(map(len, widths)), "the test needs seeds sharing a width"
        assert compiled.count("Compiling jit(one)") == len(set.union(*widths)), compiled
    for seed, result in zip(SEEDS, results):
        assert rows(tmp_path / f"seed{seed}" / "metrics.jsonl") == rows(alone / f"seed{seed}" / "metrics.jsonl")
        assert json.loads((tmp_path / f"seed{seed}" / "config.json").read_text())["config"]["seed"] == seed
        assert result.summary["final_accuracy"] == rows(alone / f"seed{seed}" / "metrics.jsonl")[-1]["accuracy"]
    record = json.loads((tmp_path / "replicas.json").read_text())
    assert record["shared_program"] is True and record["replica_parallelism"] == "sequential"
    finals = [rows(alone / f"seed{s}" / "metrics.jsonl")[-1]["accuracy"] for s in SEEDS]
    assert record["final_accuracy"] == finals
    assert record["final_accuracy_mean"] == pytest.approx(sum(finals) / 2)
    assert record["final_accuracy_std"] == pytest.approx(abs(finals[0] - finals[1]) / 2 ** 0.5)


def test_vmapped_replicas_equal_separate_runs(alone, tmp_path):
    replicas.run_replicas(dataclasses.replace(BASE, out=str(tmp_path)), SEEDS, parallelism="vmap", progress=False)
    for seed in SEEDS:
        got, want = rows(tmp_path / f"seed{seed}" / "metrics.jsonl"), rows(alone / f"seed{seed}" / "metrics.jsonl")
        assert [r["round"] for r in got] == [r["round"] for r in want]
        for g, w in zip(got, want):
            assert g.keys() == w.keys()
            for key in w:
                if isinstance(w[key], float):
                    # One program over both replicas may fuse the float reductions differently.
                    assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key
                else:
                    assert g[key] == w[key], key   # exact counts: rounds, bits, FLOPs, steps


def test_resumed_group_brings_a_lagging_replica_up_first(tmp_path):
    longer = dataclasses.replace(CHEAP, rounds=3)
    replicas.run_replicas(dataclasses.replace(CHEAP, out=str(tmp_path)), SEEDS, parallelism="sequential",
                          progress=False)
    # An interruption after seed 1 saved round 3 but before seed 2 did.
    runner.run(dataclasses.replace(longer, seed=1, out=str(tmp_path / "seed1")), resume=True, progress=False)
    replicas.run_replicas(dataclasses.replace(longer, rounds=4, out=str(tmp_path)), SEEDS, resume=True,
                          parallelism="sequential", progress=False)
    assert [r["round"] for r in rows(tmp_path / "seed1" / "metrics.jsonl")] == [1, 2, 3, 4]
    # A seed added on resume starts from round 0 and is brought up to the others first.
    replicas.run_replicas(dataclasses.replace(CHEAP, rounds=4, out=str(tmp_path)), [2, 5], resume=True,
                          parallelism="sequential", progress=False)
    assert [r["round"] for r in rows(tmp_path / "seed5" / "metrics.jsonl")] == [1, 2, 3, 4]
    straight = tmp_path.parent / (tmp_path.name + "_straight")
    runner.run(dataclasses.replace(CHEAP, rounds=4, seed=2, out=str(straight)), progress=False)
    assert rows(tmp_path / "seed2" / "metrics.jsonl") == rows(straight / "metrics.jsonl")


def test_seed_chosen_malicious_clients_run_with_a_program_each(tmp_path):
    config = dataclasses.replace(CHEAP, attack="min_max", malicious_fraction=0.34, rounds=1,
                                 out=str(tmp_path))
    replicas.run_replicas(config, SEEDS, parallelism="vmap", progress=False)
    record = json.loads((tmp_path / "replicas.json").read_text())
    assert record["shared_program"] is False and "malicious" in record["why_not_shared"]
    alone = tmp_path.parent / (tmp_path.name + "_alone")
    runner.run(dataclasses.replace(config, seed=2, out=str(alone)), progress=False)
    assert rows(tmp_path / "seed2" / "metrics.jsonl") == rows(alone / "metrics.jsonl")


@pytest.mark.parametrize("seeds,needle", [([1, 1], "lists a seed twice"), ([], "at least one seed")])
@pytest.mark.fast
def test_bad_seed_lists_are_refused(seeds, needle, tmp_path):
    with pytest.raises(RunError, match=needle):
        replicas.run_replicas(dataclasses.replace(BASE, out=str(tmp_path)), seeds, progress=False)


def test_cli_seeds_prints_the_spread_and_refuses_seed_with_seeds(tmp_path, capsys):
    args = ["run", "--algorithm", "fedavg", "--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3",
            "--local-epochs", "1", "--batch-size", "32", "--lr", "0.1", "--partition", "iid", "--rounds", "1",
            "--quiet", "--out", str(tmp_path / "run")]
    assert main(args + ["--seeds", "0", "1", "--replica-parallelism", "vmap"]) == 0
    out = capsys.readouterr().out
    assert "seed 0: final accuracy" in out and "over 2 seeds:" in out
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_dir()) == ["seed0", "seed1"]
    assert main(args[:-1] + [str(tmp_path / "other"), "--seed", "3", "--seeds", "0", "1"]) == 2
    assert "either --seed" in capsys.readouterr().err
    assert main(args[:-1] + [str(tmp_path / "third"), "--seeds", "0", "--replica-parallelism", "pmap"]) == 2
    assert "--replica-parallelism" in capsys.readouterr().err

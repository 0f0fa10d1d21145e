"""Sweeps: grid x seeds in one process, members equal to their separate runs, one compiled program
for traced values, a program per value where tracing cannot work (said why), divergence recorded,
resume of the whole sweep, the table, report and plot."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import fedjax_sparse as fjs
from fedjax_sparse.driver import sweeps
from fedjax_sparse.cli import main
from fedjax_sparse.driver.config import RunConfig, typed_axes
from fedjax_sparse.errors import RunError

BASE = dict(algorithm="spafl", dataset="digits", num_clients=6, clients_per_round=3, local_epochs=1,
            batch_size=32, lr=0.1, partition="iid", eval_every=1, rounds=2)


def rows(path) -> list[dict]:
    return [json.loads(line) for line in (Path(path) / "metrics.jsonl").read_text().splitlines()]


def same_rows(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for key in ("round", "accuracy", "loss", "density", "total_uplink_bits", "total_flops"):
            assert x[key] == y[key], (key, x[key], y[key])


@pytest.mark.fast
def test_parse_sweep_values_and_one_line_refusals():
    config = RunConfig.from_json(BASE)
    # Text, typed for the configuration swept (config.typed_axes: the algorithm's options, the model's).
    axes = sweeps.parse_sweep(["lr=0.01,0.1", "option.ramp=true,false", "model_option.init=model,x"])
    assert typed_axes(config, axes, "sweep") == {
        "lr": [0.01, 0.1], "option.ramp": [True, False], "model_option.init": ["model", "x"]}
    assert typed_axes(config, sweeps.parse_sweep(["local_epochs=1,2"]), "sweep") == {"local_epochs": [1, 2]}
    for bad, needle in ((["lr"], "takes KEY=V1,V2"), (["lr=0.1", "lr=0.2"], "names 'lr' twice"),
                        (["lr=0.1,0.1"], "lists a value twice"), (["=1,2"], "takes KEY=V1,V2"),
                        (["lr=0.1,0.10"], "lists a value twice")):
        with pytest.raises(RunError, match=needle):
            typed_axes(config, sweeps.parse_sweep(bad), "sweep")
    for axes, needle in (({"seed": [1, 2]}, "--seeds"), ({"client_parallelism": ["map"]}, "execution"),
                         ({"bogus": [1]}, "cannot vary 'bogus'"), ({}, "at least one --sweep")):
        with pytest.raises(RunError, match=needle):
            sweeps.check_axes(config, axes)
    with pytest.raises(RunError, match="--sweep-select"):
        sweeps.parse_select("accuracy_at_gbit")


@pytest.mark.fast
def test_grid_labels_and_member_configs():
    config = RunConfig.from_json({**BASE, "out": "/x"})
    members = sweeps.members_of(config, {"lr": [0.1, 0.2], "option.alpha": [0.001]}, [3, 4])
    assert [(sweeps.point_label(m.point), m.seed) for m in members] == [
        ("lr=0.1,option.alpha=0.001", 3), ("lr=0.1,option.alpha=0.001", 4),
        ("lr=0.2,option.alpha=0.001", 3), ("lr=0.2,option.alpha=0.001", 4)]
    last = members[-1].config
    assert (last.lr, last.seed, last.options, last.out) == (0.2, 4, {"alpha": 0.001},
                                                           "/x/lr=0.2,option.alpha=0.001/seed4")


def test_traced_members_share_one_program_and_equal_their_separate_runs(tmp_path, caplog):
    """lr and SpaFL's alpha enter one compiled round as arrays: a 2 x 2 grid over 2 seeds compiles the
    round program as often as one point does, and every member's metrics equal its run alone."""
    def compiled_rounds(axes, out):
        caplog.clear()
        with jax.log_compiles(True), caplog.at_level(logging.WARNING):
            result = sweeps.sweep(RunConfig.from_json({**BASE, "out": str(out)}), axes, [0, 1], progress=False)
        return result, sum("jit(run)" in r.getMessage() for r in caplog.records)
    result, grid_compiles = compiled_rounds({"lr": [0.05, 0.1], "option.alpha": [0.001, 0.01]}, tmp_path / "grid")
    _, one_compiles = compiled_rounds({"lr": [0.05], "option.alpha": [0.001]}, tmp_path / "one")
    assert grid_compiles == one_compiles >= 1
    record = json.loads((tmp_path / "grid" / "sweep.json").read_text())
    assert record["traced_keys"] == ["lr", "option.alpha"] and record["own_program_keys"] == {}
    assert [p["members"] for p in record["programs"]] == [8]
    assert len(result.rows) == 4 and all(p["finished"] == 2 for p in result.rows)
    for lr, alpha, seed in ((0.05, 0.01, 1), (0.1, 0.001, 0)):
        alone = tmp_path / f"alone{lr}{alpha}{seed}"
        fjs.run(RunConfig.from_json({**BASE, "lr": lr, "options": {"alpha": alpha}, "seed": seed,
                                     "out": str(alone)}), progress=False)
        same_rows(rows(tmp_path / "grid" / f"lr={lr},option.alpha={alpha}" / f"seed{seed}"), rows(alone))
    # The table: mean and sample std over the two seeds, recomputed from the members' summaries.
    point = result.rows[0]
    finals = [json.loads((tmp_path / "grid" / point["point"] / f"seed{s}" / "summary.json").read_text())
              ["final_accuracy"] for s in (0, 1)]
    assert point["final_accuracy"] == pytest.approx(np.mean(finals))
    assert point["final_accuracy_std"] == pytest.approx(np.std(finals, ddof=1))
    best = max(result.rows, key=lambda p: p["best_accuracy"])
    assert result.best["point"] == best["point"]


def test_untraceable_values_get_a_program_each_and_the_sweep_says_why(tmp_path):
    """local_epochs sizes the local loop's shuffles (a shape): each value gets its own program."""
    result = sweeps.sweep(RunConfig.from_json({**BASE, "algorithm": "fedavg", "out": str(tmp_path / "s")}),
                              {"local_epochs": [1, 2], "lr": [0.05, 0.1]}, [0], progress=False)
    record = result.record
    assert record["traced_keys"] == ["lr"] and "local_epochs" in record["own_program_keys"]
    assert sorted(len(p["points"]) for p in record["programs"]) == [2, 2]
    alone = tmp_path / "alone"
    fjs.run(RunConfig.from_json({**BASE, "algorithm": "fedavg", "local_epochs": 2, "lr": 0.05,
                                 "out": str(alone)}), progress=False)
    same_rows(rows(tmp_path / "s" / "local_epochs=2,lr=0.05" / "seed0"), rows(alone))


def test_only_float_options_are_traced():
    """An integer option (fedavg_robust's search_steps) would reach the algorithm as a float32 array:
    it gets a program per value instead, and the sweep says why."""
    config = RunConfig.from_json({**BASE, "algorithm": "fedavg_robust", "rounds": 1})
    exp = fjs.build(config)
    state = exp.engine.init(jax.random.PRNGKey(0))
    keys, why = sweeps.traced_keys(exp, state, (("lr", 0.1), ("option.search_steps", 5)))
    assert keys == ["lr"] and "not a float option" in why["option.search_steps"]


def test_a_diverging_member_is_recorded_and_the_others_go_on(tmp_path):
    result = sweeps.sweep(RunConfig.from_json({**BASE, "algorithm": "fedavg", "out": str(tmp_path / "s")}),
                              {"lr": [0.1, 1e30]}, [0, 1], progress=False)
    assert sorted(result.record["diverged"]) == ["lr=1e+30/seed0", "lr=1e+30/seed1"]
    good, bad = result.rows
    assert good["finished"] == 2 and bad["finished"] == 0 and bad["diverged"] == [0, 1]
    assert result.best["point"] == "lr=0.1"
    assert "diverged: [0, 1]" in (tmp_path / "s" / "sweep.md").read_text()


def test_resume_continues_the_whole_sweep(tmp_path, capsys):
    """A sweep stopped with members done (kept), half-done (resumed) and not started (started) ends
    on the numbers of an uninterrupted sweep."""
    flags = ["run", "--algorithm", "fedavg", "--dataset", "digits", "--num-clients", "6", "--clients-per-round",
             "3", "--local-epochs", "1", "--batch-size", "32", "--partition", "iid", "--eval-every", "1",
             "--sweep", "lr=0.05,0.1", "--seeds", "0", "1", "--quiet"]
    assert main([*flags, "--rounds", "3", "--out", str(tmp_path / "whole")]) == 0
    out = tmp_path / "cut"
    assert main([*flags, "--rounds", "2", "--out", str(out)]) == 0
    # lr=0.1 seed 1 never started; lr=0.05 seed 0 finished 3 rounds on its own; the rest are half-done.
    shutil.rmtree(out / "lr=0.1" / "seed1")
    shutil.copytree(tmp_path / "whole" / "lr=0.05" / "seed0", out / "lr=0.05" / "seed0", dirs_exist_ok=True)
    assert main(["run", "--resume", "--out", str(out), "--rounds", "3", "--quiet"]) == 0
    for point in ("lr=0.05", "lr=0.1"):
        for seed in ("seed0", "seed1"):
            same_rows(rows(out / point / seed), rows(tmp_path / "whole" / point / seed))
    assert "| lr=0.1 | 2/2 |" in capsys.readouterr().out
    whole, cut = (json.loads((d / "sweep.json").read_text())["points"] for d in (tmp_path / "whole", out))
    assert [p["final_accuracy"] for p in whole] == [p["final_accuracy"] for p in cut]


def test_a_sweep_refuses_an_occupied_out_and_report_and_plot_read_it(tmp_path, capsys):
    flags = ["run", "--algorithm", "fedavg", "--dataset", "digits", "--num-clients", "6", "--clients-per-round",
             "3", "--local-epochs", "1", "--batch-size", "32", "--partition", "iid", "--rounds", "2",
             "--sweep", "lr=0.05,0.1", "--seeds", "0", "1", "--quiet", "--out", str(tmp_path / "s")]
    assert main(flags) == 0
    assert main(flags) == 2
    assert "already holds a sweep" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "s")]) == 0
    table = capsys.readouterr().out
    assert "| lr=0.05 | 2/2 |" in table and "Best by best_accuracy" in table
    pytest.importorskip("matplotlib")
    assert main(["plot", str(tmp_path / "s"), "--out", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").stat().st_size > 0


def test_vmapped_members_equal_the_sequential_ones(tmp_path):
    axes = {"lr": [0.05, 0.1]}
    seq = sweeps.sweep(RunConfig.from_json({**BASE, "out": str(tmp_path / "seq")}), axes, [0, 1],
                           parallelism="sequential", progress=False)
    vm = fjs.sweep(RunConfig.from_json({**BASE, "out": str(tmp_path / "vmap")}), axes, [0, 1],
                          parallelism="vmap", progress=False)
    assert vm.record["programs"][0]["mode"] == "vmap"
    for a, b in zip(seq.rows, vm.rows):
        assert a["final_accuracy"] == pytest.approx(b["final_accuracy"], abs=2e-3)


def test_rebuilt_algorithms_keep_their_untraced_options_for_the_dp_refusal():
    """FedDrop with optimize=false may run under DP; the rebuilt algorithm must say so to with_dp
    (which reads the options from hparams), or every traced FedDrop+DP sweep would be refused."""
    config = RunConfig.from_json({**BASE, "algorithm": "feddrop", "model": "cnn_small", "rounds": 1,
                                  "options": {"optimize": "false"}, "dp_clip": 1.0, "dp_noise_multiplier": 1.0})
    exp = fjs.build(config)
    engine = sweeps.make_rebuild(exp, ["lr"])({"lr": jax.numpy.float32(0.05)})
    assert engine.algorithm.hparams["optimize"] is False and engine.algorithm.name.endswith("+dp")


def test_one_programs_members_are_open_at_a_time(tmp_path, monkeypatch):
    """Members are opened group by group and closed before the next group opens (every member alive
    at once filled 23 GiB with 500-client SpaFL states); keep_states=False keeps no final state."""
    alive: set[int] = set()
    peak = [0]
    real_open = sweeps.open_run

    def counting_open(*args, **kwargs):
        run = real_open(*args, **kwargs)
        real_close = run.close

        def close():
            alive.discard(id(run))
            real_close()
        run.close = close
        alive.add(id(run))
        peak[0] = max(peak[0], len(alive))
        return run
    monkeypatch.setattr(sweeps, "open_run", counting_open)
    config = RunConfig.from_json({**BASE, "algorithm": "fedavg", "rounds": 1, "out": str(tmp_path / "s")})
    result = sweeps.sweep(config, {"local_epochs": [1, 2]}, [0, 1], progress=False, keep_states=False)
    assert len(result.record["programs"]) == 2 and all(r is not None for r in result.results)
    assert peak[0] == 2 and not alive
    assert all(r.state is None for r in result.results)



def test_a_sweep_of_your_flax_model_and_arrays_equals_their_runs(tmp_path):
    """Objects (a Flax module, a user's arrays) reach every member as in fjs.run: a traced lr grid
    over two seeds, one member equal to fjs.run with the same objects; the keys an object decides
    are refused in one line, and an algorithm object runs each point with its own program."""
    import flax.linen as nn
    from sklearn.datasets import load_digits

    class Small(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(8, (3, 3))(x))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    d = load_digits()
    x = (d.images[..., None] * 16).astype(np.uint8)
    ids = np.arange(len(d.target)) % 6
    data = fjs.data.from_arrays(x[:1400], d.target[:1400], x[1400:], d.target[1400:], ids[:1400], ids[1400:])
    model = fjs.models.from_flax(Small(), input_shape=(8, 8, 1))
    config = RunConfig.from_json({**BASE, "algorithm": "fedavg", "num_clients": 6, "rounds": 2,
                                  "out": str(tmp_path / "s")})
    result = sweeps.sweep(config, {"lr": [0.05, 0.1]}, [0, 1], progress=False, model=model, data=data)
    assert result.record["traced_keys"] == ["lr"] and len(result.record["programs"]) == 1
    alone = fjs.run(dataclasses.replace(config, lr=0.1, seed=1, out=str(tmp_path / "alone")), model=model,
                    data=data, progress=False)
    same_rows(rows(tmp_path / "s" / "lr=0.1" / "seed1"), rows(tmp_path / "alone"))
    assert alone.summary["final_accuracy"] == result.results[3].summary["final_accuracy"]
    for axes, needle in (({"model_option.init": ["a"]}, "the model is an object"),
                         ({"num_clients": [3]}, "the partitioned data is an object")):
        with pytest.raises(RunError, match=needle):
            sweeps.sweep(config, axes, [0], progress=False, model=model, data=data)
    def fedavg(task):   # named like a registered algorithm, which the sweep must not rebuild it as
        return fjs.algorithms.fedavg(task, weighted=False)
    own = sweeps.sweep(dataclasses.replace(config, out=str(tmp_path / "own")), {"lr": [0.05, 0.1]}, [0],
                       progress=False, data=data, model=model, algorithm=fedavg)
    assert own.record["traced_keys"] == [] and len(own.record["programs"]) == 2

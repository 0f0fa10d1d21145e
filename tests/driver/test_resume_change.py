"""A way on after a failure (issue 42 item 5): ``--resume --change lr=V`` / ``option.NAME=V`` continues a
run from its checkpoint with another learning rate or algorithm option, recorded in config.json with
the round, marked by ``report`` and ``plot``; every other difference is still refused; and a paper's
setting by name (``--setting``, ``RunConfig.from_setting``)."""
import json

import pytest

import fedjax_sparse as fjs
from fedjax_sparse.cli import main

QUICK = ["--algorithm", "fedavg", "--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3",
         "--local-epochs", "1", "--batch-size", "32", "--lr", "0.1", "--partition", "iid", "--quiet"]


def cli(args, capsys):
    code = main(args)
    return code, capsys.readouterr().err


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_changed_learning_rate_applies_from_the_checkpoint_and_is_recorded_and_marked(tmp_path, capsys):
    straight, changed = tmp_path / "straight", tmp_path / "changed"
    assert cli(["run", *QUICK, "--rounds", "4", "--out", str(straight)], capsys)[0] == 0
    assert cli(["run", *QUICK, "--rounds", "2", "--out", str(changed)], capsys)[0] == 0
    # Diverged after its checkpoint (its NaN loss is written as null): the way on is a lower lr.
    with open(changed / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"round": 3, "accuracy": 0.1, "loss": None}) + "\n")
    code, err = cli(["run", *QUICK, "--rounds", "4", "--out", str(changed), "--resume", "--change", "lr=0.05"],
                    capsys)
    assert code == 0, err
    before, after = rows(straight), rows(changed)
    assert [r["round"] for r in after] == [1, 2, 3, 4] and after[2]["loss"] is not None   # the failed row is gone
    assert after[:2] == before[:2] or [r["loss"] for r in after[:2]] == [r["loss"] for r in before[:2]]
    assert all(a["loss"] != b["loss"] for a, b in zip(after[2:], before[2:]))   # lr 0.05 from round 3 on
    recorded = json.loads((changed / "config.json").read_text())
    assert recorded["config"]["lr"] == 0.05
    assert recorded["resumed"][-1] == {"at_round": 2, "changed": {"rounds": 4},
                                       "changed_experiment": {"lr": {"from": 0.1, "to": 0.05}}}
    table = fjs.report_table([straight, changed])
    assert "[lr 0.1→0.05 from round 3]" in table and table.count("→") == 1, table
    figure = fjs.plot_runs([straight, changed])
    first = figure.axes[0]
    assert any("lr 0.1→0.05 from round 3" in t.get_text() for t in first.get_legend().get_texts())
    assert [line.get_xdata()[0] for line in first.lines if line.get_linestyle() == ":"] == [2]


def test_resume_refuses_every_other_difference_and_names_change_for_the_lr(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(["run", *QUICK, "--rounds", "1", "--out", str(out)], capsys)[0] == 0
    config_before = (out / "config.json").read_text()
    for args, needle in (
            (["--lr", "0.05"], "--lr 0.05 (recorded: 0.1); the learning rate and algorithm options may change "
                               "from the checkpoint on with --change lr=VALUE"),
            (["--change", "rounds=5"], "--change rounds: a resumed run may change only lr, option.NAME"),
            (["--change", "dataset=mnist"], "--change dataset: a resumed run may change only"),
            (["--change", "lr=fast"], "--change lr='fast': expected a number"),
            (["--change", "lr=0.05"], "has no rounds left (1 of 1); pass a larger --rounds with it")):
        code, err = cli(["run", *QUICK, "--rounds", "1", "--out", str(out), "--resume", *args], capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    code, err = cli(["run", *QUICK, "--rounds", "2", "--out", str(tmp_path / "new"), "--change", "lr=0.05"], capsys)
    assert code == 2 and "--change changes a resumed run from its checkpoint on: add --resume" in err, err
    assert (out / "config.json").read_text() == config_before   # nothing rewritten
    # Python: the same refusals in its words.
    config = fjs.RunConfig(algorithm="fedavg", dataset="digits", num_clients=6, clients_per_round=3, local_epochs=1,
                           lr=0.1, partition="iid", rounds=2, out=str(out))
    with pytest.raises(fjs.RunError, match=r"change seed: a resumed run may change only lr, option.NAME"):
        fjs.run(config, resume=True, change={"seed": 3}, progress=False)


@pytest.mark.fast
def test_a_papers_setting_by_name_with_overrides():
    config = fjs.RunConfig.from_setting("spafl_fmnist", rounds=10, options={"alpha": 0.01})
    assert (config.algorithm, config.dataset, config.model, config.lr, config.rounds) == \
        ("spafl", "fashion_mnist", "lenet5_caffe", 0.001, 10)
    assert config.options == {"alpha": 0.01, "ramp": True, "momentum": 0.9, "keep_optimizer_state": True}
    assert config.execution.eval_batch_size == 128 and config.preprocess == "raw"
    from fedjax_sparse.cli import _parser, config_from_args
    flags, given = config_from_args(_parser().parse_args(["run", "--setting", "spafl_fmnist", "--rounds", "10",
                                                          "--option", "alpha=0.01"]))
    assert flags == config   # the flags' text typed as Python gives it
    assert {"lr", "rounds", "options", "preprocess"} <= given
    with pytest.raises(fjs.RunError, match=r"unknown RunConfig.from_setting\('spafl'\); valid: spafl_fmnist, "):
        fjs.RunConfig.from_setting("spafl")

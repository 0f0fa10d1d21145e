"""What a new user still meets (issue 32, item 5): each probe is a command a newcomer types, and
the one line it now answers with.

* ``--aggregator`` / ``--attack`` around an algorithm they cannot wrap (FSL's integer rankings,
  Local's empty messages...) are refused by ``config.validate``, before data, model or folder;
  every registered algorithm declares whether they apply, and the declaration is checked
  against the messages its clients actually send (tests/algorithms/test_every_algorithm.py).
* ``plot --y acuracy`` is refused with the valid keys; ``report`` and ``plot`` mark a run that is
  still running (or stopped) instead of calling its numbers final.
* a run that failed before its first checkpoint (diverged) does not block the corrected command.
* another dataset's files under ``--data-dir`` are named as such.
* ``--option momentum 0.9`` (no ``=``) says how to write it.
"""
import json

import pytest

from fedjax_sparse.cli import main

from helpers import fake_run

QUICK = ["--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3", "--local-epochs", "1",
         "--batch-size", "32", "--lr", "0.1", "--partition", "iid", "--quiet"]


def run_cli(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(code, err, needle):
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


# ---------------------------------------------------------------- 1. wrappers that cannot apply
@pytest.mark.parametrize("algorithm, extra, needle", [
    ("fsl", ["--aggregator", "multi_krum"],
     "--aggregator multi_krum cannot wrap fsl: its clients send rankings (integers), not float updates"),
    ("sfsl", ["--attack", "min_max", "--malicious-fraction", "0.2"],
     "--attack min_max cannot wrap sfsl: its clients send rankings (integers)"),
    ("local", ["--attack", "min_max", "--malicious-fraction", "0.2"],
     "--attack min_max cannot wrap local: its clients send nothing"),
    ("spafl_local", ["--aggregator", "trimmed_mean"], "--aggregator trimmed_mean cannot wrap spafl_local: its "
     "clients send nothing"),
    ("spafl", ["--option", "share_thresholds=false", "--aggregator", "mean"],
     "--aggregator mean cannot wrap spafl: its clients send nothing"),
    ("signsgd", ["--aggregator", "trimmed_mean"], "cannot wrap signsgd: its clients send signs"),
    ("fedpm", ["--aggregator", "multi_krum"], "cannot wrap fedpm: its clients send binary masks"),
    ("heterofl", ["--aggregator", "multi_krum"], "cannot wrap heterofl: its clients send sub-models"),
    ("fjord", ["--attack", "min_max", "--malicious-fraction", "0.2"], "cannot wrap fjord: its clients send"),
])
def test_a_wrapper_that_cannot_apply_is_refused_in_one_line_before_anything_is_built(
        algorithm, extra, needle, tmp_path, capsys):
    out = tmp_path / "run"
    # mnist from a folder that does not exist: refused before the data is looked for.
    code, _, err = run_cli(["run", "--algorithm", algorithm, "--dataset", "mnist", "--data-dir",
                            str(tmp_path / "nowhere"), "--rounds", "1", "--quiet", "--out", str(out), *extra], capsys)
    one_line_error(code, err, needle)
    assert "drop --" in err
    assert not out.exists()  # no folder, no config.json


@pytest.mark.parametrize("algorithm", ["scaffold", "topk"])
def test_wrappable_algorithms_run_a_wrapped_round(algorithm, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["run", "--algorithm", algorithm, *QUICK, "--rounds", "1", "--aggregator", "multi_krum",
                            "--attack", "min_max", "--malicious-fraction", "0.4", "--out", str(out)], capsys)
    assert code == 0, err
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert "server_krum_selected" in row and "server_attack_gamma" in row


# ---------------------------------------------------------------- 2. plot keys; unfinished runs
def row(round_, acc):
    return {"round": round_, "accuracy": acc, "accuracy_std": 0.1, "total_uplink_bits": 1e9 * round_,
            "total_downlink_bits": 1e9 * round_, "total_flops": 1e12 * round_, "density": 1.0}


def test_plot_refuses_an_unknown_key_and_lists_the_valid_ones(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = fake_run(tmp_path / "a", dict(algorithm="fedavg", rounds=2), [row(1, 0.5), row(2, 0.6)], {"rounds": 2})
    for flag in ("--y", "--x"):
        code, _, err = run_cli(["plot", str(a), flag, "acuracy", "--out", str(tmp_path / "fig.png")], capsys)
        one_line_error(code, err, f"unknown {flag} 'acuracy'")
        for key in ("accuracy", "round", "gbit", "tflops", "density", "total_flops"):
            assert key in err.split("valid")[1], err
    assert not (tmp_path / "fig.png").exists()
    assert run_cli(["plot", str(a), "--y", "accuracy", "--x", "gbit", "--out", str(tmp_path / "ok.png")],
                   capsys)[0] == 0


def test_report_and_plot_mark_an_unfinished_run(tmp_path, capsys):
    done = fake_run(tmp_path / "done", dict(algorithm="fedavg", seed=1, rounds=2), [row(1, 0.5), row(2, 0.6)],
                    {"rounds": 2, "rounds_per_second_after_first_chunk": 2.0})
    running = fake_run(tmp_path / "running", dict(algorithm="fedavg", seed=2, rounds=100),
                       [row(r, 0.4) for r in range(1, 38)])
    # Finished once, then resumed with more --rounds: its summary.json is the old one.
    extended = fake_run(tmp_path / "extended", dict(algorithm="fedavg", seed=3, rounds=10),
                        [row(1, 0.5), row(2, 0.6)], {"rounds": 2})
    code, out, _ = run_cli(["report", str(done), str(running), str(extended)], capsys)
    assert code == 0
    header, _, first, second, third = out.splitlines()
    assert "final" not in header.split("|")[3] or "latest" in header.split("|")[3], header
    assert "running or stopped" not in first and "| 2 |" in first
    assert "round 37/100 (running or stopped)" in second, second
    assert "round 2/10 (running or stopped)" in third, third
    # Only finished runs: the column still says final.
    code, out, _ = run_cli(["report", str(done)], capsys)
    assert "final acc" in out.splitlines()[0] and "running" not in out

    matplotlib = pytest.importorskip("matplotlib")
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as text, searchable
        assert run_cli(["plot", str(done), str(running), "--out", str(tmp_path / "fig.svg")], capsys)[0] == 0
    svg = (tmp_path / "fig.svg").read_text()
    assert "round 37/100, running or stopped" in svg
    assert svg.count("running or stopped") == 1  # the finished run's label is not marked


# ---------------------------------------------------------------- 3. a failed start does not block
def test_a_run_that_diverged_before_its_first_checkpoint_does_not_block_the_corrected_command(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "--algorithm", "fedavg", *QUICK, "--rounds", "2", "--eval-every", "2", "--out", str(out)]
    code, _, err = run_cli(args + ["--lr", "1e30"], capsys)
    assert code == 2 and "diverged" in err
    assert (out / "metrics.jsonl").exists() and not (out / "summary.json").exists()
    code, _, err = run_cli(args, capsys)  # the corrected command, same --out
    assert code == 0, err
    assert "failed start" in err  # a notice says what was replaced
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [2] and rows[0]["loss"] is not None  # the failed row is gone
    assert json.loads((out / "config.json").read_text())["config"]["lr"] == 0.1


def test_a_resumable_diverged_or_foreign_folder_is_still_refused_naming_the_flag(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "--algorithm", "fedavg", *QUICK, "--rounds", "1", "--out", str(out)]
    assert run_cli(args, capsys)[0] == 0
    (out / "summary.json").unlink()  # a checkpoint without a summary: an interrupted run, resumable
    before = (out / "metrics.jsonl").read_text()
    code, _, err = run_cli(args, capsys)
    one_line_error(code, err, "is not empty (it holds a run stopped after a checkpoint); pass --resume")
    assert (out / "metrics.jsonl").read_text() == before
    # Diverged after its checkpoint (the NaN loss is written as null): --resume would diverge again.
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"round": 2, "accuracy": 0.1, "loss": None}) + "\n")
    code, _, err = run_cli(args, capsys)
    one_line_error(code, err, "(it holds a run that diverged at round 2); pass --overwrite to replace it")
    assert "--resume" not in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"config": {}}))
    (other / "notes.txt").write_text("mine")  # not a run's file: never removed
    code, _, err = run_cli(args[:-1] + [str(other)], capsys)
    one_line_error(code, err, "is not empty (it holds files no run writes: notes.txt)")
    assert (other / "notes.txt").read_text() == "mine" and (other / "config.json").exists()


def test_an_attack_without_a_malicious_client_is_refused_before_the_data_loads(tmp_path, capsys):
    code, _, err = run_cli(["run", "--algorithm", "fedavg", "--dataset", "mnist", "--data-dir", str(tmp_path),
                            "--num-clients", "6", "--clients-per-round", "3", "--attack", "min_max",
                            "--malicious-fraction", "0.1", "--quiet"], capsys)
    one_line_error(code, err, "--malicious-fraction 0.1 of --num-clients 6 makes no client malicious; raise it to "
                              "at least 0.167")


# ---------------------------------------------------------------- 4. another dataset's files
def test_another_datasets_files_are_named(shared_data, capsys):
    code, _, err = run_cli(["run", "--dataset", "mnist", "--data-dir", str(shared_data / "fashion_mnist"),
                            "--rounds", "1", "--quiet"], capsys)
    one_line_error(code, err, "these are fashion_mnist's train-images-idx3-ubyte.gz: use --dataset fashion_mnist, "
                              "or point --data-dir at mnist's files")
    assert "re-download" not in err


# ---------------------------------------------------------------- 5. --option KEY VALUE
@pytest.mark.parametrize("flag, key, value", [("--option", "momentum", "0.9"), ("--model-option", "init", "3")])
def test_option_without_equals_says_key_equals_value(flag, key, value, capsys):
    code, _, err = run_cli(["run", *QUICK, flag, key, value, "--rounds", "1"], capsys)
    one_line_error(code, err, f"{flag} takes KEY=VALUE, got '{key}' followed by '{value}': write {flag} "
                              f"{key}={value}")
    code, _, err = run_cli(["run", *QUICK, "--rounds", "1", flag, key], capsys)  # nothing after it
    one_line_error(code, err, f"{flag} takes KEY=VALUE, got '{key}'")

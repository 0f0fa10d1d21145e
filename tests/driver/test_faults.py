"""Fault injection: a run is never lost and never silently wrong.

Kill -9 at random points then ``--resume`` (equal to an uninterrupted run), concurrent runs into
one folder (one refused), stale locks, torn metrics, damaged checkpoints, resumes that would change
the experiment, and bad inputs (exit code 2, one line, no traceback, nothing lost). The kill sweep
of many runs is marked ``slow`` (``pytest -m slow tests/driver/test_faults.py``); the default suite kills
two runs.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedjax_sparse.driver import runner
from fedjax_sparse.driver.checkpoint import CHECKPOINT_DIR, LOCK, OutputLock, has_checkpoint
from fedjax_sparse.cli import main

QUICK = ["--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3", "--local-epochs", "1",
         "--batch-size", "32", "--lr", "0.1", "--partition", "iid", "--quiet"]
# Values that must agree exactly between an interrupted-then-resumed run and an uninterrupted one.
COMPARED = ("round", "accuracy", "loss", "global_accuracy", "total_flops", "total_uplink_bits", "total_client_steps")


def run_cli(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def one_line_error(code, err, needle):
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


def cli_process(args) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", "fedjax_sparse", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 6-round run, evaluated every round."""
    out = tmp_path_factory.mktemp("faults") / "straight"
    assert main(["run", "--algorithm", "fedavg", *QUICK, "--rounds", "6", "--out", str(out)]) == 0
    return rows_of(out)


def assert_same_rows(rows, reference):
    assert [r["round"] for r in rows] == [r["round"] for r in reference]
    for got, want in zip(rows, reference):
        for key in COMPARED:
            if want[key] is None:
                assert got[key] is None, (key, got["round"])
                continue
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (key, got["round"])


# ---------------------------------------------------------------- kill -9 then resume
def kill_and_resume(out: Path, *, delay: float | None = None, after_rows: int | None = None) -> bool:
    """Starts a 6-round run, kills it with SIGKILL after ``delay`` s or as soon as ``after_rows``
    metrics rows exist, then resumes it to the end. Returns whether the kill landed before the
    run finished."""
    # A checkpoint after every round (by default the clock decides, every 60 s: longer than this run).
    args = ["--algorithm", "fedavg", *QUICK, "--rounds", "6", "--checkpoint-every", "1", "--out", str(out)]
    proc = cli_process(args)
    deadline = time.time() + (delay if delay is not None else 300)
    while proc.poll() is None and time.time() < deadline:
        if after_rows is not None and (out / "metrics.jsonl").exists() and len(
                (out / "metrics.jsonl").read_text().splitlines()) >= after_rows:
            break
        time.sleep(0.01)
    killed = proc.poll() is None
    proc.kill()
    proc.wait()
    if has_checkpoint(out):
        resumed = cli_process(args + ["--resume"])
    else:  # killed before its first checkpoint: nothing to resume, start again
        resumed = cli_process(args + ["--overwrite"])
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-2000:]
    return killed


def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, reference):
    out = tmp_path / "killed"
    # Right after round 2's row is written: between the metrics row and its checkpoint, or after.
    assert kill_and_resume(out, after_rows=2)
    assert_same_rows(rows_of(out), reference)
    assert not (out / LOCK).exists()


@pytest.mark.slow
def test_kill_9_sweep(tmp_path, reference):
    """Many kills at random points (``pytest -m slow``); prints the counts the README reports.

    The kill times are fractions of an uninterrupted run's wall time, timed here: fixed 3-14 s
    delays missed most runs on a fast host with a warm compile cache (2 of 12 killed)."""
    start = time.perf_counter()
    straight = cli_process(["--algorithm", "fedavg", *QUICK, "--rounds", "6", "--out", str(tmp_path / "timed")])
    _, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err[-2000:]
    duration = time.perf_counter() - start
    rng = random.Random(0)
    killed = lost = 0
    for i in range(12):
        out = tmp_path / f"s{i}"
        killed += kill_and_resume(out, delay=rng.uniform(0.2, 0.95) * duration)
        try:
            assert_same_rows(rows_of(out), reference)
        except AssertionError:
            lost += 1
    print(f"\nkill -9 sweep: {killed} runs killed (uninterrupted run {duration:.1f} s), 12 resumed, "
          f"{lost} differing from the uninterrupted run")
    assert lost == 0 and killed >= 6


# ---------------------------------------------------------------- locks
def test_second_run_into_a_locked_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    with OutputLock(out):  # this process holds it: a live pid on this host
        code, _, err = run_cli(["run", "--algorithm", "fedavg", *QUICK, "--rounds", "1", "--out", str(out)], capsys)
    one_line_error(code, err, f"is in use by another run (pid {os.getpid()}")
    assert not (out / "metrics.jsonl").exists()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket
    (out / LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "earlier"}))
    code, _, err = run_cli(["run", "--algorithm", "fedavg", *QUICK, "--rounds", "1", "--out", str(out)], capsys)
    assert code == 0 and "taking over the stale lock" in err
    assert not (out / LOCK).exists() and len(rows_of(out)) == 1


def test_concurrent_runs_into_one_folder_one_is_refused(tmp_path):
    out = tmp_path / "run"
    args = ["--algorithm", "fedavg", *QUICK, "--rounds", "3", "--out", str(out)]
    first = cli_process(args)
    deadline = time.time() + 120
    while not (out / LOCK).exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    second = cli_process(args)
    _, err2 = second.communicate(timeout=600)
    _, err1 = first.communicate(timeout=600)
    assert first.returncode == 0, err1[-2000:]
    assert second.returncode == 2 and "is in use by another run" in err2 and "Traceback" not in err2
    assert [r["round"] for r in rows_of(out)] == [1, 2, 3]  # not interleaved


# ---------------------------------------------------------------- resume semantics and damaged files
def test_resume_continues_to_the_recorded_rounds_and_refuses_changes(tmp_path, capsys, reference):
    out = tmp_path / "run"
    args = ["run", "--algorithm", "fedavg", *QUICK, "--out", str(out)]
    assert run_cli(args + ["--rounds", "6"], capsys)[0] == 0
    # Cut back to round 3 as a crash would leave it (rows and checkpoint of round 3).
    shutil.rmtree(out / CHECKPOINT_DIR)
    runner.run(runner.RunConfig(algorithm="fedavg", dataset="digits", num_clients=6, clients_per_round=3,
                                local_epochs=1, batch_size=32, lr=0.1, partition="iid", rounds=3,
                                out=str(tmp_path / "three")), progress=False)
    shutil.copytree(tmp_path / "three" / CHECKPOINT_DIR, out / CHECKPOINT_DIR)
    (out / "summary.json").unlink()
    code, _, err = run_cli(["run", "--resume", "--out", str(out), "--lr", "0.5", "--algorithm", "fedprox"], capsys)
    one_line_error(code, err, "--lr 0.5 (recorded: 0.1)")
    assert "--algorithm 'fedprox' (recorded: 'fedavg')" in err
    # No --rounds: continue to the recorded 6 (not the default 30); --eval-every is harmless.
    code, _, err = run_cli(["run", "--resume", "--out", str(out), "--quiet", "--eval-every", "1"], capsys)
    assert code == 0, err
    assert_same_rows(rows_of(out), reference)
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["config"]["rounds"] == 6 and recorded["resumed"][-1]["at_round"] == 3
    code, _, err = run_cli(["run", "--resume", "--out", str(out), "--quiet"], capsys)
    assert code == 0 and "is complete (6 of 6 rounds)" in err and len(rows_of(out)) == 6


def test_torn_metrics_tail_and_damaged_checkpoint_are_repaired_on_resume(tmp_path, capsys, reference):
    out = tmp_path / "run"
    args = ["run", "--algorithm", "fedavg", *QUICK, "--rounds", "4", "--checkpoint-every", "1", "--out", str(out)]
    assert run_cli(args, capsys)[0] == 0
    # A kill mid-write tears the last line; the newest checkpoint (round 4) is damaged.
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"round": 5, "accur')
    newest = out / CHECKPOINT_DIR / "4"
    for path in newest.rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(b"\x00garbage")
    code, _, err = run_cli(["run", "--resume", "--out", str(out), "--rounds", "6", "--quiet"], capsys)
    assert code == 0, err
    assert "dropped the torn last line" in err and "resuming from round 3" in err
    assert_same_rows(rows_of(out), reference)


# ---------------------------------------------------------------- metrics.jsonl damaged (issue 50 item 2)
def _without_seconds(out: Path) -> list[str]:
    """The file's rows as written, less the wall clock (the only value a resumed run may change)."""
    return [json.dumps({k: v for k, v in json.loads(line).items() if k != "seconds"})
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def four_rounds(tmp_path_factory):
    """A run stopped after round 4, its checkpoint of round 4 (every round evaluated)."""
    out = tmp_path_factory.mktemp("four") / "run"
    assert main(["run", "--algorithm", "fedavg", *QUICK, "--rounds", "4", "--out", str(out)]) == 0
    return out


def _cut(path: Path, how: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    if how == "inside row 2":       # a kill while row 2 was written (the rows after it never were)
        path.write_text(lines[0] + lines[1][:40])
    elif how == "after row 2":      # cut at a row's end: every line reads, rows 3-4 are gone
        path.write_text("".join(lines[:2]))
    elif how == "inside row 4":     # the last row torn
        path.write_text("".join(lines[:3]) + lines[3][:-30])
    elif how == "damaged line 2":   # a line before the last overwritten (bytes that are not even UTF-8)
        path.write_bytes((lines[0]).encode() + b"\xff\x00" * 20 + b"\n" + "".join(lines[2:]).encode())
    elif how == "emptied":
        path.write_text("")
    else:
        path.unlink()


@pytest.mark.parametrize("how,lost", [("inside row 2", "2-4 (3 rows)"), ("after row 2", "3-4 (2 rows)"),
                                      ("inside row 4", "4 (1 row)"), ("damaged line 2", "2-4 (3 rows)"),
                                      ("emptied", "1-4 (4 rows)"), ("missing", "1-4 (4 rows)")])
def test_a_damaged_metrics_file_is_restored_from_the_checkpoint(tmp_path, capsys, reference, four_rounds, how,
                                                                 lost):
    """The issue's case: rows cut before the checkpoint's round were lost for good (rows 1-3, 7, 8 after
    a cut inside row 4 and a checkpoint at 6, with only "dropped the torn last line"; an emptied
    file: no notice at all). The checkpoint holds the rows: the resumed file is the uninterrupted run's."""
    out = tmp_path / "run"
    shutil.copytree(four_rounds, out)
    _cut(out / "metrics.jsonl", how)
    code, _, err = run_cli(["run", "--resume", "--out", str(out), "--rounds", "6", "--quiet"], capsys)
    assert code == 0, err
    straight = _without_seconds(out)
    assert [json.loads(r)["round"] for r in straight] == [1, 2, 3, 4, 5, 6]
    assert straight == [json.dumps({k: v for k, v in r.items() if k != "seconds"}) for r in reference]
    assert f"restored the rows of rounds {lost} from the checkpoint of round 4" in err, err


def test_a_checkpoint_without_rows_names_the_rows_it_cannot_restore(tmp_path, capsys, four_rounds):
    """Checkpoints of earlier versions hold no rows: a cut file stays cut, and the resume says which rows."""
    out = tmp_path / "run"
    shutil.copytree(four_rounds, out)
    for generation in (out / CHECKPOINT_DIR).iterdir():
        shutil.rmtree(generation / "rows", ignore_errors=True)
    _cut(out / "metrics.jsonl", "after row 2")
    code, _, err = run_cli(["run", "--resume", "--out", str(out), "--rounds", "6", "--quiet"], capsys)
    assert code == 0, err
    assert [r["round"] for r in rows_of(out)] == [1, 2, 5, 6]
    assert "has no rows after round 2" in err and "rows of rounds 3-4 stay missing" in err, err


def test_a_finished_run_without_checkpoints_gives_one_way_forward(tmp_path, capsys):
    """Its checkpoints deleted (as the recorded results do), a finished run can be neither resumed nor
    extended. Before, a new run into it said "pass --resume ... to extend it" and --resume said "run
    without --resume": each pointed at the other. Now every attempt gives the same one line."""
    out = tmp_path / "run"
    args = ["run", "--algorithm", "fedavg", *QUICK, "--rounds", "3", "--out", str(out)]
    assert run_cli(args, capsys)[0] == 0
    shutil.rmtree(out / CHECKPOINT_DIR)
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    fix = "it holds a finished run whose checkpoints were deleted, which can be neither resumed nor extended; " \
          "start the new run in another --out"
    for attempt in (args, args + ["--resume"], ["run", "--resume", "--out", str(out), "--rounds", "6", "--quiet"]):
        code, _, err = run_cli(attempt, capsys)
        one_line_error(code, err, fix)
        assert "--resume" not in err.split(fix)[0] and "--resume" not in err.split(fix)[1], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept   # untouched
    code, _, err = run_cli(args[:-1] + [str(tmp_path / "another")], capsys)   # the way forward works
    assert code == 0, err


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("extra,needle", [
    (["--model-option", "bogus=1"], "unknown --model-option bogus for model cnn_small; accepted: init="),
    (["--client-parallelism", "bucketed"], "unknown --client-parallelism 'bucketed'; valid: auto, vmap, map"),
    (["--personal-eval", "loop"], "unknown --personal-eval 'loop'; valid: auto, per_client"),
])
def test_bad_options_give_one_line(extra, needle, tmp_path, capsys):
    code, _, err = run_cli(["run", "--algorithm", "fedavg", *QUICK, "--rounds", "1",
                            "--out", str(tmp_path / "x"), *extra], capsys)
    one_line_error(code, err, needle)


@pytest.mark.parametrize("content,needle", [
    ("[1, 2]", "must hold a JSON object"),
    ('{"rounds": "5"}', "config key 'rounds' (flag --rounds) expects an integer, got '5'"),
    ('{"lr": [0.1]}', "config key 'lr' (flag --lr) expects a number"),
    ('{"roundz": 5}', "unknown config key(s) ['roundz']"),
    ('{"round_mode": "per_round"}', "config key 'round_mode': its mode was removed in 0.2.0"),
    ('{"execution": {"client_bucket_size": 4}}', "unknown execution key(s) ['client_bucket_size']"),
])
@pytest.mark.fast
def test_bad_config_files_give_one_line(content, needle, tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(content)
    code, _, err = run_cli(["run", "--config", str(cfg), "--quiet"], capsys)
    one_line_error(code, err, needle)


@pytest.mark.fast
def test_config_files_of_earlier_versions_read_with_removed_modes_at_their_inert_values():
    """Every recorded config.json holds round_mode "scan" and client_bucket_size 0 (the modes removed
    in 0.2.0 at their defaults): they must still read, to the same configuration."""
    from fedjax_sparse.driver.config import RunConfig
    old = RunConfig.from_json({"rounds": 3, "round_mode": "scan", "client_bucket_size": 0,
                               "client_parallelism": "map"})
    assert old == RunConfig.from_json({"rounds": 3, "client_parallelism": "map"})
    assert "round_mode" not in old.to_json() and "client_bucket_size" not in old.to_json()


def test_unwritable_out_gives_one_line(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, _, err = run_cli(["run", "--algorithm", "fedavg", *QUICK, "--rounds", "1",
                            "--out", str(blocker / "sub")], capsys)
    one_line_error(code, err, "--out")


def test_nan_is_written_as_null_and_overwrite_keeps_old_outputs_until_the_new_run_builds(tmp_path, capsys):
    out = tmp_path / "nan"
    code, _, err = run_cli(["run", "--algorithm", "fedavg", *QUICK, "--rounds", "2", "--lr", "1e30",
                            "--out", str(out)], capsys)
    assert code == 2 and "diverged" in err
    text = (out / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text.splitlines()[-1])
    assert row["loss"] is None
    # --overwrite with a configuration that fails to build leaves the old run in place.
    code, _, err = run_cli(["run", "--algorithm", "fedavg", *QUICK, "--rounds", "1", "--out", str(out),
                            "--overwrite", "--model-option", "bogus=1"], capsys)
    assert code == 2 and (out / "metrics.jsonl").read_text() == text


@pytest.mark.fast
def test_a_first_format_npz_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    """Runs written before the orbax checkpoints (OUT/checkpoint.npz: the state's leaves by position)
    cannot follow reordered state fields: --resume refuses them, naming the file and the way out."""
    import numpy as np
    out = tmp_path / "old"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"config": dict(algorithm="fedavg", dataset="digits", num_clients=6,
                                                                clients_per_round=3, rounds=3, partition="iid")}))
    np.savez(out / "checkpoint.npz", np.zeros(3), totals=json.dumps({"round": 3}))
    code, _, err = run_cli(["run", "--resume", "--out", str(out), "--rounds", "6", "--quiet"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "checkpoint.npz is a checkpoint of fedjax_sparse before its orbax checkpoints" in err
    assert "start a fresh run in a new --out" in err

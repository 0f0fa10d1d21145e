"""Checkpoints on their own cadence, chunks bounded by time, and SIGTERM / SIGINT (issue 32, items 1-2).

A run stopped by a signal checkpoints the rounds it finished and exits with 128 + the signal; its
``--resume`` ends with exactly the uninterrupted run's metrics. The signal is sent at several points:
before the first chunk (during build), while the first chunk compiles, between chunks, and while a
checkpoint is being written.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedjax_sparse import runner
from fedjax_sparse.runner import ChunkClock
from fedjax_sparse.errors import RunStopped

from helpers import flat_config

BASE = dict(algorithm="fedavg", dataset="digits", model="cnn_small", num_clients=6, clients_per_round=3,
            local_epochs=1, batch_size=32, lr=0.1, partition="iid", checkpoint_seconds=0.0)


def rows(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    runner.run(flat_config(**BASE, rounds=6, eval_every=3, out=str(out)), progress=False)
    return rows(out)


@pytest.mark.fast
def test_chunk_clock_sizes_chunks_by_time_in_powers_of_two():
    clock = ChunkClock(5.0)
    assert clock.cap is None                      # nothing measured, nothing estimated: no cap
    clock.measured(rounds=3, seconds=2.1)         # 0.7 s per round: 7 rounds fit, 4 is the power of two
    assert clock.cap == 4
    clock.measured(rounds=1, seconds=6.0)         # a round longer than the bound: one round per chunk
    assert clock.cap == 1
    assert ChunkClock(5.0, estimated_round_seconds=0.3).cap == 16
    off = ChunkClock(0.0, estimated_round_seconds=100.0)
    off.measured(1, 100.0)
    assert off.cap is None


def _advances(monkeypatch):
    """Records the number of rounds of each chunk the engine runs."""
    from fedjax_sparse.engine import Engine
    sizes = []
    real = Engine.advance

    def advance(self, state, data, n, mode="scan"):
        sizes.append(n)
        return real(self, state, data, n, mode)
    monkeypatch.setattr(Engine, "advance", advance)
    return sizes


def test_time_bounded_chunks_give_the_same_metrics(tmp_path, monkeypatch, uninterrupted):
    sizes = _advances(monkeypatch)
    # A bound far below a round's time: every chunk is one round, and nothing else changes.
    runner.run(flat_config(**{**BASE, "max_chunk_seconds": 1e-9}, rounds=6, eval_every=3,
                                out=str(tmp_path / "short")), progress=False)
    assert sizes == [1] * 6
    assert rows(tmp_path / "short") == uninterrupted
    sizes.clear()
    runner.run(flat_config(**{**BASE, "max_chunk_seconds": 0.0}, rounds=6, eval_every=3,
                                out=str(tmp_path / "eval")), progress=False)
    assert sizes == [3, 3]


def test_checkpoint_every_and_the_clock_add_checkpoints_between_evaluations(tmp_path, monkeypatch):
    saved = []
    real = runner.Checkpointer.save

    def save(self, state, totals, population=None):
        saved.append(int(totals["round"]))
        return real(self, state, totals, population=population)
    monkeypatch.setattr(runner.Checkpointer, "save", save)
    runner.run(flat_config(**BASE, rounds=10, eval_every=5, checkpoint_every=2, out=str(tmp_path / "a")),
               progress=False)
    assert saved == [2, 4, 6, 8, 10]   # evaluations (5, 10) add none: checkpoints keep their own cadence
    saved.clear()
    # By the clock: a checkpoint at every chunk end once the interval has passed (here at once).
    runner.run(flat_config(**{**BASE, "checkpoint_seconds": 1e-9, "max_chunk_seconds": 1e-9}, rounds=4,
                                eval_every=4, out=str(tmp_path / "b")), progress=False)
    assert saved == [1, 2, 3, 4]


def _signal_at(monkeypatch, where: str, signum=signal.SIGTERM):
    """Sends ``signum`` to this process at one point of the run (once)."""
    from fedjax_sparse.engine import Engine
    sent = []

    def send():
        if not sent:
            sent.append(1)
            # Without the run's handler the default action would end this test process.
            assert signal.getsignal(signum) not in (signal.SIG_DFL, signal.default_int_handler), "no handler"
            os.kill(os.getpid(), signum)
    if where == "build":
        real_build = runner.build
        monkeypatch.setattr(runner, "build", lambda *a, **k: (send(), real_build(*a, **k))[1])
    elif where in ("compile", "round 4"):
        real = Engine.advance
        calls = []

        def advance(self, state, data, n, mode="scan"):
            calls.append(n)
            if where == "compile" or sum(calls) >= 4:
                send()   # while the chunk runs: it finishes, then the run stops
            return real(self, state, data, n, mode)
        monkeypatch.setattr(Engine, "advance", advance)
    else:
        real_save = runner.Checkpointer.save

        def save(self, state, totals, population=None):
            send()       # during the checkpoint write: it completes, then the run stops
            return real_save(self, state, totals, population=population)
        monkeypatch.setattr(runner.Checkpointer, "save", save)


@pytest.mark.parametrize("where,stopped_at", [("build", 0), ("compile", 1), ("round 4", 4), ("checkpoint", 2)])
def test_a_signal_stops_with_a_checkpoint_and_resume_ends_exactly_as_uninterrupted(
        tmp_path, monkeypatch, uninterrupted, where, stopped_at):
    out = tmp_path / "run"
    config = flat_config(**{**BASE, "max_chunk_seconds": 1e-9}, rounds=6, eval_every=3, checkpoint_every=2,
                              out=str(out))
    with monkeypatch.context() as patch:
        _signal_at(patch, where)
        with pytest.raises(RunStopped) as stop:
            runner.run(config, progress=False)
    assert stop.value.round == stopped_at and stop.value.exit_code == 143
    assert f"stopped at round {stopped_at}" in str(stop.value)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # the handlers are put back
    if stopped_at == 0:
        assert "nothing to resume" in str(stop.value)
        runner.run(config, progress=False)   # the same command again starts afresh in the same folder
    else:
        assert f"fjs.run(config, resume=True) with config.out={str(out)!r}" in str(stop.value)   # the API's words
        assert max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == stopped_at
        runner.run(config, resume=True, progress=False)
    assert rows(out) == uninterrupted


def test_a_long_evaluation_interval_loses_nothing_on_sigterm(tmp_path, monkeypatch, uninterrupted):
    # The case: rare evaluations (here one, at the end); SIGTERM before it used to leave nothing.
    out = tmp_path / "rare"
    config = flat_config(**{**BASE, "max_chunk_seconds": 1e-9}, rounds=6, eval_every=6, out=str(out))
    with monkeypatch.context() as patch:
        _signal_at(patch, "round 4")
        with pytest.raises(RunStopped, match="stopped at round 4"):
            runner.run(config, progress=False)
    assert not (out / "metrics.jsonl").exists() or rows(out) == []
    runner.run(config, resume=True, progress=False)
    assert rows(out) == [uninterrupted[-1]]


def test_the_cli_exits_143_on_sigterm_and_130_on_sigint_with_one_line(tmp_path):
    """The real thing: a child process, the signal sent from outside while it trains."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        out = tmp_path / signum.name
        args = [sys.executable, "-m", "fedjax_sparse", "run", "--algorithm", "fedavg", "--dataset", "digits",
                "--model", "cnn_small", "--num-clients", "6", "--clients-per-round", "3", "--rounds", "100000",
                "--eval-every", "100000", "--max-chunk-seconds", "0.2", "--quiet", "--out", str(out)]
        child = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while not (out / "config.json").exists() and time.time() < deadline:   # built; now compiling
            time.sleep(0.2)
        time.sleep(3)   # compiled, and training chunk after chunk
        child.send_signal(signum)
        _, err = child.communicate(timeout=120)
        assert child.returncode == code, err
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"{signum.name}: stopped at round ") and last.endswith(f"--out {out} --resume")
        stopped = int(last.split("stopped at round ")[1].split(";")[0])
        assert stopped > 0 and (out / "checkpoints" / str(stopped)).is_dir()

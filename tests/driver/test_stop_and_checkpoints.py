"""Checkpoints on their own cadence, chunks bounded by time, and SIGTERM / SIGINT (issue 32, items 1-2).

A run stopped by a signal checkpoints the rounds it finished and exits with 128 + the signal; its
``--resume`` ends with exactly the uninterrupted run's metrics. The signal is sent at several points:
before the first chunk (during build), while the first chunk compiles, between chunks, and while a
checkpoint is being written.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedjax_sparse.driver import runner
from fedjax_sparse.driver.runner import ChunkClock
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
    from fedjax_sparse.core.engine import Engine
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

    def save(self, state, totals, population=None, **kwargs):
        saved.append(int(totals["round"]))
        return real(self, state, totals, population=population, **kwargs)
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
    from fedjax_sparse.core.engine import Engine
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

        def save(self, state, totals, population=None, **kwargs):
            send()       # during the checkpoint write: it completes, then the run stops
            return real_save(self, state, totals, population=population, **kwargs)
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
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
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


# ---------------------------------------------------------------- a stop anywhere (issue 50 item 1)
# The default: an evaluation (and a metrics row) after every round, so most of a run's host time
# is spent evaluating and logging; one-round chunks, and checkpoints only where a stop asks for one.
EVERY_ROUND = dict(BASE, rounds=6, eval_every=1, max_chunk_seconds=1e-9)


@pytest.fixture(scope="module")
def every_round(tmp_path_factory):
    out = tmp_path_factory.mktemp("every") / "run"
    runner.run(flat_config(**EVERY_ROUND, out=str(out)), progress=False)
    return rows(out)


def _latest_checkpoint(out: Path) -> int | None:
    steps = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()] \
        if (out / "checkpoints").is_dir() else []
    return max(steps, default=None)


def _stop_then_continue(config, out: Path, **run_kwargs) -> int | None:
    """Runs ``config`` (a patch sends the signal somewhere inside), then does what the stop's message
    says: --resume, or the same command again. Returns the round it stopped at (None: it finished).
    The message must be true: "continue with --resume" only over a checkpoint of that very round."""
    try:
        runner.run(config, progress=False, **run_kwargs)
        return None
    except RunStopped as stop:
        stopped = stop.round
        message = str(stop)
    assert f"stopped at round {stopped};" in message
    if stopped == 0:
        assert "nothing to resume: run the same command again" in message
        runner.run(config, progress=False)
    else:
        assert "resume=True" in message
        assert _latest_checkpoint(out) == stopped, f"{message}, yet the newest checkpoint is {_latest_checkpoint(out)}"
        runner.run(config, resume=True, progress=False)
    return stopped


def _send_inside(patch, target, name: str, calls: tuple[int, ...], signum=signal.SIGTERM, times: int = 1):
    """Sends ``signum`` (``times`` times) to this process from inside the ``calls``-th calls (1-based) of
    ``target.name``, before its body runs (which then completes: the handler only records the stop)."""
    real = getattr(target, name)
    count = [0]

    def inside(*args, **kwargs):
        count[0] += 1
        if count[0] in calls:
            assert signal.getsignal(signum) not in (signal.SIG_DFL, signal.default_int_handler), "no handler"
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return real(*args, **kwargs)
    patch.setattr(target, name, inside)


@pytest.mark.parametrize("where,call,stopped_at", [
    ("evaluation", 2, 2),          # the case: the stop lands while round 2 is evaluated
    ("metrics row", 3, 3),         # while the row of round 3 is logged (the extra logs)
    ("progress", 1, 1),            # while the bar is updated after round 1
    ("on_eval", 4, 4),             # in the caller's callback after round 4's evaluation
    ("first chunk", 1, 1),         # while the first chunk's compile time is booked
    ("checkpoint write", 1, 2),    # inside a checkpoint's write (--checkpoint-every 2: round 2)
    ("stop checkpoint", 1, 2),     # a second SIGTERM inside the stop's own checkpoint (sent at round 2)
    ("evaluation", 6, None),       # after the last round: nothing left to stop, the run finishes
])
def test_a_stop_anywhere_resumes_to_the_uninterrupted_run(tmp_path, monkeypatch, every_round, where, call,
                                                          stopped_at):
    from fedjax_sparse.core.engine import Engine
    from fedjax_sparse.driver.progress import Progress
    from fedjax_sparse.driver.sinks import MetricSinks
    out = tmp_path / "run"
    fields = dict(EVERY_ROUND, out=str(out), log="csv")
    kwargs = {}
    with monkeypatch.context() as patch:
        if where == "evaluation":
            _send_inside(patch, Engine, "evaluate", (call,))
        elif where == "metrics row":
            _send_inside(patch, MetricSinks, "write", (call,))
        elif where == "progress":
            _send_inside(patch, Progress, "update", (call,))
        elif where == "first chunk":
            _send_inside(patch, runner.OpenRun, "_first_chunk_done", (call,))
        elif where == "on_eval":
            seen = []

            def on_eval(row, state, experiment):
                seen.append(row["round"])
                if len(seen) == call:
                    os.kill(os.getpid(), signal.SIGTERM)
            kwargs["on_eval"] = on_eval
        elif where == "checkpoint write":
            fields["checkpoint_every"] = 2
            _send_inside(patch, runner.Checkpointer, "save", (call,))
        else:   # the stop checkpoint: the first save, asked for by a stop inside round 2's evaluation
            _send_inside(patch, Engine, "evaluate", (2,))
            _send_inside(patch, runner.Checkpointer, "save", (call,))
        got = _stop_then_continue(flat_config(**fields), out, **kwargs)
    assert got == stopped_at
    assert rows(out) == every_round
    assert (out / "summary.json").is_file()


@pytest.mark.parametrize("checkpoint_every,during,newest", [(0, 2, None), (2, 3, 2)])
def test_a_second_ctrl_c_says_truthfully_what_can_be_resumed(tmp_path, monkeypatch, capsys, every_round,
                                                             checkpoint_every, during, newest):
    """Two Ctrl-C stop at once, without the stop's checkpoint; the one line says what the folder holds,
    and following it ends with the uninterrupted run (before: "rerun the same command with --resume",
    which then found nothing to resume when no checkpoint had been written)."""
    from fedjax_sparse.cli import main
    from fedjax_sparse.core.engine import Engine
    out = tmp_path / "run"
    args = ["run", "--algorithm", "fedavg", "--dataset", "digits", "--model", "cnn_small", "--num-clients", "6",
            "--clients-per-round", "3", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.1", "--partition",
            "iid", "--checkpoint-seconds", "0", "--checkpoint-every", str(checkpoint_every), "--rounds", "6",
            "--eval-every", "1", "--max-chunk-seconds", "1e-9", "--quiet", "--out", str(out)]
    with monkeypatch.context() as patch:
        _send_inside(patch, Engine, "evaluate", (during,), signum=signal.SIGINT, times=2)
        code = main(args)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 130, last
    assert _latest_checkpoint(out) == newest
    if newest is None:
        assert last.endswith("no checkpoint was written, nothing to resume: run the same command again"), last
        assert main(args) == 0, capsys.readouterr().err
    else:
        assert f"the newest checkpoint is of round {newest}; continue with: " in last, last
        assert last.endswith(f"--out {out} --resume"), last
        assert main(args + ["--resume"]) == 0, capsys.readouterr().err
    assert rows(out) == every_round


# Every line the run's host bookkeeping executes is a moment a signal may land on: opening the run, the
# loop, recording a chunk (evaluation, metrics row, logs, progress), checkpoint writes, the summary.
_BOOKKEEPING = tuple(str(Path(runner.__file__).with_name(name))
                     for name in ("runner.py", "checkpoint.py", "sinks.py", "progress.py"))


def _at_line(k: int | None):
    """A trace function sending SIGTERM at the ``k``-th line executed in the bookkeeping modules while
    the run's handler is installed (None: only counts them, in ``.lines``). Before the handler (the
    folder's lock) and after it (the lock's release) SIGTERM's default action ends the process: true of
    a real run too, and nothing there claims a checkpoint (stop_sweep.py meets those moments for real)."""
    def local(frame, event, arg):
        if event == "line" and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            tracer.lines += 1
            if tracer.lines == k:
                os.kill(os.getpid(), signal.SIGTERM)
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename in _BOOKKEEPING else None
    tracer.lines = 0
    return tracer


def _traced(tracer, function, *args, **kwargs):
    sys.settrace(tracer)
    try:
        return function(*args, **kwargs)
    finally:
        sys.settrace(None)


@pytest.fixture(scope="module")
def bookkeeping_lines(tmp_path_factory, every_round):
    """Lines the bookkeeping of an uninterrupted run executes (counted once)."""
    counter = _at_line(None)
    out = tmp_path_factory.mktemp("count") / "run"
    _traced(counter, runner.run, flat_config(**EVERY_ROUND, out=str(out)), progress=False)
    assert rows(out) == every_round
    return counter.lines


def _stop_at_line(tmp_path, every_round, k):
    out = tmp_path / f"line{k}"
    config = flat_config(**EVERY_ROUND, out=str(out))
    stopped = _traced(_at_line(k), _stop_then_continue, config, out)
    assert rows(out) == every_round, f"stopped at round {stopped} by a signal at line event {k}"
    return stopped


@pytest.mark.parametrize("fraction", [0.02, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9])
def test_a_signal_at_any_line_of_the_bookkeeping_resumes_identically(tmp_path, every_round, bookkeeping_lines,
                                                                      fraction):
    _stop_at_line(tmp_path, every_round, max(1, int(fraction * bookkeeping_lines)))


@pytest.mark.slow
def test_a_signal_at_every_other_line_of_the_bookkeeping_resumes_identically(tmp_path, every_round,
                                                                            bookkeeping_lines):
    """Every other line event of the run while its handler is installed (``pytest -m slow
    tests/driver/test_stop_and_checkpoints.py -k every_other -s``: 1,130 stops, each resumed, in 20 min on 2
    shared cores; every line would double that for neighbouring moments); prints how the stops ended."""
    ended: dict = {}
    moments = range(1, bookkeeping_lines + 1, 2)
    for k in moments:
        stopped = _stop_at_line(tmp_path, every_round, k)
        ended[stopped] = ended.get(stopped, 0) + 1
        shutil.rmtree(tmp_path / f"line{k}")
    print(f"\n{len(moments)} of {bookkeeping_lines} line events, each stopped and resumed identically; stopped "
          f"at round: {dict(sorted(ended.items(), key=lambda kv: -1 if kv[0] is None else kv[0]))} (None: finished)")


# ---------------------------------------------------------------- several runs in one process
def _member_rows(out: Path) -> dict[str, list[dict]]:
    return {str(p.parent.relative_to(out)): rows(p.parent) for p in sorted(out.rglob("metrics.jsonl"))}


@pytest.mark.parametrize("kind", ["seeds", "sweep"])
def test_a_stop_of_seeds_or_a_sweep_checkpoints_every_member_and_resumes_to_the_uninterrupted_runs(
        tmp_path, monkeypatch, kind):
    """--seeds and --sweep run several members in one process: a SIGTERM (here inside the 3rd evaluation)
    stops them all between two chunks, each with a checkpoint of the same round, one line says so, and
    the same call with resume ends with every member's uninterrupted metrics (before: no handler, the
    default action ended the process with no checkpoint and no word)."""
    import fedjax_sparse as fjs
    from fedjax_sparse.core.engine import Engine
    from fedjax_sparse.driver.replicas import run_replicas

    def go(out: Path, resume: bool = False):
        config = flat_config(**EVERY_ROUND, out=str(out))
        if kind == "seeds":
            return run_replicas(config, [0, 1], parallelism="sequential", resume=resume, progress=False)
        return fjs.sweep(config, {"lr": [0.05, 0.1]}, seeds=[0], parallelism="sequential", resume=resume,
                         progress=False)

    go(tmp_path / "straight")
    out = tmp_path / "stopped"
    with monkeypatch.context() as patch:
        _send_inside(patch, Engine, "evaluate", (3,))
        with pytest.raises(RunStopped) as stop:
            go(out)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # the handlers are put back
    members = sorted(p.parent for p in out.rglob("config.json"))
    assert len(members) == 2
    stopped = stop.value.round
    assert 0 < stopped < 6 and stop.value.exit_code == 143
    assert f"every run in {out} checkpointed; continue with the same call and resume=True" in str(stop.value)
    assert [_latest_checkpoint(m) for m in members] == [stopped, stopped]
    go(out, resume=True)
    assert _member_rows(out) == _member_rows(tmp_path / "straight")

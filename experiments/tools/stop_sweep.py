"""SIGTERM at random moments of a real run, each stop followed as its message says (issue 50 item 1).

A fresh ``python -m fedjax_sparse run --algorithm spafl --dataset digits --rounds R --out DIR`` (the
issue's command: ``--eval-every 1`` by default, the progress lines on stderr) gets SIGTERM at a time
drawn uniformly between its start and the wall time of an uninterrupted run of the same command
(timed first); a run that has already exited gets none and is drawn again, until ``--stops`` signals
have reached a live run. Then, by what the run said:

* exit 143, ``SIGTERM: stopped at round R; continue with: ... --resume``: the newest checkpoint must
  be of round R (the promise), and ``--resume`` continues it;
* ``... nothing to resume: run the same command again`` (round 0), or no message at all because the
  signal came before the run had installed its handler (exit -15 during Python's start, nothing
  written): the same command again;
* exit 0 (the signal landed after the last round: the run finishes), or exit -15 after the run had
  put its handler back (it had finished: summary.json written, the signal landed while the summary
  was printed): nothing to do.

The folder must then hold the uninterrupted run's results: ``metrics.jsonl`` byte-identical once each
row's wall clock (``seconds``) is removed, and ``summary.json`` equal in every field that is not a
time or a memory peak. Recorded (2 shared CPU cores)::

    python experiments/tools/stop_sweep.py --stops 50 --rounds 1000 \\
        --json experiments/results/faults/stop_sweep_spafl_digits_cpu.json

Exit status 0 when every stop ended with the uninterrupted run's results and kept its promise.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def command(out: Path, rounds: int) -> list[str]:
    return [sys.executable, "-m", "fedjax_sparse", "run", "--algorithm", "spafl", "--dataset", "digits",
            "--rounds", str(rounds), "--out", str(out)]


def environment() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}


def follow(record: dict, args: list[str], what: str) -> None:
    """Does what the stop said (``what``: which advice); a failure is recorded, not raised."""
    done = subprocess.run(args, env=environment(), capture_output=True, text=True, timeout=3600)
    record["followed"] = what
    if done.returncode != 0:
        record["follow_failed"] = f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"


def rows_without_seconds(out: Path) -> list[str]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.dumps({k: v for k, v in json.loads(line).items() if k != "seconds"}) for line in lines]


def deterministic_summary(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    return {k: v for k, v in summary.items() if not any(w in k for w in ("second", "peak_", "memory"))}


def newest_checkpoint(out: Path) -> int | None:
    folder = out / "checkpoints"
    return max((int(p.name) for p in folder.iterdir() if p.name.isdigit()), default=None) if folder.is_dir() else None


def one_stop(out: Path, rounds: int, delay: float) -> dict:
    """Starts the run, sends SIGTERM after ``delay`` s, follows the message; returns what happened."""
    child = subprocess.Popen(command(out, rounds), env=environment(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    sent = child.poll() is None
    if sent:
        child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=600)
    last = err.strip().splitlines()[-1] if err.strip() else ""
    said = last.replace(str(out), "DIR")[:300]   # the folder is a scratch one
    record: dict = {"delay_s": round(delay, 3), "exit": child.returncode, "said": said, "sent": sent}
    if not sent:
        record["ended"] = "exited before the signal"
    elif child.returncode == 0:
        record["ended"] = "finished"
    elif child.returncode == 143 and "; continue with: " in last and last.endswith(f"--out {out} --resume"):
        stopped = int(last.split("stopped at round ")[1].split(";")[0])
        record.update(ended="stopped", round=stopped, newest_checkpoint=newest_checkpoint(out))
        record["promise_kept"] = record["newest_checkpoint"] == stopped
        follow(record, command(out, rounds) + ["--resume"], "--resume")
    elif child.returncode == 143 and last.endswith("nothing to resume: run the same command again"):
        record.update(ended="stopped before round 1", round=0, promise_kept=newest_checkpoint(out) is None)
        follow(record, command(out, rounds), "the same command")
    elif child.returncode == -signal.SIGTERM and (out / "summary.json").is_file():
        # The default action once the run had finished and put the previous handler back.
        record["ended"] = "killed after it finished"
    elif child.returncode == -signal.SIGTERM:
        # The default action before the run installed its handler (Python starting): nothing promised.
        record.update(ended="killed before the handler", promise_kept=newest_checkpoint(out) is None)
        follow(record, command(out, rounds), "the same command")
    else:
        record.update(ended="unexpected", promise_kept=False)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stops", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="draws the stop times")
    parser.add_argument("--work", default=None, help="folder for the runs (default: a temporary one, removed)")
    parser.add_argument("--json", default=None, help="writes the result there")
    args = parser.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="stop_sweep_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        reference = work / "uninterrupted"
        shutil.rmtree(reference, ignore_errors=True)
        start = time.perf_counter()
        straight: dict = {}
        follow(straight, command(reference, args.rounds), "the uninterrupted run")
        if "follow_failed" in straight:
            raise SystemExit(f"the uninterrupted run failed ({straight['follow_failed']})")
        duration = time.perf_counter() - start
        want_rows, want_summary = rows_without_seconds(reference), deterministic_summary(reference)
        rng = random.Random(args.seed)
        stops: list[dict] = []
        missed = 0
        while len(stops) < args.stops and missed < 3 * args.stops:
            i = len(stops)
            out = work / f"stop{i}"
            shutil.rmtree(out, ignore_errors=True)
            record = one_stop(out, args.rounds, rng.uniform(0.0, duration))
            if not record["sent"]:   # the run had finished before the draw: no stop, draw again
                missed += 1
                shutil.rmtree(out, ignore_errors=True)
                continue
            record["identical"] = ("follow_failed" not in record and (out / "summary.json").is_file()
                                   and rows_without_seconds(out) == want_rows
                                   and deterministic_summary(out) == want_summary)
            stops.append(record)
            print(f"stop {i + 1}/{args.stops}: {record['ended']}"
                  f"{' at round ' + str(record['round']) if 'round' in record else ''} after {record['delay_s']} s; "
                  f"promise kept: {record.get('promise_kept', True)}; identical: {record['identical']}"
                  f"{'; ' + record['follow_failed'] if 'follow_failed' in record else ''}", flush=True)
            if record["identical"] and record.get("promise_kept", True):
                shutil.rmtree(out, ignore_errors=True)   # kept otherwise (with --work), to be looked at
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    ended: dict = {}
    for record in stops:
        ended[record["ended"]] = ended.get(record["ended"], 0) + 1
    good = sum(r["identical"] and r.get("promise_kept", True) for r in stops)
    result = {"command": " ".join(["python", *command(Path("DIR"), args.rounds)[1:]]),
              "uninterrupted_seconds": round(duration, 2), "stops": len(stops), "seed": args.seed,
              "draws_after_the_run_had_exited": missed,
              "ended": ended, "identical_and_promise_kept": good, "runs": stops}
    print(f"{good} of {len(stops)} SIGTERM stops resumed to the uninterrupted run's results with their promise kept "
          f"(uninterrupted run {duration:.1f} s; {ended}; {missed} draws after the run had exited, redrawn)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if good == len(stops) == args.stops else 1


if __name__ == "__main__":
    sys.exit(main())

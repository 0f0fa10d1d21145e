"""Several seeds of one configuration in one process ("replicas"): replica r is the run ``config`` with
``seed = seeds[r]`` in ``OUT/seed<seed>`` (the same numbers as that run alone), ``OUT/replicas.json`` collects
them; replicas that can share one compiled program do (:func:`unshareable_reason`), and :class:`RunGroup`
advances them (sweeps' members too). docs/running.md, "Several seeds at once".
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.driver.checkpoint import has_checkpoint, locked_out_dir
from fedjax_sparse.driver.config import RunConfig
from fedjax_sparse.errors import RunError, arg, in_callers_words
from fedjax_sparse.data.federated import pad_index_rows
from fedjax_sparse.core.engine import Engine, metrics_to_host
from fedjax_sparse.driver.progress import Progress
from fedjax_sparse.driver.experiment import check, with_components
from fedjax_sparse.driver.runner import RunResult, StopSignals, open_run

REPLICA_PARALLELISM = ("auto", "vmap", "sequential")


def resolve_replica_parallelism(mode: str) -> str:
    if mode not in REPLICA_PARALLELISM:
        raise RunError(f"unknown replica parallelism {mode!r}; valid: {', '.join(REPLICA_PARALLELISM)} "
                       f"(fix {arg('replica_parallelism')})")
    if mode == "auto":
        return "sequential" if jax.default_backend() == "cpu" else "vmap"
    return mode


def unshareable_reason(runs) -> str | None:
    """Why the replicas cannot run through one program (None: they can)."""
    first = runs[0]
    options = first.exp.algorithm.hparams
    if first.config.attack is not None or float(options.get("malicious_fraction", 0) or 0) > 0:
        return "the malicious clients are chosen by seed"
    base = first.exp.data
    for run in runs[1:]:
        data = run.exp.data
        # mean and std are read only by ``standardize`` (each partition's own statistics).
        static = ("preprocess_name", "num_classes", "input_shape") + (
            ("mean", "std") if base.preprocess_name == "standardize" else ())
        if any(getattr(data, f) != getattr(base, f) for f in static):
            return "the preprocessing constants differ between seeds (e.g. standardize statistics per partition)"
        for field in ("train_x", "train_y", "test_x", "test_y"):
            a, b = getattr(data, field), getattr(base, field)
            if a.shape != b.shape or a.dtype != b.dtype or not bool(jnp.array_equal(a, b)):
                return f"the data pools differ between seeds ({field})"
    return None


def padded_rows(idx: jax.Array, counts: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """(index rows [N, width] zero-padded, counts [N]): only the counts decide which rows are
    read, so the padding changes no number."""
    idx_np, counts_np = np.asarray(idx), np.asarray(counts)
    rows, _ = pad_index_rows([idx_np[i, :c] for i, c in enumerate(counts_np)], pad_to=width)
    return jnp.asarray(rows), jnp.asarray(counts_np)


def _stack(trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


def _take(tree, i: int):
    return jax.tree_util.tree_map(lambda x: x[i], tree)


def seed_list(seeds) -> list[int]:
    """``seeds`` as a list of distinct non-negative ints, or a one-line RunError: a string (``"01"`` would be
    the seeds 0 and 1), a single number or a non-integer is refused, never coerced."""
    import numbers
    if isinstance(seeds, numbers.Integral) and not isinstance(seeds, bool):
        raise RunError(f"seeds must be a list of integers such as [0, 1, 2], got the int {seeds}: write "
                       f"seeds=[{seeds}] (one seed) or seeds=range({seeds})")
    if isinstance(seeds, (str, bytes, dict)) or not hasattr(seeds, "__iter__"):
        raise RunError(f"seeds must be a list of integers such as [0, 1, 2], got the {type(seeds).__name__} "
                       f"{seeds!r}")
    seeds = list(seeds)
    for s in seeds:
        if not isinstance(s, numbers.Integral) or isinstance(s, bool):
            raise RunError(f"seeds must be integers, got {s!r}")
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise RunError(f"{arg('seeds')} needs at least one seed")
    if len(set(seeds)) != len(seeds):
        raise RunError(f"{arg('seeds')} lists a seed twice: {seeds}; each seed is one run")
    if any(s < 0 for s in seeds):
        raise RunError(f"{arg('seeds')} must be non-negative integers, got {seeds}")
    return seeds


@in_callers_words
def run_replicas(config: RunConfig, seeds: Sequence[int], *, parallelism: str = "auto", resume: bool = False,
                 overwrite: bool = False, progress: bool = True, given: set[str] | None = None,
                 on_eval_for_seed: Callable[[int], Callable | None] | None = None) -> list:
    """Runs ``config`` once per seed (see the module docstring); returns the seeds' ``RunResult``s.

    ``on_eval_for_seed(seed)``: that replica's ``on_eval(row, state, experiment)`` hook (as in
    ``runner.run``), or None."""
    seeds = seed_list(seeds)
    if config.execution.client_state == "host":
        raise RunError(f"{arg('seeds')} stacks every replica's clients on the device; run "
                       f"{arg('client_state', 'host')} one {arg('seed')} at a time")
    config, parts = with_components(config)
    # Checked once for every seed (a replica's configuration differs in its seed and folder only), as
    # runner.run checks its own; a resumed seed's is the recorded one, checked once merged (open_run).
    checked = check(config, parts) if not resume or parts.given() else None
    mode = resolve_replica_parallelism(parallelism)
    out = Path(config.out) if config.out else None
    with contextlib.ExitStack() as stack:
        signals = stack.enter_context(StopSignals())
        if out is not None:
            stack.enter_context(locked_out_dir(out))
        opened: list = []
        for seed in seeds:
            out_r = out / f"seed{seed}" if out else None
            cfg = dataclasses.replace(config, seed=seed, out=str(out_r) if out_r else None)
            if cfg.execution.client_parallelism == "measure" and opened and not isinstance(opened[0], RunResult):
                # Measured once, on the first seed: the others run the schedule it chose.
                cfg = cfg.replace(client_parallelism=opened[0].exp.engine.mode)
            if out_r is not None:
                stack.enter_context(locked_out_dir(out_r))
            start = cfg if checked is None else dataclasses.replace(checked, config=cfg)
            # --resume continues every seed that has a checkpoint and starts the others (a seed killed
            # before its first checkpoint has nothing a resume would keep).
            resume_r = resume and out_r is not None and has_checkpoint(out_r)
            opened.append(open_run(start, out_r, resume=resume_r, overwrite=overwrite or (resume and not resume_r),
                                    experiment=None, given=given))
        results: dict[int, RunResult] = {s: r for s, r in zip(seeds, opened) if isinstance(r, RunResult)}
        runs = [r for r in opened if not isinstance(r, RunResult)]
        reason = unshareable_reason(runs) if runs else None
        shared = reason is None
        t_start = time.perf_counter()
        if runs:
            hooks = [on_eval_for_seed(r.config.seed) if on_eval_for_seed else None for r in runs]
            group = RunGroup(runs, mode if shared else "separate", progress, hooks, signals=signals, out=out)
            results.update({run.config.seed: result for run, result in zip(runs, group.run_to_end())})
        ordered = [results[s] for s in seeds]
        if out is not None:
            finals = [r.summary.get("final_accuracy") for r in ordered]
            known = [f for f in finals if f is not None]
            (out / "replicas.json").write_text(json.dumps({
                "seeds": seeds, "replica_parallelism": mode if shared else "separate",
                "shared_program": shared, **({"why_not_shared": reason} if reason else {}),
                "runs": [f"seed{s}" for s in seeds],
                "final_accuracy": finals,
                "final_accuracy_mean": float(np.mean(known)) if known else None,
                "final_accuracy_std": float(np.std(known, ddof=1)) if len(known) > 1 else None,
                "seconds_this_session": time.perf_counter() - t_start}, indent=2))
        return ordered


class RunGroup:
    """Advances open runs ("members": replicas of seeds, or a sweep's grid points x seeds) chunk by
    chunk and books each chunk in every member's files.

    ``mode``: ``sequential`` (one compiled program, members one after another), ``vmap`` (one
    program over a leading member axis) or ``separate`` (each member its own engine and program).
    ``program``: None (the first member's engine runs every member: they differ only by keys and
    partitions), or ``(rebuild, hyper_parameters)``: ``rebuild(hp) -> Engine`` builds the engine for
    traced values ``hp`` (a dict of arrays) and ``hyper_parameters[i]`` are member i's values, so
    members that differ in them (a sweep's learning rates, algorithm options) share the program.
    ``keep_going``: a member whose training diverges is recorded in ``diverged`` (its message) and
    dropped; the others go on (else the divergence is raised).
    ``signals``: a stop (SIGTERM / SIGINT) it received ends :meth:`run` between two chunks, after every
    member has booked the chunk, with a checkpoint of each member (:class:`RunStopped`; ``out``: the
    group's folder, named by the message)."""

    def __init__(self, runs, mode: str, progress: bool, hooks, program=None, keep_going: bool = False,
                 label: Callable | None = None, signals: StopSignals | None = None, out: Path | None = None):
        self.runs, self.mode = runs, mode
        self.signals, self.out = signals, out
        self.engine: Engine = runs[0].exp.engine
        self.rebuild: Callable[[dict], Engine] | None = program[0] if program is not None else None
        self.hps: list[dict] = program[1] if program is not None else []
        self.keep_going = keep_going
        self.diverged: dict[int, str] = {}
        first = runs[0]
        self.bar = Progress(first.config.rounds, min(r.round for r in runs), progress)
        for run, hook in zip(runs, hooks):
            run.label = label(run) if label else f" (seed {run.config.seed})"
            run.start(None, hook)
        if mode != "separate":
            base = first.exp.data
            # One evaluation program for all: each replica's own test split, its index rows padded to
            # a common width (the union for the global model keeps its own length).
            test_width = max(int(r.exp.data.test_idx.shape[1]) for r in runs)
            for run in runs:
                own = run.exp.data
                test_idx, test_count = padded_rows(own.test_idx, own.test_count, test_width)
                eval_data = base.replace(test_idx=test_idx, test_count=test_count,
                                         global_test_idx=own.global_test_idx)
                run.evaluate = (lambda data: lambda s: self.engine.evaluate(s, data))(eval_data)
            width = max(int(r.exp.data.train_idx.shape[1]) for r in runs)
            self.rows = [padded_rows(r.exp.data.train_idx, r.exp.data.train_count, width) for r in runs]
            # Training reads only the pool and each replica's train rows: one data shape for all.
            self.train_data = [base.replace(train_idx=i, train_count=c) for i, c in self.rows]

    @functools.cached_property
    def _hp_scan_fn(self):
        """(hp, state, data, n) -> the member's n rounds, ``hp`` traced: one program for all values."""
        def run(hp, state, data, num_rounds):
            engine = self.rebuild(hp)
            return jax.lax.scan(lambda s, _: engine.round_step(s, data), state, None, length=num_rounds)
        return jax.jit(run, static_argnums=3, donate_argnums=1)

    @functools.cached_property
    def _hp_vmap_fn(self):
        """The same over a leading member axis of hp, states and train rows."""
        def run(hps, states, data, num_rounds):
            def one(hp, state, train_idx, train_count):
                engine = self.rebuild(hp)
                member_data = data.replace(train_idx=train_idx, train_count=train_count)
                return jax.lax.scan(lambda s, _: engine.round_step(s, member_data), state, None, length=num_rounds)
            return jax.vmap(one)(hps, states, data.train_idx, data.train_count)
        return jax.jit(run, static_argnums=3, donate_argnums=1)

    def _advance_one(self, i: int, n: int, first: bool) -> None:
        run = self.runs[i]
        t = time.perf_counter()
        if self.mode == "separate":
            state, metrics = run.exp.engine.advance(run.state, run.exp.data, n)
        elif self.rebuild is not None:
            state, metrics = self._hp_scan_fn(self.hps[i], run.state, self.train_data[i], n)
            metrics = metrics_to_host(metrics)
        else:
            state, metrics = self.engine.advance(run.state, self.train_data[i], n)
        self._record(i, state, metrics, n, t if first else None)

    def _record(self, i: int, state, metrics, n: int, chunk_started) -> None:
        try:
            self.runs[i].record(state, metrics, n, chunk_started=chunk_started)
        except RunError as e:
            if not (self.keep_going and "diverged" in str(e)):
                raise
            self.diverged[i] = str(e)

    def run(self) -> list:
        """Runs every member to its last round (or its divergence); returns their final states."""
        runs = self.runs
        first = [True] * len(runs)
        restarted = False
        # Catch up: an interruption between two members' checkpoints leaves some a chunk behind.
        target = max(r.round for r in runs)
        for i, run in enumerate(runs):
            while run.round < target and i not in self.diverged:
                self._stop_if_asked()
                self._advance_one(i, min(run.next_chunk(), target - run.round), first[i])
                first[i] = False
        while True:
            # Between chunks only: every member has booked the last one, so their checkpoints agree.
            self._stop_if_asked()
            active = [i for i in range(len(runs)) if i not in self.diverged]
            n = runs[active[0]].next_chunk() if active else 0
            if n <= 0:
                break
            if any(runs[i].next_chunk() != n for i in active):
                raise RunError("members disagree on the next chunk; resume each run separately")
            lead = runs[active[0]]
            if first[active[0]]:
                self.bar.note(f"compiling and running rounds {lead.round + 1}-{lead.round + n} of "
                              f"{len(active)} runs ({self.mode}) ...")
            t_chunk = time.perf_counter()
            if self.mode == "vmap":
                states = _stack([runs[i].state for i in active])
                data = self.train_data[0].replace(train_idx=jnp.stack([self.rows[i][0] for i in active]),
                                                  train_count=jnp.stack([self.rows[i][1] for i in active]))
                if self.rebuild is None:
                    states, metrics = self.engine.run_replica_rounds(states, data, n)
                else:
                    states, metrics = self._hp_vmap_fn(_stack([self.hps[i] for i in active]), states, data, n)
                for j, i in enumerate(active):
                    self._record(i, _take(states, j), metrics_to_host(_take(metrics, j)), n,
                                 t_chunk if first[i] else None)
                    first[i] = False
            else:
                for i in active:
                    self._advance_one(i, n, first[i])
                    first[i] = False
            if not restarted:  # rates and the ETA count from after the compiling chunk
                self.bar.restart(lead.round)
                restarted = True
            accuracies = [runs[i].rows[-1]["accuracy"] for i in active
                          if runs[i].rows and runs[i].rows[-1]["accuracy"] is not None]
            self.bar.update(lead.round, float(np.mean(accuracies)) if accuracies else None)
        return [r.state for r in runs]

    def run_to_end(self, keep_states: bool = True) -> list:
        """Runs every member to its end (:meth:`run`), finishes each and closes the group: the members'
        ``RunResult`` (``state`` None unless ``keep_states``), None for one that diverged (``diverged``)."""
        try:
            states = self.run()
            return [None if i in self.diverged else RunResult(run.finish(), state if keep_states else None,
                                                                rows=run.rows, config=run.config)
                    for i, (run, state) in enumerate(zip(self.runs, states))]
        finally:
            self.close()

    def _stop_if_asked(self) -> None:
        if self.signals is not None:
            self.signals.stop_runs([run for i, run in enumerate(self.runs) if i not in self.diverged], self.out,
                                   several=True)

    def close(self) -> None:
        self.bar.close()
        for run in self.runs:
            run.close()

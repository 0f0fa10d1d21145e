"""Wall-clock timing of engine rounds (for benchmark scripts; tests never time)."""
from __future__ import annotations

import time

import jax


def time_rounds(engine, state, data, rounds: int):
    """Runs one round (compiles), then ``rounds`` more, each jitted alone and
    synchronised. Returns (state, seconds of the first round including
    compilation, [rounds] seconds of the others, the last round's metrics)."""
    t0 = time.perf_counter()
    state, metrics = engine.round_fn(state, data)
    jax.block_until_ready(state)
    first = time.perf_counter() - t0
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        state, metrics = engine.round_fn(state, data)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return state, first, times, metrics

"""How a run executes (``RunConfig.execution``): a leaf module, so that the configuration
(:mod:`fedjax_sparse.config`, which re-exports it) and the error translation
(:mod:`fedjax_sparse.errors`) both read the field names without importing each other."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Execution:
    """How a run executes: client schedules, round programs, evaluation mode, where the clients' state
    lives, checkpoint cadence, extra logs. None of it changes what is computed (bitwise, tested;
    ``client_storage="bfloat16"`` is the one lossy choice and says so), so every field may change when
    a run is resumed. Flags of the same names set it (``--client-parallelism`` ...); ``config.json``
    holds it as ``"execution"``. Which mode wins where: docs/design.md."""
    # auto (map on a CPU, packed on one accelerator, vmap across several) | vmap | map | packed | measure
    client_parallelism: str = "auto"
    eval_batch_size: int | None = None  # None: auto (see fedjax_sparse.experiment.auto_eval_batch_size)
    personal_eval: str = "auto"         # auto (= per_client) | per_client
    # Where the clients' persistent state lives (fedjax_sparse.population): device (all N rows) | host
    # (host memory, copy-on-write; only each chunk's cohort rows go to the device).
    client_state: str = "device"
    client_storage: str = "float32"     # host: float32 (exact) | bfloat16 (half the memory, lossy)
    host_chunk_rounds: int = 25         # host: rounds per device program (device rows: this x K)
    # Checkpoints on their own cadence (besides the end and a stop): every N rounds (0: no round
    # cadence) and at the first chunk end this many seconds after the previous one (0: off).
    checkpoint_every: int = 0
    checkpoint_seconds: float = 60.0
    # The host regains control after at most about this many seconds of device work (chunks of
    # rounds sized from the measured round time), to serve progress, checkpoints and signals.
    max_chunk_seconds: float = 5.0
    log: str = ""                       # extra logs beside metrics.jsonl: csv, tensorboard (comma-separated)


EXECUTION_FIELDS = tuple(f.name for f in dataclasses.fields(Execution))

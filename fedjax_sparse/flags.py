"""The run's flags, one row each: (flag, RunConfig or Execution field, type, help). A leaf module
(stdlib only): the CLI builds its parser from it and :func:`fedjax_sparse.errors.python_words`
translates a message's flags into Python arguments with it, without either importing the other."""
from __future__ import annotations


def flag_of(name: str) -> str:
    """A RunConfig or Execution field's flag: ``client_parallelism`` -> ``--client-parallelism``."""
    return "--" + name.replace("_", "-")


RUN_FLAGS = [
    # flag, config field, type, help
    ("--algorithm", "algorithm", str, "algorithm name (see `list`)"),
    ("--dataset", "dataset", str, "dataset name (see `list`), or npz:PATH (your arrays: x_train, y_train, x_test, "
     "y_test [, client_ids_train, client_ids_test] with --partition natural)"),
    ("--data-dir", "data_dir", str, "folder with the dataset's original files"),
    ("--model", "model", str, "model name (see `list`; default: per dataset), or package.module:Name for your own "
     "flax.linen / flax.nnx module (a class built without arguments, an instance, or a factory; the working "
     "directory is on the import path)"),
    ("--num-clients", "num_clients", int, "number of clients N"),
    ("--clients-per-round", "clients_per_round", int, "clients sampled per round K (<= N)"),
    ("--client-sampling", "client_sampling", str,
     "fixed (default: exactly K of N each round) | poisson (each client independently with probability K / N: "
     "cohorts of varying size; DP accounted as published)"),
    ("--resample-every", "resample_every", int, "keep each sampled cohort for this many rounds (default 1)"),
    ("--rounds", "rounds", int, "number of rounds"),
    ("--local-epochs", "local_epochs", int, "local epochs E per round"),
    ("--batch-size", "batch_size", int, "local batch size"),
    ("--lr", "lr", float, "client learning rate (default: the algorithm's, `list` shows it: 0.1, SpaFL's and "
     "SignSGD's 0.01)"),
    ("--partition", "partition", str, "iid | dirichlet:ALPHA | dirichlet_split:ALPHA[:FRAC] | shards:S | natural"),
    ("--min-client-samples", "min_client_samples", int, "redraw the partition until every client has this many"),
    ("--seed", "seed", int, "random seed (data partition, init, sampling)"),
    ("--eval-every", "eval_every", int, "evaluate (and log, checkpoint) every M rounds"),
    ("--checkpoint-every", "checkpoint_every", int,
     "checkpoint every N rounds (default 0: by the clock, at the end and when stopped by a signal)"),
    ("--checkpoint-seconds", "checkpoint_seconds", float,
     "checkpoint at the first chunk end this many seconds after the previous checkpoint (default 60; 0: off)"),
    ("--max-chunk-seconds", "max_chunk_seconds", float,
     "the host regains control after about this much device work: progress, checkpoints, SIGTERM/SIGINT "
     "(default 5; 0: chunks end only at evaluations and checkpoints)"),
    ("--out", "out", str, "output directory (config.json, metrics.jsonl, summary.json, checkpoint)"),
    ("--preprocess", "preprocess", str, "input scaling: unit (x/255) | raw (0-255) | standardize"),
    ("--client-parallelism", "client_parallelism", str,
     "auto (map on a CPU, packed on one accelerator, vmap across several or across processes) | vmap | map | "
     "packed (clients sorted by size, in lockstep groups that pad at most ~1.2x) | "
     "measure (time one round of map, vmap and packed, use the fastest; recorded in config.json)"),
    ("--eval-batch-size", "eval_batch_size", int, "evaluation batch size (default: from the clients' test-set sizes)"),
    ("--personal-eval", "personal_eval", str,
     "personalised evaluation: auto (default) = per_client (one call per client, whole test set, native "
     "convolutions)"),
    ("--client-state", "client_state", str,
     "where the clients' persistent state lives: device (default, all N rows) | host (host memory, "
     "copy-on-write; only each chunk's cohort rows go to the device: populations of 10^5+ clients)"),
    ("--client-storage", "client_storage", str,
     "with --client-state host: float32 (default, exact) | bfloat16 (half the host memory, lossy)"),
    ("--host-chunk-rounds", "host_chunk_rounds", int,
     "with --client-state host: rounds per device program (default 25; the device holds this x K rows)"),
    ("--log", "log", str, "extra logs beside metrics.jsonl: csv, tensorboard (comma-separated)"),
    ("--aggregator", "aggregator", str, "robust aggregation around any algorithm: mean | trimmed_mean | multi_krum"),
    ("--dp-clip", "dp_clip", float, "client-level DP (DP-FedAvg): clip each sampled client's update to this L2 norm"),
    ("--dp-noise-multiplier", "dp_noise_multiplier", float,
     "DP: Gaussian noise of this x --dp-clip on the sum of the clipped updates (the mean's: / K)"),
    ("--dp-target-epsilon", "dp_target_epsilon", float,
     "DP: instead of --dp-noise-multiplier, the noise calibrated to reach this epsilon after --rounds"),
    ("--dp-delta", "dp_delta", float, "DP: the delta epsilon is reported at (default 1e-5)"),
    ("--dp-accountant", "dp_accountant", str,
     "DP: the accountant of epsilon and --dp-target-epsilon: auto (default: pld with --client-sampling poisson, "
     "else rdp) | rdp | pld (--client-sampling poisson only)"),
    ("--trim-fraction", "trim_fraction", float, "fraction of the cohort trimmed per side / assumed malicious (0.1)"),
    ("--attack", "attack", str, "model-poisoning attack around any algorithm: min_max"),
    ("--malicious-fraction", "malicious_fraction", float, "fraction of malicious clients for --attack"),
    ("--partition-file", "partition_file", str,
     "pinned partition: a fedjax_sparse.partition/1 JSON (client -> train/test indices; `partition --out` writes one)"),
    ("--init-params", "init_params", str,
     "pinned initial weights: .npz keyed params/<layer>/<name> (layouts in fedjax_sparse/pinning.py)"),
    ("--cohort-schedule", "cohort_schedule", str,
     "pinned cohorts: a fedjax_sparse.cohorts/1 JSON, the client ids of every round"),
]

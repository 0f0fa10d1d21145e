"""The driver: a run from its configuration to its files, on top of the core.

* ``settings``: a run's settings, each declared once with its flag (``RunFields``, ``Execution``);
* ``config``: ``RunConfig`` (reading, KEY=VALUE overrides, validation); ``catalog``: what ``list`` says and the
  default learning rates;
* ``experiment``: building an experiment (data, partition, model, task, algorithm, engine: ``build``);
  ``pinning``: pinned draws (partition, initial weights, cohorts); ``privacy``: DP accounting (epsilon);
* ``runner``: the run loop (``run``: resume rules, chunks of rounds, evaluation, checkpoints, signals);
  ``progress``: the bar, summaries and their JSON; ``checkpoint``: a run's folder, its lock,
  ``metrics.jsonl`` and checkpoints; ``sinks``: CSV and TensorBoard logs;
* ``sweeps`` (a grid x seeds), ``replicas`` (several seeds in one process), ``population`` (client state in host
  memory), ``distributed`` (several processes).

It imports the core, the algorithms, the models and the data, and the papers' named settings
(``RunConfig.from_setting``); nothing below it imports it (tests/front_door/test_package_layout.py). Importing
this package imports none of its modules.
"""

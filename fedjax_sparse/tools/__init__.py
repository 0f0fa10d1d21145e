"""Tools over finished or running runs: what sits on top of the driver.

* ``bench``: how fast a configuration runs here (``python -m fedjax_sparse bench``: variants side by side);
* ``programs``: what a compiled round is made of, read from its program text (grouped convolutions, kernels
  per local step);
* ``timing``: wall-clock timing of rounds and the machine facts recorded beside it (benchmark scripts);
* ``reporting``: comparing runs from their own files (``plot``, ``report``; ``fjs.plot_runs``,
  ``fjs.report_table``);
* ``sidebyside``: per-round curves of this project's runs and of the authors'-code drivers, side by side.

The tools import the driver and the layers below it; none of those imports a tool
(tests/front_door/test_package_layout.py). Importing this package imports none of its modules.
"""

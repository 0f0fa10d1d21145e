"""The papers: their named settings and the seed studies that reproduce their tables.

* ``settings``: the papers' named settings as ``RunConfig`` keys (plain data; ``setting(name)``,
  ``SPAFL_FMNIST_BASE``, ...), read here as ``fedjax_sparse.papers.NAME`` too;
* ``studies``: a table of methods, each run over several seeds, reported next to a paper's numbers.

Nothing but the command line, the driver's ``RunConfig.from_setting`` and the experiment scripts imports
them (tests/front_door/test_package_layout.py).
"""
from fedjax_sparse.papers.settings import *  # noqa: F403  (the settings' names: fedjax_sparse.papers.NAME)

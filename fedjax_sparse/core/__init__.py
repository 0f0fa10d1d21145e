"""The pure JAX core: what a federated round computes, with no file, flag or process in it.

* ``algorithm``: what an algorithm is (``Algorithm``: data plus pure functions; ``Task``, the contexts,
  ``client_metrics``);
* ``engine``: the round engine (``Engine``: sampling, schedules, ``lax.scan`` over rounds, vmap/map over
  clients);
* ``training``: one client's local loop over its padded data;
* ``evaluation``: a state's personalised and global accuracy (``Evaluator``);
* ``accounting``: bits and FLOPs, exactly (``Cost``);
* ``memory``: a run's peak memory on a device and on the host, known from shapes before compiling, and the
  one-line refusal naming the flag that makes it fit (``estimate``, ``check_fits``, ``check_weights_fit``).

It builds on ``models`` and ``data`` (the stacked client data) and imports nothing of the algorithms, the
driver, the tools or the papers (tests/front_door/test_package_layout.py); importing it imports none of its modules.
"""

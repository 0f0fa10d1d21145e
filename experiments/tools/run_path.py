"""The modules of ``fedjax_sparse`` a command passes through, and the switches between them (issue 49 item 1).

Runs ``python -m fedjax_sparse ARGS`` in this process (default: a 2-round SpaFL run on digits into a
temporary folder) under ``sys.setprofile``, and counts every Python call whose caller and callee are
both in the package: the modules called, the *switches* (a call from one module into another) and the
distinct caller -> callee pairs; the same again by *unit*, a module's first name below the package
(``fedjax_sparse.core.engine`` -> ``core``; a flat module is a unit of its own), which shows how many
places of the package's layout a run crosses. Main thread only (the checkpoint writer's threads are
left out, so the counts repeat from run to run). Recorded in docs/design.md ("Layout")::

    python experiments/tools/run_path.py [--json PATH] [-- run --algorithm spafl --dataset digits ...]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile

PACKAGE = "fedjax_sparse"


def unit(module: str) -> str:
    """``fedjax_sparse.core.engine`` -> ``core``; ``fedjax_sparse`` itself -> ``fedjax_sparse``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def trace(argv: list[str]) -> dict:
    from fedjax_sparse.cli import main

    calls: collections.Counter = collections.Counter()
    switches: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith(PACKAGE):
            return
        calls[callee] += 1
        back = frame.f_back
        caller = back.f_globals.get("__name__", "") if back is not None else ""
        if caller.startswith(PACKAGE) and caller != callee:
            switches[caller, callee] += 1

    sys.setprofile(profile)
    try:
        code = main(argv)
    finally:
        sys.setprofile(None)
    units: collections.Counter = collections.Counter()
    for (a, b), n in switches.items():
        if unit(a) != unit(b):
            units[unit(a), unit(b)] += n
    return {"command": argv, "exit_code": code, "modules": len(calls), "calls": sum(calls.values()),
            "switches": sum(switches.values()), "switch_pairs": len(switches),
            "units": sorted({unit(m) for m in calls}), "unit_switches": sum(units.values()),
            "unit_pairs": len(units),
            "module_calls": dict(sorted(calls.items())),
            "unit_switch_counts": {f"{a} -> {b}": n for (a, b), n in sorted(units.items())}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("command", nargs="*", help="the CLI's arguments (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        command = args.command or ["run", "--algorithm", "spafl", "--dataset", "digits", "--rounds", "2",
                                   "--out", out]
        result = trace(command)
        result["command"] = [a.replace(out, "OUT") for a in result["command"]]
    print(f"{result['modules']} modules in {len(result['units'])} units, {result['calls']} calls; "
          f"{result['switches']} switches between modules ({result['switch_pairs']} pairs), "
          f"{result['unit_switches']} between units ({result['unit_pairs']} pairs)")
    print("units: " + ", ".join(result["units"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0 if result["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Mutation testing of the mechanism code with mutmut (optional extra ``mutation``).

mutmut makes many small wrong versions of a module (a flipped comparison, a
changed constant, a dropped argument...) and runs the tests that cover each
mutated function; a *surviving* mutant is a change no test noticed. Not part
of the default suite: install with ``pip install -e '.[mutation]'`` and run

    python experiments/tools/mutation_test.py                          # masks.py and dropout.py
    python experiments/tools/mutation_test.py fedjax_sparse/mechanisms/supermask.py --max-children 2
    python experiments/tools/mutation_test.py all --time-limit 3000    # every module below
    python experiments/tools/mutation_test.py fedjax_sparse/mechanisms/threshold_masks.py \
        --mutants 'fedjax_sparse.mechanisms.threshold_masks.x_row_sum*'

Each module is mutated in its own scratch copy of the package and tests
(``--workdir``, default a folder under the system temp dir), with the fast
test selection of ``TARGETS`` and a mutmut config written there, so the
working tree is never touched. Prints killed / survived / untested counts per
module and the diff of every survivor; docs/testing.md records the last run.
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the repository

# module -> the fast tests that pin it (pytest arguments)
TARGETS = {
    "fedjax_sparse/mechanisms/threshold_masks.py": ["tests/mechanisms/test_masks.py"],
    "fedjax_sparse/mechanisms/syncdrop.py": ["tests/mechanisms/test_dropout.py"],
    # The next four are narrowed to their unit tests (the engine / end-to-end tests of the full
    # files take 40-110 s a run on 2 cores; docs/testing.md lists the selections' times), plus the
    # tests written for their survivors.
    "fedjax_sparse/mechanisms/supermask.py": [
        "tests/algorithms/test_fsl.py",
        "tests/mechanisms/test_mechanisms.py::test_supermask_defaults_to_absolute_scores",
        "tests/mechanisms/test_mutation_supermask.py",
        "-k", "not engine and not learns and not reorders_by_global and not rejects"],
    "fedjax_sparse/mechanisms/robust_aggregation.py": [
        "tests/algorithms/test_robust.py", "tests/mechanisms/test_mutation_robust.py",
        "-k", "not engine_runs and not scale_attack and not mean_aggregator and not lr_schedules"],
    "fedjax_sparse/mechanisms/attacks.py": [
        "tests/algorithms/test_robust.py",
        "tests/algorithms/test_fsl.py::test_reverse_attack_reverses_the_malicious_vote",
        "tests/mechanisms/test_mutation_attacks.py",
        "-k", "not engine_runs and not scale_attack and not mean_aggregator and not lr_schedules"],
    "fedjax_sparse/core/accounting.py": [
        "tests/core/test_accounting.py", "tests/models/test_layers.py::test_lenet5_caffe_shapes_costs_and_rows",
        "tests/core/test_mutation_accounting.py",
        "-k", "not spafl_flops and not metrics_jsonl"],
}
DEFAULT = ["fedjax_sparse/mechanisms/threshold_masks.py", "fedjax_sparse/mechanisms/syncdrop.py"]

CONFIG = """[tool.mutmut]
source_paths = ["fedjax_sparse"]
only_mutate = [{only}]
pytest_add_cli_args_test_selection = [{tests}]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q", "-m", "not slow"]
# JAX is not fork-safe once its backend is up: fork workers from a clean server.
process_isolation = "forkserver"
forkserver_warmup = "none"
use_git_change_detection = false
"""


def quoted(items) -> str:
    return ", ".join(f'"{item}"' for item in items)


def prepare(workdir: Path, module: str) -> None:
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "fedjax_sparse", workdir / "fedjax_sparse", ignore=ignore)
    shutil.copytree(ROOT / "tests", workdir / "tests", ignore=ignore)
    (workdir / "pyproject.toml").write_text(CONFIG.format(only=quoted([module]), tests=quoted(TARGETS[module])))


def mutmut(workdir: Path, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or "mutmut"
    env = {**os.environ, "PYTHONPATH": str(workdir)}
    return subprocess.run([exe, *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)


def results(workdir: Path) -> dict[str, str]:
    out = mutmut(workdir, "results", "--all", "true").stdout
    return dict(re.findall(r"^\s*(\S+__mutmut_\d+): (.+)$", out, flags=re.M))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help=f"modules (or 'all'); default {' '.join(DEFAULT)}")
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=1800.0, help="seconds for all modules together")
    parser.add_argument("--mutants", nargs="+", default=[],
                        help="only these mutant names (fnmatch globs, e.g. "
                             "'fedjax_sparse.mechanisms.syncdrop.x_solve_scaling*'), "
                             "to re-check earlier survivors")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "fedjax_sparse_mutation")
    args = parser.parse_args()
    modules = list(TARGETS) if args.modules == ["all"] else (args.modules or DEFAULT)
    unknown = [m for m in modules if m not in TARGETS]
    if unknown:
        parser.error(f"no test selection for {unknown}; known: {', '.join(TARGETS)}")
    deadline = time.monotonic() + args.time_limit
    any_survivor = False
    for module in modules:
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"{module}: skipped, time limit reached")
            continue
        workdir = args.workdir / Path(module).stem
        prepare(workdir, module)
        start = time.monotonic()
        try:
            run = mutmut(workdir, "run", "--max-children", str(args.max_children), *args.mutants, timeout=left)
            finished = run.returncode == 0
        except subprocess.TimeoutExpired:
            finished = False
        status = results(workdir)
        if args.mutants:
            status = {k: v for k, v in status.items() if any(fnmatch.fnmatch(k, m) for m in args.mutants)}
        counts: dict[str, int] = {}
        for value in status.values():
            counts[value] = counts.get(value, 0) + 1
        summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        print(f"{module}: {len(status)} mutants ({summary}) in {time.monotonic() - start:.0f} s"
              + ("" if finished else " [run incomplete: time limit or error]"))
        for name, value in sorted(status.items()):
            if value in ("survived", "no tests", "timeout", "suspicious"):
                any_survivor = True
                diff = mutmut(workdir, "show", name).stdout
                changed = [l for l in diff.splitlines() if l[:1] in "+-" and l[:3] not in ("---", "+++")]
                print(f"  {value}: {name}")
                for line in changed:
                    print(f"      {line.strip()}")
    return 1 if any_survivor else 0


if __name__ == "__main__":
    sys.exit(main())

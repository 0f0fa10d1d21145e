"""Checks that hand-written wrong mechanisms ("mutations") fail the tests written for them.

Each mutation replaces one exact string (that must occur exactly once) in a
copy of the package made in a temporary folder; the named tests then run
against that copy (PYTHONPATH points at it), so the working tree is never
touched. A mutation is *killed* when the tests fail. docs/testing.md lists the
mutations and the failures they gave.

    python experiments/tools/mechanism_mutations.py            # all of them
    python experiments/tools/mechanism_mutations.py M1 M4      # some
    python experiments/tools/mechanism_mutations.py --baseline # the tests pass unmutated

Runs one pytest per mutation (a few tens of seconds each on 2 CPU cores).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the repository
T = "tests/mechanisms/test_mechanisms.py::"

# name: (file, old, new, tests that must fail, what is wrong)
MUTATIONS = {
    "M1": ("fedjax_sparse/algorithms/feddrop_family.py",
           "draw_key = ctx.shared_key if synchronized else key_private_draws",
           "draw_key = ctx.key if synchronized else key_private_draws",
           [T + "test_feddrop_clients_draw_the_rounds_shared_dropout_masks"],
           "FedDrop clients draw private instead of shared dropout masks"),
    "M2": ("fedjax_sparse/algorithms/feddrop_family.py",
           "lambda x: -mu * jnp.log(flops.budget_slack(1.0 / x, 1.0 if budget is None else budget))",
           "lambda x: +mu * jnp.log(flops.budget_slack(1.0 / x, 1.0 if budget is None else budget))",
           [T + "test_barrier_sign_pushes_keep_probabilities_away_from_the_budget"],
           "sign of the FLOPs-budget log-barrier flipped"),
    "M3a": ("fedjax_sparse/algorithms/fsl_family.py",
            'weight_init="signed_constant", mask_by="abs"',
            'weight_init="signed_constant", mask_by="raw"',
            [T + "test_supermask_defaults_to_absolute_scores",
             T + "test_fsl_default_masks_by_absolute_score_on_client_and_server"],
            "FSL's default masks by raw score (FSL_OPTIONS)"),
    "M3b": ("fedjax_sparse/mechanisms/supermask.py",
            'def supermask(scores: jax.Array, fraction: float, mask_by: str = "abs")',
            'def supermask(scores: jax.Array, fraction: float, mask_by: str = "raw")',
            [T + "test_supermask_defaults_to_absolute_scores"],
            "supermask()'s default masks by raw score"),
    "M3c": ("fedjax_sparse/algorithms/fsl_family.py",
            "sm.topk_mask(jnp.abs(sm.reorder_scores(sorted_scores[name], ranking[name])), fraction)",
            "sm.topk_mask(sm.reorder_scores(sorted_scores[name], ranking[name]), fraction)",
            [T + "test_fsl_default_masks_by_absolute_score_on_client_and_server"],
            "FSL server's global mask by raw score under mask_by=abs"),
    "M3d": ("fedjax_sparse/algorithms/fsl_family.py",
            "w * sm.supermask(scores[layer], subnet_fraction, mask_by)",
            'w * sm.supermask(scores[layer], subnet_fraction, "raw")',
            [T + "test_fsl_default_masks_by_absolute_score_on_client_and_server"],
            "FSL clients train raw-score masks under mask_by=abs"),
    "M4": ("fedjax_sparse/algorithms/fsl_family.py",
           "optax.chain(optax.add_decayed_weights(weight_decay), optax.trace(decay=momentum))",
           "optax.chain(optax.trace(decay=momentum))",
           [T + "test_fsl_score_update_is_sgd_with_momentum_and_weight_decay"],
           "FSL's weight decay on the scores removed"),
    "M4b": ("fedjax_sparse/algorithms/fsl_family.py",
            "optax.chain(optax.add_decayed_weights(weight_decay), optax.trace(decay=momentum))",
            "optax.chain(optax.add_decayed_weights(weight_decay))",
            [T + "test_fsl_score_update_is_sgd_with_momentum_and_weight_decay"],
            "FSL's momentum on the scores removed"),
    "M5a": ("fedjax_sparse/algorithms/spafl_family.py",
            "opt_state = client_state.opt_state if keep_optimizer_state else optimizer.init(trainable)",
            "opt_state = optimizer.init(trainable)",
            [T + "test_spafl_momentum_persists_across_a_clients_rounds"],
            "SpaFL clients restart their optimiser state every round"),
    "M5b": ("fedjax_sparse/algorithms/spafl_family.py",
            "opt_state=opt_state if keep_optimizer_state else None,",
            "opt_state=client_state.opt_state if keep_optimizer_state else None,",
            [T + "test_spafl_momentum_persists_across_a_clients_rounds"],
            "SpaFL's trained optimiser state is not written back to the client state"),
    "M5c": ("fedjax_sparse/algorithms/spafl_family.py",
            "momentum=0.9, keep_optimizer_state=True",
            "momentum=0.9, keep_optimizer_state=False",
            [T + "test_spafl_momentum_persists_across_a_clients_rounds"],
            "SpaFL's default does not keep optimiser state"),
}


def run_tests(package_root: Path, tests: list[str]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests],
                          cwd=package_root, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def failures(output: str) -> list[str]:
    """The failed tests (pytest -rf's "FAILED" lines) and the first error line of the output."""
    errors = [l[1:].strip() for l in output.splitlines() if l.startswith("E ") and l[1:].strip()]
    failed = [l[len("FAILED "):].split(" - ")[0] for l in output.splitlines() if l.startswith("FAILED ")]
    return failed + ["first error: " + (errors[0][:300] if errors else "?")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"mutations to run (default all: {', '.join(MUTATIONS)})")
    parser.add_argument("--baseline", action="store_true", help="run the tests once without any mutation")
    args = parser.parse_args()
    names = args.names or list(MUTATIONS)
    survived = 0
    with tempfile.TemporaryDirectory(prefix="mechanism_mutations_") as tmp:
        copy = Path(tmp)
        shutil.copytree(ROOT / "tests", copy / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        (copy / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
        if args.baseline:
            shutil.copytree(ROOT / "fedjax_sparse", copy / "fedjax_sparse")
            tests = sorted({t for m in MUTATIONS.values() for t in m[3]})
            code, out = run_tests(copy, tests)
            print("baseline:", "PASS" if code == 0 else "FAIL\n" + out)
            return code
        for name in names:
            path, old, new, tests, what = MUTATIONS[name]
            if (copy / "fedjax_sparse").exists():
                shutil.rmtree(copy / "fedjax_sparse")
            shutil.copytree(ROOT / "fedjax_sparse", copy / "fedjax_sparse",
                            ignore=shutil.ignore_patterns("__pycache__"))
            source = (copy / path).read_text()
            if source.count(old) != 1:
                print(f"{name}: the string to mutate occurs {source.count(old)} times in {path}; update the script")
                return 2
            (copy / path).write_text(source.replace(old, new))
            code, out = run_tests(copy, tests)
            killed = code != 0
            survived += not killed
            print(f"{name} ({what}): {'KILLED' if killed else 'SURVIVED'}")
            for line in failures(out):
                print("    " + line)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())

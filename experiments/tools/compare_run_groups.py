"""Per-round accuracy of groups of runs side by side: mean +- std over each group's seeds.

    python experiments/tools/compare_run_groups.py \\
        --group "ours, own draws" RUN_DIR ... \\
        --group "ours, authors' draws" RUN_DIR ... \\
        --group "authors' code, authors' draws" AUTHORS_DIR ... \\
        --rounds 10 20 30 40 50 --out OUT_STEM

A run folder is either this project's (``metrics.jsonl``; accuracy is a fraction,
reported in percent) or one written by the authors'-code drivers of
``experiments/tools/sidebyside/`` (``curve.json``, accuracy already in percent); both are
read by ``fedjax_sparse.tools.sidebyside.read_ours`` / ``read_authors``. A run without a given
round (evaluated less often, or stopped early) does not count at that round, so
``n`` can differ per round. Writes ``OUT_STEM.json`` (every group's per-seed values
and mean, std (ddof 1), n per round) and ``OUT_STEM.md`` (the table).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedjax_sparse.tools.sidebyside import at_round, read_authors, read_ours, summarise


def read_run(folder: Path) -> dict:
    if (folder / "curve.json").exists():
        return read_authors(folder)
    if (folder / "metrics.jsonl").exists():
        return read_ours(folder)
    raise FileNotFoundError(f"{folder}: neither metrics.jsonl (a project run) nor curve.json (an authors' run)")


def compare(groups: list[tuple[str, list[Path]]], rounds: list[int]) -> dict:
    out: dict = {"rounds": rounds, "groups": []}
    for name, folders in groups:
        runs = [read_run(f) for f in folders]
        per_seed = [{"source": r["source"], "seed": r["seed"],
                     "accuracy": {str(k): at_round(r, k) for k in rounds}} for r in runs]
        stats = {str(k): summarise([v for v in (at_round(r, k) for r in runs) if v is not None])
                 for k in rounds}
        out["groups"].append({"name": name, "runs": per_seed, "accuracy": stats})
    return out


def markdown(result: dict) -> str:
    rounds = result["rounds"]
    lines = ["| group | " + " | ".join(f"round {k}" for k in rounds) + " |",
             "|---|" + "---|" * len(rounds)]
    for g in result["groups"]:
        cells = []
        for k in rounds:
            s = g["accuracy"][str(k)]
            if s["n"] == 0:
                cells.append("–")
            elif s["std"] is None:
                cells.append(f"{s['mean']:.1f} (1)")
            else:
                cells.append(f"{s['mean']:.1f} ± {s['std']:.1f} ({s['n']})")
        lines.append(f"| {g['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nAccuracy in percent, mean ± std (ddof 1) over runs (n).\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group", nargs="+", action="append", required=True, metavar=("NAME", "RUN_DIR"),
                    help="a name, then the group's run folders")
    ap.add_argument("--rounds", nargs="+", type=int, default=[10, 20, 30, 40, 50])
    ap.add_argument("--out", type=Path, required=True, help="output stem: writes STEM.json and STEM.md")
    args = ap.parse_args(argv)
    groups = []
    for spec in args.group:
        if len(spec) < 2:
            ap.error(f"--group {spec[0]!r} names no run folder")
        groups.append((spec[0], [Path(p) for p in spec[1:]]))
    result = compare(groups, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

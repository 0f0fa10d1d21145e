"""Every recorded result under experiments/results/ still reads: each ``config.json`` as a RunConfig
(validated as ``run`` would; recorded ones hold execution keys of earlier versions at their inert
values), each run folder through ``report``'s and the studies' readers (metrics, summary, recorded
masks). The compatibility code kept in the package is what this needs (issue 49 item 4); no checkpoint
is recorded there."""
import json
from pathlib import Path

import pytest

from fedjax_sparse.tools import reporting
from fedjax_sparse.papers import studies
from fedjax_sparse.driver.checkpoint import CHECKPOINT_DIR, LEGACY_CHECKPOINT
from fedjax_sparse.driver.config import RunConfig, validate

RESULTS = Path(__file__).resolve().parents[2] / "experiments" / "results"
CONFIGS = sorted(RESULTS.rglob("config.json"))


@pytest.mark.fast
def test_every_recorded_config_reads_and_validates():
    assert len(CONFIGS) > 100, "the recorded runs moved"
    for path in CONFIGS:
        config = RunConfig.from_json(json.loads(path.read_text())["config"])
        validate(config)


@pytest.mark.fast
def test_every_recorded_run_folder_reads():
    folders = sorted({p.parent for p in RESULTS.rglob("metrics.jsonl")})
    assert folders
    for folder in folders:
        record = reporting.load_run(folder)
        assert record.rows, folder
        if record.config.get("dp_clip") is not None:
            # Recorded DP summaries predate dp_accountant: the accountant is read from the config.
            assert record.dp["dp_accountant"] in ("rdp", "pld"), folder
        run = studies.load_run(folder)
        assert run is not None and run["rows"] == record.rows, folder
    assert len(folders) > 100, "the recorded runs moved"
    checkpoints = [*RESULTS.rglob(CHECKPOINT_DIR), *RESULTS.rglob(LEGACY_CHECKPOINT)]
    assert not checkpoints, "a recorded checkpoint: read it here too"

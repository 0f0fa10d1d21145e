"""SpaFL on Fashion-MNIST: the paper's Table 1/2/3 FMNIST column, several seeds.

    python experiments/reproduce/spafl_fmnist.py --data-dir ../shared/data --rounds 500 --seeds 0 1 2 \\
        --out experiments/results/spafl_fmnist

Setting (paper Sec. 5.1 / Appendix A.1 and the reference code): 100 clients,
Dirichlet(0.2) label skew that also splits the test set (each client is
tested on its own label mix), every client >= batch-size samples, 10 clients
per round, 5 local epochs, batch 64, LeNet-5-Caffe, SGD lr 0.001 momentum 0.9,
raw 0-255 inputs, alpha 0.002 with the code's regulariser ramp, 500 rounds,
every client evaluated after every round (unweighted mean).

Methods (``--methods``): ``spafl``, ``spafl_no_eq13`` (Table 3),
``spafl_thresholds_only`` (Table 1), ``fedavg`` (dense, equal-weight mean,
momentum 0.9) and ``local`` (the paper's "Local": SpaFL's pruning without
any communication, i.e. ``spafl_local``); ``local_dense`` runs the engine's
plain Local training for reference. Table 2's baselines ``fedpm``,
``heterofl`` and ``fjord`` (docs/baselines.md) run with Table 7's learning
rates (0.15, 0.001, 0.01).

Each (method, seed) is one ``fjs.run`` into
``OUT/<method>/seed<k>/`` (config.json, metrics.jsonl, summary.json); runs
with a summary.json are skipped, interrupted ones resume from their
checkpoint; a run whose loss turns NaN/inf gets ``diverged.json``, the study
goes on, reruns skip it and the report counts it apart ("2 (+1 diverged)")
and out of the means (``--replicas`` runs stop at the first divergence, as
before). ``--replicas sequential|vmap|auto`` runs each method's seeds as
replicas in one process (``fedjax_sparse.driver.replicas``: the same files and
numbers, one compiled program for all seeds). For the SpaFL family a callback records, after every
evaluation, every client's conv1 row mask and density (``spafl_masks.npz``):
the paper's density is the mean over *all* clients of their mean per-layer
kept fraction. At the end: ``OUT/results.md`` / ``results.json`` (accuracy
mean ± std over seeds, best round and final; total Gbit; total FLOPs;
density; next to the paper's numbers), ``learning_curves.png`` and
``sparsity_pattern_conv1.png`` (Fig. 3 of the paper: active conv1 filters of
every client at three rounds). ``--report-only`` rebuilds these from OUT.

FLOPs: ours count a multiply-accumulate as 2 FLOPs and sum over all sampled
clients; the paper counts MACs and reports the mean per client (its code
divides by the 100 clients), so "paper convention" = ours / (2 * N).
"""
from __future__ import annotations

import sys

from fedjax_sparse import papers
from fedjax_sparse.papers import studies

# The setting and its methods: fedjax_sparse.papers (SPAFL_FMNIST_*); running and reporting a study
# over seeds: fedjax_sparse.papers.studies.
STUDIES = {"fmnist": papers.SPAFL_FMNIST_STUDY}


def main(argv=None) -> int:
    return studies.main(argv, studies=STUDIES, default_study="fmnist", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())

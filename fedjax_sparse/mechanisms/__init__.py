"""The papers' mechanisms as pure array functions (jit/vmap/grad-friendly), with no engine types.

* ``threshold_masks``: SpaFL's trainable-threshold row masks and their straight-through estimators.
* ``syncdrop``: FedDrop's SyncDrop channel dropout (shared uniforms, per-client keep probabilities),
  its FLOPs model (``SparseFlopsModel``, eq. 9-10) and the dropout-aware initialisation (Thm. 1).
* ``supermask``: FSL's supermasks (frozen weights, scores, top-k masks), rankings, VOTE and rank bits.
* ``robust_aggregation``: Trimmed-mean, Multi-Krum, SignSGD's majority vote, TopK sparsification.
* ``widths``: width scaling (HeteroFL, FjORD): nested sub-models of the first ``ceil(p C)`` channels
  of every layer, sliced out or masked, with their exact bits and FLOPs (``WidthLayout``).
* ``attacks``: the threat model (``Threat``: which clients are malicious, what they know) and the
  poisoning attacks (min-max, DYN-OPT against Trimmed-mean / Multi-Krum, scaling, SignSGD's sign
  reversal, FSL's ranking reversal).

Nothing here imports ``fedjax_sparse.algorithms``, ``engine``, ``runner`` or ``data``; the
algorithms build on these modules.
"""
from fedjax_sparse.mechanisms import attacks, robust_aggregation, supermask, syncdrop, threshold_masks, widths

__all__ = ["attacks", "robust_aggregation", "supermask", "syncdrop", "threshold_masks", "widths"]

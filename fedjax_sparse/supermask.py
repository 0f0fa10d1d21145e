"""Moved to :mod:`fedjax_sparse.mechanisms.supermask`; this module re-exports it so old imports keep working."""
from fedjax_sparse.mechanisms.supermask import *  # noqa: F401,F403
from fedjax_sparse.mechanisms.supermask import (  # noqa: F401
    BISECT_MAX_KEYS, MASK_BY, MIB_BITS, WEIGHT_INITS, argsort, frozen_weights, initial_scores, kept_count,
    kth_largest_key, mask_from_ranking, mebibytes, order_keys, rank_bits, ranking, ranking_bits, reorder_scores,
    reputations,
    reverse_ranking, sparse_reputations, straight_through_topk, supermask, supernet_from_seed,
    top_of_ranking, topk_mask, vote, vote_sparse)
from fedjax_sparse.mechanisms.supermask import __all__  # noqa: F401

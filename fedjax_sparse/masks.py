"""Moved to :mod:`fedjax_sparse.mechanisms.threshold_masks`; this module re-exports it so old imports keep working."""
from fedjax_sparse.mechanisms.threshold_masks import *  # noqa: F401,F403
from fedjax_sparse.mechanisms.threshold_masks import (  # noqa: F401
    RESET_KEPT_FRACTION, STE_ESTIMATORS, apply_row_mask, kept_fraction, reset_thresholds, row_mean_abs,
    row_sum, step_ste, threshold_row_mask)
from fedjax_sparse.mechanisms.threshold_masks import __all__  # noqa: F401

"""Moved to :mod:`fedjax_sparse.mechanisms.syncdrop`; this module re-exports it so old imports keep working."""
from fedjax_sparse.mechanisms.syncdrop import *  # noqa: F401,F403
from fedjax_sparse.mechanisms.syncdrop import (  # noqa: F401
    ChannelLayout, INIT_SCHEMES, SparseFlopsModel, channel_scale_hooks, channel_uniforms, dropout_aware_init,
    dropout_scale, keep_mask, solve_scaling, syncdrop)
from fedjax_sparse.mechanisms.syncdrop import __all__  # noqa: F401

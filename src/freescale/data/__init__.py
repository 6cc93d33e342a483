"""Data layer: the jagged batch type, synthetic and MovieLens-format sources, load-time
validation and the prefetching loader. See ``docs/data.md``."""

from freescale.data.batch import JaggedBatch, lengths_to_offsets
from freescale.data.loader import LoaderError, PrefetchingLoader
from freescale.data.movielens import MovieLensSource, load_interactions
from freescale.data.synthetic import (
    SyntheticSource,
    local_range,
    normalized_entropy,
    oracle_ne,
)
from freescale.data.validate import BadInputError, truncate_uih, validate_batch

__all__ = [
    "JaggedBatch",
    "lengths_to_offsets",
    "SyntheticSource",
    "local_range",
    "normalized_entropy",
    "oracle_ne",
    "MovieLensSource",
    "load_interactions",
    "PrefetchingLoader",
    "LoaderError",
    "BadInputError",
    "truncate_uih",
    "validate_batch",
]

"""Balanced data: length statistics -> balanced packs of a fixed shape -> sampler and collator.

See :mod:`.lengths` (loading), :mod:`.isf` (OmniBal's ISF), :mod:`.balance` (ours),
:mod:`.metrics` (Pad/Dist Ratios), :mod:`.sampler`, :mod:`.collate` and :mod:`.plan`.
"""

from omnibal_compile.data.balance import balance_pack, balanced_partition
from omnibal_compile.data.collate import MODEL_KEYS, PackingCollator, synthetic_sample
from omnibal_compile.data.data_plan import DataOptions, DataPlan, plan_data
from omnibal_compile.data.isf import IsfSearch, isf_pack, isf_search
from omnibal_compile.data.lengths import (
    INTERNVL_TOKENS_PER_TILE,
    LengthStats,
    bundled_length_files,
    load_lengths,
    scale_lengths,
)
from omnibal_compile.data.metrics import BalanceMetrics, ShapeCost, balance_metrics, dist_ratio, shape_model_cost
from omnibal_compile.data.packing import (
    OVERSIZED_POLICIES,
    Packing,
    PackShape,
    length_grouped_batches,
    random_batches,
)
from omnibal_compile.data.sampler import BalancedBatchSampler

__all__ = [
    "LengthStats", "load_lengths", "scale_lengths", "bundled_length_files", "INTERNVL_TOKENS_PER_TILE",
    "PackShape", "Packing", "OVERSIZED_POLICIES", "random_batches", "length_grouped_batches",
    "isf_pack", "isf_search", "IsfSearch", "balance_pack", "balanced_partition",
    "BalanceMetrics", "ShapeCost", "balance_metrics", "dist_ratio", "shape_model_cost",
    "BalancedBatchSampler", "PackingCollator", "MODEL_KEYS", "synthetic_sample",
    "DataOptions", "DataPlan", "plan_data",
]

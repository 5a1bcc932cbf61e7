"""Losses for post-training, each a pure function returning unreduced values.

Data arrays come first, then keyword-only hyperparameters, then `where` (True = counts). Reduce
per-token values with `aggregate`, which returns a numerator and a denominator so that gradient
accumulation and data parallelism give exactly the full-batch result.
"""

from tunelib.losses._aggregation import AGGREGATION_MODES, Aggregate, aggregate
from tunelib.losses._aot import aot_loss
from tunelib.losses._distillation import (
    forward_kl_loss,
    generalized_jsd_loss,
    reverse_kl_loss,
    soft_hard_distillation_loss,
    teacher_argmax_loss,
    teacher_top_k,
    top_k_forward_kl_loss,
)
from tunelib.losses._dpo import dpo_loss, length_normalized_dpo_loss, robust_dpo_loss
from tunelib.losses._dpo_margin import discopop_loss, exo_loss, hinge_loss, ipo_loss
from tunelib.losses._dpo_per_response import (
    apo_down_loss,
    apo_zero_loss,
    bco_pair_loss,
    nca_loss,
    sppo_hard_loss,
)
from tunelib.losses._entropy import (
    EntropyStatistics,
    entropy_bonus,
    entropy_statistics,
    high_entropy_mask,
)
from tunelib.losses._feature_matching import attention_output_matching_loss, feature_matching_loss
from tunelib.losses._fused_distillation import fused_distillation_loss
from tunelib.losses._kl import KL_ESTIMATORS, kl_penalty, kl_reward_shaping
from tunelib.losses._kto import kto_loss, kto_reference_point
from tunelib.losses._off_policy import truncated_importance_weights
from tunelib.losses._policy_gradient import (
    RATIO_LEVELS,
    cispo_loss,
    importance_ratio,
    policy_gradient_loss,
    sapo_loss,
)
from tunelib.losses._preference_diagnostics import (
    implicit_rewards,
    preference_accuracy,
    reward_margins,
)
from tunelib.losses._reference_free import cpo_loss, orpo_log_odds_ratio, orpo_loss, simpo_loss
from tunelib.losses._reward_model import bradley_terry_loss
from tunelib.losses._rl_diagnostics import (
    ApproxKL,
    ClipFractions,
    RatioStatistics,
    approx_kl,
    clip_fractions,
    ratio_statistics,
)
from tunelib.losses._sft import nll_loss
from tunelib.losses._value import value_loss

__all__ = [
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "RATIO_LEVELS",
    "Aggregate",
    "ApproxKL",
    "ClipFractions",
    "EntropyStatistics",
    "RatioStatistics",
    "aggregate",
    "aot_loss",
    "apo_down_loss",
    "apo_zero_loss",
    "approx_kl",
    "attention_output_matching_loss",
    "bco_pair_loss",
    "bradley_terry_loss",
    "cispo_loss",
    "clip_fractions",
    "cpo_loss",
    "discopop_loss",
    "dpo_loss",
    "entropy_bonus",
    "entropy_statistics",
    "exo_loss",
    "feature_matching_loss",
    "forward_kl_loss",
    "fused_distillation_loss",
    "generalized_jsd_loss",
    "high_entropy_mask",
    "hinge_loss",
    "implicit_rewards",
    "importance_ratio",
    "ipo_loss",
    "kl_penalty",
    "kl_reward_shaping",
    "kto_loss",
    "kto_reference_point",
    "length_normalized_dpo_loss",
    "nca_loss",
    "nll_loss",
    "orpo_log_odds_ratio",
    "orpo_loss",
    "policy_gradient_loss",
    "preference_accuracy",
    "ratio_statistics",
    "reverse_kl_loss",
    "reward_margins",
    "robust_dpo_loss",
    "sapo_loss",
    "simpo_loss",
    "soft_hard_distillation_loss",
    "sppo_hard_loss",
    "teacher_argmax_loss",
    "teacher_top_k",
    "top_k_forward_kl_loss",
    "truncated_importance_weights",
    "value_loss",
]

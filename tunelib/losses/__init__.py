"""Losses for post-training, each a pure function returning unreduced values.

Data arrays come first, then keyword-only hyperparameters, then `where` (True = counts). Reduce
per-token values with `aggregate`, which returns a numerator and a denominator so that gradient
accumulation and data parallelism give exactly the full-batch result. The files follow the
families: the DPO family against a reference model, a link of a pair's log-ratios each
(`_dpo_family.py`): on the margin (`_dpo.py`), on each log-ratio (`_dpo_anchored.py`), on the
batch's sorted log-ratios (`_dpo_aot.py`), and its f-divergence and length-desensitised variants
(`_dpo_variants.py`), WPO's pair weights
(`_preference_weighting.py`), reference-free preference losses (`_reference_free.py`),
unpaired feedback (`_kto.py`), reward models (`_reward_model.py`); RL objectives
(`_policy_gradient.py`, `_sequence_policy.py`, `_kl.py`, `_value.py`, `_entropy.py`,
`_off_policy.py`, `_rollout_correction.py`); SFT (`_sft.py`); distillation (`_distillation.py`,
`_feature_matching.py`); mixture-of-experts routers (`_router.py`); and `_aggregation.py`.
Diagnostics are in `tunelib.metrics`.
"""

from tunelib._deprecation import moved_names
from tunelib.losses._aggregation import AGGREGATION_MODES, Aggregate, aggregate
from tunelib.losses._deprecated import fused_distillation_loss  # noqa: F401 (deprecated)
from tunelib.losses._distillation import (
    forward_kl_loss,
    generalized_jsd_loss,
    reverse_kl_loss,
    soft_hard_distillation_loss,
    teacher_argmax_loss,
    teacher_top_k,
    top_k_forward_kl_loss,
)
from tunelib.losses._dpo import (
    discopop_loss,
    dpo_loss,
    exo_loss,
    hinge_loss,
    ipo_loss,
    length_normalized_dpo_loss,
    robust_dpo_loss,
)
from tunelib.losses._dpo_anchored import (
    apo_down_loss,
    apo_zero_loss,
    bco_pair_loss,
    nca_loss,
    sppo_hard_loss,
)
from tunelib.losses._dpo_aot import aot_loss
from tunelib.losses._dpo_variants import (
    F_DPO_DIVERGENCES,
    f_dpo_loss,
    f_dpo_scores,
    length_desensitized_dpo_loss,
    length_desensitized_logps,
)
from tunelib.losses._entropy import entropy_bonus
from tunelib.losses._feature_matching import attention_output_matching_loss, feature_matching_loss
from tunelib.losses._kl import KL_ESTIMATORS, kl_penalty
from tunelib.losses._kto import kto_loss, kto_reference_point
from tunelib.losses._off_policy import off_policy_sequence_mask, truncated_importance_weights
from tunelib.losses._policy_gradient import (
    RATIO_LEVELS,
    cispo_loss,
    importance_ratio,
    policy_gradient_loss,
    sapo_loss,
)
from tunelib.losses._preference_weighting import wpo_weights
from tunelib.losses._reference_free import cpo_loss, orpo_log_odds_ratio, orpo_loss, simpo_loss
from tunelib.losses._reward_model import bradley_terry_loss
from tunelib.losses._rollout_correction import (
    ROLLOUT_CORRECTIONS,
    CorrectedRollouts,
    RolloutCorrection,
    rollout_correction,
)
from tunelib.losses._router import load_balancing_loss, router_z_loss
from tunelib.losses._sequence_policy import luspo_loss, vespo_loss
from tunelib.losses._sft import nll_loss
from tunelib.losses._value import value_loss

# Names that moved to the packages of their role; served from here until tunelib 0.3.0.
__getattr__ = moved_names(
    __name__,
    {
        **{
            name: ("tunelib.metrics", name)
            for name in (
                "ApproxKL",
                "ClipFractions",
                "EntropyStatistics",
                "RatioStatistics",
                "approx_kl",
                "clip_fractions",
                "entropy_statistics",
                "implicit_rewards",
                "preference_accuracy",
                "ratio_statistics",
                "reward_margins",
            )
        },
        "high_entropy_mask": ("tunelib.advantages", "high_entropy_mask"),
        "kl_reward_shaping": ("tunelib.advantages", "kl_reward_shaping"),
    },
)

__all__ = [
    "AGGREGATION_MODES",
    "F_DPO_DIVERGENCES",
    "KL_ESTIMATORS",
    "RATIO_LEVELS",
    "ROLLOUT_CORRECTIONS",
    "Aggregate",
    "CorrectedRollouts",
    "RolloutCorrection",
    "aggregate",
    "aot_loss",
    "apo_down_loss",
    "apo_zero_loss",
    "attention_output_matching_loss",
    "bco_pair_loss",
    "bradley_terry_loss",
    "cispo_loss",
    "cpo_loss",
    "discopop_loss",
    "dpo_loss",
    "entropy_bonus",
    "exo_loss",
    "f_dpo_loss",
    "f_dpo_scores",
    "feature_matching_loss",
    "forward_kl_loss",
    "generalized_jsd_loss",
    "hinge_loss",
    "importance_ratio",
    "ipo_loss",
    "kl_penalty",
    "kto_loss",
    "kto_reference_point",
    "length_desensitized_dpo_loss",
    "length_desensitized_logps",
    "length_normalized_dpo_loss",
    "load_balancing_loss",
    "luspo_loss",
    "nca_loss",
    "nll_loss",
    "off_policy_sequence_mask",
    "orpo_log_odds_ratio",
    "orpo_loss",
    "policy_gradient_loss",
    "reverse_kl_loss",
    "robust_dpo_loss",
    "rollout_correction",
    "router_z_loss",
    "sapo_loss",
    "simpo_loss",
    "soft_hard_distillation_loss",
    "sppo_hard_loss",
    "teacher_argmax_loss",
    "teacher_top_k",
    "top_k_forward_kl_loss",
    "truncated_importance_weights",
    "value_loss",
    "vespo_loss",
    "wpo_weights",
]

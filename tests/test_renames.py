"""Every renamed argument and moved name of the losses, log-probs, metrics, advantages, models
and data keeps working until tunelib 0.3.0: the old form warns and gives the same result as the
new one."""

import importlib

import numpy as np
import pytest

from tests._helpers import assert_close
from tunelib import advantages, logprobs, losses

RNG = np.random.default_rng(0)
PAIR = [RNG.uniform(-20, -1, 3).astype(np.float32) for _ in range(4)]
MEANS = [RNG.uniform(-3, -0.1, 3).astype(np.float32) for _ in range(2)]
TOKENS = [RNG.uniform(-3, -0.1, (2, 4)).astype(np.float32) for _ in range(3)]
LOGITS = [RNG.normal(size=(2, 4, 5)).astype(np.float32) for _ in range(2)]
TARGETS = np.array([[0, 4, 2, 1], [3, 3, 0, 1]])

# (function, positional data, fixed keywords, old name, new name, value)
ARGUMENTS = [
    (losses.exo_loss, PAIR, {}, "epsilon", "label_smoothing", 0.05),
    (losses.simpo_loss, MEANS, {}, "gamma", "margin", 0.7),
    (losses.cpo_loss, PAIR[:2], {}, "alpha", "nll_weight", 0.3),
    (losses.orpo_loss, MEANS, {}, "lambda_", "odds_ratio_weight", 0.4),
    (losses.bradley_terry_loss, MEANS, {}, "center_coefficient", "centering_weight", 0.01),
    (losses.entropy_bonus, TOKENS[:1], {}, "coefficient", "entropy_weight", 0.02),
    (losses.generalized_jsd_loss, LOGITS, {}, "beta", "mix", 0.3),
    (losses.soft_hard_distillation_loss, LOGITS, {}, "alpha", "soft_weight", 0.8),
    (losses.soft_hard_distillation_loss, LOGITS, {"divergence": "jsd"}, "beta", "mix", 0.2),
    (losses.soft_hard_distillation_loss, LOGITS, {}, "labels", "targets", TARGETS),
    (advantages.kl_reward_shaping, TOKENS, {}, "beta", "kl_coef", 0.1),
]


@pytest.mark.parametrize(
    ("fn", "data", "fixed", "old", "new", "value"),
    ARGUMENTS,
    ids=[f"{a[0].__name__}-{a[3]}" for a in ARGUMENTS],
)
def test_renamed_argument_still_works_and_warns(fn, data, fixed, old, new, value):
    with pytest.warns(DeprecationWarning, match=f"{old}=.*0.3.0.*{new}="):
        before = fn(*data, **fixed, **{old: value})
    after = fn(*data, **fixed, **{new: value})
    np.testing.assert_array_equal(before, after)
    with pytest.raises(TypeError, match=old):
        fn(*data, **fixed, **{old: value, new: value})


def test_value_loss_clip_epsilon_is_both_clip_bounds():
    with pytest.warns(DeprecationWarning, match="clip_epsilon"):
        before = losses.value_loss(*TOKENS, clip_epsilon=0.1)
    after = losses.value_loss(*TOKENS, epsilon_low=0.1, epsilon_high=0.1)
    np.testing.assert_array_equal(before, after)
    with pytest.warns(DeprecationWarning):
        unclipped = losses.value_loss(*TOKENS, clip_epsilon=None)
    np.testing.assert_array_equal(
        unclipped, losses.value_loss(*TOKENS, epsilon_low=None, epsilon_high=None)
    )
    with pytest.raises(TypeError, match="clip_epsilon"):
        losses.value_loss(*TOKENS, clip_epsilon=0.1, epsilon_high=0.2)


MOVED = [
    *[
        ("tunelib.losses", name, "tunelib.metrics")
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
    ],
    ("tunelib.losses", "high_entropy_mask", "tunelib.advantages"),
    ("tunelib.losses", "kl_reward_shaping", "tunelib.advantages"),
    ("tunelib.advantages", "AdvantageStatistics", "tunelib.metrics"),
    ("tunelib.advantages", "advantage_statistics", "tunelib.metrics"),
    ("tunelib.advantages", "zero_std_fraction", "tunelib.metrics"),
    *[
        ("tunelib.models", name, "tunelib.formats")
        for name in (
            "COPIED_FILES",
            "GGUF_ARCHITECTURES",
            "GGUF_TENSOR_TYPES",
            "MODEL_TYPES",
            "GGUFModel",
            "GGUFTensor",
            "HFCheckpoint",
            "config_from_hf",
            "config_to_hf",
            "convert_gguf",
            "gguf_raw_tensors",
            "gguf_tensors",
            "load_gguf",
            "load_hf_checkpoint",
            "read_gguf",
            "save_gguf",
            "save_hf_checkpoint",
        )
    ],
    ("tunelib.data", "gguf_tokenizer", "tunelib.formats"),
    ("tunelib.data", "gguf_tokenizer_metadata", "tunelib.formats"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED, ids=[f"{m[0]}.{m[1]}" for m in MOVED])
def test_moved_name_is_served_from_its_old_place_with_a_warning(old, name, new):
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} .*{new}.{name}"):
        served = getattr(old_module, name)
    # The very same object, so every result is the same.
    assert served is getattr(new_module, name)
    assert name not in old_module.__all__ and name in new_module.__all__


def test_moved_kl_reward_shaping_with_its_old_argument():
    with pytest.warns(DeprecationWarning) as caught:
        before = losses.kl_reward_shaping(*TOKENS, beta=0.2)
    assert len(caught) == 2  # the move and the rename
    np.testing.assert_array_equal(before, advantages.kl_reward_shaping(*TOKENS, kl_coef=0.2))


def test_fused_distillation_loss_is_tau_squared_times_the_fused_divergence():
    rng = np.random.default_rng(1)
    h_s, w_s = (
        rng.normal(size=(3, 4)).astype(np.float32),
        rng.normal(size=(4, 7)).astype(np.float32),
    )
    h_t, w_t = (
        rng.normal(size=(3, 2)).astype(np.float32),
        rng.normal(size=(2, 7)).astype(np.float32),
    )
    heads = (h_s, w_s, h_t, w_t)
    with pytest.warns(DeprecationWarning, match="fused_distillation_loss.*fused_divergence"):
        old = losses.fused_distillation_loss(*heads, divergence="jsd", beta=0.3, temperature=2.0)
    new = logprobs.fused_divergence(*heads, divergence="jsd", mix=0.3, temperature=2.0)
    assert_close(old, 4.0 * np.asarray(new), rtol=1e-6)
    materialised = losses.generalized_jsd_loss(h_s @ w_s, h_t @ w_t, mix=0.3, temperature=2.0)
    assert_close(old, materialised, rtol=1e-5, atol=1e-6)
    with pytest.warns(DeprecationWarning):
        unscaled = losses.fused_distillation_loss(
            *heads, divergence="jsd", beta=0.3, temperature=2.0, temperature_squared=False
        )
    np.testing.assert_array_equal(unscaled, new)
    assert "fused_distillation_loss" not in losses.__all__

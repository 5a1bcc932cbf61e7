"""`kit.grpo`: the settings `--is-correction` names, and the GRPO objective's use of them."""

import typing

import numpy as np
import pytest

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)
from tests._helpers import assert_close
from tunelib import losses

from kit import grpo
from kit.grpo_config import GRPOConfig


def test_every_correction_the_flag_offers_is_a_setting():
    names = typing.get_args(typing.get_type_hints(GRPOConfig)["is_correction"])
    assert set(names) == {"auto", "none", "tis", *losses.ROLLOUT_CORRECTIONS}
    assert grpo.rollout_correction("none", 2.0) is None
    assert grpo.rollout_correction("tis", 1.5) == losses.RolloutCorrection("token", 1.5)
    for name, preset in losses.ROLLOUT_CORRECTIONS.items():
        assert grpo.rollout_correction(name, 1.5) is preset  # a preset ignores --is-cap


def _batch(rng, b=4, t=5):
    where = np.arange(t)[None, :] < rng.integers(1, t + 1, (b, 1))
    logps = rng.uniform(-3, 0, (b, t)).astype(np.float32)
    return {
        "where": where,
        "keep": np.array([True, True, False, True]),
        "advantages": rng.normal(size=b).astype(np.float32),
        "old": (logps + rng.normal(0, 0.1, (b, t))).astype(np.float32),
        "logps": (logps + rng.normal(0, 0.1, (b, t))).astype(np.float32),
    }


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_rejected_tokens_leave_the_loss_and_its_means(aggregation):
    """A batch with a correction's kept mask and weights gives the loss of the same batch
    whose mask is the kept one, each token's term times its weight."""
    rng = np.random.default_rng(0)
    batch = _batch(rng)
    token_logps = rng.uniform(-3, 0, batch["where"].shape).astype(np.float32)
    entropy = np.ones_like(token_logps)
    settings = dict(
        aggregation=aggregation, epsilon_low=0.2, epsilon_high=0.2, kl_coef=0.0, max_length=5
    )
    is_keep = batch["where"] & (rng.uniform(size=batch["where"].shape) < 0.7)
    weights = np.where(is_keep, rng.uniform(0.5, 2.0, is_keep.shape), 0.0).astype(np.float32)
    corrected, _ = grpo.objective(
        token_logps, entropy, None, {**batch, "is_keep": is_keep, "is_weights": weights},
        **settings,
    )  # fmt: skip
    where = batch["where"] & batch["keep"][:, None] & is_keep
    per_token = losses.policy_gradient_loss(
        token_logps, batch["old"], batch["advantages"], epsilon_low=0.2, epsilon_high=0.2,
        where=where,
    ) * weights  # fmt: skip
    expected = losses.aggregate(per_token, mode=aggregation, where=where).mean()
    assert_close(corrected, expected, rtol=1e-6)
    plain, _ = grpo.objective(token_logps, entropy, None, batch, **settings)
    assert abs(float(plain) - float(corrected)) > 1e-4  # the correction changed the loss

r"""Rollout correction: importance weights and rejection for tokens the sampler drew.

One setting, `RolloutCorrection`, holds the two mechanisms the anchors combine: truncated
importance weights that reweight the policy loss, and rejection that removes tokens or whole
sequences from it (and from its denominators); named presets reproduce the published
settings. `truncated_importance_weights` (`_off_policy.py`) is the weights alone.
"""

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from tunelib import _validation as v
from tunelib._typing import Mask

WeightLevel = Literal["token", "sequence"]
RejectLevel = Literal["token", "sequence", "geometric"]


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    r"""How to correct a batch for the sampler's policy: importance weights, rejection, veto.

    With $\log \rho_t = \log \pi_{\mathrm{train}}(y_t) - \log \pi_{\mathrm{sampler}}(y_t)$ on
    the valid tokens of a sequence $i$, a level's log-ratio is $\log \rho_t$ (``"token"``),
    $\sum_t \log \rho_t$ (``"sequence"``) or $\frac{1}{|y_i|} \sum_t \log \rho_t$
    (``"geometric"``, the geometric mean of the token ratios), the same on every token of
    the sequence for the last two.

    Attributes:
      weight_level: ``"token"`` or ``"sequence"``: the importance weight $w = \min(\rho, C)$
        at that level; None: every kept token weighs 1 (rejection alone).
      weight_cap: $C > 0$.
      reject_level: ``"token"``, ``"sequence"`` or ``"geometric"``: keep a token only where
        its level's ratio lies in $[\rho_{\min}, \rho_{\max}]$; None: no rejection.
      reject_upper: $\rho_{\max} > 0$.
      reject_lower: $\rho_{\min} \ge 0$, at most $\rho_{\max}$; None: $1 / \rho_{\max}$.
      veto: reject a whole sequence when one of its tokens has $\rho_t$ below this (a
        token the trainer finds that many times less likely than the sampler did); None: no
        veto.
    """

    weight_level: WeightLevel | None = "token"
    weight_cap: float = 2.0
    reject_level: RejectLevel | None = None
    reject_upper: float = 2.0
    reject_lower: float | None = None
    veto: float | None = None

    def __post_init__(self):
        if self.weight_level is not None:
            v.one_of(self.weight_level, "weight_level", WeightLevel.__args__)
        if self.reject_level is not None:
            v.one_of(self.reject_level, "reject_level", RejectLevel.__args__)
        if self.weight_level is None and self.reject_level is None and self.veto is None:
            raise ValueError("a RolloutCorrection needs weights, rejection or a veto.")
        if not self.weight_cap > 0:
            raise ValueError(f"weight_cap must be > 0, got {self.weight_cap}.")
        if not self.reject_upper > 0:
            raise ValueError(f"reject_upper must be > 0, got {self.reject_upper}.")
        if self.reject_lower is not None and not 0 <= self.reject_lower <= self.reject_upper:
            raise ValueError(
                f"reject_lower must lie in [0, reject_upper={self.reject_upper}], got "
                f"{self.reject_lower}."
            )
        if self.veto is not None and not self.veto > 0:
            raise ValueError(f"veto must be > 0, got {self.veto}.")

    @property
    def lower(self) -> float:
        """$\\rho_{\\min}$: `reject_lower`, or $1 / \\rho_{\\max}$ when it is None."""
        return 1.0 / self.reject_upper if self.reject_lower is None else self.reject_lower


# The published settings, by the names this library gives them (docs/rollout_correction.md
# maps each to verl's, TRL's and Tunix's).
ROLLOUT_CORRECTIONS: dict[str, RolloutCorrection] = {
    # Token-level truncated importance sampling, C = 2 (Yao et al. 2025).
    "token-tis": RolloutCorrection("token", 2.0),
    # Token-level masked importance sampling: rho kept where it is at most C = 2, else the
    # token is dropped (TRL's "token_mask").
    "token-mis": RolloutCorrection("token", 2.0, "token", 2.0, 0.0),
    # Sequence-level truncated importance sampling, C = 2 (verl's decoupled_seq_is).
    "seq-tis": RolloutCorrection("sequence", 2.0),
    # Sequence-level masked importance sampling (Liu et al. 2025): sequences whose product of
    # ratios exceeds 2 are dropped (TRL's "sequence_mask").
    "seq-mis": RolloutCorrection("sequence", 2.0, "sequence", 2.0, 0.0),
    # Sequence weights truncated at 2 and sequences outside [1/2, 2] rejected (verl's
    # decoupled_seq_is_rs).
    "seq-tis-rs": RolloutCorrection("sequence", 2.0, "sequence", 2.0),
    # No weights; sequences whose geometric-mean ratio leaves [0.999, 1.001], or with a token
    # ratio under 1e-4, rejected (verl's decoupled_geo_rs, Liu et al.'s Geo-RS with veto).
    "geo-rs": RolloutCorrection(None, 2.0, "geometric", 1.001, 0.999, veto=1e-4),
    # IcePop (Ling Team 2025): token ratios kept as weights inside [0.5, 5], tokens outside
    # dropped.
    "icepop": RolloutCorrection("token", 5.0, "token", 5.0, 0.5),
}


class CorrectedRollouts(NamedTuple):
    """The weights and the kept tokens of a batch, and what the correction did to it.

    Attributes:
      weights: `[B, T]` importance weights of the kept tokens, 0 elsewhere; no gradient.
      keep: `[B, T]` the valid tokens the correction kept (use it as the loss's mask, so that
        rejected tokens leave its denominators too).
      ess: the effective sample size of the kept tokens' weights as a fraction of their
        number, $(\\sum w)^2 / (n \\sum w^2)$ (1 for equal weights, 0 when none is kept).
      rejected_tokens: the share of the valid tokens rejected (by the level or the veto).
      rejected_sequences: the share of the sequences with a valid token that lost them all.
      truncated: the share of the kept tokens whose weight was truncated at the cap.
    """

    weights: Float[Array, "B T"]
    keep: Bool[Array, "B T"]
    ess: Float[Array, ""]
    rejected_tokens: Float[Array, ""]
    rejected_sequences: Float[Array, ""]
    truncated: Float[Array, ""]


def level_log_ratios(log_rho: jax.Array, where: jax.Array, level: str) -> jax.Array:
    """The log-ratio of `level` ("token", "sequence": the row's sum, "geometric": its mean
    over the valid tokens) on every token of `log_rho` (`[B, T]`, 0 where masked)."""
    if level == "token":
        return log_rho
    total = jnp.sum(log_rho, axis=-1, keepdims=True)
    if level == "geometric":
        total = total / jnp.maximum(jnp.sum(where, axis=-1, keepdims=True), 1)
    return jnp.broadcast_to(total, log_rho.shape)


def _share(part: jax.Array, whole: jax.Array) -> jax.Array:
    return jnp.sum(part) / jnp.maximum(jnp.sum(whole), 1)


def rollout_correction(
    token_logps: Float[ArrayLike, "B T"],
    sampler_token_logps: Float[ArrayLike, "B T"],
    correction: RolloutCorrection,
    *,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> CorrectedRollouts:
    r"""Importance weights and the tokens kept, for a batch the sampler drew.

    With $\log \rho_t$ = `token_logps` $-$ `sampler_token_logps` and the levels of
    `RolloutCorrection`:

    $$
    w_t = \min\big(\rho^{(w)}_t, C\big), \qquad
    k_t = m_t \cdot \mathbb{1}\big[\rho_{\min} \le \rho^{(r)}_t \le \rho_{\max}\big]
    \cdot \prod_{s \in y_i} \mathbb{1}\big[\rho_s \ge \nu\big]
    $$

    where $\rho^{(w)}$ is the ratio at `weight_level` ($w = 1$ without one), $\rho^{(r)}$ at
    `reject_level` (no condition without one), $\nu$ the `veto` (no condition without one) and
    $m$ = `where`. The per-token policy loss is then multiplied by $w \cdot k$ and aggregated
    over the mask $k$: rejected tokens leave the loss and its denominators, as verl's
    rejection sampling does to the response mask. For PPO's clipped loss, pass the trainer's
    log-probs before the update (the proximal policy, verl's decoupled mode) as
    `token_logps`; passing the current ones corrects a plain policy gradient (verl's
    bypass mode with a policy-gradient loss). Everything is computed in log space without
    gradient, so any finite or infinite log-ratio gives finite weights.

    Args:
      token_logps: `[B, T]` the trainer's log-probs of the sampled tokens.
      sampler_token_logps: `[B, T]` the log-probs the sampler reported for them.
      correction: a `RolloutCorrection`, or one of `ROLLOUT_CORRECTIONS` (static).
      where: `[B, T]` mask, True (or 1) = counts; NaN or infinite log-probs under a False
        entry are ignored.

    Returns:
      `CorrectedRollouts`: weights (float32, float64 for float64 input), the kept mask, and
      the effective sample size and the rejected and truncated shares.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import ROLLOUT_CORRECTIONS, rollout_correction
      >>> train = jnp.log(jnp.array([[0.5, 0.9, 0.3, 0.05], [0.4, 0.4, 0.4, 0.4]]))
      >>> sampler = jnp.log(jnp.array([[0.5, 0.3, 0.4, 0.5], [0.4, 0.4, 0.4, 0.4]]))
      >>> # ratios 1, 3, 0.75, 0.1 in the first row, 1 in the second
      >>> out = rollout_correction(train, sampler, ROLLOUT_CORRECTIONS["token-tis"])
      >>> print(out.weights.round(3))
      [[1.   2.   0.75 0.1 ]
       [1.   1.   1.   1.  ]]
      >>> out = rollout_correction(train, sampler, ROLLOUT_CORRECTIONS["icepop"])
      >>> print(out.weights.round(3), out.keep.astype(int), out.rejected_tokens, sep="\n")
      [[1.   3.   0.75 0.  ]
       [1.   1.   1.   1.  ]]
      [[1 1 1 0]
       [1 1 1 1]]
      0.125
      >>> out = rollout_correction(train, sampler, ROLLOUT_CORRECTIONS["seq-tis-rs"])
      >>> print(out.keep.astype(int), out.rejected_sequences, sep="\n")  # 0.225 < 1/2
      [[0 0 0 0]
       [1 1 1 1]]
      0.5

    References:
      Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
      2025, https://fengyao.notion.site/off-policy-rl.
      Liu et al., "When Speed Kills Stability: Demystifying RL Collapse from the
      Training-Inference Mismatch", 2025, https://richardli.xyz/rl-collapse.
      Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
      Thinking Model" (IcePop), 2025, https://arxiv.org/abs/2510.18855.
    """
    if not isinstance(correction, RolloutCorrection):
        raise TypeError(
            f"correction must be a RolloutCorrection (or one of ROLLOUT_CORRECTIONS: "
            f"{sorted(ROLLOUT_CORRECTIONS)}), got {correction!r}."
        )
    (logps, sampler), where = v.masked_floats(
        where, ndim=2, token_logps=token_logps, sampler_token_logps=sampler_token_logps
    )
    log_rho = lax.stop_gradient(logps - sampler)
    dtype = log_rho.dtype
    keep = where
    if correction.reject_level is not None:
        level = level_log_ratios(log_rho, where, correction.reject_level)
        upper = jnp.log(jnp.asarray(correction.reject_upper, dtype))
        lower = jnp.log(jnp.asarray(correction.lower, dtype))  # -inf for 0
        keep = keep & (level <= upper) & (level >= lower)
    if correction.veto is not None:
        below = where & (log_rho < jnp.log(jnp.asarray(correction.veto, dtype)))
        keep = keep & ~jnp.any(below, axis=-1, keepdims=True)
    log_cap = jnp.log(jnp.asarray(correction.weight_cap, dtype))
    if correction.weight_level is None:
        log_weights = jnp.zeros_like(log_rho)
    else:
        log_weights = level_log_ratios(log_rho, where, correction.weight_level)
    truncated = keep & (log_weights > log_cap)
    log_weights = jnp.minimum(log_weights, log_cap)
    weights = jnp.where(keep, jnp.exp(log_weights), 0.0)
    # ESS from the log-weights shifted by their largest kept one (no overflow), as
    # `tunelib.metrics.effective_sample_size` computes it (metrics import the losses).
    shifted = jnp.where(keep, log_weights - jnp.max(jnp.where(keep, log_weights, -jnp.inf)), 0.0)
    scaled = jnp.where(keep, jnp.exp(shifted), 0.0)
    count = jnp.sum(keep)
    ess = jnp.where(
        count > 0,
        jnp.sum(scaled) ** 2 / jnp.maximum(count * jnp.sum(scaled**2), 1e-30),
        0.0,
    )
    rows = jnp.any(where, axis=-1)
    lost = rows & ~jnp.any(keep, axis=-1)
    return CorrectedRollouts(
        weights=weights,
        keep=keep,
        ess=ess.astype(dtype),
        rejected_tokens=_share(where & ~keep, where).astype(dtype),
        rejected_sequences=_share(lost, rows).astype(dtype),
        truncated=_share(truncated, keep).astype(dtype),
    )

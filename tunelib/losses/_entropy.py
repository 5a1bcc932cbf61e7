r"""The entropy bonus of policy optimisation: a loss term that keeps the policy exploring.

It takes per-token entropies $H_t$ of the current policy's next-token distribution, from
`tunelib.logprobs.token_entropy`, as a `[B, T]` array. The entropy statistics that RL runs
log are in `tunelib.metrics`, the high-entropy token mask in `tunelib.advantages`.
"""

import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _deprecation
from tunelib import _validation as v
from tunelib._typing import Mask, Scalar


@_deprecation.renamed_arguments(coefficient="entropy_weight")
def entropy_bonus(
    entropy: Float[ArrayLike, "B T"],
    *,
    entropy_weight: Scalar,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Per-token entropy bonus as a loss term: minimising it raises the policy's entropy.

    $$
    \ell_t = -c \, H_t
    $$

    with $H_t$ = `entropy` (differentiable, from `tunelib.logprobs.token_entropy` of the
    current policy's logits) and $c$ = `entropy_weight`. PPO (Schulman et al. 2017, eq. 9) adds
    $c_2 H$ to the objective with $c_2 = 0.01$ on Atari; LLM recipes mostly use 0 to $10^{-3}$
    (verl's ``entropy_coeff``). Reduce it with the same `aggregate` mode as the policy loss and
    add it to that loss. A negative weight minimises entropy instead. `entropy_weight` was
    called `coefficient`, which still works until tunelib 0.3.0, with a `DeprecationWarning`.

    Args:
      entropy: `[B, T]` per-token entropies in nats.
      entropy_weight: $c$, the weight of the bonus; may be traced (for a schedule).
      where: `[B, T]` mask, True (or 1) = a completion token that counts. Masked tokens give
        exactly 0 and a zero gradient, even when their entropies are NaN or infinite.

    Returns:
      `[B, T]` per-token loss terms, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import entropy_bonus
      >>> entropy = jnp.array([[0.5, 2.0, 1.0]])
      >>> print(entropy_bonus(entropy, entropy_weight=0.01, where=jnp.array([[True, True, False]])))
      [[-0.005 -0.02   0.   ]]

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", 2017,
      https://arxiv.org/abs/1707.06347.
    """
    (entropy,), where = v.masked_floats(where, ndim=2, entropy=entropy)
    return jnp.where(where, -jnp.asarray(entropy_weight, entropy.dtype) * entropy, 0.0)

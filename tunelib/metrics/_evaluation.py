"""Evaluation from k samples per prompt: pass@k and majority voting (maj@k)."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from tunelib import _validation as v
from tunelib._typing import Mask


def _samples(x: jax.Array, name: str) -> None:
    """Samples come as `[B, n]`: prompts on the first axis, their samples on the second."""
    if x.ndim != 2:
        raise ValueError(
            f"{name} must have shape [B, n] (n samples of each of B prompts), got shape "
            f"{tuple(x.shape)}."
        )


def pass_at_k(
    correct: Mask[ArrayLike, "B n"], *, k: int, where: Mask[ArrayLike, "B n"] | None = None
) -> Float[Array, " B"]:
    r"""The unbiased estimate of pass@k of each prompt from its $n$ samples, $c$ of them correct.

    $$
    \mathrm{pass@}k = 1 - \frac{\binom{n - c}{k}}{\binom{n}{k}}
    = 1 - \prod_{i = n - c + 1}^{n} \Big(1 - \frac{k}{i}\Big)
    $$

    with $n$ the samples of a prompt that `where` keeps and $c$ those of them that are
    `correct`: the probability that at least one of $k$ samples drawn without replacement from
    the $n$ is correct, an unbiased estimate of the chance that $k$ fresh samples contain a
    correct one. The product form (Chen et al.'s) never forms the binomials, which overflow
    for large $n$; it is 1 exactly when $n - c < k$. Averaged over prompts (`.mean()`) it is
    the pass@k a run reports; pass@1 is the fraction of correct samples, $c / n$.

    Each prompt needs $n \ge k$. A row that `where` leaves empty is padding and gives 0. A row
    with $0 < n < k$ is a `ValueError` when `where` is concrete (a Python or NumPy array, or a
    JAX array outside `jit`); under `jit` it cannot be seen and the row gives NaN.

    Args:
      correct: `[B, n]` whether each sample is correct, boolean or integer 0/1.
      k: the number of samples pass@k draws, a Python int in $[1, n]$ (static).
      where: `[B, n]` which samples exist, True (or 1) = counts; None = all (then every prompt
        has the same $n$).

    Returns:
      `[B]` float32 values in $[0, 1]$, one per prompt.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import pass_at_k
      >>> correct = jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
      >>> print(pass_at_k(correct, k=1), pass_at_k(correct, k=2).round(4))
      [0.25 0.5  0.  ] [0.5    0.8333 0.    ]
      >>> where = jnp.array([[True, True, False, False]] * 3)  # 2 samples per prompt
      >>> print(pass_at_k(correct, k=2, where=where))
      [1. 1. 0.]

    References:
      Chen et al., "Evaluating Large Language Models Trained on Code", 2021,
      https://arxiv.org/abs/2107.03374 (section 2.1).
    """
    correct = v.mask_like(correct, "correct")
    _samples(correct, "correct")
    where = v.mask_array(where, correct.shape)
    v.sample_count(k, where, per_row=True)
    n = jnp.sum(where, axis=-1)[:, None]
    c = jnp.sum(correct & where, axis=-1)[:, None]
    i = jnp.arange(1, correct.shape[-1] + 1, dtype=jnp.float32)
    factors = jnp.where((i > n - c) & (i <= n), 1.0 - k / i, 1.0)
    value = 1.0 - jnp.prod(factors, axis=-1)
    n = n[:, 0]
    return jnp.where(n >= k, value, jnp.where(n == 0, 0.0, jnp.nan))


def majority_at_k(
    answers: Int[ArrayLike, "B n"],
    correct: Mask[ArrayLike, "B n"],
    *,
    k: int,
    where: Mask[ArrayLike, "B n"] | None = None,
) -> Float[Array, " B"]:
    r"""Whether the most frequent answer among each prompt's first $k$ samples is correct.

    $$
    \mathrm{maj@}k = \Big[\, \hat a \text{ is correct} \Big], \qquad
    \hat a = \operatorname*{arg\,max}_{a} \sum_{j=1}^{k} m_j \, [a_j = a]
    $$

    with $a_j$ = `answers` (an integer id per sample: equal ids are equal answers, however
    the caller normalises them) and $m_j$ = `where`, over the first $k$ samples of each
    prompt. The voted answer $\hat a$ is correct when the earliest of its samples is `correct`
    (the samples of one answer are graded alike). Ties go to the answer that appears first
    among the $k$ samples. Samples that `where` drops (no answer could be extracted) do not
    vote; a prompt none of whose first $k$ samples votes gives 0. The mean over prompts
    (`.mean()`) is the maj@k a run reports (self-consistency).

    Args:
      answers: `[B, n]` integer answer ids; values under a False `where` are ignored.
      correct: `[B, n]` whether each sample's answer is correct, boolean or integer 0/1.
      k: the number of samples that vote, a Python int in $[1, n]$ (static); the first $k$.
      where: `[B, n]` which samples vote, True (or 1) = counts; None = all.

    Returns:
      `[B]` float32, 1 where the voted answer is correct and 0 elsewhere.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import majority_at_k
      >>> answers = jnp.array([[7, 3, 3, 7, 3], [5, 6, 6, 5, 5]])
      >>> correct = answers == jnp.array([[7], [5]])
      >>> print(majority_at_k(answers, correct, k=5), majority_at_k(answers, correct, k=4))
      [0. 1.] [1. 1.]

    References:
      Wang et al., "Self-Consistency Improves Chain of Thought Reasoning in Language Models",
      2022, https://arxiv.org/abs/2203.11171.
    """
    answers = v.int_array(answers, "answers")
    _samples(answers, "answers")
    correct = v.mask_like(correct, "correct")
    v.check_shape(correct, "correct", answers.shape, f"answers {tuple(answers.shape)}")
    where = v.mask_array(where, answers.shape)
    v.sample_count(k, where, per_row=False)
    answers, correct, where = answers[:, :k], correct[:, :k], where[:, :k]
    same = (answers[:, :, None] == answers[:, None, :]) & where[:, :, None] & where[:, None, :]
    # Every sample of an answer has its vote count, so the first sample with the most votes is
    # the first appearance of the tied answer that appears first.
    winner = jnp.argmax(jnp.sum(same, axis=-1), axis=-1)
    won = jnp.take_along_axis(correct, winner[:, None], axis=-1)[:, 0]
    return (won & jnp.any(where, axis=-1)).astype(jnp.float32)

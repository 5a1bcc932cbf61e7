"""Reducing per-token losses to a scalar as a numerator and a denominator.

A mean is only exact under gradient accumulation and data parallelism if numerators and
denominators are summed separately over micro-batches (or devices) and divided once. Every mode
here therefore returns an `Aggregate(total, count)`; `Aggregate.mean()` divides.
"""

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Float, Int

from tunelib import _validation as v
from tunelib import logprobs
from tunelib._typing import Mask, Scalar

AggregationMode = Literal[
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "global_token_mean",
    "seq_mean_token_sum",
]
_NORMALISED_MODES = ("seq_mean_token_sum_norm", "global_token_mean")
AGGREGATION_MODES: tuple[str, ...] = AggregationMode.__args__
EmptyRows = Literal["skip", "count"]
EMPTY_ROWS: tuple[str, ...] = EmptyRows.__args__


class Aggregate(NamedTuple):
    """A loss reduction kept as `total / count` so that partial results can be summed.

    Attributes:
      total: the numerator, a float scalar.
      count: the denominator, a float scalar (a token count, a sequence count, or a sequence
        count times a normalising constant, depending on the mode; with
        ``empty_rows="count"`` the sequence count includes rows without a valid token).
    """

    total: jax.Array
    count: jax.Array

    def merge(self, other: "Aggregate") -> "Aggregate":
        """The aggregate of the union of both batches: totals and counts add."""
        return Aggregate(self.total + other.total, self.count + other.count)

    def mean(self) -> jax.Array:
        """`total / count`, and 0 (not NaN) when `count` is 0."""
        safe = jnp.where(self.count > 0, self.count, 1)
        return jnp.where(self.count > 0, self.total / safe, 0.0)


def aggregate(
    values: Float[ArrayLike, "B T"],
    *,
    mode: AggregationMode,
    norm_constant: Scalar | None = None,
    empty_rows: EmptyRows = "skip",
    where: Mask[ArrayLike, "B T"] | None = None,
    segment_ids: Int[ArrayLike, "B T"] | None = None,
) -> Aggregate:
    r"""Reduce per-token losses `[B, T]` with one of the named modes in the literature.

    With mask $m_{i,t}$ = `where`, values $\ell_{i,t}$ = `values`,
    $|o_i| = \sum_t m_{i,t}$ and $\mathcal{I}$ the sequences that count (see `empty_rows`
    below: by default $\mathcal{I} = \{i : |o_i| > 0\}$):

    * ``"token_mean"`` (DAPO, Yu et al. 2025): every valid token weighs the same,
      $\sum_{i,t} m_{i,t}\ell_{i,t} \,/\, \sum_{i,t} m_{i,t}$.
    * ``"seq_mean_token_mean"`` (GRPO, Shao et al. 2024): the mean over sequences of each
      sequence's token mean, $\frac{1}{|\mathcal{I}|}\sum_{i \in \mathcal{I}}
      \frac{1}{\max(|o_i|, 1)}\sum_t m_{i,t}\ell_{i,t}$.
    * ``"seq_mean_token_sum_norm"`` (Dr. GRPO, Liu et al. 2025): each sequence's token sum
      divided by a constant $C$ = `norm_constant` (the paper uses the maximum completion
      length), then the mean over sequences,
      $\frac{1}{|\mathcal{I}|\,C}\sum_{i \in \mathcal{I}} \sum_t m_{i,t}\ell_{i,t}$.
    * ``"global_token_mean"``: the token sum of this batch divided by a token count $N$ =
      `norm_constant` supplied from outside, $\sum_{i,t} m_{i,t}\ell_{i,t} / N$. With $N$ the
      number of valid tokens in all micro-batches of an accumulation step (and all devices),
      known from the masks before the step, each micro-batch's `mean()` is its exact share of
      the step's token mean: sum those values, or their gradients as they are computed, and
      the result is the token mean over the whole step. (Here the count is $N$ itself, so do
      not `merge` these aggregates; the other modes merge.)
    * ``"seq_mean_token_sum"`` (LUSPO, Liu et al. 2026): the mean over sequences of each
      sequence's token sum, $\frac{1}{|\mathcal{I}|}\sum_{i \in \mathcal{I}} \sum_t
      m_{i,t}\ell_{i,t}$; a sequence-level loss spread over its tokens is thereby weighed by
      the sequence's length.

    Empty rows, `empty_rows`: a row without a valid token (padding, a completion masked out
    because it was truncated, or a filtered group) adds 0 to every numerator. Whether it
    counts in the sequence modes' denominator differs between libraries:

    * ``"skip"`` (default): $\mathcal{I}$ holds only the sequences with a valid token, so a
      batch's value does not depend on how many empty rows it carries. Tunix does this in
      every mode (`tunix/rl/common.py`, `aggregate_loss`, 0.1.7).
    * ``"count"``: $\mathcal{I}$ holds every row, an empty row being a sequence of loss 0.
      TRL (1.16, `GRPOTrainer._compute_loss`) does this: its ``"grpo"``, ``"sapo"`` and
      ``"luspo"`` take the mean over all rows and ``"dr_grpo"`` divides by the batch size times
      the maximum completion length.

    The token modes count tokens, so `empty_rows` does not change them.

    The reductions of TRL and Tunix, each one call (`where` = the completion mask, times
    TRL's tool mask where it has one):

    * TRL ``"grpo"``, ``"sapo"``: ``mode="seq_mean_token_mean", empty_rows="count"``.
    * TRL ``"dr_grpo"``: ``mode="seq_mean_token_sum_norm", empty_rows="count"``, $C$ =
      `max_completion_length`.
    * TRL ``"dapo"``, ``"cispo"`` (and ``"vespo"``): ``mode="global_token_mean"`` with $N$ =
      TRL's `num_items_in_batch` (the valid tokens of the generation batch over all
      processes) times `gradient_accumulation_steps / steps_per_generation`; with the default
      `steps_per_generation` (equal to the accumulation steps) that is the number of valid
      tokens of the optimiser step.
    * TRL ``"luspo"``: ``mode="seq_mean_token_sum", empty_rows="count"``.
    * Tunix ``"sequence-mean-token-scale"``: ``mode="seq_mean_token_sum_norm"`` with $C$ =
      Tunix's `norm`, whose default is the width $T$ of the completion array.
    * Tunix ``"token-mean"``, ``"sequence-mean-token-mean"``, ``"seq-mean-token-sum"``:
      ``"token_mean"``, ``"seq_mean_token_mean"``, ``"seq_mean_token_sum"``.

    Under gradient accumulation TRL divides each micro-batch's value by the number of
    accumulation steps and Tunix averages the micro-batches' gradients (`optax.MultiSteps`);
    in the merging modes both equal the merged aggregate here when every micro-batch has the
    same number of rows (TRL, always so) or the same denominator (Tunix).

    Packed rows: with `segment_ids` (1, 2, ... per sequence of a row, 0 on padding, as the
    packed pipelines of `tunelib.data` give them), each segment counts as one sequence $i$ in
    the sequence modes, so a packed batch gives exactly the value of the same sequences
    padded one per row; a token with segment id 0 belongs to no sequence there. With
    ``empty_rows="count"`` every segment id that occurs in a row is a sequence, whether or not
    `where` keeps any of its tokens (and then every id is checked, not only those at valid
    tokens). The token modes do not depend on how tokens are grouped into sequences and
    ignore `segment_ids`.

    Summing `total` and `count` over micro-batches (`Aggregate.merge`) and dividing once gives
    exactly the full-batch value in every mode but ``"global_token_mean"``, whose
    micro-batches' means add up to it.

    Args:
      values: `[B, T]` per-token losses.
      mode: one of ``"token_mean"``, ``"seq_mean_token_mean"``, ``"seq_mean_token_sum_norm"``,
        ``"global_token_mean"``, ``"seq_mean_token_sum"``.
      norm_constant: $C > 0$ for ``"seq_mean_token_sum_norm"``, the global token count
        $N > 0$ for ``"global_token_mean"``; required by those two modes and rejected by the
        others; may be traced.
      empty_rows: ``"skip"`` (default) or ``"count"``, whether sequences without a valid token
        count in the sequence modes' denominator (see above); static.
      where: `[B, T]` mask, True (or 1) = counts. Masked entries contribute exactly 0, even
        when they are NaN or infinite.
      segment_ids: optional `[B, T]` integer segment ids of packed rows, at most T (see
        above); checked when they can be read, under `jax.jit` an id outside `[1, T]` belongs
        to no sequence.

    Returns:
      An `Aggregate` of float32 scalars (float64 for float64 values).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import aggregate
      >>> losses = jnp.array([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
      >>> where = jnp.array([[True, True, False], [True, False, False], [False] * 3])
      >>> print(aggregate(losses, mode="token_mean", where=where).mean())  # (1 + 3 + 4) / 3
      2.6666667
      >>> print(aggregate(losses, mode="seq_mean_token_mean", where=where).mean())  # (2 + 4) / 2
      3.0
      >>> out = aggregate(losses, mode="seq_mean_token_mean", empty_rows="count", where=where)
      >>> print(out.mean())  # (2 + 4 + 0) / 3, as TRL's "grpo"
      2.0

    References:
      Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
      Language Models" (GRPO), 2024, https://arxiv.org/abs/2402.03300.
      Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", 2025,
      https://arxiv.org/abs/2503.14476.
      Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO),
      2025, https://arxiv.org/abs/2503.20783.
      Liu et al., "Length-Unbiased Sequence Policy Optimization: Revealing and Controlling
      Response Length Variation in RLVR" (LUSPO), 2026, https://arxiv.org/abs/2602.05261.
    """
    v.one_of(mode, "mode", AGGREGATION_MODES)
    v.one_of(empty_rows, "empty_rows", EMPTY_ROWS)
    if (mode in _NORMALISED_MODES) != (norm_constant is not None):
        raise ValueError(
            f"norm_constant is required by the modes {_NORMALISED_MODES} and used by no other "
            f"mode; got mode={mode!r}, norm_constant={norm_constant!r}."
        )
    (values,), where = v.masked_floats(where, ndim=2, values=values)
    dtype = values.dtype
    counted = empty_rows == "count"
    if segment_ids is not None:
        checked = jnp.ones_like(where) if counted else where
        v.segment_ids_array(segment_ids, values.shape, where=checked, num_segments=values.shape[-1])
    if mode == "token_mean":
        return Aggregate(jnp.sum(values), jnp.sum(where).astype(dtype))
    if mode == "global_token_mean":
        v.positive_scalar(norm_constant, "norm_constant")
        return Aggregate(jnp.sum(values), jnp.asarray(norm_constant, dtype))
    # The sequence modes: per sequence (a row, or a segment of a packed row) its token sum and
    # its number of valid tokens; which sequences count is `empty_rows`'s choice.
    segments = {}
    if segment_ids is not None:
        segments = {"segment_ids": segment_ids, "num_segments": values.shape[-1]}
    sums = logprobs.sequence_sum(values, where=where, **segments)
    lengths = logprobs.sequence_sum(jnp.ones_like(values), where=where, **segments)
    if not counted:
        sequences = jnp.sum(lengths > 0).astype(dtype)
    elif segment_ids is None:
        sequences = jnp.asarray(values.shape[0], dtype)
    else:  # every segment that occurs, with or without a valid token
        occurring = logprobs.sequence_sum(jnp.ones_like(values), **segments) > 0
        sequences = jnp.sum(occurring).astype(dtype)
    if mode == "seq_mean_token_mean":
        return Aggregate(jnp.sum(sums / jnp.maximum(lengths, 1)), sequences)
    if mode == "seq_mean_token_sum":
        return Aggregate(jnp.sum(sums), sequences)
    v.positive_scalar(norm_constant, "norm_constant")
    return Aggregate(jnp.sum(sums), sequences * jnp.asarray(norm_constant, dtype))

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
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "global_token_mean"
]
_NORMALISED_MODES = ("seq_mean_token_sum_norm", "global_token_mean")
AGGREGATION_MODES: tuple[str, ...] = AggregationMode.__args__


class Aggregate(NamedTuple):
    """A loss reduction kept as `total / count` so that partial results can be summed.

    Attributes:
      total: the numerator, a float scalar.
      count: the denominator, a float scalar (a token count, a sequence count, or a sequence
        count times a normalising constant, depending on the mode).
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
    where: Mask[ArrayLike, "B T"] | None = None,
    segment_ids: Int[ArrayLike, "B T"] | None = None,
) -> Aggregate:
    r"""Reduce per-token losses `[B, T]` with one of the named modes in the literature.

    With mask $m_{i,t}$ = `where`, values $\ell_{i,t}$ = `values`,
    $|o_i| = \sum_t m_{i,t}$ and $\mathcal{I} = \{i : |o_i| > 0\}$:

    * ``"token_mean"`` (DAPO, Yu et al. 2025): every valid token weighs the same,
      $\sum_{i,t} m_{i,t}\ell_{i,t} \,/\, \sum_{i,t} m_{i,t}$.
    * ``"seq_mean_token_mean"`` (GRPO, Shao et al. 2024): the mean over sequences of each
      sequence's token mean, $\frac{1}{|\mathcal{I}|}\sum_{i \in \mathcal{I}}
      \frac{1}{|o_i|}\sum_t m_{i,t}\ell_{i,t}$.
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

    Rows without a valid token carry no data and are left out of both the numerator and the
    denominator in every mode, so the result of a batch does not depend on how many empty
    (padding or filtered-out) rows it carries. TRL's Dr. GRPO divides by the full batch size
    instead, which counts such rows as zero-loss sequences.

    Packed rows: with `segment_ids` (1, 2, ... per sequence of a row, 0 on padding, as the
    packed pipelines of `tunelib.data` give them), each segment counts as one sequence $i$ in
    the sequence modes, so a packed batch gives exactly the value of the same sequences
    padded one per row; a token with segment id 0 belongs to no sequence there. The token
    modes do not depend on how tokens are grouped into sequences and ignore `segment_ids`.

    Summing `total` and `count` over micro-batches (`Aggregate.merge`) and dividing once gives
    exactly the full-batch value in the first three modes; in ``"global_token_mean"`` the
    micro-batches' means add up to it.

    Args:
      values: `[B, T]` per-token losses.
      mode: one of ``"token_mean"``, ``"seq_mean_token_mean"``, ``"seq_mean_token_sum_norm"``,
        ``"global_token_mean"``.
      norm_constant: $C > 0$ for ``"seq_mean_token_sum_norm"``, the global token count
        $N > 0$ for ``"global_token_mean"``; required by those two modes and rejected by the
        others; may be traced.
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
      >>> losses = jnp.array([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0]])
      >>> where = jnp.array([[True, True, False], [True, False, False]])
      >>> print(aggregate(losses, mode="token_mean", where=where).mean())  # (1 + 3 + 4) / 3
      2.6666667
      >>> print(aggregate(losses, mode="seq_mean_token_mean", where=where).mean())  # (2 + 4) / 2
      3.0
    """
    v.one_of(mode, "mode", AGGREGATION_MODES)
    if (mode in _NORMALISED_MODES) != (norm_constant is not None):
        raise ValueError(
            f"norm_constant is required by the modes {_NORMALISED_MODES} and used by no other "
            f"mode; got mode={mode!r}, norm_constant={norm_constant!r}."
        )
    (values,), where = v.masked_floats(where, ndim=2, values=values)
    dtype = values.dtype
    if segment_ids is not None:
        v.segment_ids_array(segment_ids, values.shape, where=where, num_segments=values.shape[-1])
    if mode == "token_mean":
        return Aggregate(jnp.sum(values), jnp.sum(where).astype(dtype))
    if mode == "global_token_mean":
        v.positive_scalar(norm_constant, "norm_constant")
        return Aggregate(jnp.sum(values), jnp.asarray(norm_constant, dtype))
    # The sequence modes: per sequence (a row, or a segment of a packed row) its token sum and
    # its number of valid tokens; sequences without one are left out.
    segments = {}
    if segment_ids is not None:
        segments = {"segment_ids": segment_ids, "num_segments": values.shape[-1]}
    sums = logprobs.sequence_sum(values, where=where, **segments)
    lengths = logprobs.sequence_sum(jnp.ones_like(values), where=where, **segments)
    sequences = jnp.sum(lengths > 0).astype(dtype)
    if mode == "seq_mean_token_mean":
        return Aggregate(jnp.sum(sums / jnp.maximum(lengths, 1)), sequences)
    v.positive_scalar(norm_constant, "norm_constant")
    return Aggregate(jnp.sum(sums), sequences * jnp.asarray(norm_constant, dtype))

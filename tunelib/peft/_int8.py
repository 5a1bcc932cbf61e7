r"""8-bit absmax quantisation with one scale per output channel."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import quax
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array, Float

from tunelib import _validation as v


class Int8Tensor(quax.ArrayValue):
    """A matrix (or a stack of them) stored as int8 values and one float32 scale per channel.

    Like `NF4Tensor` it stands in for the array it quantises inside `tunelib.peft.lora`.

    Attributes:
      values: `[..., m, n]` int8 in `[-127, 127]`.
      scale: `[..., n]` (channel axis -1) or `[..., m]` (channel axis -2) float32.
      channel_axis: -1 or -2, the axis that has one scale per index.
      value_dtype: the dtype the array is dequantised to.
    """

    # Untyped: pytree operations (abstract templates for checkpoints) put other leaves here.
    values: Any
    scale: Any
    channel_axis: int = eqx.field(static=True)
    value_dtype: jnp.dtype = eqx.field(static=True)

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.values.shape, self.value_dtype)

    def dequantize(self, dtype: DTypeLike | None = None) -> Array:
        """The array, computed in float32 and cast to `dtype` (default `value_dtype`)."""
        scale = jnp.expand_dims(self.scale, -1 if self.channel_axis == -2 else -2)
        out = self.values.astype(jnp.float32) * scale
        return out.astype(self.value_dtype if dtype is None else dtype)

    def materialise(self) -> Array:
        return self.dequantize()

    def with_dtype(self, dtype: DTypeLike) -> "Int8Tensor":
        """The same tensor, dequantising to `dtype`."""
        return dataclasses.replace(self, value_dtype=jnp.dtype(dtype))

    def transpose(self) -> "Int8Tensor":
        """The transposed array: values swapped, the channel axis follows."""
        return Int8Tensor(
            values=jnp.swapaxes(self.values, -1, -2),
            scale=self.scale,
            channel_axis=-1 if self.channel_axis == -2 else -2,
            value_dtype=self.value_dtype,
        )

    @property
    def T(self) -> "Int8Tensor":
        return self.transpose()


def int8_quantize(x: Float[ArrayLike, "*S m n"], *, channel_axis: int = -1) -> Int8Tensor:
    r"""Quantise matrices to int8 with one absmax scale per channel.

    For channel $j$ (an index of `channel_axis`), $s_j = \max_i |w_{ij}| / 127$ and
    $q_{ij} = \mathrm{round}(w_{ij} / s_j) \in [-127, 127]$, so $|s_j q_{ij} - w_{ij}| \le s_j / 2$.
    A channel of zeros has $s_j = 0$ and codes 0. With a kernel `[in, out]` the default
    `channel_axis=-1` gives one scale per output feature, as LLM.int8's row-wise scales of a
    PyTorch `[out, in]` weight do.

    Args:
      x: `[..., m, n]` floating-point weights.
      channel_axis: -1 (one scale per column) or -2 (one per row).

    Returns:
      An `Int8Tensor` standing for `x`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.peft import int8_quantize
      >>> q = int8_quantize(jnp.array([[1.0, -0.5], [0.25, 2.0]]))
      >>> print(q.values, q.scale * 127, q.dequantize()[1])
      [[127  -32]
       [ 32  127]] [1. 2.] [0.2519685 2.       ]

    References:
      Dettmers et al., "LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale",
      2022, https://arxiv.org/abs/2208.07339.
    """
    x = v.float_array(x, "x")
    v.check_ndim(x, "x", at_least=2)
    if channel_axis not in (-1, -2):
        raise ValueError(f"channel_axis must be -1 or -2, got {channel_axis!r}.")
    high = x.astype(jnp.float32)
    reduce = -2 if channel_axis == -1 else -1
    scale = jnp.max(jnp.abs(high), axis=reduce) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    values = jnp.clip(jnp.round(high / jnp.expand_dims(safe, reduce)), -127, 127)
    return Int8Tensor(
        values=values.astype(jnp.int8),
        scale=scale,
        channel_axis=channel_axis,
        value_dtype=jnp.dtype(x.dtype),
    )

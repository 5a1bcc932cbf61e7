"""Grouped matrix products: rows sorted by group, each group times its own matrix.

The product behind a dropless mixture of experts: tokens sorted by expert, each expert's run
of rows times that expert's weights. It is one JAX primitive, `grouped_matmul_p`, so that
`tunelib.peft` can give adapted and quantised expert weights their own rules (LoRA's low-rank
path, dequantisation per product), as it does for `dot_general`. Two implementations lower it:

- "ragged_dot": `jax.lax.ragged_dot`, XLA's grouped GEMM on GPU and TPU. On CPU, JAX lowers it
  by expanding the rows over every group (G times the multiply-adds and memory).
- "blocked": each group's rows padded to whole blocks of `b` rows, one `[b, K] @ [K, N]`
  product per block in a loop, unused blocks skipped: at most `(M + G b) K N` multiply-adds on
  any backend, with no copy of the weights.
"""

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from tunelib import _validation as v

GroupedImplementation = Literal["auto", "ragged_dot", "blocked"]
GROUPED_IMPLEMENTATIONS: tuple[str, ...] = ("auto", "ragged_dot", "blocked")

grouped_matmul_p = Primitive("tunelib_grouped_matmul")


def grouped_matmul(
    x: Float[ArrayLike, "M K"],
    w: Float[ArrayLike, "G K N"],
    group_sizes: Int[ArrayLike, " G"],
    *,
    implementation: GroupedImplementation = "auto",
    block_size: int | None = None,
) -> Float[Array, "M N"]:
    r"""Rows of `x` in runs by group, each run times its group's matrix.

    $y_m = x_m W_{g(m)}$, where row $m$ belongs to group $g$ when
    $\sum_{j<g} n_j \le m < \sum_{j \le g} n_j$ ($n$ = `group_sizes`); rows past
    $\sum_g n_g$ belong to no group and give 0. This is `jax.lax.ragged_dot`'s contract.
    Differentiable in `x` and `w` (not in `group_sizes`), under `jit`, `grad` and `vmap`.

    Args:
      x: `[M, K]` rows, sorted by group.
      w: `[G, K, N]`, one matrix per group.
      group_sizes: `[G]` integer rows per group, summing to at most `M` (traced values are
        not checked).
      implementation: "ragged_dot" (`jax.lax.ragged_dot`), "blocked" (see the module notes)
        or "auto": "blocked" on CPU, "ragged_dot" on GPU and TPU. "blocked" is refused on a
        TPU: on a v5e the MoE layer's value and weight gradients with it are right, but
        its input gradient disagreed with the naive layer's by 0.87 of its scale (the
        transpose rule's blocked product of the cotangent; by `ragged_dot` it is right),
        though the product alone agreed with `ragged_dot` there (benchmarks/README.md,
        "The fifth run on a v5e"); the cause inside XLA's program is not found yet.
      block_size: rows per block of "blocked"; None picks $\min(128, \max(8, 2^{\lceil
        \log_2 (M / G) \rceil}))$ from the shapes.

    Returns:
      `[M, N]` in the dtype `x` and `w` promote to.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.models import grouped_matmul
      >>> x = jnp.arange(8.0).reshape(4, 2)
      >>> w = jnp.stack([jnp.eye(2), 10 * jnp.eye(2)])
      >>> grouped_matmul(x, w, jnp.array([1, 2]))  # row 0 in group 0, rows 1-2 in group 1
      Array([[ 0.,  1.],
             [20., 30.],
             [40., 50.],
             [ 0.,  0.]], dtype=float32)
    """
    x, w = v.float_array(x, "x"), v.float_array(w, "w")
    group_sizes = v.int_array(group_sizes, "group_sizes")
    if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            "x, w and group_sizes must have shapes [M, K], [G, K, N] and [G], got "
            f"{x.shape}, {w.shape} and {group_sizes.shape}."
        )
    if x.shape[1] != w.shape[1] or w.shape[0] != group_sizes.shape[0]:
        raise ValueError(
            f"x {x.shape}, w {w.shape} and group_sizes {group_sizes.shape} disagree: need "
            "[M, K], [G, K, N] and [G]."
        )
    if implementation not in GROUPED_IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {GROUPED_IMPLEMENTATIONS}, got {implementation!r}."
        )
    if implementation == "auto":
        implementation = "blocked" if jax.default_backend() == "cpu" else "ragged_dot"
    elif implementation == "blocked" and jax.default_backend() == "tpu":
        raise ValueError(
            'implementation="blocked" is refused on a TPU: inside the MoE layer its input '
            'gradient was wrong there (benchmarks/README.md); use "auto" or "ragged_dot".'
        )
    if block_size is None:
        per_group = -(-x.shape[0] // w.shape[0])
        block_size = min(128, max(8, 1 << max(per_group - 1, 0).bit_length()))
    elif isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}.")
    dtype = jnp.result_type(x.dtype, w.dtype)
    return grouped_matmul_p.bind(
        x.astype(dtype),
        w.astype(dtype),
        group_sizes.astype(jnp.int32),
        implementation=implementation,
        block_size=block_size,
    )


def _abstract_eval(x, w, group_sizes, *, implementation, block_size):
    del group_sizes, implementation, block_size
    return jax.core.ShapedArray((x.shape[0], w.shape[2]), x.dtype)


class _Layout:
    """Where each row of `x` goes when every group is padded to whole blocks."""

    def __init__(self, group_sizes: jax.Array, rows: int, block: int):
        groups = group_sizes.shape[0]
        self.blocks = -(-rows // block) + groups  # every group adds at most one partial block
        self.block = block
        ends = jnp.cumsum(group_sizes)
        padded = -(-group_sizes // block) * block
        padded_ends = jnp.cumsum(padded)
        index = jnp.arange(rows)
        group = jnp.searchsorted(ends, index, side="right")
        self.valid = group < groups
        g = jnp.minimum(group, groups - 1)
        start = (ends - group_sizes)[g]
        slot = (padded_ends - padded)[g] + index - start
        self.slot = jnp.where(self.valid, slot, self.blocks * block)  # out of range: dropped
        first_rows = jnp.arange(self.blocks) * block
        self.block_group = jnp.minimum(
            jnp.searchsorted(padded_ends, first_rows, side="right"), groups - 1
        )
        self.block_used = first_rows < padded_ends[-1]

    def to_blocks(self, x: jax.Array) -> jax.Array:
        padded = jnp.zeros((self.blocks * self.block, x.shape[1]), x.dtype)
        return padded.at[self.slot].set(x, mode="drop").reshape(self.blocks, self.block, -1)

    def from_blocks(self, y: jax.Array) -> jax.Array:
        y = y.reshape(self.blocks * self.block, -1)
        return jnp.where(self.valid[:, None], y.at[self.slot].get(mode="clip"), 0)


def _blocked(x, w, group_sizes, block):
    layout = _Layout(group_sizes, x.shape[0], block)
    zeros = jnp.zeros((block, w.shape[2]), x.dtype)

    def body(_, inputs):
        rows, group, used = inputs
        product = lax.cond(
            used,
            lambda: rows @ lax.dynamic_index_in_dim(w, group, keepdims=False),
            lambda: zeros,
        )
        return None, product

    inputs = (layout.to_blocks(x), layout.block_group, layout.block_used)
    _, y = lax.scan(body, None, inputs)
    return layout.from_blocks(y)


def _blocked_weight_cotangent(x, cotangent, group_sizes, groups, block):
    """`sum over each group's rows of x_m^T ct_m`, `[G, K, N]`, one block at a time."""
    layout = _Layout(group_sizes, x.shape[0], block)

    def body(total, inputs):
        rows, ct, group, used = inputs
        add = lax.cond(
            used,
            lambda: lax.dynamic_index_in_dim(total, group, keepdims=False) + rows.T @ ct,
            lambda: lax.dynamic_index_in_dim(total, group, keepdims=False),
        )
        return lax.dynamic_update_index_in_dim(total, add, group, 0), None

    inputs = (
        layout.to_blocks(x),
        layout.to_blocks(cotangent),
        layout.block_group,
        layout.block_used,
    )
    init = jnp.zeros((groups, x.shape[1], cotangent.shape[1]), x.dtype)
    total, _ = lax.scan(body, init, inputs)
    return total


def _forward(x, w, group_sizes, *, implementation, block_size):
    if implementation == "ragged_dot":
        return lax.ragged_dot(x, w, group_sizes)
    return _blocked(x, w, group_sizes, block_size)


def _impl(*args, **params):
    return jax.jit(functools.partial(_forward, **params))(*args)


def _jvp(primals, tangents, **params):
    x, w, group_sizes = primals
    dx, dw, _ = tangents
    out = grouped_matmul_p.bind(x, w, group_sizes, **params)
    parts = []
    if type(dx) is not ad.Zero:
        parts.append(grouped_matmul_p.bind(dx, w, group_sizes, **params))
    if type(dw) is not ad.Zero:
        parts.append(grouped_matmul_p.bind(x, dw, group_sizes, **params))
    if not parts:
        return out, jnp.zeros_like(out)
    return out, functools.reduce(jnp.add, parts)


def _transpose(cotangent, x, w, group_sizes, *, implementation, block_size):
    if type(cotangent) is ad.Zero:
        return None, None, None
    dx = dw = None
    if ad.is_undefined_primal(x):
        dx = grouped_matmul_p.bind(
            cotangent,
            jnp.swapaxes(w, 1, 2),
            group_sizes,
            implementation=implementation,
            block_size=block_size,
        )
    if ad.is_undefined_primal(w):
        groups = w.aval.shape[0]
        if implementation == "ragged_dot":
            aval = jax.ShapeDtypeStruct(w.aval.shape, w.aval.dtype)
            (dw,) = jax.linear_transpose(lambda w: lax.ragged_dot(x, w, group_sizes), aval)(
                cotangent
            )
        else:
            dw = _blocked_weight_cotangent(x, cotangent, group_sizes, groups, block_size)
    return dx, dw, None


def _batch(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims, strict=True)]
    return lax.map(lambda a: grouped_matmul_p.bind(*a, **params), tuple(args)), 0


grouped_matmul_p.def_abstract_eval(_abstract_eval)
grouped_matmul_p.def_impl(_impl)
ad.primitive_jvps[grouped_matmul_p] = _jvp
ad.primitive_transposes[grouped_matmul_p] = _transpose
batching.primitive_batchers[grouped_matmul_p] = _batch
mlir.register_lowering(grouped_matmul_p, mlir.lower_fun(_forward, multiple_results=False))

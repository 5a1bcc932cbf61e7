r"""Adapted weights that act as arrays inside any JAX function, via Quax's dispatch.

`apply_lora` replaces each adapted weight of a parameter tree by a `LoraWeight` $(W, A, B, s)$;
`lora(fn)` wraps a function so that, while it runs, a matrix product with a `LoraWeight`
computes $x W + s\,(x A) B$ (for stacked experts, `tunelib.models.grouped_matmul`, per
group) and casting or transposing it acts on the parts. The function's
own code does not change: a Flax NNX module, a plain JAX function or a Haiku-style `apply`
see arrays. Any other operation on a `LoraWeight` (indexing, reshaping, a gather) first
materialises $W + s\,AB$ and warns with a `MaterializationWarning`.
"""

import functools
import math
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import quax
from jax import lax
from jaxtyping import Array, ArrayLike, PyTree

from tunelib._products import plain_products
from tunelib._validation import compute_dtype
from tunelib.models import grouped_matmul_p
from tunelib.peft import _transforms
from tunelib.peft._adapters import check_adapters
from tunelib.peft._rules import path_string


class MaterializationWarning(UserWarning):
    """An operation other than a matrix product, a cast or a transpose met a `LoraWeight`,
    so the dense $W + s\\,AB$ was formed for it."""


class LoraWeight(quax.ArrayValue):
    r"""A weight $W$ with a low-rank update: it stands for $W + s\,AB$ without forming it.

    Built by `apply_lora`; used inside a function wrapped by `lora`.

    Attributes:
      w: the frozen base weight `[..., d_0, d_1]`, an array or a quantised tensor.
      a: `[..., d_0, r]`.
      b: `[..., r, d_1]`.
      key: `[..., 2]` uint32 PRNG key data for dropout on the adapter's input, or None (no
        dropout).
      scale: $s$.
      dropout: the dropout probability.
    """

    # Untyped: pytree operations (labels, abstract templates) put other leaves here.
    w: Any
    a: Any
    b: Any
    key: Any
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(tuple(self.w.shape), self.w.dtype)

    def dense(self) -> Array:
        r"""$W + s\,AB$, computed in at least float32 and cast to $W$'s dtype."""
        w = _dense(self.w)
        high = compute_dtype(w.dtype, self.a.dtype, self.b.dtype)
        delta = self.scale * (self.a.astype(high) @ self.b.astype(high))
        return (w.astype(high) + delta).astype(w.dtype)

    def materialise(self) -> Array:
        warnings.warn(
            f"an operation other than a matrix product met a LoRA weight of shape "
            f"{tuple(self.shape)}, so W + s·A·B was formed for it.",
            MaterializationWarning,
            stacklevel=2,
        )
        return self.dense()


def _dense(w: Any) -> Array:
    return w.materialise() if isinstance(w, quax.ArrayValue) else w


def apply_lora(params: PyTree, adapters: PyTree, *, dropout_key: jax.Array | None = None) -> PyTree:
    """`params` with every adapted weight replaced by a `LoraWeight` (nothing is copied).

    Pass the result to a function wrapped by `lora`. Differentiate with respect to the
    adapters (the `LoraAdapter` tree), not the result, so that no gradient is formed for the
    frozen base: `jax.grad(lambda ad: loss(apply_lora(params, ad)))(adapters)`.

    Args:
      params: the base parameters (quantised tensors allowed).
      adapters: `init_lora` adapters for some of its weights.
      dropout_key: the PRNG key of this step's dropout masks (one per adapted weight and
        leading index); None turns dropout off (evaluation).

    Returns:
      A pytree like `params` with `LoraWeight` leaves at the adapted paths.
    """
    found = check_adapters(params, adapters)
    index = {path: n for n, path in enumerate(found)}

    def wrap(path, leaf):
        name = path_string(path)
        adapter = found.get(name)
        if adapter is None:
            return leaf
        key = None
        if adapter.dropout > 0 and dropout_key is not None:
            lead = tuple(leaf.shape[:-2])
            keys = jax.random.split(jax.random.fold_in(dropout_key, index[name]), math.prod(lead))
            key = jax.random.key_data(keys).reshape(*lead, -1)
        return LoraWeight(
            w=leaf, a=adapter.a, b=adapter.b, key=key, scale=adapter.scale, dropout=adapter.dropout
        )

    return jax.tree_util.tree_map_with_path(
        wrap, params, is_leaf=lambda x: isinstance(x, quax.ArrayValue)
    )


def lora(fn):
    """Wrap `fn` so that `LoraWeight`s and quantised tensors in its arguments act as arrays.

    `fn` is any JAX-traceable function: a model's forward pass taking a parameter pytree,
    `lambda state, x: nnx.merge(graphdef, state)(x)` for a Flax NNX module, a loss. Inside
    it, a matrix product `x @ W` (any `lax.dot_general`, so also `jnp.einsum`, `jnp.dot`,
    Flax's `Linear`) with a `LoraWeight` computes $x W + s\\,(x A) B$, and with an
    `NF4Tensor` or `Int8Tensor` dequantises the weight under a custom VJP that keeps only the
    stored codes for the backward pass. Works under `jax.jit`, `jax.grad`, `jax.vmap`,
    `lax.scan` (stacked layers), `lax.while_loop`, `jax.checkpoint` (remat) and with
    `jax.custom_vjp` functions inside `fn`. This is `quax.quaxify`, plus two rules.

    Note:
      Quax (pinned to `quax>=0.4.6,<0.5` in `pyproject.toml`) does not carry custom VJPs or
      remat regions through its trace, so the first call of any `lora`-wrapped function
      teaches it two rules, once per process (importing `tunelib.peft` changes nothing):
      `process_custom_vjp_call` on Quax's trace class (unless the installed Quax has its
      own) binds a custom-VJP function on plain arrays one level up, materialising an
      adapted weight passed straight into one; and a Quax rule for `jax.checkpoint`'s
      primitive keeps adapted and quantised weights as they are inside the region. Other
      Quax users in the process see both rules from then on.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib import peft
      >>> def mlp(params, x):                       # the user's code, unchanged
      ...     return jnp.tanh(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((4, 8)) / 4, "w2": jnp.ones((8, 2)) / 8}
      >>> adapters = peft.init_lora(params, [peft.LoraRule(pattern="w.", rank=2)],
      ...                           key=jax.random.key(0))
      >>> x = jnp.ones((3, 4))
      >>> out = peft.lora(mlp)(peft.apply_lora(params, adapters), x)
      >>> print(bool(jnp.array_equal(out, mlp(params, x))))  # B = 0: the base, exactly
      True
      >>> def loss(adapters):
      ...     return jnp.sum(peft.lora(mlp)(peft.apply_lora(params, adapters), x) ** 2)
      >>> grads = jax.jit(jax.grad(loss))(adapters)
      >>> print(grads["w1"].a.shape, grads["w1"].b.shape)
      (4, 2) (2, 8)
    """
    quaxified = quax.quaxify(fn)

    @functools.wraps(fn, updated=())
    def run(*args, **kwargs):
        _transforms.install()
        with plain_products():  # the models' products stay plain, for Quax's rules
            return quaxified(*args, **kwargs)

    return run


# ----------------------------------------------------------------------------- dispatch rules


def _swap(x: Any) -> Any:
    """The transpose of the last two axes, for arrays and quantised tensors alike."""
    return x.transpose() if isinstance(x, quax.ArrayValue) else jnp.swapaxes(x, -1, -2)


def _cast(x: Any, dtype) -> Any:
    return x.with_dtype(dtype) if isinstance(x, quax.ArrayValue) else x.astype(dtype)


def _swaps_last_two(permutation: tuple[int, ...]) -> bool:
    n = len(permutation)
    return n >= 2 and tuple(permutation) == (*range(n - 2), n - 1, n - 2)


@quax.register(lax.convert_element_type_p)
def _cast_lora(x: LoraWeight, *, new_dtype, **params) -> LoraWeight:
    del params
    return eqx.tree_at(
        lambda t: (t.w, t.a, t.b),
        x,
        (_cast(x.w, new_dtype), x.a.astype(new_dtype), x.b.astype(new_dtype)),
    )


@quax.register(lax.transpose_p)
def _transpose_lora(x: LoraWeight, *, permutation) -> LoraWeight | Array:
    if not _swaps_last_two(permutation):
        return lax.transpose(x.materialise(), permutation)
    return eqx.tree_at(lambda t: (t.w, t.a, t.b), x, (_swap(x.w), _swap(x.b), _swap(x.a)))


def _dropped(x: Array, weight: LoraWeight) -> Array:
    """The adapter's input: `x` with inverted dropout when the weight carries a key."""
    if weight.key is None or weight.dropout == 0:
        return x
    key = jax.random.wrap_key_data(weight.key.reshape(-1, weight.key.shape[-1])[0])
    keep = jax.random.bernoulli(key, 1.0 - weight.dropout, x.shape)
    return jnp.where(keep, x / (1.0 - weight.dropout), 0).astype(x.dtype)


def lora_dot_general(x: Array, weight: LoraWeight, dimension_numbers, params, weight_is_rhs):
    r"""`dot_general` of `x` with $W + s\,AB$ as $x W + s\,(x A) B$ (or mirrored).

    The low-rank path handles a product that contracts one of the weight's last two axes and
    treats its leading axes (if any) as batch axes in order; any other product materialises.
    """
    (x_contract, w_contract), (x_batch, w_batch) = (
        dimension_numbers
        if weight_is_rhs
        else ((dimension_numbers[0][1], dimension_numbers[0][0]), dimension_numbers[1][::-1])
    )
    n = weight.ndim
    lead = tuple(range(n - 2))
    if len(w_contract) != 1 or w_contract[0] < n - 2 or tuple(w_batch) != lead:
        dense = weight.materialise()
        args = (x, dense) if weight_is_rhs else (dense, x)
        return lax.dot_general(*args, dimension_numbers, **params)
    base_args = (x, weight.w) if weight_is_rhs else (weight.w, x)
    y = quax.quaxify(lax.dot_general)(*base_args, dimension_numbers, **params)
    # Contract x with the factor on the weight's contracted axis, then with the other one.
    first, second = (
        (weight.a, weight.b) if w_contract[0] == n - 2 else (_swap(weight.b), _swap(weight.a))
    )
    inner = {k: params[k] for k in ("precision", "preferred_element_type") if k in params}
    dtype = jnp.result_type(x.dtype, first.dtype)
    first, second = first.astype(dtype), second.astype(dtype)
    t = lax.dot_general(
        _dropped(x, weight), first, ((x_contract, (n - 2,)), (x_batch, lead)), **inner
    )
    u = lax.dot_general(t, second, (((t.ndim - 1,), (n - 2,)), (lead, lead)), **inner)
    if not weight_is_rhs:
        u = jnp.moveaxis(u, -1, n - 2)
    return y + (weight.scale * u).astype(y.dtype)


@quax.register(lax.dot_general_p)
def _dot_lora_right(lhs: ArrayLike, rhs: LoraWeight, *, dimension_numbers, **params) -> Array:
    return lora_dot_general(jnp.asarray(lhs), rhs, dimension_numbers, params, True)


@quax.register(lax.dot_general_p)
def _dot_lora_left(lhs: LoraWeight, rhs: ArrayLike, *, dimension_numbers, **params) -> Array:
    return lora_dot_general(jnp.asarray(rhs), lhs, dimension_numbers, params, False)


@quax.register(grouped_matmul_p)
def _grouped_lora(x: ArrayLike, w: LoraWeight, group_sizes: ArrayLike, **params) -> Array:
    r"""A grouped product with adapted expert weights: $x W_g + s\,(x A_g) B_g$ per group."""
    x = jnp.asarray(x)
    y = quax.quaxify(grouped_matmul_p.bind)(x, w.w, group_sizes, **params)
    dtype = jnp.result_type(x.dtype, w.a.dtype)
    inputs = _dropped(x, w).astype(dtype)
    t = grouped_matmul_p.bind(inputs, w.a.astype(dtype), group_sizes, **params)
    u = grouped_matmul_p.bind(t, w.b.astype(dtype), group_sizes, **params)
    return y + (w.scale * u).astype(y.dtype)

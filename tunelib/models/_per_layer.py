"""Stacked layer weights held one array per layer, so that a loop over the layers multiplies
by each layer's weight where it lies instead of copying it out of the stack.

XLA on CPU (and on GPU) runs a matrix product on whole buffers: a product by one layer's
slice of a stacked `[L, ...]` weight, taken at a traced layer index inside a loop, is preceded
by a copy of that slice (a `dynamic-slice` into a fresh buffer), every time the loop runs.
Holding the weight as `L` arrays and choosing among them with `lax.switch` on the layer
index gives each branch a product by a whole array, so nothing is copied: the loop keeps the
compiled size of one layer (plus one product per layer in each branch set) instead of
unrolling the layers. `Decoder.decoding_layout` makes them.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


@jax.tree_util.register_pytree_node_class
class PerLayer:
    """One weight of `L` stacked layers as `L` arrays, layer order (a pytree of them; as any
    pytree node it may hold other leaves than arrays: shapes, tracers)."""

    def __init__(self, arrays: tuple):
        self.arrays = tuple(arrays)

    @classmethod
    def unstack(cls, stacked: jax.Array) -> "PerLayer":
        """The `[L, ...]` `stacked` weight as `L` arrays (one copy of it). Each is cut at a
        traced index: one compiled slice per shape, not one per layer."""
        take = lambda i: jax.lax.dynamic_index_in_dim(stacked, i, keepdims=False)  # noqa: E731
        return cls(tuple(take(jnp.int32(i)) for i in range(stacked.shape[0])))

    def at(self, index: jax.Array) -> "LayerWeight":
        """Layer `index`'s weight (traced), for `LayerWeight.product`."""
        return LayerWeight(self.arrays, index, self.arrays[0].dtype)

    def tree_flatten(self):
        return self.arrays, None

    @classmethod
    def tree_unflatten(cls, _, arrays):
        return cls(arrays)


class LayerWeight:
    """Layer `index`'s weight among the `arrays` of a `PerLayer`, read in place by
    `product`. It stands where a layer's weight array stands in a module
    (`variable[...]`, `.astype(dtype)`, `.shape`, `.dtype`), so the module code is unchanged
    up to its product."""

    def __init__(self, arrays: tuple[jax.Array, ...], index: jax.Array, dtype: DTypeLike):
        self.arrays, self.index, self.dtype = arrays, index, jnp.dtype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.arrays[0].shape

    @property
    def ndim(self) -> int:
        return self.arrays[0].ndim

    def __getitem__(self, key):
        if key is not Ellipsis:
            raise TypeError(f"a LayerWeight is read whole ([...]), not at {key!r}.")
        return self

    def astype(self, dtype: DTypeLike) -> "LayerWeight":
        return LayerWeight(self.arrays, self.index, dtype)

    def product(self, fn: Callable[[jax.Array, jax.Array], jax.Array], x: jax.Array):
        """`fn(x, weight)` for this layer's weight (in this dtype): one `lax.switch` branch
        per layer, each with its own whole array."""
        branches = [lambda x, w=w: fn(x, w.astype(self.dtype)) for w in self.arrays]
        return jax.lax.switch(self.index, branches, x)


def is_per_layer(x: object) -> bool:
    return isinstance(x, PerLayer)


def layer_at(state, index: jax.Array):
    """Layer `index` (traced) of a stacked layers' `state`: `LayerWeight`s of its
    `PerLayer` weights, and its slice of every other (small) array."""

    def at(leaf):
        if isinstance(leaf, PerLayer):
            return leaf.at(index)
        return jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False)

    return jax.tree.map(at, state, is_leaf=is_per_layer)

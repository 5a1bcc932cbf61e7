"""Label trees that tell an Optax optimizer the adapters from the frozen base."""

import dataclasses

import jax
from jaxtyping import PyTree

from tunelib.peft._adapters import LoraAdapter
from tunelib.peft._weights import LoraWeight


def lora_labels(tree: PyTree, *, trainable: str = "lora", frozen: str = "frozen") -> PyTree:
    """A label tree for `optax.partition`: `trainable` on adapter leaves, `frozen` elsewhere.

    Adapter leaves are the `a` and `b` of every `LoraAdapter` (and of every `LoraWeight`)
    in `tree`, so one tree can hold the base and the adapters, for example
    `{"base": params, "lora": adapters}`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from tunelib import peft
      >>> tree = {"base": {"w": jnp.ones((3, 2))},
      ...         "lora": {"w": peft.LoraAdapter(a=jnp.ones((3, 1)), b=jnp.zeros((1, 2)))}}
      >>> labels = peft.lora_labels(tree)
      >>> print(labels["base"]["w"], labels["lora"]["w"].a)
      frozen lora
      >>> optimizer = optax.partition({"lora": optax.adam(1e-3), "frozen": optax.set_to_zero()},
      ...                             labels)
    """

    def label(node):
        if isinstance(node, LoraAdapter):
            return dataclasses.replace(node, a=trainable, b=trainable)
        if isinstance(node, LoraWeight):
            frozen_w = jax.tree.map(lambda _: frozen, node.w)
            key = None if node.key is None else frozen
            return dataclasses.replace(node, w=frozen_w, a=trainable, b=trainable, key=key)
        return frozen

    return jax.tree.map(label, tree, is_leaf=lambda x: isinstance(x, LoraAdapter | LoraWeight))


def lora_mask(tree: PyTree) -> PyTree:
    """`lora_labels` as booleans (True on adapter leaves), for `optax.masked`."""
    labels = lora_labels(tree, trainable="lora", frozen="frozen")
    return jax.tree.map(lambda label: label == "lora", labels)

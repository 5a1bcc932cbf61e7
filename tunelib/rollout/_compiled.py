"""How the rollout's programs are compiled: `jax.jit`, on plain, adapted or quantised weights.

`sample` and `run_episodes` run jitted programs that take the model's parameters second. Those
parameters may hold `tunelib.peft` values: `LoraWeight`s from `peft.apply_lora` (a base plus
adapters, never merged) and quantised tensors (`peft.quantize_params`, `peft.gguf_base`). A
program given such parameters runs through `peft.lora`, so its products compute
$xW + s\\,(xA)B$ and dequantise per layer, and no dense copy of the weights is formed.

`peft.lora` traces inside `tunelib._products.plain_products()`, and the sampler's
`products="plain"` inside `unblocked_products()`: each changes the program a model traces
(float32 products on CPU stay one plain product). A jitted function caches its trace by the
shapes of its arguments, and an adapted weight has the shape of its base: so the contexts
(`products_key()`) are a static argument of every program here, and the programs of the
same shapes traced in different contexts are compiled apart (otherwise the one traced first
would serve all, and a blocked product met by an adapted weight would form it densely).
"""

import functools
from collections.abc import Callable

import jax
import quax
from jaxtyping import PyTree

from tunelib import peft
from tunelib._products import products_key


def holds_peft_values(params: PyTree) -> bool:
    """Whether `params` hold adapted (`peft.LoraWeight`) or quantised weights."""
    is_value = lambda x: isinstance(x, quax.ArrayValue)  # noqa: E731
    return any(is_value(leaf) for leaf in jax.tree.leaves(params, is_leaf=is_value))


def program(
    *, static_argnums: tuple[int, ...], donate_argnums: tuple[int, ...] = ()
) -> Callable[[Callable], Callable]:
    """`jax.jit` for a rollout program `fn(graphdef, params, ...)`, with its static and
    donated positional arguments; parameters holding `tunelib.peft` values run it through
    `peft.lora`."""

    def wrap(fn: Callable) -> Callable:
        shifted = lambda nums: tuple(i + 1 for i in nums)  # noqa: E731
        keyed = jax.jit(
            lambda plain, *args: fn(*args),
            static_argnums=(0, *shifted(static_argnums)),
            donate_argnums=shifted(donate_argnums),
        )

        def run(*args):
            return keyed(products_key(), *args)

        adapted = peft.lora(run)

        @functools.wraps(fn)
        def call(*args):
            return adapted(*args) if holds_peft_values(args[1]) else run(*args)

        call._cache_size = keyed._cache_size  # compilations so far, plain and adapted
        return call

    return wrap

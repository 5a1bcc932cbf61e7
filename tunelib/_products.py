"""How the models' matrix products are traced: plain, or blocked over their inputs (read at
trace time).

`tunelib.models`' dense layers rewrite float32 products on CPU into blocked sums, for
accuracy (`Dense`). Two contexts make them one plain `x @ W` instead:

- `plain_products()`, a must: under `tunelib.peft.lora` a weight may be an adapted or
  quantised value whose own product rule computes it without forming the dense weight.
  Inside a `lax.scan` over stacked layers the layer cannot tell: its weight is traced as a
  plain array, and Quax interprets the traced program afterwards, where a reshaped weight is
  formed in full. So `peft.lora` traces its function inside `plain_products()`, and the
  layers check `products_must_be_plain()`; so does `Decoder.decoding_layout`, which leaves
  such weights as they are.
- `unblocked_products()`, a choice of speed over the last bits of float32 accuracy (the
  sampler's `products="plain"`): the weights stay as they are, each product is one dot.

A program traced in either context differs from one traced outside, so whoever caches traced
programs keys them by `products_key()`.
"""

import contextlib
import contextvars
from collections.abc import Iterator

_PLAIN = contextvars.ContextVar("tunelib_plain_products", default=False)
_UNBLOCKED = contextvars.ContextVar("tunelib_unblocked_products", default=False)


@contextlib.contextmanager
def plain_products() -> Iterator[None]:
    """Within the block, every product a model traces is one plain `x @ W`."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


@contextlib.contextmanager
def unblocked_products() -> Iterator[None]:
    """Within the block, `Dense`'s float32 products on CPU are one plain `x @ W` each, by
    choice (weights and layouts unchanged)."""
    token = _UNBLOCKED.set(True)
    try:
        yield
    finally:
        _UNBLOCKED.reset(token)


def products_must_be_plain() -> bool:
    """Whether the function being traced runs inside `plain_products()`."""
    return _PLAIN.get()


def products_are_blocked() -> bool:
    """Whether `Dense` may block the float32 products it traces: outside both contexts."""
    return not (_PLAIN.get() or _UNBLOCKED.get())


def products_key() -> tuple[bool, bool]:
    """The contexts a function is traced in, as a key for a cache of traced programs."""
    return _PLAIN.get(), _UNBLOCKED.get()

"""Whether a matrix product must stay one plain `x @ W` (read at trace time).

`tunelib.models`' dense layers rewrite float32 products on CPU into blocked sums, for
accuracy (`Dense`). Under `tunelib.peft.lora` a weight may be an adapted or quantised value
whose own product rule computes it without forming the dense weight. Inside a `lax.scan` over
stacked layers the layer cannot tell: its weight is traced as a plain array, and Quax
interprets the traced program afterwards, where a reshaped weight is formed in full. So
`peft.lora` traces its function inside `plain_products()`, and the layers check
`products_must_be_plain()`.
"""

import contextlib
import contextvars
from collections.abc import Iterator

_PLAIN = contextvars.ContextVar("tunelib_plain_products", default=False)


@contextlib.contextmanager
def plain_products() -> Iterator[None]:
    """Within the block, every product a model traces is one plain `x @ W`."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


def products_must_be_plain() -> bool:
    """Whether the function being traced runs inside `plain_products()`."""
    return _PLAIN.get()

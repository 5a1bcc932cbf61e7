r"""What the losses of the DPO family share: a preference pair's log-ratios and arguments.

Every loss of the DPO family takes the four `[B]` sequence log-probabilities of a preference
pair, the policy's and the reference model's for the chosen ($y_w$) and the rejected ($y_l$)
completion, and sees them only through their log-ratios

$$
r_w = \log \frac{\pi_\theta(y_w)}{\pi_{\mathrm{ref}}(y_w)}, \qquad
r_l = \log \frac{\pi_\theta(y_l)}{\pi_{\mathrm{ref}}(y_l)}, \qquad
h = r_w - r_l,
$$

as Optax's classification losses see their inputs only through logits. Each loss is a link,
a function of the margin $h$ or of the two log-ratios and of its hyperparameters, with its
paper; its entry lists those hyperparameters, and these arguments it shares with the family
(`help()` shows them in each loss's own list):

- `chosen_logps`: `[B]` policy log-probabilities of the chosen completions, each the sum of
  its token log-probs over the completion (the per-token mean where the loss says so).
- `rejected_logps`: `[B]` policy log-probabilities of the rejected completions.
- `ref_chosen_logps`: `[B]` reference-policy log-probabilities of the chosen completions.
- `ref_rejected_logps`: `[B]` reference-policy log-probabilities of the rejected ones.
- `where`: `[B]` mask, True (or 1) = counts. Masked rows give exactly 0 and a zero gradient,
  even when their inputs are NaN or infinite.
"""

import inspect
import itertools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from tunelib import _validation as v

# The family's four data arguments, in their order.
PAIR = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")


def _args_section(doc: str) -> tuple[list[str], int, int, dict[str, list[str]]]:
    """A docstring's lines, the bounds of its Args entries, and each entry's lines by name."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "Args:") + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    indent = len(lines[start]) - len(lines[start].lstrip())
    entries: dict[str, list[str]] = {}
    for line in lines[start:end]:
        if not line[indent].isspace():
            name = line[indent:].split(":", 1)[0]
            entries[name] = []
        entries[name].append(line[indent:])
    return lines, start, end, entries


def _listed_arguments(doc: str) -> dict[str, list[str]]:
    """The entries of the list "- `name`: text" in `doc`, as the lines of Args entries."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("- `"))
    entries: dict[str, list[str]] = {}
    for line in itertools.takewhile(str.strip, lines[start:]):
        if line.startswith("- `"):
            name, text = line[len("- `") :].split("`: ", 1)
            entries[name] = [f"{name}: {text}"]
        else:
            entries[name].append(line)
    return entries


# The family's argument block, the list in this module's docstring, as Args entries.
PAIR_ARGUMENTS = _listed_arguments(__doc__) if __doc__ else {}


def with_pair_arguments(fn: Callable) -> Callable:
    """Completes `fn`'s Args section with the family's arguments it does not document.

    The section is rewritten in the order of `fn`'s signature: an argument keeps its own
    entry when the docstring has one (a loss that reads an argument differently says so
    there), and takes the entry of `PAIR_ARGUMENTS` otherwise. Only the docstring changes.
    """
    if not fn.__doc__:  # python -OO
        return fn
    lines, start, end, own = _args_section(fn.__doc__)
    indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
    entries = []
    for name in inspect.signature(fn).parameters:
        entries += [indent + line for line in own.pop(name, None) or PAIR_ARGUMENTS.get(name, [])]
    if own:
        raise TypeError(f"{fn.__qualname__} documents arguments it does not take: {list(own)}.")
    fn.__doc__ = "\n".join([*lines[:start], *entries, *lines[end:]])
    return fn


def pair_logps(
    pair: Sequence[ArrayLike], where: ArrayLike | None
) -> tuple[list[jax.Array], jax.Array]:
    """The checked `[B]` log-probs of `pair` (0 on masked rows) and the mask.

    `pair` holds the family's four data arguments in the order of `PAIR`; the errors name
    them.
    """
    return v.masked_floats(where, ndim=1, **dict(zip(PAIR, pair, strict=True)))


def dpo_margin(pair: Sequence[ArrayLike], where: ArrayLike | None) -> tuple[jax.Array, jax.Array]:
    """The checked margin `h` of `pair` (0 on masked rows) and the mask.

    Computed as the policy's log-odds minus the reference's, as TRL does.
    """
    (chosen, rejected, ref_chosen, ref_rejected), where = pair_logps(pair, where)
    return (chosen - rejected) - (ref_chosen - ref_rejected), where


def _in_dtype(hyperparameters: dict[str, ArrayLike], dtype: jnp.dtype) -> dict[str, jax.Array]:
    return {name: jnp.asarray(x, dtype) for name, x in hyperparameters.items()}


def on_margin(
    link: Callable[..., jax.Array],
    pair: Sequence[ArrayLike],
    where: ArrayLike | None,
    **hyperparameters: ArrayLike,
) -> jax.Array:
    """`link(h, **hyperparameters)` per pair, 0 on masked rows.

    The caller checks the hyperparameters; the link gets them in the margin's dtype.
    """
    h, where = dpo_margin(pair, where)
    return jnp.where(where, link(h, **_in_dtype(hyperparameters, h.dtype)), 0.0)


def on_log_ratios(
    link: Callable[..., jax.Array],
    pair: Sequence[ArrayLike],
    where: ArrayLike | None,
    **hyperparameters: ArrayLike,
) -> jax.Array:
    """`link(r_w, r_l, **hyperparameters)` per pair, 0 on masked rows (as `on_margin`)."""
    (chosen, rejected, ref_chosen, ref_rejected), where = pair_logps(pair, where)
    r_w, r_l = chosen - ref_chosen, rejected - ref_rejected
    return jnp.where(where, link(r_w, r_l, **_in_dtype(hyperparameters, r_w.dtype)), 0.0)

"""Weight deltas for disaggregated RL: only the elements an update changed, bit for bit."""

from typing import NamedTuple

import jax
import numpy as np
from jaxtyping import PyTree

from tunelib.rollout._policy import fingerprint

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class WeightDelta(NamedTuple):
    """What changed between two trees of weights of the same structure, shapes and dtypes.

    Attributes:
      positions: per leaf, in tree order, the flat positions of its changed elements (int32,
        int64 for a leaf of more than 2**31 elements), ascending.
      values: per leaf, the new elements at those positions (the leaf's dtype).
      fingerprint: `tunelib.rollout.fingerprint` of the new tree, checked on arrival.
    """

    positions: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    fingerprint: int

    @classmethod
    def receiving(cls, previous: PyTree, counts, fingerprint: int) -> "WeightDelta":
        """Zeros shaped as a delta of `previous` with `counts[i]` changed elements in leaf i
        and `fingerprint`: what a receiver that was sent the counts fills with the positions
        and values (they travel as arrays of these shapes and dtypes)."""
        old, _ = _leaves(previous)
        if len(counts) != len(old):
            raise ValueError(f"{len(counts)} counts for the {len(old)} leaves of previous.")
        counts = [int(n) for n in counts]
        positions = tuple(
            np.zeros(n, _position_dtype(x.size)) for n, x in zip(counts, old, strict=True)
        )
        values = tuple(np.zeros(n, x.dtype) for n, x in zip(counts, old, strict=True))
        return cls(positions, values, int(fingerprint))

    @property
    def changed(self) -> int:
        """The number of changed elements."""
        return sum(p.size for p in self.positions)

    @property
    def nbytes(self) -> int:
        """The bytes of its positions and values: what a push of it sends."""
        return sum(p.nbytes + v.nbytes for p, v in zip(self.positions, self.values, strict=True))


def _leaves(tree: PyTree) -> tuple[list[np.ndarray], object]:
    leaves, structure = jax.tree.flatten(tree)
    return [np.asarray(x) for x in leaves], structure


def _position_dtype(size: int):
    """The positions' dtype in a leaf of `size` elements."""
    return np.int32 if size < 2**31 else np.int64


def _bits(x: np.ndarray) -> np.ndarray:
    """The elements' bits as unsigned integers of their width (NaN payloads and the sign of
    zero included)."""
    return np.ascontiguousarray(x).reshape(-1).view(_UNSIGNED[x.dtype.itemsize])


def weight_delta(
    previous: PyTree, current: PyTree, *, max_bytes: int | None = None
) -> WeightDelta | None:
    r"""The elements of `current` whose bits differ from `previous`'s, and where they are.

    A receiver that holds `previous` rebuilds `current` exactly from it
    (`apply_weight_delta`). Elements are compared as bits, so the delta is exact for any dtype
    (a NaN or a -0.0 that changed is sent; an unchanged NaN is not). What a delta saves
    depends on the dtype: after an update of small steps most float32 elements change in
    their low bits, while far fewer survive the rounding to bfloat16 (TRL measured about
    99 % of a bfloat16 model's elements unchanged between steps); compare `nbytes` with the
    tree's own bytes and send the whole tree when the delta is not smaller. Host arrays
    (NumPy, or JAX arrays fetched to the host).

    Args:
      previous: a pytree of arrays: what the receiver holds.
      current: a pytree of the same structure, shapes and dtypes.
      max_bytes: the most bytes the delta may have (`WeightDelta.nbytes`), such as the
        tree's own: when it would have more, None is returned once the changed elements
        counted leaf by leaf pass the bound, before the positions of that leaf are made (a
        push that will send the whole tree does not pay for the positions of most of its
        elements: a push of Qwen3-0.6B's bfloat16 shapes with 98 % of the elements changed
        took 12.1 s instead of 30.4 s, the whole tree's own push 9.1 s,
        `benchmarks/weight_push.py`). None: no bound.

    Returns:
      A `WeightDelta`: the changed positions and values per leaf, and `current`'s
      fingerprint; None when it would have more than `max_bytes`.

    Raises:
      ValueError: when the trees' structures, shapes or dtypes differ.

    Examples:
      >>> import numpy as np
      >>> from tunelib.rollout import apply_weight_delta, weight_delta
      >>> before = {"w": np.zeros((2, 3), np.float32), "b": np.ones(3, np.float32)}
      >>> after = {"w": before["w"].copy(), "b": before["b"].copy()}
      >>> after["w"][1, 2] = 0.5
      >>> delta = weight_delta(before, after)
      >>> print(delta.changed, delta.nbytes, [p.tolist() for p in delta.positions])
      1 8 [[], [5]]
      >>> rebuilt = apply_weight_delta(before, delta)
      >>> print(np.array_equal(rebuilt["w"], after["w"]), rebuilt["w"] is before["w"])
      True False
      >>> print(weight_delta(before, after, max_bytes=7))   # 8 bytes: send the whole tree
      None
    """
    old, structure = _leaves(previous)
    new, new_structure = _leaves(current)
    if structure != new_structure:
        raise ValueError(
            f"previous and current differ in structure: {structure} and {new_structure}."
        )
    _check_alike(old, new)
    positions, values, nbytes = [], [], 0
    for a, b in zip(old, new, strict=True):
        differ = _bits(a) != _bits(b)
        index = _position_dtype(b.size)
        if max_bytes is not None:  # counted before any position of this leaf is made
            nbytes += int(np.count_nonzero(differ)) * (np.dtype(index).itemsize + b.itemsize)
            if nbytes > max_bytes:
                return None
        changed = np.flatnonzero(differ).astype(index)
        positions.append(changed)
        values.append(np.ascontiguousarray(b).reshape(-1)[changed])
    return WeightDelta(tuple(positions), tuple(values), int(fingerprint(new)))


def _check_alike(old: list, new: list) -> None:
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"leaf {i} of previous is {a.dtype}{list(a.shape)}, of current "
                f"{b.dtype}{list(b.shape)}: a delta needs the same shapes and dtypes."
            )


def apply_weight_delta(previous: PyTree, delta: WeightDelta, *, check: bool = True) -> PyTree:
    """`previous` with `delta`'s elements written in: the tree `weight_delta` was made from.

    The result is new arrays (`previous` is not changed). With `check` the result's
    fingerprint is compared with the one the delta carries, so a delta applied to other
    weights than those it was made against (a missed push, a restart) is refused instead of
    giving a tree that is neither.

    Args:
      previous: the pytree of host arrays the delta was made against.
      delta: a `WeightDelta` from `weight_delta(previous, current)`.
      check: compare the result's fingerprint with `delta.fingerprint`.

    Returns:
      The current tree, as NumPy arrays of `previous`' structure.

    Raises:
      ValueError: when the delta has another number of leaves, names positions outside a
        leaf, or (with `check`) the result's fingerprint is not the delta's.
    """
    old, structure = _leaves(previous)
    if len(old) != len(delta.positions) or len(old) != len(delta.values):
        raise ValueError(
            f"the delta has {len(delta.positions)} leaves, previous {len(old)}: it was made "
            f"for another tree."
        )
    out = []
    for i, (a, where, value) in enumerate(zip(old, delta.positions, delta.values, strict=True)):
        flat = np.array(a, copy=True).reshape(-1)
        if where.size and (where.min() < 0 or where.max() >= flat.size):
            raise ValueError(f"the delta names positions outside leaf {i} of {flat.size}.")
        flat[where] = value
        out.append(flat.reshape(a.shape))
    rebuilt = structure.unflatten(out)
    if check:
        got = int(fingerprint(out))
        if got != delta.fingerprint:
            raise ValueError(
                f"the weights the delta was applied to are not those it was made against "
                f"(fingerprint {got:#010x} after applying it, expected "
                f"{delta.fingerprint:#010x}): send the whole weights."
            )
    return rebuilt

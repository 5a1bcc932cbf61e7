"""`largest_batch` is the largest batch that fits by a direct check of every candidate;
`resize_batch` keeps dtypes, shardings and rows per example."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests._helpers import raises_naming
from tunelib.memory import MemoryPlan, largest_batch, memory_plan, resize_batch

H, MULTIPLE, TOP = 128, 8, 256
W = jax.ShapeDtypeStruct((H, H), jnp.float32)


def layer(w, x):
    return jnp.tanh(jnp.tanh(x @ w) @ w) @ w


@functools.cache
def compiled_plan(rows: int) -> MemoryPlan:
    return memory_plan(layer, W, jax.ShapeDtypeStruct((rows, H), jnp.float32))


@functools.cache
def every_peak() -> dict[int, int]:
    """The direct check: every candidate batch size compiled."""
    return {b: compiled_plan(b).peak_bytes for b in range(MULTIPLE, TOP + 1, MULTIPLE)}


def largest_by_direct_check(memory: int) -> int:
    return max((b for b, peak in every_peak().items() if peak <= memory), default=0)


@given(st.integers(0, 10**6), st.sampled_from([8, 64, 256]))
def test_the_search_finds_what_compiling_every_size_finds(extra, start):
    peaks = every_peak()
    assert list(peaks.values()) == sorted(peaks.values())  # the peak grows with the batch
    memory = peaks[MULTIPLE] - 1000 + extra  # from nothing fitting to everything
    calls = []

    def plan_at(rows):
        calls.append(rows)
        return compiled_plan(rows)

    found = largest_batch(
        plan_at, device_memory=memory, start=start, multiple_of=MULTIPLE, max_size=TOP
    )
    assert found.size == largest_by_direct_check(memory)
    assert sorted(found.peaks) == sorted(set(calls)) and len(calls) == len(set(calls))
    assert all(found.peaks[b] == peaks[b] for b in found.peaks)
    if found.size:
        assert found.plan == compiled_plan(found.size) and found.plan.peak_bytes <= memory
        assert found.size == TOP or found.peaks[found.size + MULTIPLE] > memory  # checked
    else:
        assert found.plan is None and found.peaks[MULTIPLE] > memory
    assert len(calls) <= 8  # the line through two peaks lands near the answer


def fake_plan(peak: int) -> MemoryPlan:
    fields = dict.fromkeys(MemoryPlan._fields, 0)
    return MemoryPlan(**{**fields, "peak_bytes": peak, "activations_bytes": None})


@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=40),
    st.integers(0, 1000),
    st.integers(1, 40),
)
def test_any_nondecreasing_peak_gives_the_largest_size_that_fits(steps, memory, start):
    """Peaks that are not linear in the batch (jumps, plateaus) take more compilations, not
    a wrong answer."""
    peaks = np.cumsum(steps)  # peaks[b - 1] for b = 1 .. len(steps)
    top = len(steps)
    start = min(start, top)
    found = largest_batch(
        lambda b: fake_plan(int(peaks[b - 1])), device_memory=max(memory, 1), start=start,
        max_size=top,
    )  # fmt: skip
    fitting = [b for b in range(1, top + 1) if peaks[b - 1] <= max(memory, 1)]
    assert found.size == (max(fitting) if fitting else 0)


def test_resize_batch_keeps_dtypes_shardings_and_rows_per_example():
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 devices")
    rows = NamedSharding(Mesh(devices, ("data",)), P("data"))
    batch = {
        "prompts": jax.ShapeDtypeStruct((8, 5), jnp.int32, sharding=rows),
        "tokens": jnp.zeros((32, 7), jnp.bfloat16, device=rows),  # 4 completions a prompt
        "step": jnp.int32(3),
    }
    out = resize_batch(batch, 24)
    assert out["prompts"].shape == (24, 5) and out["tokens"].shape == (96, 7)
    assert out["tokens"].dtype == jnp.bfloat16 and out["tokens"].sharding == rows
    assert (out["step"].shape, out["step"].dtype) == ((), jnp.int32)  # no batch axis: kept
    # Split over 8 devices, the prompts must stay a multiple of 8.
    with raises_naming("size 12", "multiple of 8"):
        resize_batch(batch, 12)
    # Unsharded, any size.
    plain = {"x": jax.ShapeDtypeStruct((6, 3), jnp.float32), "y": np.zeros((12,), np.int8)}
    assert jax.tree.map(lambda x: x.shape, resize_batch(plain, 5)) == {"x": (5, 3), "y": (10,)}


def test_bad_searches_and_batches_name_what_is_wrong():
    with raises_naming("multiple of the batch size 4"):
        resize_batch({"a": np.zeros((4, 2)), "b": np.zeros((6, 2))}, 2)
    with raises_naming("no array with a first"):
        resize_batch({"a": np.float32(1.0)}, 2)
    with raises_naming("size", ">= 1"):
        resize_batch({"a": np.zeros((4, 2))}, 0)
    with raises_naming("start", "multiple of"):
        largest_batch(compiled_plan, device_memory=2**20, start=12, multiple_of=8)
    with raises_naming("max_size"):
        largest_batch(compiled_plan, device_memory=2**20, start=16, max_size=8)
    with raises_naming("multiple_of", ">= 1"):
        largest_batch(compiled_plan, device_memory=2**20, start=16, multiple_of=0)
    with raises_naming("device_memory", ">= 1"):
        largest_batch(compiled_plan, device_memory=0, start=16)

"""Assertions and strategies shared by the test modules."""

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import chex
import hypothesis.extra.numpy as hnp
import jax
import jaxtyping
import numpy as np
import PIL.Image
import pytest
from hypothesis import strategies as st


def finite_floats(low: float = -20.0, high: float = 20.0) -> st.SearchStrategy[float]:
    """Finite float32 values without subnormals.

    XLA on CPU flushes subnormals to zero, so -1e-45 and 0.0 tie inside a kernel but not in a
    NumPy reference (an argmax then picks different tokens); such inputs test XLA, not us.
    """
    return st.floats(
        low, high, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32
    )


def float_arrays(shape: Sequence[int], low: float = -20.0, high: float = 20.0):
    """Float32 arrays of `shape` with bounded, finite entries."""
    return hnp.arrays(np.float32, tuple(shape), elements=finite_floats(low, high))


def bool_arrays(shape: Sequence[int]):
    return hnp.arrays(np.bool_, tuple(shape))


@contextlib.contextmanager
def raises_naming(
    *names: str, error: type[Exception] | tuple = (ValueError, TypeError)
) -> Iterator:
    """Expect an error whose message names every one of `names`.

    Under the test suite's runtime type checking, jaxtyping reports shape and dtype mismatches
    (as a `TypeError` naming the argument) before tunelib's own checks run; `own_checks`
    switches it off to test those.
    """
    with pytest.raises(error) as info:
        yield info
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"


@contextlib.contextmanager
def own_checks() -> Iterator[None]:
    """Run with jaxtyping's runtime checking off, so tunelib's own trace-time checks answer."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def assert_traced_once(fn: Callable, calls: Sequence[tuple[tuple, dict]]) -> None:
    """Jit `fn`, run every call, and fail if `fn` was traced more than once.

    `calls` differ only in the values (not shapes) of their arguments, including numeric
    hyperparameters passed as arrays: none of them may trigger a recompilation.
    """
    jitted = jax.jit(chex.assert_max_traces(fn, n=1))
    for args, kwargs in calls:
        jax.block_until_ready(jitted(*args, **kwargs))
    chex.clear_trace_counter()


def assert_close(actual, expected, *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


def assert_within_float32_rounding(got, float32, exact, *, factor: float = 4.0):
    """Each leaf of `got` is within `factor` R max|exact| of the leaf of `exact`, for R
    float32's relative rounding: the largest distance of a leaf of `float32` from `exact`,
    relative to that leaf's largest entry (and at least float32's epsilon).

    For two float32 computations of one function (`float32`, and `exact` its float64 twin on
    the same weights) that sum in different orders: each rounds by about as much, how much
    depends on the CPU, and R pools it over every leaf (a small leaf's own maximum is a noisy
    estimate of it)."""
    leaves = [
        (np.asarray(g, np.float64), np.asarray(f, np.float64), np.asarray(e, np.float64))
        for g, f, e in zip(jax.tree.leaves(got), jax.tree.leaves(float32),
                           jax.tree.leaves(exact), strict=True)
    ]  # fmt: skip
    relative = np.finfo(np.float32).eps
    for _, f, e in leaves:
        relative = max(relative, np.abs(f - e).max() / max(np.abs(e).max(), 1e-30))
    assert relative < 1e-4  # float32's rounding, not a bug's
    for g, _, e in leaves:
        assert_close(g, e, rtol=0, atol=factor * relative * np.abs(e).max())


def x64_copies(*arrays) -> tuple[np.ndarray, ...]:
    """Fresh copies of module-level NumPy arrays, to use under `jax.enable_x64`.

    JAX keeps the device copy of a NumPy array that a jitted function traced, and hands it to
    later calls given the same object even in the other mode: an int64 buffer to a program
    compiled for int32 or the reverse (`RuntimeProgramInputMismatch`). A test's float64 part
    works on copies, so that the module's arrays stay the float32 tests' alone."""
    return tuple(np.array(x) for x in arrays)


def user_env(*, compilation_cache: bool = False) -> dict:
    """The environment a user's script runs in: one CPU device, not the test session's eight
    (the session's other compile-time XLA flags stay).

    With `compilation_cache`, the script shares the session's JAX compilation cache (made in
    `conftest.py`), so a train step that one recipe run compiled loads from disk in the next.
    The cache has no size limit: with one, JAX lists and reads every entry of the folder at
    each write to choose what to evict, under a lock, which made a recipe run that writes
    its programs into a folder of 3,000 entries take 6.9 s instead of 3.8 s. An entry read
    while another process writes it fails JAX's decompression and is compiled instead (with
    a warning). Benchmarks whose checked figures are compile times run without the cache
    (`tests/benchmarks/_run.py`).
    """
    out = {
        k: v
        for k, v in os.environ.items()
        if k != "XLA_FLAGS" and not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
    }
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    if flags:
        out["XLA_FLAGS"] = " ".join(flags)
    out["JAX_PLATFORMS"] = "cpu"
    cache = os.environ.get("TUNELIB_TEST_COMPILATION_CACHE")
    if compilation_cache and cache:
        out["JAX_COMPILATION_CACHE_DIR"] = cache
        out["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        out["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return out


def load_script(path: Path, name: str) -> ModuleType:
    """Import a script that is not part of a package (a benchmark) as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_image(
    rng: np.random.Generator, height: int, width: int, mode: str = "RGB"
) -> PIL.Image.Image:
    """A PIL image of random pixels: mode "RGB", "RGBA" or "L" (grey)."""
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return PIL.Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)

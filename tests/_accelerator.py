"""The devices of the accelerator tier (tests marked `accelerator`, docs/tpu.md).

The tier computes on JAX's default backend, a GPU or a TPU, and its references on the host's
CPU backend beside it (`conftest.py` adds it to `JAX_PLATFORMS`) or in float64 NumPy. With
`TUNELIB_ACCELERATOR_TESTS_ON_CPU=1` the default backend is the CPU itself and the Pallas
kernels run in the interpreter: a check of the tests, not of an accelerator.
"""

import contextlib
from collections.abc import Iterator

import jax

from tests._precision import backend_name


def backend() -> str:
    """The backend under test: "tpu", "gpu", or "cpu" when the tier is checked on a CPU."""
    return backend_name()


def interpreted() -> bool:
    """Whether Pallas kernels run in the interpreter (the tier on a CPU)."""
    return backend() == "cpu"


def kernel_options() -> dict:
    """Keyword arguments of `fused_token_logps_pallas`: the default backend's own compiled
    kernels, or on a CPU the TPU kernels (the tier's first target) in the interpreter."""
    return {"platform": "tpu", "interpret": True} if interpreted() else {}


def host() -> jax.Device:
    return jax.devices("cpu")[0]


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Computations on uncommitted inputs inside run on the host's CPU."""
    with jax.default_device(host()):
        yield

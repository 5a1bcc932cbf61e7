"""Test-session setup shared by `tests/` and the doctests in `tunelib/`.

Runs before anything imports JAX or tunelib: simulates 8 CPU devices, turns on runtime shape
and dtype checking of every annotated tunelib function (jaxtyping + beartype), and registers
the hypothesis profiles.
"""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import HealthCheck, settings  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

install_import_hook("tunelib", "beartype.beartype")

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=200, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

"""Memory plans as text, and the memory a device has."""

from collections.abc import Mapping

import jax

from tunelib.memory._plan import MemoryPlan, check_device_memory

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

# The rows of `format_plans`: (label, field); None in the table where a plan has no value.
_ROWS = (
    ("params", "params_bytes"),
    ("frozen weights", "frozen_bytes"),
    ("optimizer state", "opt_state_bytes"),
    ("inputs", "inputs_bytes"),
    ("constants", "constant_bytes"),
    ("outputs", "output_bytes"),
    ("  less donated", "alias_bytes"),
    ("gradients", "gradients_bytes"),
    ("activations", "activations_bytes"),
    ("KV cache", "kv_cache_bytes"),
    ("other temporaries", "temporaries_bytes"),
    ("program", "generated_code_bytes"),
    ("peak", "peak_bytes"),
)


def format_bytes(count: int) -> str:
    """`count` bytes in binary units, three significant digits: `format_bytes(3 * 2**29)` is
    `'1.50 GiB'`."""
    value, unit = float(count), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(count)} B"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {_UNITS[unit]}"


def format_plans(plans: Mapping[str, MemoryPlan], *, device_memory: int | None = None) -> str:
    """A table of memory plans side by side, one column each, per device.

    The rows are the plan's split: the arguments (params, frozen weights, optimizer state,
    inputs), the constants, the outputs (less those written into donated arguments), the
    temporaries (gradients, activations, KV cache, the rest), the program and the peak.
    Rows that are 0 in every plan are left out; `-` marks an estimate a plan did not make.
    With `device_memory`, a last row says whether each peak fits in it.

    Args:
      plans: column name -> `MemoryPlan` (for instance the step as it is, with remat, with
        LoRA: each compiled with that change).
      device_memory: bytes per device, or None.

    Returns:
      The table, lines joined by newlines.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib.memory import format_plans, memory_plan
      >>> w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
      >>> plan = memory_plan(lambda w: jnp.sum(w), w, params=w)
      >>> print(format_plans({"sum": plan}, device_memory=2**20))
                        sum
      params       4.00 MiB
      outputs          4 B
      peak         4.00 MiB
      fits 1.00 MiB      no

    References:
      JAX, "Ahead-of-time lowering and compilation", https://docs.jax.dev/en/latest/aot.html.
    """
    if not plans:
        raise ValueError("plans is empty: give at least one MemoryPlan.")
    for name, plan in plans.items():
        if not isinstance(plan, MemoryPlan):
            raise TypeError(f"plans[{name!r}] must be a MemoryPlan, got {type(plan).__name__}.")
    if device_memory is not None:
        check_device_memory(device_memory)
    rows = [("", list(plans))]
    for label, field in _ROWS:
        values = [getattr(p, field) for p in plans.values()]
        if field == "peak_bytes" or any(values):
            rows.append((label, [("-" if x is None else format_bytes(x)) for x in values]))
    if device_memory is not None:
        answers = ["yes" if p.fits(device_memory) else "no" for p in plans.values()]
        rows.append((f"fits {format_bytes(device_memory)}", answers))
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(cells[i]) for _, cells in rows) for i in range(len(plans))]
    lines = [
        " ".join(
            [label.ljust(label_width), *(c.rjust(w) for c, w in zip(cells, widths, strict=True))]
        )
        for label, cells in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def device_memory_bytes(device: jax.Device | None = None) -> int | None:
    """The memory a device has for arrays, in bytes, as its runtime reports it
    (`memory_stats()["bytes_limit"]` on GPUs and TPUs); None where it reports none (CPU).

    Args:
      device: a device; default `jax.devices()[0]`.

    Returns:
      The bytes, or None.

    Examples:
      >>> import jax
      >>> from tunelib.memory import device_memory_bytes
      >>> limit = device_memory_bytes()
      >>> limit is None or limit > 0
      True

    References:
      JAX, `jax.Device.memory_stats`, https://docs.jax.dev/en/latest/jax.html.
    """
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats()
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None

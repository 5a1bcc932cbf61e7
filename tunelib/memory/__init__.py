"""Memory plans: the peak memory per device of a train or sampling step, before running it.

`memory_plan(step, *args)` compiles a step ahead of time on abstract arguments (arrays or
`jax.ShapeDtypeStruct`s with shardings; nothing is allocated) and returns a `MemoryPlan`:
XLA's argument, output, donated, scratch and program sizes, split into parameters, frozen
weights, optimizer state, inputs, gradients, activations, KV cache and other temporaries.
`largest_batch` finds the largest batch that fits a device's memory, compiling each
candidate (`resize_batch` makes the arguments of another batch size); `format_plans` puts
plans of one step with and without a change (remat, LoRA, QLoRA, the fused log-prob head,
smaller micro-batches) side by side; `device_memory_bytes` is what a device reports having.
"""

from tunelib.memory._batch import resize_batch
from tunelib.memory._plan import MemoryPlan, memory_plan
from tunelib.memory._report import device_memory_bytes, format_bytes, format_plans
from tunelib.memory._search import BatchSearch, largest_batch
from tunelib.memory._trees import tree_bytes

__all__ = [
    "BatchSearch",
    "MemoryPlan",
    "device_memory_bytes",
    "format_bytes",
    "format_plans",
    "largest_batch",
    "memory_plan",
    "resize_batch",
    "tree_bytes",
]

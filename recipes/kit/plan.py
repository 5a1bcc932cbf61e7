"""The memory plan of a run: `--plan` prints it and exits, `--device-memory SIZE` refuses a run
predicted not to fit, in one line that says what to change.

Every recipe calls `check` on its state, its batches and its step before its loop, before
anything is written: the step is compiled for the first batch's shapes (never run;
`tunelib.memory.memory_plan`) and its peak memory per device compared with
`--device-memory`. With `--plan`, or when the run does not fit, `check` returns the plan as
a `Planned`, which the recipe returns in place of a trained run's result, and the entry
point (`guard`) reports. A step that is one jitted function of `(state, batch)` is planned
as it is; a recipe whose step runs several (a sampler, then an update) or branches on the
host gives `check` its parts: `pieces(state, batch) -> {name: Piece}`, each a
jittable function and its arguments, and the step's peak is the largest part's, plus what
the other parts keep resident meanwhile (the optimizer state during sampling).

Nothing here imports JAX at import time.
"""

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kit.config import Lora, parse_size
from kit.errors import UserError
from kit.runs import RunFolder, default_out


@dataclasses.dataclass(frozen=True)
class Piece:
    """One jitted part of a step: `fn(*args)`. Arrays in `args` are used for their shapes,
    dtypes and shardings only; `batch_argnums` name the arguments made from the batch (their
    first axis grows with it); `kv_cache` is the shape tree of a sampler's KV cache;
    `donate_argnums`, the arguments `fn` donates when it is not a jitted function itself
    (whose own donation the plan sees), such as a `functools.partial` of one."""

    fn: Callable
    args: tuple
    batch_argnums: tuple[int, ...] = ()
    kv_cache: Any = None
    donate_argnums: tuple[int, ...] = ()


def sampler(graphdef, policy, prompt_tokens, prompt_where, sampling, *, group_size: int = 1):
    """The `Piece` of `tunelib.rollout.sample` on these prompts, with its KV cache's shape."""
    import jax
    import quax
    from flax import nnx

    from tunelib import rollout

    def sample(policy, prompt_tokens, prompt_where, key):
        return rollout.sample(
            graphdef, policy, prompt_tokens, prompt_where, key, sampling, group_size=group_size
        )

    rows, length = prompt_tokens.shape[0] * group_size, prompt_tokens.shape[1]
    length = sampling.cache_length or length + sampling.max_new_tokens
    # The weights' shapes as the model sees them: an adapted or quantised weight
    # (`peft.apply_lora`, NF4, GGUF blocks) has its dense weight's shape and dtype.
    is_value = lambda x: isinstance(x, quax.ArrayValue)  # noqa: E731
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), policy, is_leaf=is_value
    )
    # Windowed, as `sample` makes it by default: sliding-window layers in rings.
    model = nnx.merge(graphdef, shapes)
    cache = jax.eval_shape(lambda: model.init_cache(rows, length, windowed=True))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    return Piece(sample, (policy, prompt_tokens, prompt_where, key), (1, 2), cache)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The plan of one step at one batch size.

    `plans` holds each part's `tunelib.memory.MemoryPlan`; `held` the bytes the run keeps
    on a device while that part runs that are not among its arguments (the other parts'
    resident arrays and compiled-in constants). The step's peak is the largest sum."""

    batch_size: int
    plans: dict
    held: dict
    resident_bytes: int  # the state, frozen weights and constants: held between steps

    @property
    def peaks(self) -> dict:
        return {name: plan.peak_bytes + self.held[name] for name, plan in self.plans.items()}

    @property
    def peak_bytes(self) -> int:
        return max(self.peaks.values())

    @property
    def step_bytes(self) -> int:
        """What a step adds to the memory held before it: `peak_bytes - resident_bytes`."""
        return self.peak_bytes - self.resident_bytes


@dataclasses.dataclass(frozen=True)
class Planned:
    """What `check` returns before the first step when the plan is made (`--plan`), or the
    run does not fit (`--device-memory`): nothing trains, the recipe returns it, and `guard`
    reports it."""

    plan: StepPlan
    context: "Context"


@dataclasses.dataclass(frozen=True)
class Context:
    """What planning the step at other batch sizes needs: the state, the first batch (as
    shape structs), the parts of a step and the batch sizes the devices allow."""

    state: Any  # as shape structs: planned at every step's shapes, not step 0's arrays
    batch: Any
    pieces: Callable
    multiple: int
    devices: int
    platform: str
    live_state: Any  # the state, the step and its batches, to run it (benchmarks/)
    step_fn: Callable
    batches: Any
    placement: Any  # the run's `kit.parallel.Placement`, or None

    def plan_at(self, size: int, *, estimate: bool = False) -> StepPlan:
        from tunelib.memory import resize_batch

        batch = self.batch if size == _rows(self.batch) else resize_batch(self.batch, size)
        return _step_plan(self.state, batch, self.pieces, estimate=estimate)


def _rows(batch) -> int:
    """The rows of a batch: the smallest first axis of its arrays (G completions of each of
    B prompts are B rows)."""
    import jax

    return min(x.shape[0] for x in jax.tree.leaves(batch) if x.shape)


def _shapes(tree):
    """Every array of `tree` as a `jax.ShapeDtypeStruct` of its shape, dtype and sharding."""
    import jax
    import numpy as np

    def leaf(x):
        if isinstance(x, jax.Array | np.ndarray):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
        return x

    return jax.tree.map(leaf, tree)


def check(
    config, placed, *, state, batches, step_fn, pieces: Callable | None = None
) -> Planned | None:
    """Before the first step: with `--plan` or `--device-memory`, plan the step on the
    first batch's shapes (split over `placed`, a `kit.parallel.Placement`, or None: one
    device); return the `Planned` run to print it, or when it does not fit (None: train)."""
    if not (config.plan or config.device_memory):
        return None
    import jax

    from tunelib.memory import format_bytes

    from kit import parallel

    saved = batches.get_state()  # peek at the first batch; the loop reads it again
    batch = next(batches)
    batches.set_state(saved)
    batch = _shapes(placed.rows(batch) if placed is not None else batch)
    if pieces is None:
        pieces = _whole_step(step_fn)
    devices = placed.num_devices if placed is not None else 1
    platform = jax.devices()[0].platform.upper()
    context = Context(
        _shapes(state), batch, pieces, devices, devices, platform, state, step_fn, batches,
        placed,
    )  # fmt: skip
    plan = context.plan_at(_rows(batch))  # `conclude` adds the estimates a printed plan shows
    memory = device_memory(config)
    if config.plan or (memory is not None and plan.peak_bytes > memory):
        return Planned(plan, context)
    if parallel.is_main():
        print(
            f"{config.run_name()}: predicted peak {format_bytes(plan.peak_bytes)} per device "
            f"of --device-memory {config.device_memory}",
            flush=True,
        )


def _whole_step(step_fn: Callable) -> Callable:
    """The step as one piece. The recipes' train steps donate their state: a partial of a
    jitted step is planned with that donation (a jitted one shows its own)."""
    donate = () if hasattr(step_fn, "trace") else (0,)

    def pieces(state, batch):
        return {"step": Piece(step_fn, (state, batch), batch_argnums=(1,), donate_argnums=donate)}

    return pieces


def device_memory(config) -> int | None:
    """`--device-memory` in bytes, else what the device reports (None on CPU)."""
    if config.device_memory:
        return parse_size(config.device_memory)
    from tunelib.memory import device_memory_bytes

    return device_memory_bytes()


def _step_plan(state, batch, pieces_fn: Callable, *, estimate: bool) -> StepPlan:
    """Each part planned (`tunelib.memory.memory_plan`), and what is held outside it: the
    state's shape structs and the arrays the parts take besides (a frozen reference) are
    what the run holds between steps."""
    import jax

    from tunelib.memory import memory_plan, tree_bytes

    pieces = pieces_fn(state, batch)
    ids = {id(x) for x in jax.tree.leaves(state)}
    resident = {id(x): x for x in jax.tree.leaves(state)}
    for piece in pieces.values():
        resident.update((id(x), x) for x in jax.tree.leaves(piece.args) if isinstance(x, jax.Array))
    plans, used = {}, {}
    for name, piece in pieces.items():
        leaves = {id(x) for x in jax.tree.leaves(piece.args)}
        used[name] = leaves

        def among(tree, leaves=leaves):
            tree_leaves = jax.tree.leaves(tree)
            return tree if tree_leaves and all(id(x) in leaves for x in tree_leaves) else None

        params = among(state.get("params"))
        opt_state = among(state.get("opt_state"))
        frozen = [x for i, x in resident.items() if i in leaves and i not in ids]
        plans[name] = memory_plan(
            piece.fn, *piece.args, params=params, frozen=frozen, opt_state=opt_state,
            gradients=params if opt_state is not None else None, kv_cache=piece.kv_cache,
            batch_argnums=piece.batch_argnums if estimate else (),
            donate_argnums=piece.donate_argnums,
        )  # fmt: skip
    held = {}
    for name in pieces:
        outside = [x for i, x in resident.items() if i not in used[name]]
        constants = sum(p.constant_bytes for other, p in plans.items() if other != name)
        held[name] = tree_bytes(outside) + constants
    constants = sum(p.constant_bytes for p in plans.values())
    return StepPlan(_rows(batch), plans, held, tree_bytes(list(resident.values())) + constants)


# ----------------------------------------------------------------------------- reporting


def _changes(config) -> list[tuple[str, dict]]:
    """The flag changes that lower a recipe's memory, those its configuration can take:
    remat, LoRA, QLoRA and the fused log-prob head (no `[B, T, V]` logits)."""
    out = [] if config.remat else [("--remat", {"remat": True})]
    if isinstance(config, Lora):
        rank = config.lora_rank
        if rank == 0:
            out.append(("--lora-rank 16", {"lora_rank": 16}))
        if not config.qlora:
            flags = "--qlora" if rank else "--lora-rank 16 --qlora"
            out.append((flags, {"lora_rank": rank or 16, "qlora": True}))
    if config.logprobs == "naive":
        out.append(("--logprobs chunked", {"logprobs": "chunked"}))
    full = {k: 0.0 for k in config.FULL_LOGITS if getattr(config, k)}
    if full:  # these need every logit; without them the loss takes the fused head
        out.append((" ".join(f"--{k.replace('_', '-')} 0" for k in full), full))
    return out


def _plan_with(config, train: Callable, run, changes: dict) -> StepPlan | None:
    """The plan of the recipe with `changes` to its flags: its set-up run again, its step
    compiled (None when the change does not apply to this model)."""
    changed = dataclasses.replace(config, plan=True, **changes)
    try:
        planned = train(changed, run)
    except UserError:
        return None
    if not isinstance(planned, Planned):
        raise AssertionError("a recipe in plan mode returned without planning its step")
    return planned.plan


def conclude(planned: Planned, config, train: Callable, run) -> None:
    """Report a `Planned` run: print the plan (`--plan`), or refuse the run in one line with
    what would make it fit (`--device-memory`)."""
    from tunelib.memory import largest_batch

    from kit import parallel

    plan, context = planned.plan, planned.context
    if config.plan:  # the printed plan, with its estimates at other batch sizes
        plan = context.plan_at(plan.batch_size, estimate=True)
    memory = device_memory(config)
    search = None
    if memory is not None:
        search = largest_batch(
            context.plan_at, device_memory=memory, start=plan.batch_size,
            multiple_of=context.multiple, max_size=max(plan.batch_size, 2**16),
        )  # fmt: skip
    tried = []
    if memory is not None and plan.peak_bytes > memory:
        for flags, changes in _changes(config):
            changed = _plan_with(config, train, run, changes)
            if changed is not None:
                tried.append((flags, changed))
                if not config.plan and changed.peak_bytes <= memory:
                    break
    if not config.plan:
        raise UserError(_refusal(config, plan, memory, search, tried))
    if parallel.is_main():
        print(_report(config, plan, context, memory, search, tried), flush=True)


def _refusal(config, plan, memory, search, tried) -> str:
    from tunelib.memory import format_bytes

    head = (
        f"the run needs {format_bytes(plan.peak_bytes)} per device (predicted), more than "
        f"--device-memory {config.device_memory}: "
    )
    fixes = []
    if search is not None and search.size:
        fixes.append(f"--batch-size {search.size} fits ({format_bytes(search.plan.peak_bytes)})")
    fixes += [
        f"{flags} would need {format_bytes(p.peak_bytes)}"
        for flags, p in tried
        if p.peak_bytes <= memory
    ]
    if fixes:
        return head + "; or ".join(fixes) + " (see --plan)"
    resident = format_bytes(plan.resident_bytes)
    return (
        head
        + f"no batch size fits (the weights and optimizer state alone take {resident})"
        + ("".join(f"; {flags} would need {format_bytes(p.peak_bytes)}" for flags, p in tried))
        + "; use a device with more memory or a smaller model"
    )


def _report(config, plan: StepPlan, context: Context, memory, search, tried) -> str:
    from tunelib.memory import format_bytes, format_plans

    devices = f"{context.devices} {context.platform} device" + "s" * (context.devices > 1)
    lines = [
        f"{config.run_name()}: memory plan per device ({devices}), the step compiled for a "
        f"batch of {plan.batch_size} rows and never run",
        format_plans(plan.plans),
    ]
    if len(plan.plans) > 1:
        for name, held in plan.held.items():
            lines.append(
                f"while {name} runs, the run also holds {format_bytes(held)}: "
                f"{format_bytes(plan.peaks[name])}"
            )
        lines.append(f"peak of a step: {format_bytes(plan.peak_bytes)}")
    if any(p.activations_bytes is not None for p in plan.plans.values()):
        lines.append(
            "(XLA reports the temporaries as one size; the split estimates it: activations "
            "and the KV cache are the part that grows with the batch, from a second "
            "compilation at half of it; gradients, at most the parameters' size, come from "
            "the rest, and are left out when XLA fuses each into its update)"
        )
    if memory is None:
        lines.append(
            f"device memory: {context.platform} reports none; --device-memory SIZE (e.g. "
            "16GiB) plans against it"
        )
        return "\n".join(lines)
    source = f"--device-memory {config.device_memory}" if config.device_memory else "the device"
    verdict = "fits" if plan.peak_bytes <= memory else "does not fit"
    lines.append(f"device memory {format_bytes(memory)} ({source}): the run {verdict}")
    if search is not None:
        if search.size:
            lines.append(
                f"the largest --batch-size that fits: {search.size} "
                f"({format_bytes(search.plan.peak_bytes)}; "
                f"{len(search.peaks)} batch sizes compiled)"
            )
        else:
            lines.append("no --batch-size fits")
    for flags, changed in tried:
        fits = "fits" if changed.peak_bytes <= memory else "does not fit"
        lines.append(f"with {flags}: {format_bytes(changed.peak_bytes)}, {fits}")
    return "\n".join(lines)


class PlanFolder(RunFolder):
    """The run folder of `--plan`: neither checked against `--resume` / `--overwrite` nor
    ever opened (the plan is made before anything is written)."""

    def __init__(self, path: Path, *, steps: int):
        super().__init__(path, resume=False, overwrite=True, steps=steps)
        self.overwrite, self.held = False, []

    def open(self, config) -> None:
        raise AssertionError("--plan reached the first step without planning it")


# The runs a recipe trains first when their model is absent: (the flag naming the model,
# the default run's name, a field only such recipes have).
CHAINED = (("model", "sft", "sft_steps"), ("teacher", "teacher", "teacher_steps"))


def check_start(config) -> None:
    """`--plan` trains nothing: a model the recipe would train first must be there."""
    for field, name, marker in CHAINED:
        if hasattr(config, marker) and getattr(config, field) is None:
            folder = default_out(name, config.seed)
            if not (folder / "model" / "config.json").is_file():
                raise UserError(
                    f"--plan trains nothing, and the {name} model this run starts from is not "
                    f"in {folder} yet: train it first (python recipes/sft.py --out {folder}) "
                    f"or name a model with --{field}"
                )


def guard(config, train: Callable, run) -> Any:
    """`train(config, run)` with `--plan` or `--device-memory`: a `Planned` run becomes the
    printed plan or a refusal in one line."""
    if config.plan:
        check_start(config)
    result = train(config, run)
    if not isinstance(result, Planned):
        return result
    conclude(result, config, train, run)
    sys.stdout.flush()
    return None

"""The memory plan of one compiled step: XLA's buffer sizes, split by what holds them."""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jax_core

from tunelib.memory._batch import batch_multiple, batch_size, resize_batch
from tunelib.memory._trees import PyTree, abstract, leaf_bytes, shape_dtype, tree_bytes


class MemoryPlan(NamedTuple):
    """The bytes one device holds while a compiled step runs, and what holds them.

    The first six fields come from the compiler (`Compiled.memory_analysis()`) or from the
    arguments themselves; the rest split them. Every value is in bytes, per device.

    Attributes:
      peak_bytes: `argument_bytes + constant_bytes + output_bytes - alias_bytes +
        temp_bytes + generated_code_bytes`: everything live while the step runs.
      argument_bytes: the arguments, from their shapes, dtypes and shardings (what is
        resident when the step starts; XLA's own count leaves out unused arguments).
      output_bytes: the results (XLA), allocated by the step.
      alias_bytes: the results written into donated arguments' buffers (XLA): counted once.
      temp_bytes: XLA's scratch allocation for everything in between (intermediates,
        gradients, activations kept for the backward pass, a sampler's KV cache).
      generated_code_bytes: the compiled program itself (XLA; 0 on CPU).
      constant_bytes: arrays the step closes over instead of taking as arguments.
      params_bytes, frozen_bytes, opt_state_bytes: the pieces of `argument_bytes` given as
        `params`, `frozen` and `opt_state`.
      inputs_bytes: the rest of `argument_bytes` (the batch, keys, counters).
      gradients_bytes: the part of `temp_bytes` taken to be gradients: the size of the tree
        given as `gradients`, at most the temporaries that do not grow with the batch
        (XLA often fuses a gradient into the update that consumes it, and never holds
        them all: then this is less than the parameters' size).
      kv_cache_bytes: the part of `temp_bytes` taken to be the KV cache: the size of the
        tree given as `kv_cache`, at most the temporaries that grow with the batch.
      activations_bytes: the rest of the temporaries that grow with the batch, estimated
        from a second compilation at another batch size (None without `batch_argnums`).
      temporaries_bytes: the rest of `temp_bytes`.
      batch_size: the batch the plan was made at (None without `batch_argnums`).
    """

    peak_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    constant_bytes: int
    params_bytes: int
    frozen_bytes: int
    opt_state_bytes: int
    inputs_bytes: int
    gradients_bytes: int
    kv_cache_bytes: int
    activations_bytes: int | None
    temporaries_bytes: int
    batch_size: int | None

    def fits(self, device_memory: int) -> bool:
        """Whether the peak fits in `device_memory` bytes."""
        check_device_memory(device_memory)
        return self.peak_bytes <= device_memory

    @property
    def transient_bytes(self) -> int:
        """What the step allocates on top of its arguments: `peak_bytes - argument_bytes`."""
        return self.peak_bytes - self.argument_bytes


def check_device_memory(device_memory: object, name: str = "device_memory") -> None:
    if isinstance(device_memory, bool) or not isinstance(device_memory, int | np.integer):
        raise TypeError(f"{name} must be an int (bytes), got {type(device_memory).__name__}.")
    if device_memory < 1:
        raise ValueError(f"{name} must be >= 1 byte, got {device_memory}.")


def _argnums(value: int | Sequence[int], name: str, count: int) -> tuple[int, ...]:
    numbers = (value,) if isinstance(value, int) else tuple(value)
    for i in numbers:
        if isinstance(i, bool) or not isinstance(i, int) or not -count <= i < count:
            raise ValueError(
                f"{name} must index the step's {count} positional arguments, got {value!r}."
            )
    return tuple(sorted({i % count for i in numbers}))


def _constants(closed: Any) -> list:
    """Every array a traced step closes over, in it and in the functions it calls (each
    once)."""
    found: dict[int, Any] = {}

    def visit(jaxpr: Any) -> None:
        if isinstance(jaxpr, jax_core.ClosedJaxpr):
            for c in jaxpr.consts:
                if isinstance(c, jax.Array | np.ndarray):
                    found.setdefault(id(c), c)
            jaxpr = jaxpr.jaxpr
        for eqn in jaxpr.eqns:
            for param in eqn.params.values():
                for inner in param if isinstance(param, tuple | list) else (param,):
                    if isinstance(inner, jax_core.ClosedJaxpr | jax_core.Jaxpr):
                        visit(inner)

    visit(closed)
    return list(found.values())


def _hoisted(traced: Any, flat_args: list, donated_flat: tuple[int, ...]) -> Any:
    """The traced step with the arrays it closes over taken as its first argument (so they
    are not compiled into the program), traced again on `(consts, *flat_args)`."""
    closed = traced.jaxpr

    def step(consts, *flat):
        return jax_core.jaxpr_as_fun(jax_core.ClosedJaxpr(closed.jaxpr, consts))(*flat)

    consts = abstract(list(closed.consts))
    donate = tuple(i + 1 for i in donated_flat)
    return jax.jit(step, donate_argnums=donate).trace(consts, *flat_args)


class _Compiled(NamedTuple):
    stats: Any  # XLA's CompiledMemoryStats
    argument_bytes: list[int]  # per dynamic argument leaf, in order, on one device
    constant_bytes: int


def _compile(step: Callable, args: tuple, static: tuple[int, ...], donate: tuple[int, ...]):
    """Trace and compile `step` on `args`. A plain function's own closed-over arrays are
    hoisted into an argument, as they are when it runs eagerly and passes them to the jitted
    functions it calls. Each argument leaf is counted under the sharding the compiler gave
    it (a leaf given without one is laid out by the compiler)."""
    jitted = hasattr(step, "trace") and hasattr(step, "lower")
    if jitted and (static or donate):
        raise ValueError(
            "static_argnums and donate_argnums are for a plain function: step is jitted "
            "already, and its own apply."
        )
    try:
        if jitted:
            traced = step.trace(*args)
        else:
            traced = jax.jit(step, static_argnums=static, donate_argnums=donate).trace(*args)
    except jax.errors.JAXTypeError as error:
        raise ValueError(
            f"step could not be traced on abstract arguments ({type(error).__name__}): the "
            "plan compiles it without running it, so it must be a jittable function of its "
            "arguments (no Python branch on an array's value, no host transfer)."
        ) from error
    constants = tree_bytes(_constants(traced.jaxpr))
    dynamic = tuple(a for i, a in enumerate(args) if i not in static)
    flat = jax.tree.leaves(dynamic)
    hoist = not jitted and bool(traced.jaxpr.consts)
    if hoist:
        donated_flat, start = [], 0
        for i, a in zip((i for i in range(len(args)) if i not in static), dynamic, strict=True):
            count = len(jax.tree.leaves(a))
            if i in donate:
                donated_flat.extend(range(start, start + count))
            start += count
        traced = _hoisted(traced, flat, tuple(donated_flat))
    compiled = traced.lower().compile()
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError(f"this backend ({jax.default_backend()}) reports no memory analysis.")
    laid_out = compiled.input_shardings[0]
    shardings = (
        list(laid_out[1:]) if hoist else jax.tree.structure(dynamic).flatten_up_to(tuple(laid_out))
    )
    sizes = [
        leaf_bytes(x if s is None else jax.ShapeDtypeStruct(*shape_dtype(x), sharding=s))
        for x, s in zip(flat, shardings, strict=True)
    ]
    return _Compiled(stats, sizes, constants)


def _batch_leaves(args: tuple, batch: tuple[int, ...]) -> list:
    return [x for i in batch for x in jax.tree.leaves(args[i]) if len(shape_dtype(x)[0]) >= 1]


def memory_plan(
    step: Callable[..., Any],
    *args: Any,
    params: PyTree = None,
    frozen: PyTree = None,
    opt_state: PyTree = None,
    gradients: PyTree = None,
    kv_cache: PyTree = None,
    batch_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
) -> MemoryPlan:
    r"""The peak memory per device of `step(*args)`, compiled but never run.

    The step is traced on abstract arguments and compiled ahead of time
    (`jax.jit(step).trace(*args).lower().compile()`); nothing is allocated on a device. XLA's
    `memory_analysis()` gives the sizes of the outputs $O$, of the outputs written into
    donated arguments $A$, of the scratch space $T$ and of the program $C$; the arguments
    $P$ are counted from their shapes, dtypes and the shardings the compiler gave them, and
    arrays the step closes over $K$ from its trace. The peak is

    $$
    M_{\mathrm{peak}} = P + K + O - A + T + C,
    $$

    the memory one device holds from the start of the step to its end (XLA allocates the
    scratch space once per call). $P$ is split into the trees given as `params`, `frozen`
    and `opt_state` and the rest (inputs). XLA reports $T$ as one number; its split is an
    estimate. With `batch_argnums`, the step is compiled a second time at another batch size
    $b'$ (half, or twice, $b$), and the part of $T$ proportional to the batch,

    $$
    T_{\propto} = (T_b - T_{b'})\, \frac{b}{b - b'} \quad \text{(clipped to } [0, T]),
    $$

    is the KV cache (the size of `kv_cache`, at most $T_{\propto}$) and activations (the
    rest: the forward pass's saved values, logits tiles); the part that does not grow,
    $T - T_{\propto}$, is gradients (the size of `gradients`, at most that) and other
    temporaries. Without `batch_argnums`, $T_{\propto}$ is taken as $T$ for the cache,
    gradients come next, and activations are not separated from the other temporaries
    (`activations_bytes` is None).

    Arguments may be arrays (their shapes, dtypes and shardings are used, never their
    values) or `jax.ShapeDtypeStruct`s with shardings: the plan of a model that does not fit
    on this machine is made without allocating it. A jitted `step` is compiled as it is; a
    plain function is jitted with `static_argnums` and `donate_argnums`, and the arrays it
    closes over become an argument, as they are when it runs eagerly.

    Args:
      step: the train (or sampling) step, jitted or not.
      *args: its positional arguments: arrays, `jax.ShapeDtypeStruct`s, static values.
      params: the trainable parameters among `args` (a pytree; only its sizes are used).
      frozen: frozen weights among `args` (a reference model, a LoRA base).
      opt_state: the optimizer state among `args`.
      gradients: a pytree shaped as the step's gradients (usually `params`); counted within
        the temporaries.
      kv_cache: a pytree shaped as the KV cache a sampling step makes (for instance
        `jax.eval_shape` of `Decoder.init_cache`); counted within the temporaries.
      batch_argnums: the arguments whose leaves have the batch on their first axis: with
        them, activations are estimated from a second compilation (`resize_batch`).
      static_argnums: static arguments of a plain-function `step`.
      donate_argnums: donated arguments of a plain-function `step`.

    Returns:
      A `MemoryPlan`, in bytes per device.

    Raises:
      ValueError: for argnums out of range, `params`, `frozen` and `opt_state` larger than
        the arguments, a batch argument without a leaf that has a first axis, or a step that
        cannot be traced on abstract arguments.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from tunelib.memory import memory_plan, tree_bytes
      >>> params = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
      >>> optimizer = optax.adam(1e-3)
      >>> opt_state = jax.eval_shape(optimizer.init, params)
      >>> batch = jax.ShapeDtypeStruct((64, 512), jnp.float32)
      >>> def step(params, opt_state, x):
      ...     loss, grads = jax.value_and_grad(
      ...         lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(params)
      ...     updates, opt_state = optimizer.update(grads, opt_state)
      ...     return optax.apply_updates(params, updates), opt_state, loss
      >>> plan = memory_plan(step, params, opt_state, batch, params=params,
      ...                    opt_state=opt_state, gradients=params, batch_argnums=2)
      >>> plan.params_bytes, plan.opt_state_bytes, plan.inputs_bytes  # 1 MiB, 2 MiB + count
      (1048576, 2097156, 131072)
      >>> plan.peak_bytes == (plan.argument_bytes + plan.output_bytes - plan.alias_bytes
      ...                     + plan.temp_bytes + plan.generated_code_bytes)
      True
      >>> plan.fits(16 * 2**20), plan.fits(4 * 2**20)
      (True, False)

    References:
      JAX, "Ahead-of-time lowering and compilation" (`Compiled.memory_analysis`),
      https://docs.jax.dev/en/latest/aot.html.
      Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
      Models" (the split into parameters, gradients, optimizer states and activations),
      2020, https://arxiv.org/abs/1910.02054.
    """
    count = len(args)
    static = _argnums(static_argnums, "static_argnums", count) if count else ()
    donate = _argnums(donate_argnums, "donate_argnums", count) if count else ()
    batch = _argnums(batch_argnums, "batch_argnums", count) if count else ()
    if set(batch) & set(static):
        raise ValueError(f"batch_argnums {batch} must not be static (static_argnums {static}).")
    originals = [x for i, a in enumerate(args) if i not in static for x in jax.tree.leaves(a)]
    args = tuple(a if i in static else abstract(a) for i, a in enumerate(args))
    compiled = _compile(step, args, static, donate)
    stats = compiled.stats
    argument = sum(compiled.argument_bytes)
    by_leaf = {id(x): n for x, n in zip(originals, compiled.argument_bytes, strict=True)}

    def size(tree):  # a part of the arguments as laid out, else as its own shardings say
        return sum(by_leaf.get(id(x), leaf_bytes(x)) for x in jax.tree.leaves(tree))

    pieces = {
        name: size(tree)
        for name, tree in (("params", params), ("frozen", frozen), ("opt_state", opt_state))
    }
    if sum(pieces.values()) > argument:
        raise ValueError(
            f"params, frozen and opt_state hold {sum(pieces.values())} bytes per device, more "
            f"than the {argument} bytes of the step's arguments: pass parts of the arguments."
        )
    temp = int(stats.temp_size_in_bytes)
    # The KV cache and activations grow with the batch, gradients do not: with a second
    # compilation, the temporaries split into the part proportional to the batch (the
    # cache, then activations) and the rest (gradients, then other temporaries).
    activations, rows, proportional = None, None, temp
    if batch:
        proportional, rows = _activations(step, args, batch, static, donate, temp)
    kv = min(tree_bytes(kv_cache), proportional)
    if batch:
        activations = proportional - kv
    grads = min(size(gradients), temp - kv - (activations or 0))
    output, alias = int(stats.output_size_in_bytes), int(stats.alias_size_in_bytes)
    code, const = int(stats.generated_code_size_in_bytes), compiled.constant_bytes
    return MemoryPlan(
        peak_bytes=argument + const + output - alias + temp + code,
        argument_bytes=argument,
        output_bytes=output,
        alias_bytes=alias,
        temp_bytes=temp,
        generated_code_bytes=code,
        constant_bytes=const,
        params_bytes=pieces["params"],
        frozen_bytes=pieces["frozen"],
        opt_state_bytes=pieces["opt_state"],
        inputs_bytes=argument - sum(pieces.values()),
        gradients_bytes=grads,
        kv_cache_bytes=kv,
        activations_bytes=activations,
        temporaries_bytes=temp - kv - grads - (activations or 0),
        batch_size=rows,
    )


def _activations(step, args, batch, static, donate, temp) -> tuple[int, int]:
    """The batch-proportional part of the temporaries at the arguments' batch size, from a
    second compilation at another batch size; and that batch size."""
    leaves = _batch_leaves(args, batch)
    if not leaves:
        raise ValueError(
            f"batch_argnums {batch}: those arguments have no array with a first (batch) axis."
        )
    tree = [args[i] for i in batch]
    size, multiple = batch_size(tree), batch_multiple(tree)
    other = size // 2 // multiple * multiple if size >= 2 * multiple else size + multiple
    resized = dict(zip(batch, resize_batch(tree, other), strict=True))
    other_args = tuple(resized.get(i, a) for i, a in enumerate(args))
    other_temp = int(_compile(step, other_args, static, donate).stats.temp_size_in_bytes)
    proportional = (temp - other_temp) * size / (size - other)
    return round(min(max(proportional, 0.0), temp)), size

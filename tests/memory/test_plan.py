"""`memory_plan` against what can be computed without it: the arguments' bytes from their
shapes, dtypes and shardings (NumPy arithmetic), the compiler's sizes from
`jax.jit(...).lower(...).compile().memory_analysis()` called directly, and the activation
estimate from two direct compilations."""

import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests._helpers import raises_naming
from tunelib.memory import format_bytes, format_plans, memory_plan, tree_bytes

H, B = 64, 16
OPTIMIZER = optax.adam(1e-3)


def sds(shape, dtype=jnp.float32, sharding=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def nbytes(*shapes_and_dtypes) -> int:
    """Bytes of arrays of these shapes and dtypes, in NumPy arithmetic."""
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in shapes_and_dtypes)


PARAMS = {"w1": sds((H, 2 * H)), "w2": sds((2 * H, H), jnp.bfloat16), "b": sds((H,))}
PARAM_BYTES = nbytes(((H, 2 * H), np.float32), ((2 * H, H), jnp.bfloat16), ((H,), np.float32))


def train_step(params, opt_state, x):
    def loss_fn(p):
        hidden = jnp.tanh(x @ p["w1"])
        return jnp.mean((hidden @ p["w2"].astype(jnp.float32) + p["b"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss


def direct(step, *args, **jit_options):
    """XLA's own memory analysis of `step` on `args`."""
    return jax.jit(step, **jit_options).lower(*args).compile().memory_analysis()


def test_params_and_adam_state_are_counted_exactly_and_the_rest_is_xlas():
    opt_state = jax.eval_shape(OPTIMIZER.init, PARAMS)
    x = sds((B, H))
    plan = memory_plan(
        train_step, PARAMS, opt_state, x, params=PARAMS, opt_state=opt_state, gradients=PARAMS
    )
    # Adam keeps two moments of each parameter in its dtype, and an int32 step count.
    assert plan.params_bytes == PARAM_BYTES == tree_bytes(PARAMS)
    assert plan.opt_state_bytes == 2 * PARAM_BYTES + 4
    assert plan.inputs_bytes == nbytes(((B, H), np.float32))
    assert plan.argument_bytes == 3 * PARAM_BYTES + 4 + B * H * 4
    stats = direct(train_step, PARAMS, opt_state, x)
    assert plan.argument_bytes == stats.argument_size_in_bytes  # every argument is used
    assert plan.temp_bytes == stats.temp_size_in_bytes
    assert plan.output_bytes == stats.output_size_in_bytes
    assert plan.alias_bytes == stats.alias_size_in_bytes == 0
    assert plan.generated_code_bytes == stats.generated_code_size_in_bytes
    assert plan.peak_bytes == (
        plan.argument_bytes + plan.output_bytes + plan.temp_bytes + plan.generated_code_bytes
    )
    assert plan.transient_bytes == plan.peak_bytes - plan.argument_bytes
    # The temporaries split into gradients (the parameters' size, at most the temporaries:
    # here XLA fuses each gradient into its Adam update and holds a few KiB) and the rest.
    assert plan.gradients_bytes == min(PARAM_BYTES, plan.temp_bytes) > 0
    assert plan.activations_bytes is None and plan.batch_size is None
    assert plan.gradients_bytes + plan.temporaries_bytes == plan.temp_bytes
    assert plan.fits(plan.peak_bytes) and not plan.fits(plan.peak_bytes - 1)


def test_arrays_and_shape_structs_give_one_plan_and_nothing_is_allocated():
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), PARAMS)
    opt_state = OPTIMIZER.init(params)
    x = np.ones((B, H), np.float32)
    # Counted after a full collection each time: arrays that earlier tests of this worker
    # left to the garbage collector may be freed at any moment in between.
    live = live_arrays()
    from_arrays = memory_plan(train_step, params, opt_state, x, params=params)
    assert live_arrays() == live
    shapes = jax.eval_shape(OPTIMIZER.init, PARAMS)
    assert from_arrays == memory_plan(train_step, PARAMS, shapes, sds((B, H)), params=PARAMS)
    # A step of 64 GiB of parameters is planned on a machine that could not hold them.
    huge = sds((2**17, 2**17))
    plan = memory_plan(lambda w, x: jnp.sum(x @ w), huge, sds((8, 2**17)), params=huge)
    assert plan.params_bytes == 2**36 and plan.peak_bytes > 2**36
    assert live_arrays() == live


def live_arrays() -> int:
    """The arrays alive once the garbage collector has run."""
    gc.collect()
    return len(jax.live_arrays())


def test_donated_arguments_count_their_outputs_once():
    opt_state = jax.eval_shape(OPTIMIZER.init, PARAMS)
    x = sds((B, H))
    kept = memory_plan(train_step, PARAMS, opt_state, x)
    donated = memory_plan(train_step, PARAMS, opt_state, x, donate_argnums=(0, 1))
    stats = direct(train_step, PARAMS, opt_state, x, donate_argnums=(0, 1))
    assert donated.alias_bytes == stats.alias_size_in_bytes > 0
    # The new parameters and moments are written where the old ones were.
    assert donated.alias_bytes == 3 * PARAM_BYTES + 4
    assert donated.peak_bytes == kept.peak_bytes - donated.alias_bytes + (
        donated.temp_bytes - kept.temp_bytes
    )


def test_sharded_arguments_count_one_devices_shard():
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 devices")
    mesh = Mesh(devices, ("data",))
    rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    params = {"w": sds((8 * H, H), sharding=rows), "b": sds((H,), sharding=replicated)}
    x = sds((8 * B, 8 * H), sharding=rows)
    plan = memory_plan(
        lambda p, x: jnp.sum(jnp.tanh(x @ p["w"] + p["b"])), params, x, params=params
    )
    assert plan.params_bytes == nbytes(((H, H), np.float32), ((H,), np.float32))
    assert plan.inputs_bytes == nbytes(((B, 8 * H), np.float32))
    assert (
        plan.argument_bytes
        == direct(lambda p, x: jnp.sum(x @ p["w"] + p["b"]), params, x).argument_size_in_bytes
    )
    assert tree_bytes(params) == plan.params_bytes
    # A leaf given without a sharding is counted as the compiler lays it out: here, Adam's
    # moments follow their parameters' sharding.
    opt_state = jax.eval_shape(OPTIMIZER.init, params)
    plan = memory_plan(
        lambda p, o, x: train_step_sharded(p, o, x), params, opt_state, x, opt_state=opt_state
    )
    assert plan.opt_state_bytes == 2 * nbytes(((H, H), np.float32), ((H,), np.float32)) + 4


def train_step_sharded(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"])))(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state


def test_arrays_a_step_closes_over_are_counted_once_as_constants():
    w = jnp.arange(H * H, dtype=jnp.float32).reshape(H, H)  # not a splat: a real constant
    x = sds((B, H))
    expected = nbytes(((H, H), np.float32))

    def plain(x):
        return jnp.tanh(x @ w)

    jitted = jax.jit(plain)
    for step in (plain, jitted, lambda x: jitted(x)):
        plan = memory_plan(step, x)
        assert plan.constant_bytes == expected, step
        assert plan.argument_bytes == nbytes(((B, H), np.float32))
        assert plan.peak_bytes == (
            plan.argument_bytes + expected + plan.output_bytes + plan.temp_bytes
        )
    # A plain function's closed-over arrays reach the compiler as an argument, not as a
    # constant in the program: XLA counts them with the arguments.
    from tunelib.memory._plan import _compile

    hoisted = _compile(plain, (x,), (), ())
    assert hoisted.stats.argument_size_in_bytes == plan.argument_bytes + expected
    compiled_in = _compile(jitted, (x,), (), ())
    assert compiled_in.stats.argument_size_in_bytes == plan.argument_bytes


@pytest.mark.parametrize("rows", [1024, 1])  # compiled again at half, or at twice, the rows
def test_activations_are_the_temporaries_that_grow_with_the_batch(rows):
    opt_state = jax.eval_shape(OPTIMIZER.init, PARAMS)
    x = sds((rows, H))
    plan = memory_plan(
        train_step, PARAMS, opt_state, x, params=PARAMS, gradients=PARAMS, batch_argnums=2
    )
    other = rows // 2 if rows > 1 else 2
    t_b = direct(train_step, PARAMS, opt_state, x).temp_size_in_bytes
    t_other = direct(train_step, PARAMS, opt_state, sds((other, H))).temp_size_in_bytes
    proportional = min(max(round((t_b - t_other) * rows / (rows - other)), 0), t_b)
    assert plan.batch_size == rows and plan.temp_bytes == t_b
    assert plan.activations_bytes == proportional
    assert plan.gradients_bytes == min(PARAM_BYTES, t_b - proportional)
    assert plan.activations_bytes + plan.gradients_bytes + plan.temporaries_bytes == t_b
    if rows == 1024:  # the tanh activations saved for the backward pass, about 1 KiB a row
        assert plan.activations_bytes > 1000 * rows


def test_the_kv_cache_of_a_sampling_step_is_taken_from_the_temporaries():
    layers, length, heads, width = 2, 24, 2, 16

    def decode(prompts):  # a cache made inside, filled a slot a step
        rows = prompts.shape[0]
        cache = jnp.zeros((layers, rows, length, heads, width))

        def body(t, cache):
            return cache.at[:, :, t].set(jnp.tanh(prompts[:, :1, None] * t).astype(cache.dtype))

        return jax.lax.fori_loop(0, length, body, cache).sum(axis=(0, 2, 3, 4))

    prompts = sds((B, 8))
    cache = jax.eval_shape(lambda: jnp.zeros((layers, B, length, heads, width)))
    plan = memory_plan(decode, prompts, kv_cache=cache, batch_argnums=0)
    assert plan.kv_cache_bytes == layers * B * length * heads * width * 4 <= plan.temp_bytes
    assert plan.kv_cache_bytes + plan.activations_bytes + plan.temporaries_bytes == (
        plan.temp_bytes
    )


def test_format_plans_lists_the_nonzero_rows_and_whether_each_fits():
    w = sds((256, 256))
    small = memory_plan(lambda w: jnp.sum(w), w, params=w)
    big = memory_plan(lambda w: w @ w, w, params=w)
    table = format_plans({"sum": small, "matmul": big}, device_memory=300_000)
    lines = table.splitlines()
    assert lines[0].split() == ["sum", "matmul"]
    assert lines[1].split() == ["params", "256", "KiB", "256", "KiB"]
    assert lines[-2].split()[0] == "peak"
    assert lines[-1].split() == ["fits", "293", "KiB", "yes", "no"]
    assert not any(line.startswith("frozen") for line in lines)  # 0 in both: left out
    assert [format_bytes(n) for n in (0, 1023, 1024, 3 * 2**29, 10**13)] == [
        "0 B", "1023 B", "1.00 KiB", "1.50 GiB", "9.09 TiB"
    ]  # fmt: skip


def test_tree_bytes_counts_numbers_keys_and_shards():
    assert tree_bytes({"a": 1.0, "b": 3, "c": True}) == 4 + 4 + 1
    assert tree_bytes(jax.random.key(0)) == 8  # threefry key data: two uint32
    assert tree_bytes([np.zeros((3, 5), np.float16), None]) == 30
    assert tree_bytes(sds((0, 4))) == 0


def test_bad_arguments_name_what_is_wrong():
    x = sds((B, H))
    with raises_naming("batch_argnums", "2 positional arguments"):
        memory_plan(lambda w, x: x @ w, sds((H, H)), x, batch_argnums=2)
    with raises_naming("static_argnums", "jitted"):
        memory_plan(jax.jit(lambda x: x), x, static_argnums=0)
    with raises_naming("params", "more than"):
        memory_plan(lambda x: x, x, params=sds((B, 2 * H)))
    with raises_naming("batch_argnums", "first (batch) axis"):
        memory_plan(lambda s, x: x * s, sds(()), x, batch_argnums=0)
    with raises_naming("could not be traced"):
        memory_plan(lambda x: x if x.sum() > 0 else -x, x)
    with raises_naming("device_memory", error=TypeError):
        memory_plan(lambda x: x, x).fits(2.0**20)
    with raises_naming("device_memory", ">= 1"):
        memory_plan(lambda x: x, x).fits(0)
    with raises_naming("plans", "empty"):
        format_plans({})
    with raises_naming("expected arrays", error=TypeError):
        tree_bytes(["text"])
    assert math.isfinite(memory_plan(lambda x: x, x).peak_bytes)

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._helpers import raises_naming
from tests.rollout.test_sampler import CONFIG, PROMPT_WHERE, PROMPTS, make_model
from tunelib.models import TENSOR_PARALLEL_RULES, param_shardings
from tunelib.rollout import SamplingConfig, sample, sync_weights

# Training layout: FSDP, every weight split along its "embed" axis; nothing else split.
FSDP_RULES = [(name, "fsdp" if name == "embed" else None) for name, _ in TENSOR_PARALLEL_RULES]


@pytest.fixture(scope="module")
def meshes():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    devices = np.array(jax.devices()[:8])
    auto = jax.sharding.AxisType.Auto
    train = jax.sharding.Mesh(devices[:4], ("fsdp",), axis_types=(auto,))
    rollout = jax.sharding.Mesh(
        devices[4:].reshape(1, 4), ("data", "model"), axis_types=(auto,) * 2
    )
    return train, rollout


def test_sync_moves_exactly_the_trained_values_onto_the_rollout_mesh(meshes):
    train_mesh, rollout_mesh = meshes
    graphdef, params = make_model(0, dataclasses.replace(CONFIG, tie_word_embeddings=False))
    trained = jax.device_put(params, param_shardings(graphdef, params, train_mesh, FSDP_RULES))
    kernel = trained["layers"][0]["mlp"]["up_proj"]["kernel"]
    assert kernel.sharding.spec == jax.P("fsdp", None)
    targets = param_shardings(graphdef, params, rollout_mesh)
    synced = sync_weights(trained, targets, dtype="bfloat16")

    train_devices, rollout_devices = set(train_mesh.devices.flat), set(rollout_mesh.devices.flat)
    assert not train_devices & rollout_devices
    flat_synced = jax.tree_util.tree_leaves_with_path(synced)
    flat_source = jax.tree.leaves(params)
    flat_targets = jax.tree.leaves(targets)
    assert len(flat_synced) == len(flat_source) == len(flat_targets)
    for (path, out), source, target in zip(flat_synced, flat_source, flat_targets, strict=True):
        assert out.dtype == jnp.bfloat16, path
        assert out.sharding == target and set(out.devices()) == rollout_devices, path
        expected = np.asarray(source).astype(jnp.bfloat16)  # round to nearest even, as XLA
        np.testing.assert_array_equal(np.asarray(out), expected, err_msg=str(path))

    # The rollout side samples with the new weights: the same completions as a single-device
    # sampler holding the same bfloat16 weights.
    config = SamplingConfig(max_new_tokens=8, temperature=0.0)
    local = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
    expected = sample(graphdef, local, PROMPTS, PROMPT_WHERE, jax.random.key(0), config)
    rows = jax.sharding.NamedSharding(rollout_mesh, jax.P("data"))
    out = sample(graphdef, synced, jax.device_put(PROMPTS, rows),
                 jax.device_put(PROMPT_WHERE, rows), jax.random.key(0), config)  # fmt: skip
    np.testing.assert_array_equal(out.tokens, expected.tokens)
    # And not what the weights before the update give.
    stale = sample(graphdef, jax.tree.map(lambda x: -x, local), PROMPTS, PROMPT_WHERE,
                   jax.random.key(0), config)  # fmt: skip
    assert (np.asarray(stale.tokens) != np.asarray(out.tokens)).any()


def test_sync_without_cast_keeps_dtypes_and_non_float_leaves(meshes):
    _, rollout_mesh = meshes
    tree = {"w": jnp.arange(8.0).reshape(2, 4), "step": jnp.array(3), "flag": jnp.array(True)}
    target = jax.sharding.NamedSharding(rollout_mesh, jax.P())
    out = sync_weights(tree, target)
    assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, tree)
    cast = sync_weights(tree, target, dtype=jnp.float16)
    assert cast["w"].dtype == jnp.float16 and cast["step"].dtype == tree["step"].dtype
    np.testing.assert_array_equal(cast["w"], np.arange(8.0).reshape(2, 4))


def test_sync_errors(meshes):
    _, rollout_mesh = meshes
    target = jax.sharding.NamedSharding(rollout_mesh, jax.P())
    with raises_naming("dtype"):
        sync_weights({"w": jnp.ones(2)}, target, dtype=jnp.int8)
    with raises_naming("shardings", "structure"):
        sync_weights({"w": jnp.ones(2), "b": jnp.ones(2)}, {"w": target})

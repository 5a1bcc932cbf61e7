"""Weight sync for disaggregated RL: trained parameters onto the rollout mesh."""

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import PyTree


def sync_weights(
    params: PyTree, shardings: PyTree | jax.sharding.Sharding, *, dtype: DTypeLike | None = None
) -> PyTree:
    """Copy `params` onto the devices and layout of `shardings`, optionally cast to `dtype`.

    In disaggregated RL the trainer and the sampler hold the weights on different meshes,
    often on disjoint devices and with different layouts (for example FSDP for training,
    tensor parallelism for decoding) and dtypes (float32 master weights, bfloat16 for
    sampling). After each update the new weights must move across. The cast runs first,
    on the training mesh, so only the narrower values travel; then `jax.device_put`
    reshards every array to its target sharding, moving each shard between devices
    directly. Floating-point leaves are cast; integer and boolean leaves keep their dtype.

    Args:
      params: a pytree of arrays (on any devices, with any sharding).
      shardings: a pytree of the same structure with a `jax.sharding.Sharding` per leaf (for
        example from `tunelib.models.param_shardings` on the rollout mesh), or one sharding
        for every leaf.
      dtype: the rollout dtype of floating-point leaves; None keeps each leaf's dtype.

    Returns:
      `params` on the target devices: each leaf equals `params`' leaf cast to `dtype`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib.rollout import sync_weights
      >>> mesh = jax.make_mesh((1,), ("model",))
      >>> target = jax.sharding.NamedSharding(mesh, jax.P())
      >>> out = sync_weights({"w": jnp.ones((2, 3)), "step": jnp.array(7)}, target,
      ...                    dtype="bfloat16")
      >>> print(out["w"].dtype, out["step"].dtype, out["w"].sharding == target)
      bfloat16 int32 True
    """
    if dtype is not None:
        dtype = jnp.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}.")
        params = _cast(params, dtype)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, params)
    elif jax.tree.structure(shardings) != jax.tree.structure(params):
        raise ValueError(
            "shardings must be one Sharding or a pytree of the same structure as params; got "
            f"{jax.tree.structure(shardings)} for params {jax.tree.structure(params)}."
        )
    return jax.device_put(params, shardings)


@jax.jit(static_argnums=1)
def _cast(params, dtype):
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, params)

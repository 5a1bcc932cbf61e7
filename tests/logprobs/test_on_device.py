"""`fused_token_logps` on the accelerator: its implementations "naive", "chunked", "pallas"
and "auto" against one float64 reference, each within the bound of the precision it
multiplies at (`tests._precision`), at JAX's default precision and at "highest".

Part of the accelerator tier (docs/tpu.md): skipped where JAX has no GPU or TPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._precision import assert_within, fused_head
from tunelib.logprobs import fused_token_logps

pytestmark = pytest.mark.accelerator

B, T, H, V = 4, 250, 256, 5000  # N = 1000 tokens, V not a multiple of any tile
IMPLEMENTATIONS = ("naive", "chunked", "pallas", "auto")


def problem(seed=3):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, T, H)).astype(np.float32)
    w = (rng.normal(size=(H, V)) / np.sqrt(H) * 3).astype(np.float32)
    b = rng.normal(size=V).astype(np.float32)
    targets = rng.integers(0, V, (B, T))
    where = np.ones((B, T), bool)
    where[1, 200:] = False  # a padded row end
    where[3, :7] = False  # and a masked prompt
    g, e = rng.normal(size=(2, B, T)).astype(np.float32)
    return hidden, w, b, targets, where, g, e


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_every_implementation_is_within_its_bound_of_float64(precision):
    """Values, entropy and both gradients of each implementation (temperature 0.7, a bias, a
    mask) within their bounds of the float64 head: "pallas" multiplies float32 at full
    precision whatever the setting, the others at `precision`. "auto" is bit for bit one of
    the bounded-memory implementations, the one it picks on this backend; masked tokens give
    exactly 0 and send exactly 0 gradient."""
    hidden, w, b, targets, where, g, e = problem()

    def run(implementation):
        def total(hidden, w):
            logps, entropy = fused_token_logps(
                hidden, w, targets, bias=b, temperature=0.7, with_entropy=True, where=where,
                implementation=implementation,
            )  # fmt: skip
            return jnp.sum(g * logps + e * entropy), (logps, entropy)

        step = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))
        (_, values), grads = step(hidden, w)
        return jax.tree.map(np.asarray, (*values, *grads))

    with jax.default_matmul_precision(precision):
        results = {name: run(name) for name in IMPLEMENTATIONS}
    picked = [
        name
        for name in ("chunked", "pallas")  # the bounded-memory ones "auto" chooses between
        if all(np.array_equal(a, b) for a, b in zip(results["auto"], results[name], strict=True))
    ]
    assert picked, "auto is none of the implementations bit for bit"

    keep = where.reshape(-1)
    h = hidden.reshape(-1, H)[keep]
    for name in ("naive", "chunked", "pallas"):
        logps, entropy, dh, dw = results[name]
        ref = fused_head(
            h, w, b, targets.reshape(-1)[keep], temperature=0.7, g=g.reshape(-1)[keep],
            e=e.reshape(-1)[keep], precision="highest" if name == "pallas" else precision,
        )  # fmt: skip
        assert_within(logps[where], ref.logps, ref.logps_error, what=f"{name} logps")
        assert_within(entropy[where], ref.entropy, ref.entropy_error, what=f"{name} entropy")
        assert_within(dh[where], ref.dh, ref.dh_error, what=f"{name} d hidden")
        assert_within(dw, ref.dw, ref.dw_error, what=f"{name} d unembedding")
        for masked in (logps, entropy, dh):
            assert np.all(masked[~where] == 0), name

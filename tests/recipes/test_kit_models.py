"""`kit.models`: `--remat` changes the graph a recipe trains, never its parameters or what it
saves."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)
from tests._helpers import assert_close
from tunelib.data import CharTokenizer

from kit import models


def test_remat_gives_the_same_loss_and_gradients_with_the_same_parameters(tmp_path):
    model = models.new_model(CharTokenizer(), "student", seed=0)
    remat = models.with_remat(model, True)
    assert remat.config.remat and not model.config.remat
    assert remat.params is model.params
    assert models.with_remat(model, False) is model and models.with_remat(remat, True) is remat
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 20, (2, 9)), jnp.int32)

    def loss(graphdef, params):
        decoder = nnx.merge(graphdef, params)
        logits = decoder.unembed(decoder(tokens[:, :-1]))
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
        return -picked.mean()

    plain = jax.value_and_grad(loss, argnums=1)(model.graphdef, model.params)
    recomputed = jax.value_and_grad(loss, argnums=1)(remat.graphdef, remat.params)
    assert_close(recomputed[0], plain[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(recomputed[1]), jax.tree.leaves(plain[1]), strict=True):
        assert_close(a, b, rtol=1e-5, atol=1e-7)

    # The saved model is the architecture: remat is the training run's choice.
    models.save_model(tmp_path / "model", remat, remat.params)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["remat"] is False


def test_the_moe_size_is_qwen3_moe_shaped_and_computes_in_bfloat16():
    """`--model-size moe`, the model of routing replay: every layer a mixture of 8 experts,
    top 2, computing in bfloat16 on float32 weights; its forward pass runs."""
    model = models.new_model(CharTokenizer(), "moe", seed=0)
    config = model.config
    assert all(config.moe_layers) and (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.float32)}
    decoder = nnx.merge(model.graphdef, model.params)
    hidden = decoder(jnp.zeros((1, 4), jnp.int32))
    assert hidden.dtype == jnp.bfloat16 and bool(jnp.isfinite(hidden.astype(jnp.float32)).all())

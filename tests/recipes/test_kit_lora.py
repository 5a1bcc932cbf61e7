"""`kit.lora`: where `--lora-rank` puts adapters, and the frozen base a jitted step takes as an
argument rather than as constants compiled into its program."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)
from tests.recipes._scripts import no_captured_weights
from tunelib import peft
from tunelib.data import CharTokenizer

from kit import lora, models, parallel


def _paths(tree) -> list[str]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in leaves]


@pytest.mark.parametrize("qlora", [False, True])
def test_a_vision_language_model_gets_adapters_on_its_language_model_only(qlora):
    model = models.new_vision_model(CharTokenizer(), seed=0)
    tuning = lora.tuning(model, parallel.placement(2, 1), rank=4, qlora=qlora)
    adapted = _paths(tuning.trainable)
    assert adapted and all(p.startswith("language_model/layers/") for p in adapted)
    projections = [p for p in _paths(model.params) if "_proj" in p and p.endswith("kernel")]
    language = [p for p in projections if p.startswith("language_model/")]
    assert {p.rsplit("/", 1)[0] for p in language} <= {p.rsplit("/", 2)[0] for p in adapted}
    assert tuning.mode == ("qlora" if qlora else "lora")


def test_the_base_is_an_argument_of_the_step_not_a_constant_in_it():
    model = models.new_model(CharTokenizer(), "student", seed=0)
    tuning = lora.tuning(model, parallel.placement(2, 1), rank=4)
    tokens = jnp.zeros((2, 8), jnp.int32)

    def loss(trainable, base):
        params = tuning.params(trainable, base)
        return peft.lora(lambda p: nnx.merge(model.graphdef, p)(tokens).mean())(params)

    with no_captured_weights():  # the base as an argument: nothing captured
        jax.jit(jax.grad(loss))(tuning.trainable, tuning.base)
        with pytest.raises(UserWarning, match="constants were captured"):  # closed over
            jax.jit(jax.grad(lambda t: loss(t, tuning.base)))(tuning.trainable)

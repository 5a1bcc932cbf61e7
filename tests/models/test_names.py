"""The decoder's weight names for other tools: LoRA targets and Hugging Face module names."""

import re

import jax
import pytest
from flax import nnx

from tests.models.test_decoder import make_config
from tunelib.models import PROJECTION_KERNELS, Decoder, hf_module_name

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def paths(scan: bool) -> list[str]:
    config = make_config(
        scan_layers=scan, attention_bias=True, use_qk_norm=True, tie_word_embeddings=False
    )
    state = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(state, nnx.Param)))
    return [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in leaves]


@pytest.mark.parametrize("scan", [False, True])
def test_projection_kernels_select_every_projection_kernel_and_nothing_else(scan):
    every = paths(scan)
    selected = {p for p in every if re.fullmatch(PROJECTION_KERNELS, p)}
    expected = {p for p in every if p.endswith("/kernel") and p.split("/")[-2] in PROJECTIONS}
    assert selected == expected
    assert len(selected) == 7 * (1 if scan else 2)
    assert not any("lm_head" in p or "bias" in p or "norm" in p for p in selected)


def test_hf_module_names():
    assert hf_module_name("layers/3/self_attn/q_proj/kernel") == "model.layers.3.self_attn.q_proj"
    assert hf_module_name("layers/0/mlp/down_proj/bias") == "model.layers.0.mlp.down_proj"
    assert hf_module_name("embed_tokens/embedding") == "model.embed_tokens"
    assert hf_module_name("norm/scale") == "model.norm"
    assert hf_module_name("lm_head/kernel") == "lm_head"

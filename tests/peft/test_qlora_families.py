"""QLoRA on the layers of the 2026 families: NF4 bases of DeepSeek-V3's latent-attention
projections and Qwen3.5's Gated DeltaNet projections (with LoRA on every projection) give the
values and gradients of their dequantised weights. (Experts' NF4 and int8 are
`test_experts.py`'s; the products' rules, `test_quantized.py`'s.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import assert_close
from tests.models.test_deepseek import CONFIG as DEEPSEEK
from tests.models.test_qwen3_5 import CONFIG as QWEN3_5
from tunelib import peft
from tunelib.models import PROJECTION_KERNELS, Decoder, DecoderConfig

# One layer of each: DeepSeek's dense one (its attention is the latent one), Qwen3.5's DeltaNet.
FAMILIES = {
    "deepseek_v3": (
        dict(DEEPSEEK, num_hidden_layers=1),
        ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
        "self_attn",
    ),
    "qwen3_5": (
        dict(QWEN3_5, num_hidden_layers=1, layer_types=("linear_attention",)),
        ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
        "linear_attn",
    ),
}
TOKENS = np.random.default_rng(0).integers(0, 40, size=(2, 9))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_nf4_projections_equal_their_dequantised_base(family):
    fields, projections, block = FAMILIES[family]
    graphdef, state = nnx.split(Decoder(DecoderConfig(**fields), rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    # (quantised in one program: eagerly, each kernel's shape would compile its own ops)
    base = jax.jit(lambda p: peft.quantize_params(p, [PROJECTION_KERNELS], format="nf4"))(params)
    layer = base["layers"][0][block]
    for name in projections:  # every projection of the new layer is stored in 4 bits
        assert type(layer[name]["kernel"]).__name__ == "NF4Tensor", name
    rules = [peft.LoraRule(pattern=PROJECTION_KERNELS, rank=2)]
    adapters = jax.jit(lambda p: jax.tree.map(  # nonzero B: the low-rank path counts
        lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape),
        peft.init_lora(p, rules, key=jax.random.key(1)),
    ))(params)  # fmt: skip
    assert set(adapters["layers"][0][block]) >= set(projections)
    dense = jax.jit(peft.dequantize_params)(base)

    @jax.jit
    def both(adapters):
        def loss(adapters, params):
            def forward(params):
                model = nnx.merge(graphdef, params)
                return model.unembed(model(TOKENS))

            return jnp.sum(peft.lora(forward)(peft.apply_lora(params, adapters)) ** 2)

        grad = jax.value_and_grad(loss)
        return grad(adapters, base), grad(adapters, dense)

    (got, grads), (want, expected) = both(adapters)
    assert_close(got, want, rtol=1e-5)
    # float32, the two bases' products summed in other orders: 3e-5 apart at gradients of 30
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        scale = np.abs(np.asarray(e)).max()
        assert scale > 0
        assert_close(g, e, rtol=1e-4, atol=1e-5 * scale)

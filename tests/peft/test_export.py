"""Adapters on disk: Orbax round trips, the PEFT format, and parity with Hugging Face PEFT."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests._helpers import raises_naming
from tests._hf import hf_logits, hf_modules, write_tiny_checkpoint
from tunelib import peft
from tunelib.formats import load_hf_checkpoint
from tunelib.models import Decoder, DecoderConfig

CONFIG = dict(
    vocab_size=32,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
RULES = [
    peft.LoraRule(pattern=r".*q_proj/kernel", rank=2, alpha=4.0),
    peft.LoraRule(pattern=r".*(k|v|o|gate|up|down)_proj/kernel", rank=4, alpha=8.0),
]


@functools.cache
def _decoder_params(overrides: tuple):
    model = Decoder(DecoderConfig(**{**CONFIG, **dict(overrides)}), rngs=nnx.Rngs(0))
    return nnx.to_pure_dict(nnx.state(model))


def decoder_params(**overrides):
    """The test decoder's parameters (built once per configuration)."""
    return _decoder_params(tuple(sorted(overrides.items())))


def trained(adapters, seed=3):
    """Adapters with random non-zero factors, as after some training."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), adapters
    )


def assert_same_adapters(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for x, y in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_peft_export_reimports_to_identical_arrays(tmp_path, scan_layers):
    params = decoder_params(scan_layers=scan_layers)
    adapters = trained(peft.init_lora(params, RULES, key=jax.random.key(0)))
    peft.export_peft(tmp_path / "adapter", adapters, params, base_model_name_or_path="tiny")
    assert_same_adapters(peft.import_peft(tmp_path / "adapter", params), adapters)

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == "tiny"
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 8.0, False)
    expected = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["target_modules"] == expected
    assert config["rank_pattern"] == {
        r"model\.layers\.0\.self_attn\.q_proj": 2,
        r"model\.layers\.1\.self_attn\.q_proj": 2,
    }
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    lora_a = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    lora_b = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert lora_a.shape == (4, 96) and lora_b.shape == (64, 4)  # [r, in] and [out, r]
    down = (
        adapters["layers"]["mlp"]["down_proj"]["kernel"]
        if scan_layers
        else (adapters["layers"][1]["mlp"]["down_proj"]["kernel"])
    )
    a, b = (down.a[1], down.b[1]) if scan_layers else (down.a, down.b)
    np.testing.assert_array_equal(lora_a, np.asarray(a).T)
    np.testing.assert_array_equal(lora_b, np.asarray(b).T)


def test_partial_targets_export_an_exact_regex_and_rslora(tmp_path):
    params = decoder_params()
    rules = [peft.LoraRule(pattern=r"layers/0/self_attn/q_proj/kernel", scaling="rslora")]
    adapters = trained(peft.init_lora(params, rules, key=jax.random.key(0)))
    peft.export_peft(tmp_path / "adapter", adapters, params)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == r"model\.layers\.0\.self_attn\.q_proj"
    assert config["use_rslora"] is True
    back = peft.import_peft(tmp_path / "adapter", params)
    assert back["layers"][0]["self_attn"]["q_proj"]["kernel"].scale == 8 / np.sqrt(8)
    assert_same_adapters(back, adapters)


def test_a_user_model_with_its_own_module_names(tmp_path):
    params = {"encoder": {"w": jnp.ones((6, 4))}, "head": {"w": jnp.ones((4, 3))}}
    adapters = trained(
        peft.init_lora(params, [peft.LoraRule(pattern=r".*/w", rank=2)], key=jax.random.key(0))
    )

    def names(path):
        return path.replace("/", ".")

    peft.export_peft(tmp_path / "adapter", adapters, params, module_name=names)
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert set(tensors) == {
        f"base_model.model.{m}.w.lora_{f}.weight" for m in ("encoder", "head") for f in "AB"
    }
    assert_same_adapters(
        peft.import_peft(tmp_path / "adapter", params, module_name=names), adapters
    )


def test_decoder_module_name_moved_to_models():
    from tunelib.models import hf_module_name

    path = "layers/1/mlp/gate_proj/kernel"
    with pytest.warns(DeprecationWarning, match=r"peft.decoder_module_name.*hf_module_name"):
        old = peft.decoder_module_name
    assert old is hf_module_name and old(path) == "model.layers.1.mlp.gate_proj"
    assert "decoder_module_name" not in peft.__all__


def test_bad_peft_directories_are_errors_that_name_the_problem(tmp_path):
    params = decoder_params()
    adapters = trained(peft.init_lora(params, RULES, key=jax.random.key(0)))
    peft.export_peft(tmp_path / "adapter", adapters, params)
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"

    def rewrite(changed):
        save_file(changed, str(weights))

    rewrite({k: v for k, v in tensors.items() if k != name})
    with raises_naming("model.layers.0.self_attn.q_proj", "partner"):
        peft.import_peft(tmp_path / "adapter", params)
    rewrite({**tensors, name.replace("layers.0", "layers.7"): tensors[name]})
    with raises_naming("model.layers.7.self_attn.q_proj"):
        peft.import_peft(tmp_path / "adapter", params)
    rewrite({**tensors, name: tensors[name][:10]})
    with raises_naming("model.layers.0.self_attn.q_proj", "do not fit"):
        peft.import_peft(tmp_path / "adapter", params)
    rewrite({**tensors, "base_model.model.lm_head.weight": tensors[name]})
    with raises_naming("lm_head.weight", "not a LoRA factor"):
        peft.import_peft(tmp_path / "adapter", params)


def test_export_replaces_a_directory_only_when_complete(tmp_path):
    params = decoder_params()
    first = trained(peft.init_lora(params, RULES, key=jax.random.key(0)), seed=1)
    second = trained(first, seed=2)
    peft.export_peft(tmp_path / "adapter", first, params)
    peft.export_peft(tmp_path / "adapter", second, params)
    assert_same_adapters(peft.import_peft(tmp_path / "adapter", params), second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no staging left over


def test_orbax_save_and_restore_round_trip(tmp_path):
    params = decoder_params(scan_layers=True)
    rules = [peft.LoraRule(pattern=r".*_proj/kernel", rank=3, alpha=5.0, dropout=0.1)]
    adapters = trained(peft.init_lora(params, rules, key=jax.random.key(0)))
    peft.save_adapters(tmp_path / "ck", adapters)
    restored = peft.restore_adapters(tmp_path / "ck")
    assert_same_adapters(restored, adapters)
    leaf = restored["layers"]["mlp"]["up_proj"]["kernel"]
    assert (leaf.alpha, leaf.dropout, leaf.layout, leaf.rank) == (5.0, 0.1, "in_out", 3)
    peft.save_adapters(tmp_path / "ck", trained(adapters, seed=9))  # overwrite in place
    assert not np.array_equal(
        peft.restore_adapters(tmp_path / "ck")["layers"]["mlp"]["up_proj"]["kernel"].a, leaf.a
    )


def test_exported_adapters_give_the_same_logits_in_hugging_face_peft(tmp_path):
    """Our LoRA forward on a transformers checkpoint equals PEFT's on the exported adapter."""
    torch, transformers = hf_modules()
    peft_hf = pytest.importorskip("peft", reason="the Hugging Face peft package")
    directory = write_tiny_checkpoint(tmp_path / "model", "qwen2")
    loaded = load_hf_checkpoint(directory)
    adapters = trained(peft.init_lora(loaded.params, RULES, key=jax.random.key(0)), seed=5)
    peft.export_peft(tmp_path / "adapter", adapters, loaded.params)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=(2, 7))
    where = np.ones((2, 7), bool)
    where[1, 5:] = False

    def forward(params, tokens, where):
        model = nnx.merge(loaded.graphdef, params)
        return model.unembed(model(tokens, where=where))

    ours = jax.jit(lambda p, a: peft.lora(forward)(peft.apply_lora(p, a), tokens, where))(
        loaded.params, adapters
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model = peft_hf.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    theirs = hf_logits(model, tokens, where)
    np.testing.assert_allclose(np.asarray(ours)[where], theirs[where], atol=1e-4, rtol=1e-4)
    plain = jax.jit(forward)(loaded.params, tokens, where)
    assert np.abs(np.asarray(plain)[where] - theirs[where]).max() > 1e-2  # adapters matter
    merged = peft_hf.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32),
        tmp_path / "adapter",
    ).merge_and_unload()
    np.testing.assert_allclose(hf_logits(merged, tokens, where)[where], theirs[where], atol=1e-4)

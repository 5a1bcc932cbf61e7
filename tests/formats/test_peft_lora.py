"""The Hugging Face PEFT LoRA format as factor matrices per module: round trips, the fixed
config fields, the stored dtypes, and the directories it refuses. The mapping to a model's
adapters, and parity with Hugging Face PEFT, are in tests/peft/test_export.py."""

import json

import ml_dtypes
import numpy as np
import pytest

from tests._helpers import raises_naming
from tunelib.formats import read_peft_lora, write_peft_lora

RNG = np.random.default_rng(0)
FACTORS = {
    "model.layers.0.self_attn.q_proj": (
        RNG.standard_normal((2, 8)).astype(np.float32),
        RNG.standard_normal((8, 2)).astype(np.float32),
    ),
    "model.layers.1.mlp.up_proj": (
        RNG.standard_normal((4, 8)).astype(np.float16),
        RNG.standard_normal((12, 4)).astype(np.float16),
    ),
}
CONFIG = {"r": 2, "lora_alpha": 4.0, "target_modules": ["q_proj", "up_proj"]}


def test_round_trip_keeps_the_arrays_and_adds_the_fixed_fields(tmp_path):
    write_peft_lora(tmp_path / "adapter", FACTORS, CONFIG)
    config, factors = read_peft_lora(tmp_path / "adapter")
    assert config == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", **CONFIG, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None,
        "use_dora": False, "inference_mode": True,
    }  # fmt: skip
    assert factors.keys() == FACTORS.keys()
    for module, (a, b) in FACTORS.items():
        for got, want in zip(factors[module], (a, b), strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


def test_other_dtypes_are_stored_as_float32(tmp_path):
    a, b = FACTORS["model.layers.0.self_attn.q_proj"]
    write_peft_lora(tmp_path / "adapter", {"m": (a.astype(ml_dtypes.bfloat16), b)}, CONFIG)
    _, factors = read_peft_lora(tmp_path / "adapter")
    assert factors["m"][0].dtype == np.float32
    np.testing.assert_array_equal(factors["m"][0], a.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize(
    ("change", "named"),
    [({"peft_type": "IA3"}, "IA3 adapter, not LORA"), ({"use_dora": True}, "DoRA")],
)
def test_adapters_of_another_kind_are_refused(tmp_path, change, named):
    write_peft_lora(tmp_path / "adapter", FACTORS, CONFIG)
    path = tmp_path / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with raises_naming(named):
        read_peft_lora(tmp_path / "adapter")

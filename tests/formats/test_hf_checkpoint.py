"""Hugging Face checkpoints: round trips, errors naming tensors, sharding, transformers parity."""

import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests._helpers import raises_naming
from tests._hf import (
    VOCAB_SIZE,
    assert_reloads_equal,
    hf_greedy,
    hf_logits,
    hf_modules,
    model_class,
    write_tiny_checkpoint,
)
from tests.models.test_decoder import LLAMA3, build, make_config
from tunelib.formats import _hf_checkpoint as hf_checkpoint
from tunelib.formats import load_hf_checkpoint, save_hf_checkpoint
from tunelib.formats._safetensors import TensorFiles
from tunelib.models import TENSOR_PARALLEL_RULES, param_shardings
from tunelib.rollout import SamplingConfig, sample

# tunelib configs each family can express, with its distinguishing options on.
OURS = {
    "llama": dict(
        attention_bias=True,
        o_proj_bias=True,
        mlp_bias=True,
        rope_scaling=LLAMA3,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(attention_bias=True),
    "qwen3": dict(use_qk_norm=True, head_dim=8, tie_word_embeddings=False),
    "mistral": dict(sliding_window=3, tie_word_embeddings=False),
}


def leaves(params) -> dict:
    pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(pure)
    }


def assert_bits_equal(a, b) -> None:
    a, b = leaves(a), leaves(b)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        np.testing.assert_array_equal(a[key].view(np.uint8), b[key].view(np.uint8), err_msg=key)


def relayout(pure: dict, scanned: bool, to_scanned: bool, num_layers: int = 2) -> dict:
    """`pure` params with the layers stacked or unstacked as `to_scanned` asks."""
    layers = pure["layers"]
    if scanned and not to_scanned:
        layers = {i: jax.tree.map(lambda x, i=i: x[i], layers) for i in range(num_layers)}
    elif to_scanned and not scanned:
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[i] for i in range(num_layers)])
    return {**pure, "layers": layers}


@functools.cache
def model_of(family: str, scan: bool = False, seed: int = 0):
    """A tunelib model of `family` as (graphdef, params), built once per module."""
    return nnx.split(build(make_config(**OURS[family], scan_layers=scan), seed=seed))


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    """Saves `model_of(family)` once per (family, save options); tests get copies."""
    root, directories = tmp_path_factory.mktemp("saved"), {}

    def get(family, **kwargs):
        key = (family, *sorted(kwargs.items()))
        if key not in directories:
            graphdef, params = model_of(family)
            directories[key] = save_hf_checkpoint(
                root / str(len(directories)), graphdef, params, model_type=family, **kwargs
            )
        return directories[key]

    return get


@pytest.fixture
def saved(tmp_path, saved_once):
    """`saved(family, name, **save_options)`: a tunelib model of `family` saved into
    `tmp_path / name` (a copy of one saved once); returns (directory, graphdef, params)."""

    def copy(family="llama", name="ckpt", **kwargs):
        directory = Path(shutil.copytree(saved_once(family, **kwargs), tmp_path / name))
        return directory, *model_of(family)

    return copy


# ----------------------------------------------------------------------------- without torch


@pytest.mark.parametrize("family", list(OURS))
@pytest.mark.parametrize(("scan_save", "scan_load"), [(False, False), (False, True), (True, False)])
def test_save_then_load_round_trips_bit_for_bit(tmp_path, family, scan_save, scan_load):
    graphdef, params = model_of(family, scan_save)
    directory = save_hf_checkpoint(tmp_path / "ckpt", graphdef, params, model_type=family)
    loaded = load_hf_checkpoint(directory, scan_layers=scan_load)
    assert loaded.config == make_config(**OURS[family], scan_layers=scan_load)
    assert_bits_equal(loaded.params, relayout(nnx.to_pure_dict(params), scan_save, scan_load))
    # Saving the loaded model again writes identical tensors.
    again = save_hf_checkpoint(tmp_path / "again", loaded.graphdef, loaded.params,
                               hf_config=loaded.hf_config)  # fmt: skip
    first, second = (
        load_file(directory / "model.safetensors"),
        load_file(again / "model.safetensors"),
    )
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


def test_saved_tensors_are_hugging_face_layout(saved):
    directory, _, params = saved("llama")
    tensors = load_file(directory / "model.safetensors")
    layer = params["layers"][1]
    np.testing.assert_array_equal(
        tensors["model.layers.1.self_attn.q_proj.weight"],
        np.asarray(layer["self_attn"]["q_proj"]["kernel"][...]).T,
    )
    np.testing.assert_array_equal(
        tensors["model.layers.1.mlp.down_proj.bias"],
        np.asarray(layer["mlp"]["down_proj"]["bias"][...]),
    )
    np.testing.assert_array_equal(
        tensors["lm_head.weight"], np.asarray(params["lm_head"]["kernel"][...]).T
    )
    n = 2
    assert len(tensors) == 3 + n * (2 + 4 * 2 + 3 * 2)  # embed, norm, head; per layer
    config = json.loads((directory / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_theta"] == 500000.0
    assert config["rope_parameters"] == {**LLAMA3, "rope_theta": 500000.0}
    assert config["attention_bias"] and config["mlp_bias"] and config["torch_dtype"] == "float32"


def test_tied_embeddings_write_no_lm_head(saved):
    directory, _, _ = saved("qwen2")
    names = set(load_file(directory / "model.safetensors"))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_save_and_dtype_choice(saved, dtype):
    directory, _, params = saved("qwen3", dtype=dtype)
    files = TensorFiles(directory)
    with files:
        assert {files.dtype_code(n) for n in files.names()} == {
            "BF16" if dtype == "bfloat16" else "F16"
        }
    low = np.dtype(jnp.dtype(dtype))
    for param_dtype in (dtype, "float32"):
        loaded = load_hf_checkpoint(directory, param_dtype=param_dtype, dtype="bfloat16")
        assert loaded.config.param_dtype == param_dtype and loaded.config.dtype == "bfloat16"
        target = jnp.dtype(param_dtype)
        expected = jax.tree.map(
            lambda x, target=target: np.asarray(x).astype(low).astype(target),
            nnx.to_pure_dict(params),
        )
        assert_bits_equal(loaded.params, expected)


def test_sharded_save_writes_index(saved):
    directory, _, params = saved("llama", max_shard_size=40_000)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    total = 0
    for name in files:
        tensors = load_file(directory / name)
        assert sum(t.nbytes for t in tensors.values()) <= 40_000 or len(tensors) == 1
        for key, tensor in tensors.items():
            assert index["weight_map"][key] == name
            total += tensor.nbytes
    assert index["metadata"]["total_size"] == total
    assert len(index["weight_map"]) == sum(len(load_file(directory / f)) for f in files)
    assert_bits_equal(load_hf_checkpoint(directory).params, params)


def edit_checkpoint(directory, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


LAYER0 = "model.layers.0."
BAD_EDITS = {
    "missing": (
        lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
        ["missing", "model.layers.1.mlp.up_proj.weight"],
    ),
    "extra": (
        lambda t: t.update({LAYER0 + "mlp.extra.weight": np.ones(3, np.float32)}),
        ["unexpected", LAYER0 + "mlp.extra.weight"],
    ),
    "extra_layer": (
        lambda t: t.update({"model.layers.2.input_layernorm.weight": np.ones(64)}),
        ["unexpected", "model.layers.2.input_layernorm.weight"],
    ),
    "norm_shape": (
        lambda t: t.update({"model.norm.weight": np.ones(65, np.float32)}),
        ["model.norm.weight", "[65]", "[64]"],
    ),
    "vocab_padding": (
        lambda t: t.update({"model.embed_tokens.weight": np.ones((40, 64))}),
        ["model.embed_tokens.weight", "[40, 64]", "[32, 64]"],
    ),
    "transposed": (
        lambda t: t.update({LAYER0 + "self_attn.k_proj.weight": np.ones((64, 32))}),
        [LAYER0 + "self_attn.k_proj.weight", "[64, 32]", "[32, 64]"],
    ),
    "integer": (
        lambda t: t.update({"lm_head.weight": np.ones((32, 64), np.int8)}),
        ["lm_head.weight", "I8"],
    ),
}


@pytest.mark.parametrize(("edit", "named"), list(BAD_EDITS.values()), ids=list(BAD_EDITS))
def test_bad_tensors_are_named(saved, edit, named):
    directory, _, _ = saved("llama")
    edit_checkpoint(directory, edit)
    with raises_naming(*named, error=ValueError):
        load_hf_checkpoint(directory)


def test_every_missing_and_unexpected_tensor_is_listed(saved):
    directory, _, _ = saved("mistral")

    def edit(tensors):
        tensors.pop("model.norm.weight")
        tensors.pop("lm_head.weight")
        tensors["score.weight"] = np.ones((2, 64), np.float32)

    edit_checkpoint(directory, edit)
    named = ["missing", "'lm_head.weight'", "'model.norm.weight'", "unexpected", "'score.weight'"]
    with raises_naming(*named, error=ValueError):
        load_hf_checkpoint(directory)


def test_tied_lm_head_and_rotary_buffers(saved):
    directory, _, params = saved("qwen2")

    def add_equal_head(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    edit_checkpoint(directory, add_equal_head)
    assert_bits_equal(load_hf_checkpoint(directory).params, params)  # both are read as nothing

    def change_head(tensors):
        tensors["lm_head.weight"][5, 3] += 1.0

    edit_checkpoint(directory, change_head)
    with raises_naming("lm_head.weight", "differs", "row 0", error=ValueError):
        load_hf_checkpoint(directory)


def test_missing_files_are_named(saved):
    directory, _, _ = saved("llama", max_shard_size=40_000)
    second = sorted(directory.glob("model-*.safetensors"))[1]
    second.rename(directory / "moved.safetensors")
    with raises_naming(second.name, error=FileNotFoundError):
        load_hf_checkpoint(directory)
    (directory / "model.safetensors.index.json").unlink()
    with raises_naming("model.safetensors", "pytorch_model.bin", error=FileNotFoundError):
        load_hf_checkpoint(directory)
    (directory / "config.json").unlink()
    with raises_naming("config.json", error=FileNotFoundError):
        load_hf_checkpoint(directory)


@pytest.mark.parametrize("size", [5, 1000, -100])  # the header cut, its data, the last bytes
def test_a_safetensors_file_cut_short_is_named(saved, size):
    directory, _, _ = saved("llama")
    file = directory / "model.safetensors"
    with open(file, "r+b") as f:
        f.truncate(size if size > 0 else file.stat().st_size + size)
    with raises_naming("model.safetensors", "damaged or cut short", error=ValueError):
        load_hf_checkpoint(directory)


def test_index_must_agree_with_files(saved):
    directory, _, _ = saved("llama", max_shard_size=40_000)
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    first = sorted(directory.glob("model-*.safetensors"))[0].name
    assert index["weight_map"]["model.norm.weight"] != first
    index["weight_map"]["model.norm.weight"] = first
    path.write_text(json.dumps(index))
    with raises_naming("model.norm.weight", first, error=ValueError):
        load_hf_checkpoint(directory)


@pytest.mark.parametrize("scan", [False, True])
def test_loads_onto_a_mesh_with_requested_shardings(saved, scan):
    directory, _, _ = saved("llama")
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    loaded = load_hf_checkpoint(directory, mesh=mesh, scan_layers=scan)
    wanted = param_shardings(loaded.graphdef, loaded.params, mesh, TENSOR_PARALLEL_RULES)
    got = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, loaded.params))
    assert got == jax.tree.leaves(wanted)
    assert any(s.spec != jax.sharding.PartitionSpec(*[None] * len(s.spec)) for s in got)
    head = loaded.params["lm_head"]["kernel"]
    assert head.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert {s.data.shape for s in head.addressable_shards} == {(64, 8)}
    single = load_hf_checkpoint(directory, scan_layers=scan)
    assert_bits_equal(loaded.params, single.params)
    # The sharded model computes what the single-device one does.
    tokens = jnp.array([[3, 17, 9, 30, 1, 22, 8, 4]] * 2)

    @jax.jit
    def logits(params):
        model = nnx.merge(loaded.graphdef, params)
        return model.unembed(model(tokens))

    np.testing.assert_allclose(logits(loaded.params), logits(single.params), rtol=1e-5, atol=1e-5)


def test_explicit_shardings_and_their_errors(saved):
    directory, _, params = saved("qwen3")
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
    shardings = jax.tree.map(lambda _: replicated, nnx.to_pure_dict(params))
    shardings["embed_tokens"]["embedding"] = by_rows
    loaded = load_hf_checkpoint(directory, shardings=shardings)
    assert loaded.params["embed_tokens"]["embedding"].sharding == by_rows
    assert loaded.params["norm"]["scale"].sharding == replicated
    assert_bits_equal(loaded.params, params)
    with raises_naming("mesh or shardings", error=ValueError):
        load_hf_checkpoint(directory, shardings=shardings, mesh=mesh)
    del shardings["norm"]
    with raises_naming("shardings must have the structure", error=ValueError):
        load_hf_checkpoint(directory, shardings=shardings)


def test_each_device_reads_only_its_shard(saved, monkeypatch):
    """No whole tensor is read for a sharded parameter: every read is one shard's slice."""
    directory, _, _ = saved("llama")
    reads = []
    original = TensorFiles.read

    def spy(self, name, index):
        out = original(self, name, index)
        reads.append((name, out.shape))
        return out

    monkeypatch.setattr(TensorFiles, "read", spy)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    load_hf_checkpoint(directory, mesh=mesh, scan_layers=True)
    shapes = {}
    for name, shape in reads:
        shapes.setdefault(name, set()).add(shape)
    assert shapes["model.layers.0.mlp.up_proj.weight"] == {(24, 64)}  # [F / 4, H] of [96, 64]
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == {(64, 16)}  # [H, N*D / 4]
    assert shapes["lm_head.weight"] == {(8, 64)}
    # A replicated tensor is read once, not once per device.
    assert sum(name == "model.norm.weight" for name, _ in reads) == 1


def test_save_is_atomic_and_refuses_to_clobber(tmp_path, saved, monkeypatch):
    directory, graphdef, params = saved("mistral")
    with raises_naming(str(directory), error=FileExistsError):
        save_hf_checkpoint(directory, graphdef, params, model_type="mistral")
    # A save that fails part-way leaves neither a checkpoint nor a partial directory behind.

    def fail(path, tensors, *, max_shard_size):
        (path / "model-00001-of-00002.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(hf_checkpoint, "write_tensors", fail)
    with pytest.raises(OSError, match="disk full"):
        save_hf_checkpoint(tmp_path / "new", graphdef, params, model_type="mistral")
    with pytest.raises(OSError, match="disk full"):
        save_hf_checkpoint(directory, graphdef, params, model_type="mistral", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert_bits_equal(load_hf_checkpoint(directory).params, params)  # the old one is intact
    monkeypatch.undo()
    other = model_of("mistral", seed=1)[1]
    save_hf_checkpoint(directory, graphdef, other, model_type="mistral", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert_bits_equal(load_hf_checkpoint(directory).params, other)


def test_save_copies_tokenizer_files(tmp_path, saved):
    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer.json").write_text("{}")
    (source / "chat_template.jinja").write_text("{{ messages }}")
    (source / "notes.txt").write_text("not copied")
    directory, _, _ = saved("qwen2", copy_files_from=source)
    assert sorted(p.name for p in directory.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]


def test_save_errors_name_the_problem(tmp_path):
    graphdef, params = model_of("qwen3")
    with raises_naming("model_type", error=ValueError):
        save_hf_checkpoint(tmp_path / "a", graphdef, params)
    with raises_naming("use_qk_norm", "llama", error=ValueError):
        save_hf_checkpoint(tmp_path / "a", graphdef, params, model_type="llama")
    with raises_naming("max_shard_size", error=ValueError):
        save_hf_checkpoint(tmp_path / "a", graphdef, params, model_type="qwen3", max_shard_size=0)
    pure = nnx.to_pure_dict(params)
    pure["norm"]["scale"] = jnp.ones(63)
    with raises_naming("norm/scale", "(63,)", "(64,)", error=ValueError):
        save_hf_checkpoint(tmp_path / "a", graphdef, pure, model_type="qwen3")
    assert not (tmp_path / "a").exists()


# ----------------------------------------------------------------------------- with transformers

# Three rows of 12: left-padded by 3, right-padded by 2, unpadded; ids at padding are junk.
TOKENS = np.random.default_rng(0).integers(4, 300, size=(3, 12))
WHERE = np.ones(TOKENS.shape, bool)
WHERE[0, :3] = False
WHERE[1, -2:] = False


@functools.partial(jax.jit, static_argnums=0)
def logits_of(graphdef, params, tokens, where):
    model = nnx.merge(graphdef, params)
    return model.unembed(model(tokens, where=where))


@pytest.fixture(scope="module")
def hf():
    return hf_modules()


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "qwen3_moe",
        "gemma2",
        "gemma3_text",
        "gemma4_text",
        "gemma4_text_moe",
        "gpt_oss",
        "deepseek_v3",
    ],
)
def test_matches_transformers(tmp_path, hf, family):
    """Logits within 1e-4, 20 greedy tokens identical, and our save loads in transformers."""
    directory = write_tiny_checkpoint(tmp_path / "hf", family, tokenizer=False)
    reference = model_class(family).from_pretrained(directory).eval()
    expected = hf_logits(reference, TOKENS, WHERE)
    loaded = load_hf_checkpoint(directory)
    logits = np.asarray(logits_of(loaded.graphdef, loaded.params, TOKENS, WHERE))
    assert logits.shape == (3, 12, VOCAB_SIZE)
    error = np.abs(logits - expected)[WHERE].max()
    assert error < 1e-4, error
    assert np.abs(expected[WHERE]).max() > 1.0  # logits far from uniform: the test has teeth
    if family == "mistral":  # the window (5) is shorter than the rows and changes the logits
        full = model_class(family).from_pretrained(directory, sliding_window=None).eval()
        assert np.abs(hf_logits(full, TOKENS, WHERE) - expected)[WHERE].max() > 1e-2

    # Greedy decoding of 20 tokens after left-padded prompts, stop tokens off on both sides.
    prompts, prompt_where = TOKENS[[0, 2]], WHERE[[0, 2]]
    generated = hf_greedy(reference, prompts, prompt_where, 20)
    rollout = sample(loaded.graphdef, loaded.params, prompts, prompt_where, jax.random.key(0),
                     SamplingConfig(max_new_tokens=20, temperature=0.0))  # fmt: skip
    assert generated.shape == (2, 20)
    np.testing.assert_array_equal(np.asarray(rollout.tokens), generated)

    # Saved by tunelib (with the config it was loaded from), loaded by transformers.
    ours = save_hf_checkpoint(tmp_path / "ours", loaded.graphdef, loaded.params,
                              hf_config=loaded.hf_config)  # fmt: skip
    assert_reloads_equal(family, ours, reference, TOKENS, WHERE)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_transformers_loads_a_model_saved_from_scratch(tmp_path, hf, family):
    """A model tunelib built itself (no base config) is read by transformers as the same model."""
    graphdef, params = nnx.split(build(make_config(**OURS[family], vocab_size=300), seed=3))
    ours = np.asarray(logits_of(graphdef, params, TOKENS, WHERE))
    directory = save_hf_checkpoint(tmp_path / "ours", graphdef, params, model_type=family,
                                   max_shard_size=30_000)  # fmt: skip
    assert (directory / "model.safetensors.index.json").exists()
    reference = model_class(family).from_pretrained(directory).eval()
    assert np.abs(hf_logits(reference, TOKENS, WHERE) - ours)[WHERE].max() < 1e-4


def test_bf16_checkpoint_from_transformers(tmp_path, hf):
    torch, _ = hf
    directory = write_tiny_checkpoint(tmp_path / "hf", "qwen3", dtype="bfloat16", tokenizer=False)
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    state = model_class("qwen3").from_pretrained(directory, dtype=torch.bfloat16).state_dict()
    for param_dtype in ("float32", "bfloat16"):
        loaded = load_hf_checkpoint(directory, param_dtype=param_dtype)
        q = loaded.params["layers"][1]["self_attn"]["q_proj"]["kernel"]
        assert q.dtype == jnp.dtype(param_dtype)
        weight = state["model.layers.1.self_attn.q_proj.weight"].float().numpy().T
        np.testing.assert_array_equal(np.asarray(q, np.float32), weight)
        norm = state["model.layers.0.self_attn.k_norm.weight"].float().numpy()
        np.testing.assert_array_equal(
            np.asarray(loaded.params["layers"][0]["self_attn"]["k_norm"]["scale"], np.float32), norm
        )
    assert np.asarray(q).dtype == ml_dtypes.bfloat16


def test_sharded_checkpoint_from_transformers(tmp_path, hf):
    single = write_tiny_checkpoint(tmp_path / "single", "llama", tokenizer=False)
    sharded = write_tiny_checkpoint(
        tmp_path / "sharded", "llama", max_shard_size="40KB", tokenizer=False
    )
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    assert_bits_equal(load_hf_checkpoint(sharded).params, load_hf_checkpoint(single).params)


def test_older_config_layout_loads_the_same_model(tmp_path, hf):
    """transformers < 5 wrote rope_theta / rope_scaling at the top and torch_dtype."""
    directory = write_tiny_checkpoint(tmp_path / "hf", "llama", tokenizer=False)
    new = load_hf_checkpoint(directory)
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}  # the legacy key
    config["torch_dtype"] = config.pop("dtype")
    config["transformers_version"] = "4.44.0"
    path.write_text(json.dumps(config))
    old = load_hf_checkpoint(directory)
    assert old.config == new.config and old.config.rope_scaling["rope_type"] == "llama3"
    assert_bits_equal(old.params, new.params)

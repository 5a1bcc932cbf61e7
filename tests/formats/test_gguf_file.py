"""`_gguf_file.read_gguf_file` against `gguf.GGUFReader`: the same metadata, tensors and data
views, for files of every value and tensor type the `gguf` package writes, either byte
order, another alignment, and SmolLM2-135M's file; and one line for a damaged file."""

import gguf
import numpy as np
import pytest

from tests._helpers import raises_naming
from tests.models.test_smollm2 import smollm2_file
from tunelib.formats._gguf_file import read_gguf_file

QUANTS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"]


def assert_as_the_reader_reads(path):
    ours, theirs = read_gguf_file(path), gguf.GGUFReader(path)
    assert ours.metadata == {name: f.contents() for name, f in theirs.fields.items()}
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for got, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert got.tensor_type == want.tensor_type and np.array_equal(got.shape, want.shape)
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
        assert got.data.tobytes() == want.data.tobytes()


def write(path, *, endianess=gguf.GGUFEndian.LITTLE, alignment=None):
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 700)
    writer.add_int16("t.i16", -700)
    writer.add_uint32("t.u32", 70_000)
    writer.add_int32("t.i32", -70_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.text", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.5])
    writer.add_array("t.words", ["a", "", "ü b"])
    rng = np.random.default_rng(0)
    for quant in QUANTS:
        w = rng.normal(size=(4, 256)).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[quant]
        if quant in ("F32", "F16"):
            writer.add_tensor(f"w.{quant}", w.astype(quant.lower().replace("f", "float")))
        elif quant.endswith("_K"):  # blocks the package cannot make: their bytes, drawn
            shape = gguf.quant_shape_to_byte_shape(w.shape, qtype)
            blocks = rng.integers(0, 256, shape, dtype=np.uint8)
            writer.add_tensor(f"w.{quant}", blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(f"w.{quant}", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.add_tensor("v.I32", rng.integers(-9, 9, (3, 5)).astype(np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "settings",
    [{}, {"alignment": 64}, {"endianess": gguf.GGUFEndian.BIG}],
    ids=["little", "aligned-64", "big-endian"],
)
def test_every_type_reads_as_the_gguf_reader_reads_it(tmp_path, settings):
    assert_as_the_reader_reads(write(tmp_path / "all.gguf", **settings))


def test_smollm2_reads_as_the_gguf_reader_reads_it():
    assert_as_the_reader_reads(smollm2_file())


def test_a_file_cut_short_is_one_line_naming_it(tmp_path):
    whole = write(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in (200, len(whole) - 100):  # inside the headers, then inside the data
        cut.write_bytes(whole[:size])
        with raises_naming(str(cut), "is it truncated?", error=ValueError):
            read_gguf_file(cut)

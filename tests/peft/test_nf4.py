"""NF4 quantisation against a float64 NumPy reference written from the spec, and bitsandbytes.

The reference (`ref_nf4`) follows DESIGN.md and the QLoRA paper, not the implementation: blocks
of 64 over the row-major flattened `[m, n]` stored matrix, the nearest NF4 value (argmin of
distances, so a tie goes to the lower code) of w / absmax in float64, and double quantisation of
the absmax values minus their mean to the nearest dynamic-map value, 256 per block. The only
disagreements allowed are codes whose float64 scaled value lies within float32 rounding of a
midpoint between two table values.
"""

import functools
import math
from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._helpers import assert_close, assert_traced_once, own_checks, raises_naming
from tunelib import peft
from tunelib.peft import (
    DYNAMIC_MAP,
    NF4_VALUES,
    NF4Tensor,
    bits_per_parameter,
    nf4_quantize,
    pack_nibbles,
    signed_dynamic_map,
    stored_bytes,
    table_lookup,
    unpack_nibbles,
)

NF4_64 = NF4_VALUES.astype(np.float64)
MAP_64 = DYNAMIC_MAP.astype(np.float64)
# Half the widest gap of the NF4 table (between -1 and -0.696): the worst rounding error, in
# units of the block absmax. DESIGN.md and the docstring round it to 0.1519.
NF4_HALF_GAP = float(np.max(np.diff(NF4_64)) / 2)
# The widest step of the dynamic map (0.9 / 64, next to +-1): double quantisation moves an
# absmax by at most half of it times its 256-block's max |absmax - offset|.
MAP_STEP = float(np.max(np.diff(MAP_64)))
# Scaled values this close to a midpoint may round either way in float32.
MIDPOINT_TOL = 1e-6


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize(w, transpose, double_quant, block_size, absmax_block_size):
    q = nf4_quantize(
        w,
        transpose=transpose,
        double_quant=double_quant,
        block_size=block_size,
        absmax_block_size=absmax_block_size,
    )
    return q, q.dequantize(), q.block_absmax()


def quantize(w, *, transpose=False, double_quant=True, block_size=64, absmax_block_size=256):
    """The quantised tensor, its array and its absmax; compiled once per shape and options
    (which are passed on positionally, so that every spelling of a call shares the cache)."""
    return _quantize(w, transpose, double_quant, block_size, absmax_block_size)


@jax.jit
def pack_and_unpack(codes):
    packed = pack_nibbles(codes)
    return packed, unpack_nibbles(packed, codes.shape[-1])


# ---- references -------------------------------------------------------------------------------


def ref_nearest(scaled: np.ndarray, table: np.ndarray):
    """Index of the nearest `table` value (the first, i.e. lower, on a tie) and the distance to
    the nearest midpoint between two table values."""
    index = np.argmin(np.abs(scaled[..., None] - table), axis=-1)
    midpoints = (table[:-1] + table[1:]) / 2
    gap = np.min(np.abs(scaled[..., None] - midpoints), axis=-1)
    return index, gap


def ref_blockwise(flat: np.ndarray, block_size: int, table: np.ndarray):
    """Absmax quantisation of `[L, size]` in blocks of `block_size` (the tail zero-padded)."""
    size = flat.shape[1]
    blocks = np.pad(flat, ((0, 0), (0, -size % block_size))).reshape(len(flat), -1, block_size)
    absmax = np.abs(blocks).max(-1)
    scaled = blocks / np.where(absmax > 0, absmax, 1.0)[..., None]  # a zero block scales to 0
    index, gap = ref_nearest(scaled, table)
    return index.reshape(len(flat), -1)[:, :size], gap.reshape(len(flat), -1)[:, :size], absmax


def ref_nf4(stored, *, block_size=64, double_quant=True, absmax_block_size=256) -> dict:
    """float64 NF4 of the stored matrices `[..., m, n]`, flattened to `[L, ...]`."""
    stored = np.asarray(stored, np.float64)
    m, n = stored.shape[-2:]
    flat = stored.reshape(-1, m * n)
    codes, gap, absmax = ref_blockwise(flat, block_size, NF4_64)
    ref = {"codes": codes, "gap": gap, "absmax": absmax}
    if double_quant:
        offset = absmax.mean(-1)
        centred = absmax - offset[:, None]
        qcodes, qgap, scale = ref_blockwise(centred, absmax_block_size, MAP_64)
        ref.update(offset=offset, scale=scale, qcodes=qcodes, qgap=qgap)
    return ref


def ref_pack(codes: np.ndarray) -> np.ndarray:
    """Two codes per byte along the last axis, the even element high, an odd tail padded with 7."""
    codes = np.asarray(codes, np.uint8)
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.full((*codes.shape[:-1], 1), 7, np.uint8)], -1)
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def ref_unpack(packed: np.ndarray, size: int) -> np.ndarray:
    packed = np.asarray(packed, np.uint8)
    both = np.stack([packed >> 4, packed & 15], axis=-1).reshape(*packed.shape[:-1], -1)
    return both[..., :size]


def ref_block_absmax(q: NF4Tensor) -> np.ndarray:
    """The float64 absmax a tensor's stored fields encode, decoded in NumPy."""
    if q.absmax_scale is None:
        return np.asarray(q.absmax, np.float64)
    scale = np.repeat(np.asarray(q.absmax_scale, np.float64), q.absmax_block_size, axis=-1)
    scale = scale[..., : q.absmax.shape[-1]]
    offset = np.asarray(q.absmax_offset, np.float64)[..., None]
    return MAP_64[np.asarray(q.absmax)] * scale + offset


def ref_dequantize(q: NF4Tensor) -> np.ndarray:
    """The array a tensor's stored fields encode, decoded in NumPy (float64)."""
    m, n = q.stored_shape
    codes = ref_unpack(q.codes, m * n)
    values = NF4_64[codes]
    per_element = np.repeat(ref_block_absmax(q), q.block_size, axis=-1)[..., : m * n]
    out = (values * per_element).reshape(*codes.shape[:-1], m, n)
    return np.swapaxes(out, -1, -2) if q.transposed else out


def assert_decodes_its_fields(q: NF4Tensor, deq, absmax) -> None:
    """`block_absmax()` and `dequantize()` against a NumPy decoding of the stored fields, to
    float32 rounding (of the offset, with double quantisation, where the absmax cancels)."""
    ref_absmax, ref_deq = ref_block_absmax(q), ref_dequantize(q)
    assert_close(absmax, ref_absmax, rtol=1e-6, atol=1e-6 * np.abs(ref_absmax).max())
    assert_close(deq, ref_deq, rtol=1e-6, atol=1e-6 * np.abs(ref_deq).max())


def stored_layout(w: np.ndarray, transpose: bool) -> np.ndarray:
    return np.swapaxes(w, -1, -2) if transpose else w


def assert_matches_reference(w, q, *, transpose, block_size, double_quant, absmax_block_size):
    stored = stored_layout(np.asarray(w, np.float32), transpose)
    lead, (m, n) = stored.shape[:-2], stored.shape[-2:]
    size, n_blocks = m * n, math.ceil(m * n / block_size)
    ref = ref_nf4(
        stored,
        block_size=block_size,
        double_quant=double_quant,
        absmax_block_size=absmax_block_size,
    )
    assert q.shape == w.shape and q.stored_shape == (m, n) and q.transposed == transpose
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == (*lead, math.ceil(size / 2))

    # NF4 codes: equal, except by one step where the scaled value sits on a midpoint.
    codes = ref_unpack(q.codes, size).reshape(-1, size).astype(np.int64)
    differ = codes != ref["codes"]
    assert np.all(ref["gap"][differ] < MIDPOINT_TOL), ref["gap"][differ]
    assert np.all(np.abs(codes - ref["codes"])[differ] == 1)
    assert np.array_equal(np.asarray(q.codes).reshape(-1, q.codes.shape[-1]), ref_pack(codes))
    if size % 2:  # the padding nibble of an odd tail is the code of 0.0
        assert np.all(np.asarray(q.codes)[..., -1] & 15 == 7)

    if not double_quant:
        assert q.absmax.dtype == jnp.float32 and q.absmax.shape == (*lead, n_blocks)
        assert q.absmax_scale is None and q.absmax_offset is None
        # The max of float32 magnitudes is a float32: exact.
        assert np.array_equal(np.asarray(q.absmax, np.float64).reshape(-1, n_blocks), ref["absmax"])
        return
    n_scales = math.ceil(n_blocks / absmax_block_size)
    assert q.absmax.dtype == jnp.uint8 and q.absmax.shape == (*lead, n_blocks)
    assert q.absmax_scale.shape == (*lead, n_scales) and q.absmax_scale.dtype == jnp.float32
    assert q.absmax_offset.shape == lead and q.absmax_offset.dtype == jnp.float32
    offset = np.asarray(q.absmax_offset, np.float64).reshape(-1)
    d_offset = np.abs(offset - ref["offset"])  # a float32 mean against a float64 one
    assert np.all(d_offset <= 1e-6 * ref["offset"] + 1e-30)
    # Rounding slack of a centred value, per matrix, in absmax units.
    slack = (2 * d_offset + 1e-6 * (ref["offset"] + ref["scale"].max(-1)))[:, None]
    scale = np.asarray(q.absmax_scale, np.float64).reshape(-1, n_scales)
    assert np.all(np.abs(scale - ref["scale"]) <= slack)
    # 8-bit absmax codes: equal wherever the centred value is clear of a midpoint of the map.
    qcodes = np.asarray(q.absmax).reshape(-1, n_blocks).astype(np.int64)
    per_block_scale = np.repeat(ref["scale"], absmax_block_size, axis=-1)[:, :n_blocks]
    clear = ref["qgap"] * per_block_scale > slack
    assert np.array_equal(qcodes[clear], ref["qcodes"][clear])
    # The dequantised absmax: within half a map step of the block's scale of the true absmax.
    absmax = ref_block_absmax(q).reshape(-1, n_blocks)
    assert np.all(np.abs(absmax - ref["absmax"]) <= MAP_STEP / 2 * per_block_scale + slack)


def assert_requantises_stably_within_the_error_bound(w, q, deq, absmax, opts) -> None:
    """Quantising the dequantised array gives the same codes (and, without double
    quantisation, the same absmax); every element is within half the widest NF4 gap of its
    block's absmax (plus, with double quantisation, the absmax's own error); no NaN."""
    deq, absmax = np.asarray(deq), np.asarray(absmax, np.float64)
    assert np.all(np.isfinite(deq)) and np.all(np.isfinite(absmax))
    q2, _, _ = quantize(deq, **opts)

    stored = stored_layout(w.astype(np.float64), opts["transpose"])
    m, n = stored.shape[-2:]
    size, bs = m * n, opts["block_size"]
    flat = stored.reshape(-1, size)
    error = np.abs(
        stored_layout(deq.astype(np.float64), opts["transpose"]).reshape(-1, size) - flat
    )
    true_absmax = ref_nf4(stored, block_size=bs, double_quant=False)["absmax"]
    absmax = absmax.reshape(true_absmax.shape)
    codes = ref_unpack(q.codes, size).reshape(-1, size)
    codes2 = ref_unpack(q2.codes, size).reshape(-1, size)
    assert np.all(codes <= 15)

    def per_element(block_values):
        return np.repeat(block_values, bs, axis=-1)[:, :size]

    if not opts["double_quant"]:
        assert np.array_equal(codes2, codes)
        assert np.array_equal(q2.absmax, q.absmax)
        assert np.array_equal(absmax, true_absmax)
        bound = NF4_HALF_GAP * per_element(true_absmax) * (1 + 1e-6)
    else:
        # |q m' - w| <= |q| |m' - m| + |q m - w| <= |m' - m| + H m, with m = m' + (m - m').
        absmax_error = np.abs(absmax - true_absmax)
        bound = per_element(NF4_HALF_GAP * absmax + (1 + NF4_HALF_GAP) * absmax_error)
        bound = bound * (1 + 1e-6) + 1e-6 * per_element(true_absmax)
        # Requantising keeps the codes of every block whose dequantised absmax stays positive
        # (a block far below the mean absmax can come back negative, which mirrors its codes).
        keep = per_element(absmax > 0)
        assert np.array_equal(codes2[keep], codes[keep])
    assert np.all(error <= bound)


# ---- strategies -------------------------------------------------------------------------------


@st.composite
def weights(draw, max_m=9, max_n=150):
    """float32 `[..., m, n]` weights of several kinds; sizes need not be multiples of 64."""
    lead = draw(st.sampled_from([(), (), (1,), (3,)]))
    m, n = draw(st.integers(1, max_m)), draw(st.integers(1, max_n))
    shape = (*lead, m, n)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "heavy-tailed", "tiny", "small integers"]))
    if kind == "normal":
        w = rng.standard_normal(shape)
    elif kind == "heavy-tailed":
        w = rng.standard_t(2.0, shape)
    elif kind == "tiny":
        w = 1e-4 * rng.standard_normal(shape)
    else:
        w = rng.integers(-3, 4, shape)
    w = w.astype(np.float32)
    if draw(st.booleans()):  # a zero block at the start of every matrix's flattened array
        flat = w.reshape(*lead, m * n)
        flat[..., :64] = 0.0
        w = flat.reshape(shape)
    return w


options = st.fixed_dictionaries(
    {
        "transpose": st.booleans(),
        "double_quant": st.booleans(),
        "block_size": st.sampled_from([64, 64, 16]),
        "absmax_block_size": st.sampled_from([256, 256, 4]),
    }
)


# ---- the tables -------------------------------------------------------------------------------


def test_nf4_values_are_the_normal_quantiles_of_qlora():
    # QLoRA's create_normal_map(offset=0.9677083): 8 positive quantiles, 7 negative, and 0,
    # normalised by the largest.
    offset, quantile = 0.9677083, NormalDist().inv_cdf
    positive = [quantile(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
    negative = [-quantile(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
    values = np.sort(np.array([*positive, 0.0, *negative]))
    values /= values.max()
    assert NF4_VALUES.dtype == np.float32 and NF4_VALUES.shape == (16,)
    np.testing.assert_allclose(NF4_VALUES, values, rtol=0, atol=1e-6)
    assert np.all(np.diff(NF4_VALUES) > 0)
    assert NF4_VALUES[7] == 0.0 and NF4_VALUES[0] == -1.0 and NF4_VALUES[15] == 1.0
    assert abs(NF4_HALF_GAP - 0.1519036) < 1e-7


def test_dynamic_map_follows_its_formula():
    # For i = 0..6: the 2^i midpoints of linspace(0.1, 1, 2^i + 1), that is
    # 0.1 + 0.9 (2j + 1) / 2^(i + 1), times 10^(i - 6), with both signs; then 0 and 1.
    positive = [
        10.0 ** (i - 6) * (0.1 + 0.9 * (2 * j + 1) / 2 ** (i + 1))
        for i in range(7)
        for j in range(2**i)
    ]
    expected = np.sort(np.array([*positive, *(-p for p in positive), 0.0, 1.0])).astype(np.float32)
    table = signed_dynamic_map()
    assert table.dtype == np.float32 and table.shape == (256,)
    assert np.array_equal(table, expected)
    assert np.array_equal(DYNAMIC_MAP, table)
    assert np.all(np.diff(table) > 0)  # ascending and distinct
    assert 0.0 in table and table[-1] == 1.0 and table[0] == np.float32(-0.99296875)
    # Symmetric: the negative half mirrors the positive half without the extra 1.0.
    assert np.array_equal(np.sort(-table[table < 0]), table[(table > 0) & (table < 1)])
    assert abs(MAP_STEP - 0.9 / 64) < 1e-7


# ---- quantisation against the reference -------------------------------------------------------


# Shapes and options shared by several tests (and the bitsandbytes checks), so that `quantize`
# compiles each once: (shape, transpose, double_quant).
WHOLE_BLOCKS = ((8, 64), False, False)
TAIL_BLOCK = ((37, 70), False, False)  # 2590 = 40 x 64 + 30
MANY_BLOCKS = ((130, 261), False, True)  # 531 blocks: three 256-blocks of absmax, the last partial
STACKED_ODD = ((3, 5, 13), True, True)  # stacked, transposed, 65 elements: a tail of one


def fixed_weight(shape, seed=0) -> np.ndarray:
    """Columns of varied scale, a zero block (elements 64..127 of each matrix) and, stacked, one
    matrix 50 times larger than the others (one offset for all would show)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * rng.uniform(0.1, 3.0, shape[-1])
    if len(shape) == 3:
        w[1] *= 50.0
    flat = w.reshape(*shape[:-2], -1)
    flat[..., 64:128] = 0.0
    return flat.reshape(shape).astype(np.float32)


@pytest.mark.parametrize("case", [WHOLE_BLOCKS, TAIL_BLOCK, MANY_BLOCKS, STACKED_ODD])
def test_fixed_matrices_match_the_float64_reference(case):
    shape, transpose, double_quant = case
    w = fixed_weight(shape)
    q, deq, absmax = quantize(w, transpose=transpose, double_quant=double_quant)
    assert_matches_reference(
        w, q, transpose=transpose, block_size=64, double_quant=double_quant, absmax_block_size=256
    )
    assert q.block_size == 64 and q.absmax_block_size == 256 and q.value_dtype == jnp.float32
    assert deq.shape == w.shape and deq.dtype == jnp.float32
    assert_decodes_its_fields(q, deq, absmax)
    opts = {"transpose": transpose, "double_quant": double_quant, "block_size": 64}
    assert_requantises_stably_within_the_error_bound(w, q, deq, absmax, opts)
    # The zero block dequantises to exact zeros, whatever its (double-quantised) absmax.
    stored = stored_layout(np.asarray(deq), transpose)
    assert np.all(stored.reshape(*shape[:-2], -1)[..., 64:128] == 0.0)


@settings(max_examples=6)
@given(weights(), options)
def test_generated_matrices_match_the_reference_and_requantise_stably(w, opts):
    # One test for both, so that each generated shape compiles once.
    q, deq, absmax = quantize(w, **opts)
    assert_matches_reference(w, q, **opts)
    assert_decodes_its_fields(q, deq, absmax)
    assert_requantises_stably_within_the_error_bound(w, q, deq, absmax, opts)


def test_ties_go_to_the_lower_code():
    midpoints = (NF4_64[:-1] + NF4_64[1:]) / 2
    exact = midpoints == midpoints.astype(np.float32)  # ties representable in float32
    assert exact.sum() >= 5
    # One block with absmax 1, so the scaled values are the inputs themselves.
    block = np.concatenate(
        [[1.0], midpoints[exact], midpoints + 1e-6, midpoints - 1e-6, [-1.0]]
    ).astype(np.float32)
    w = np.zeros(WHOLE_BLOCKS[0], np.float32)
    w[0, : len(block)] = block
    q, _, _ = quantize(w, double_quant=False)
    codes = ref_unpack(q.codes, len(block))
    lower = np.arange(15)
    expected = np.concatenate([[15], lower[exact], lower + 1, lower, [0]])
    assert np.array_equal(codes, expected)


def test_transpose_stores_the_out_in_layout():
    w = fixed_weight(TAIL_BLOCK[0])  # an [out, in] weight; w.T is the kernel [in, out]
    q, deq, _ = quantize(np.ascontiguousarray(w.T), transpose=True, double_quant=False)
    q_t, deq_t, _ = quantize(w, transpose=False, double_quant=False)
    assert q.shape == (70, 37) and q.stored_shape == (37, 70) and q.transposed
    assert q_t.shape == (37, 70) and not q_t.transposed
    assert np.array_equal(q.codes, q_t.codes) and np.array_equal(q.absmax, q_t.absmax)
    assert np.array_equal(deq, np.asarray(deq_t).T)


def test_bf16_weights_quantise_their_float32_values_and_dequantise_to_bf16():
    w = jnp.asarray(fixed_weight(WHOLE_BLOCKS[0]), jnp.bfloat16)
    q, deq, _ = quantize(w, double_quant=False)
    q32, deq32, _ = quantize(w.astype(jnp.float32), double_quant=False)
    assert q.value_dtype == jnp.bfloat16 and q.dtype == jnp.bfloat16 and deq.dtype == jnp.bfloat16
    assert np.array_equal(q.codes, q32.codes) and np.array_equal(q.absmax, q32.absmax)
    assert np.array_equal(deq, deq32.astype(jnp.bfloat16))
    assert jax.eval_shape(lambda q: q.dequantize(jnp.float32), q).dtype == jnp.float32


# ---- properties -------------------------------------------------------------------------------


@settings(max_examples=6)
@given(
    st.sampled_from([(), (3,), (2, 2)]),
    st.integers(1, 40),
    st.integers(0, 2**32 - 1),
)
def test_pack_and_unpack_round_trip(lead, size, seed):
    codes = np.random.default_rng(seed).integers(0, 16, (*lead, size)).astype(np.uint8)
    packed, unpacked = pack_and_unpack(codes)
    assert packed.dtype == jnp.uint8 and packed.shape == (*lead, math.ceil(size / 2))
    assert np.array_equal(packed, ref_pack(codes))
    assert unpacked.dtype == jnp.uint8 and np.array_equal(unpacked, codes)
    assert np.all(np.asarray(unpacked) <= 15)


def test_pack_layout_by_hand():
    packed, unpacked = pack_and_unpack(np.array([1, 2, 15], np.int32))  # any integer dtype
    assert np.array_equal(packed, [0x12, 0xF7]) and np.array_equal(unpacked, [1, 2, 15])


@pytest.mark.parametrize(
    "shape, block_size",
    [
        ((2, 3, 128), 64),  # stacked, rows of whole blocks: decoded [..., m, n / 64, 64]
        ((5, 70), 64),  # rows are not whole blocks: decoded [..., blocks, 64], a tail of 30
        ((4, 9), 5),  # an odd block straddles bytes: decoded from the flat codes
    ],
)
def test_every_decoding_layout_matches_the_numpy_decoding(shape, block_size):
    w = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    q, deq, absmax = quantize(w, block_size=block_size, absmax_block_size=4)
    assert deq.shape == shape
    assert_decodes_its_fields(q, deq, absmax)


@pytest.mark.parametrize("table", [NF4_VALUES, DYNAMIC_MAP, np.array([2.5], np.float32)])
@pytest.mark.parametrize("gather", [False, True])
def test_table_lookup_indexes_the_table(table, gather):
    codes = np.random.default_rng(0).integers(0, table.size, (3, 2, 50))
    codes[0, 0, : table.size] = np.arange(table.size)[:50]  # small tables: every entry
    looked_up = table_lookup(jnp.asarray(codes, jnp.uint8), table, gather=gather)
    assert looked_up.dtype == jnp.float32 and looked_up.shape == codes.shape
    assert np.array_equal(looked_up, table[codes])


def test_table_lookup_refuses_a_table_that_is_not_a_power_of_two():
    with raises_naming("table", "(3,)", error=ValueError):
        table_lookup(jnp.zeros(2, jnp.int32), np.zeros(3, np.float32))


def test_zero_matrices_dequantise_to_exact_zero():
    for shape, transpose, double_quant in (TAIL_BLOCK, STACKED_ODD):
        q, deq, absmax = quantize(
            np.zeros(shape, np.float32), transpose=transpose, double_quant=double_quant
        )
        assert np.all(np.asarray(q.codes) == 0x77)  # code 7 (0.0) everywhere, padding included
        assert np.all(np.asarray(deq) == 0.0) and np.all(np.asarray(absmax) == 0.0)


@pytest.mark.parametrize("value", [1.0, -2.5, 1e30, 1e-30])
def test_constant_matrices_are_exact_and_nan_free(value):
    # Every absmax equals their mean: the centred absmax values are all zero.
    w = np.full(MANY_BLOCKS[0], value, np.float32)
    _, deq, absmax = quantize(w, transpose=False, double_quant=True)
    assert np.all(np.isfinite(np.asarray(deq))) and np.all(np.isfinite(np.asarray(absmax)))
    assert_close(deq, w, rtol=1e-6, atol=0)


# ---- bits and bytes ---------------------------------------------------------------------------


def test_bits_per_parameter_of_a_4096_square_matrix():
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    # What the quantised tensor stores, from its arrays' shapes and dtypes (no values needed).
    with_dq = jax.eval_shape(functools.partial(nf4_quantize, double_quant=True), x)
    without = jax.eval_shape(functools.partial(nf4_quantize, double_quant=False), x)
    assert bits_per_parameter(without) == 4.5
    expected = 4 + 8 / 64 + 32 / (64 * 256) + 32 / 4096**2  # codes, absmax, scales, offset
    assert bits_per_parameter(with_dq) == pytest.approx(expected, rel=1e-12)
    assert round(bits_per_parameter(with_dq), 3) == 4.127
    assert bits_per_parameter(jnp.zeros((64, 64), jnp.bfloat16)) == 16.0
    assert bits_per_parameter(jnp.zeros((64, 64), jnp.float32)) == 32.0


def test_stored_bytes_count_codes_and_constants():
    q, _, _ = quantize(fixed_weight(MANY_BLOCKS[0]), transpose=False, double_quant=True)
    codes, absmax, scales, offset = 130 * 261 // 2, 531, 4 * 3, 4
    assert stored_bytes(q) == codes + absmax + scales + offset
    assert bits_per_parameter(q) == 8 * (codes + absmax + scales + offset) / (130 * 261)
    q, _, _ = quantize(fixed_weight(TAIL_BLOCK[0]), transpose=False, double_quant=False)
    codes, absmax = 37 * 70 // 2, 4 * 41
    assert stored_bytes(q) == codes + absmax
    tree = {"q": q, "dense": jnp.zeros((10, 8), jnp.bfloat16), "step": jnp.zeros((), jnp.int32)}
    assert stored_bytes(tree) == codes + absmax + 160 + 4
    assert bits_per_parameter(tree) == 8 * (codes + absmax + 164) / (37 * 70 + 81)


# ---- NF4Tensor behaviour ---------------------------------------------------------------------


@jax.jit
def dequantize_both_ways(q: NF4Tensor):
    return q.dequantize(), q.dequantize(jnp.float32)


# KNOWN BUG, fails until fixed: `NF4Tensor.transpose` applies `eqx.tree_at` to the static
# field `transposed`, which raises "TypeError: ... is not a leaf of the pytree".
def test_transpose_flips_the_flag_only():
    q, deq, _ = quantize(fixed_weight(WHOLE_BLOCKS[0]), double_quant=False)
    t = q.transpose()
    assert t.shape == (64, 8) and t.transposed and t.stored_shape == q.stored_shape
    assert np.array_equal(t.codes, q.codes)
    assert np.array_equal(dequantize_both_ways(t)[0], np.asarray(deq).T)
    assert q.T.transposed and not q.T.T.transposed


# KNOWN BUG, fails until fixed: `NF4Tensor.with_dtype` applies `eqx.tree_at` to the static
# field `value_dtype`, which raises "TypeError: ... is not a leaf of the pytree".
def test_with_dtype_changes_the_value_dtype_only():
    shape, transpose, double_quant = STACKED_ODD
    q, deq, _ = quantize(fixed_weight(shape), transpose=transpose, double_quant=double_quant)
    low = q.with_dtype(jnp.bfloat16)
    assert low.dtype == jnp.bfloat16 and low.value_dtype == jnp.bfloat16
    assert np.array_equal(low.codes, q.codes) and np.array_equal(low.absmax, q.absmax)
    as_bf16, as_f32 = dequantize_both_ways(low)
    assert as_bf16.dtype == jnp.bfloat16 and np.array_equal(as_bf16, deq.astype(jnp.bfloat16))
    assert np.array_equal(as_f32, deq)


# ---- errors and compilation ------------------------------------------------------------------


def test_errors_name_the_argument():
    with raises_naming("block_size", error=ValueError):
        nf4_quantize(jnp.ones((4, 64)), block_size=1)
    with raises_naming("absmax_block_size", error=ValueError):
        nf4_quantize(jnp.ones((4, 64)), absmax_block_size=True)
    with raises_naming("matmul", error=ValueError):
        nf4_quantize(jnp.ones((4, 64)), matmul="triton")
    with raises_naming("x", "(0, 5)", error=ValueError):
        nf4_quantize(jnp.ones((0, 5)))
    with own_checks():
        with raises_naming("x", "dimensions", error=ValueError):
            nf4_quantize(jnp.ones(64))
        with raises_naming("x", "int32", error=TypeError):
            nf4_quantize(jnp.ones((4, 64), jnp.int32))
    with raises_naming("size", error=ValueError):
        unpack_nibbles(jnp.zeros(3, jnp.uint8), 7)
    with raises_naming("packed", "int32", error=TypeError):
        unpack_nibbles(jnp.zeros(3, jnp.int32), 6)
    with raises_naming("codes", "float32", error=TypeError):
        pack_nibbles(jnp.zeros(4, jnp.float32))


def test_no_retrace_on_new_values():
    rng = np.random.default_rng(6)
    assert_traced_once(
        lambda w: nf4_quantize(w, transpose=True).dequantize(),
        [((rng.standard_normal((16, 72)).astype(np.float32),), {}) for _ in range(3)],
    )


# ---- bitsandbytes parity ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bnb():
    pytest.importorskip("bitsandbytes")
    torch = pytest.importorskip("torch")
    import bitsandbytes.functional as F

    return F, torch


def bnb_weight(shape=TAIL_BLOCK[0]) -> np.ndarray:
    """A `[out, in]` float32 weight with a zero block, a block of NF4 midpoints (absmax 1), varied
    row scales and, for 37 x 70 = 2590 = 40 x 64 + 30, a tail block of 30."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal(shape) * rng.uniform(0.01, 4.0, (shape[0], 1))
    flat = w.reshape(-1)
    flat[:64] = 0.0
    midpoints = ((NF4_VALUES[:-1] + NF4_VALUES[1:]) / np.float32(2)).astype(np.float32)
    ties = np.concatenate(
        [[1.0], midpoints, np.nextafter(midpoints, 2), np.nextafter(midpoints, -2)]
    )
    flat[64 : 64 + len(ties)] = ties
    return flat.reshape(shape).astype(np.float32)


def test_bitsandbytes_nf4_codes_absmax_and_dequantisation(bnb):
    F, torch = bnb
    assert np.array_equal(F.get_4bit_type("nf4", device="cpu").numpy(), NF4_VALUES)
    w = bnb_weight()
    packed, state = F.quantize_4bit(
        torch.from_numpy(w), blocksize=64, compress_statistics=False, quant_type="nf4"
    )
    q, deq, _ = quantize(w, transpose=False, double_quant=False)
    assert np.array_equal(packed.numpy().reshape(-1), q.codes)
    assert np.array_equal(state.absmax.numpy(), q.absmax)
    assert np.array_equal(F.dequantize_4bit(packed, state).numpy(), deq)


def test_bitsandbytes_double_quantisation(bnb):
    F, torch = bnb
    w = bnb_weight(MANY_BLOCKS[0])  # three 256-blocks of absmax values
    packed, state = F.quantize_4bit(
        torch.from_numpy(w), blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    q, deq, absmax = quantize(w, transpose=False, double_quant=True)
    assert np.array_equal(packed.numpy().reshape(-1), q.codes)
    # Their map comes from a float32 torch.linspace: within one float32 ulp of ours.
    assert np.abs(F.create_dynamic_map(signed=True).numpy() - DYNAMIC_MAP).max() <= 2**-24
    assert state.offset.item() == pytest.approx(float(q.absmax_offset), rel=1e-6)
    assert_close(q.absmax_scale, state.state2.absmax.numpy(), rtol=1e-6, atol=0)
    # bitsandbytes' CPU blockwise 8-bit quantiser does not always round to the nearest value
    # and builds its dynamic map from a float32 torch.linspace (up to 1 ulp off ours), so its
    # 8-bit absmax codes may differ in a few places: at least 99% agree, and every
    # dequantised absmax is within one map step of the block's scale of ours.
    assert np.mean(state.absmax.numpy() == np.asarray(q.absmax)) >= 0.99
    theirs = F.dequantize_blockwise(state.absmax, state.state2).numpy() + state.offset.item()
    scale = np.repeat(np.asarray(q.absmax_scale), 256)[: absmax.shape[-1]]
    assert np.all(np.abs(theirs - np.asarray(absmax)) <= MAP_STEP * scale + 1e-6)
    per_element = np.repeat(scale, 64)[: w.size].reshape(w.shape)
    assert np.all(np.abs(F.dequantize_4bit(packed, state).numpy() - deq) <= MAP_STEP * per_element)


def test_bitsandbytes_codes_of_a_jax_kernel_need_transpose(bnb):
    """The calls docs/peft.md gives: `nf4_quantize(w)` for a Hugging Face `[out, in]` weight,
    `nf4_quantize(kernel, transpose=True)` (and `quantize_params`) for its JAX kernel
    `kernel = w.T` `[in, out]`: bitsandbytes' codes and absmax, bit for bit. Quantising the
    kernel as it is, `nf4_quantize(w.T)`, blocks the other axis and gives other codes."""
    F, torch = bnb
    w = bnb_weight()  # [out, in] = [37, 70]
    packed, state = F.quantize_4bit(
        torch.from_numpy(w), blocksize=64, compress_statistics=False, quant_type="nf4"
    )
    theirs, their_absmax = packed.numpy().reshape(-1), state.absmax.numpy()
    kernel = np.ascontiguousarray(w.T)  # [in, out] = [70, 37]
    q, deq, _ = quantize(kernel, transpose=True, double_quant=False)
    assert q.shape == (70, 37) and q.stored_shape == (37, 70)
    assert np.array_equal(q.codes, theirs) and np.array_equal(q.absmax, their_absmax)
    assert np.array_equal(deq, F.dequantize_4bit(packed, state).numpy().T)
    params = {"proj": {"kernel": kernel}}
    base = jax.jit(lambda p: peft.quantize_params(p, [r".*kernel"], double_quant=False))(params)
    assert np.array_equal(base["proj"]["kernel"].codes, theirs)
    assert np.array_equal(base["proj"]["kernel"].absmax, their_absmax)
    untransposed, _, _ = quantize(kernel, transpose=False, double_quant=False)
    assert np.mean(np.asarray(untransposed.codes) == theirs) < 0.5
    assert not np.array_equal(untransposed.absmax, their_absmax)

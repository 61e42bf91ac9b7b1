"""The native decoders (native/kvcodec.c via kvstore.codecs.native_decoders) against the numpy/torch
decoders of kvstore.codecs.layer_codec, which are the oracle: the same bytes for every input, or
the same
refusal (CorruptData). Both the F16C/AVX2 path and the portable C path are checked. Encoded
bytes are also forged directly (any codes, any scale bits: huge, tiny, subnormal, negative,
NaN, inf), since stored bytes are untrusted input."""

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvstore.codecs import layer_codec, native_decoders
from kvstore.codecs.layer_codec import LayerShape
from kvstore.errors import CorruptData
from tests.support.codec_bytes import DTYPES, raw_of

# Without the library these skip; tests/kvstore/test_extensions.py fails then.
pytestmark = pytest.mark.skipif(not native_decoders.AVAILABLE,
                                reason=f"no native codecs: {native_decoders.UNAVAILABLE_REASON}")
LOSSY = ["int8", "fp8", "int4"]
odd_shapes = st.builds(LayerShape, st.sampled_from(sorted(DTYPES)), st.integers(1, 4),
                       st.integers(1, 80), st.sampled_from([1, 3, 8, 13, 40, 64, 96, 130]))


@pytest.fixture(params=[2, 1, 0], ids=["widest", "avx2", "portable"])
def simd(request, monkeypatch):  # the same for every hypothesis example of a test (on purpose)
    monkeypatch.setattr(native_decoders, "SIMD", request.param)
    return request.param


def both(name: str, data: bytes, shape: LayerShape) -> tuple[object, object]:
    """(native result, numpy result): each the decoded bytes or the CorruptData raised."""
    res = []
    for native in (True, False):
        try:
            res.append(layer_codec.decode(name, data, shape, native=native))
        except CorruptData as e:
            res.append(e)
    return res[0], res[1]


def assert_same(name: str, data: bytes, shape: LayerShape) -> None:
    a, b = both(name, data, shape)
    if isinstance(b, CorruptData):
        assert isinstance(a, CorruptData), f"native decoded what numpy refuses: {b}"
    else:
        assert isinstance(a, np.ndarray), f"native refused what numpy decodes: {a}"
        assert np.array_equal(a, b)


def kv(shape: LayerShape, seed: int, spread: float) -> np.ndarray:
    """Real-ish KV: outlier channels, a sink-like first token, a zero channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, shape.num_kv_heads, shape.n_tokens, shape.head_dim, generator=g)
    x = x * spread * torch.exp(2 * torch.rand(1, 1, 1, shape.head_dim, generator=g))
    x[:, :, 0] *= 8.0
    x[:, :, :, 0] = 0.0
    return raw_of(x.to(DTYPES[shape.dtype]))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=odd_shapes, seed=st.integers(0, 2**31),
       spread=st.sampled_from([1e-6, 1e-3, 1.0, 300.0]), name=st.sampled_from(LOSSY))
def test_native_decode_equals_numpy_on_encoded_kv(simd, shape, seed, spread, name):
    raw = kv(shape, seed, spread)
    assert_same(name, layer_codec.encode(name, raw, shape), shape)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=odd_shapes, name=st.sampled_from(LOSSY), data=st.data())
def test_native_decode_equals_numpy_on_forged_bytes(simd, shape, name, data):
    """Any codes and any scale bits (the scales are the trailing float32s)."""
    size = layer_codec.encoded_size(name, shape)
    n_scales = ((shape.num_kv_heads * shape.head_dim + shape.num_kv_heads * shape.n_tokens)
                if name != "int4" else None)
    if n_scales is None:
        groups, g = layer_codec._int4_groups(shape)
        n_scales = shape.num_kv_heads * (groups * shape.head_dim
                                         + shape.n_tokens * (shape.head_dim // g))
    codes = data.draw(st.binary(min_size=size - 4 * n_scales, max_size=size - 4 * n_scales))
    scale = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True),
                      st.floats(0, 2.0**-126, width=32), st.floats(2.0**100, 2.0**127, width=32),
                      st.sampled_from([0.0, -0.0, 1.0, 2.0**-24, 2.0**-149]))
    bad = data.draw(st.booleans())
    scales = np.array(data.draw(st.lists(scale if bad else st.floats(0, 2.0**20, width=32),
                                         min_size=n_scales, max_size=n_scales)),
                      dtype="<f4")
    if name == "fp8" and not data.draw(st.booleans()):  # mostly without NaN codes
        codes = bytes(b if (b & 0x7F) != 0x7F else b ^ 1 for b in codes)
    assert_same(name, codes + scales.tobytes(), shape)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_int8_code_times_hard_scales_rounds_like_torch(simd, dtype):
    """Every int8 code against scales whose products land on fp16/bf16 subnormals, ties,
    the largest finite values and overflow."""
    h, n, d = 1, 2, 256
    shape = LayerShape(dtype, h, n, d)
    codes = np.arange(256, dtype=np.uint8)
    sk = np.array([2.0**-24, 2.0**-20, 3 * 2.0**-26, 1e-8, 65504 / 127, 65520 / 127, 1e37,
                   3.4e38] * (d // 8), dtype="<f4")
    sv = np.array([2.0**-25, 1.0 + 2.0**-11], dtype="<f4")
    data = np.tile(codes, 2 * h * n).tobytes() + sk.tobytes() + sv.tobytes()
    assert_same("int8", data, shape)
    a = layer_codec.decode("int8", data, shape, native=True)
    assert a.any()


def test_every_fp8_code_decodes_like_torch_and_nan_codes_are_refused(simd):
    shape = LayerShape("float16", 1, 1, 256)
    ones = np.ones(shape.head_dim + 1, dtype="<f4").tobytes()
    finite = bytes(b for b in range(256) if (b & 0x7F) != 0x7F)
    codes = finite + finite[: 256 - len(finite)]
    assert_same("fp8", codes * 2 + ones, shape)
    for nan in (0x7F, 0xFF):
        data = bytearray(codes * 2 + ones)
        data[300] = nan
        with pytest.raises(CorruptData, match="NaN"):
            layer_codec.decode("fp8", bytes(data), shape, native=True)


@pytest.mark.parametrize("name", LOSSY)
def test_a_bad_scale_is_corrupt_data_naming_the_layer(simd, name):
    shape = LayerShape("float16", 2, 33, 64)
    rng = np.random.default_rng(0)
    raw = raw_of(torch.from_numpy(rng.standard_normal((2, 2, 33, 64))).half())
    enc = layer_codec.encode(name, raw, shape)
    layers = [bytearray(enc) for _ in range(3)]
    layers[2][-4:] = np.array([-1.0], dtype="<f4").tobytes()
    data = np.frombuffer(b"".join(layers), dtype=np.uint8)
    spans = [(i * len(enc), len(enc)) for i in range(3)]
    out = np.empty(3 * shape.raw_bytes, dtype=np.uint8)
    with pytest.raises(CorruptData, match="layer 2"):
        layer_codec.decode_layers(name, data, spans, shape, out, native=True)
    with pytest.raises(CorruptData):
        layer_codec.decode_layers(name, data, spans, shape, out, native=False)
    good = np.frombuffer(enc * 2, dtype=np.uint8)
    layer_codec.decode_layers(name, good, spans[:2], shape, out[: 2 * shape.raw_bytes], native=True)
    ref = layer_codec.decode(name, enc, shape, native=False)
    assert np.array_equal(out[: shape.raw_bytes], ref)
    assert np.array_equal(out[shape.raw_bytes : 2 * shape.raw_bytes], ref)


@pytest.mark.parametrize("name", LOSSY)
def test_hostile_lengths_never_reach_native_code(name):
    shape = LayerShape("bfloat16", 3, 20, 8)
    enc = layer_codec.encode(name, kv(shape, 1, 1.0), shape)
    out = np.empty(2 * shape.raw_bytes, dtype=np.uint8)
    data = np.frombuffer(enc + enc, dtype=np.uint8)
    for bad in (enc[:-1], enc + b"\0", b"", enc[:7]):
        with pytest.raises(CorruptData):
            layer_codec.decode(name, bad, shape, native=True)
    n = len(enc)
    for spans in ([(0, n), (n, n - 1)], [(0, n), (n + 1, n)], [(0, n), (-1, n)],
                  [(0, n), (2 * n, n)], [(0, n + 1), (n, n)]):
        with pytest.raises(CorruptData):
            layer_codec.decode_layers(name, data, spans, shape, out, native=True)
    # the binding's own checks, for callers that skip layer_codec.decode_layers
    size = layer_codec.encoded_size(name, shape)
    groups, g = layer_codec._int4_groups(shape)
    kw = dict(table=layer_codec._FP8_VALUES if name == "fp8" else None,
              groups=groups if name == "int4" else 0, g=g if name == "int4" else 0)
    with pytest.raises(ValueError, match="offsets"):
        native_decoders.decode_layers(name, data, [0, n + 1], shape, size, out, **kw)
    with pytest.raises(ValueError, match="encoded_size"):
        native_decoders.decode_layers(name, data, [0, n], shape, size - 1, out, **kw)
    with pytest.raises(ValueError, match="out"):
        native_decoders.decode_layers(name, data, [0, n], shape, size, out[:-1], **kw)
    with pytest.raises(ValueError, match="data"):
        native_decoders.decode_layers(name, data.astype(np.int16), [0], shape, size, out[:1], **kw)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=odd_shapes, seed=st.integers(0, 2**31),
       spread=st.sampled_from([1e-6, 1e-3, 1.0, 300.0]), special=st.sampled_from(
           [None, 0.0, -0.0, 65504.0, 1e-7, float("inf"), float("-inf"), float("nan")]))
def test_native_int8_encode_equals_torch(simd, shape, seed, spread, special):
    """The same bytes as the torch encoder, or the same refusal of non-finite values."""
    x = torch.from_numpy(np.frombuffer(kv(shape, seed, spread).tobytes(), dtype={
        2: np.int16, 4: np.int32}[shape.itemsize]).copy()).view(DTYPES[shape.dtype])
    if special is not None:
        x.view(-1)[seed % x.numel()] = special
    raw = raw_of(x)
    got = []
    for native in (True, False):
        try:
            got.append(layer_codec.encode("int8", raw, shape, native=native))
        except ValueError as e:
            got.append(type(e))
    assert got[0] == got[1]
    if special is not None and not np.isfinite(special):
        assert got[0] is ValueError


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_int8_encode_rounds_ties_to_even_like_torch(simd, dtype):
    """Scale 1 (max 127): ties at .5 go to the even integer, in K (per channel) and V (per
    token)."""
    col = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5])
    x = torch.zeros(2, 1, 8, 8)
    x[0, 0, :, 3] = col  # K channel 3 over 8 tokens
    x[1, 0, 2, :] = col  # V token 2 over 8 channels
    shape = LayerShape(dtype, 1, 8, 8)
    raw = raw_of(x.to(DTYPES[dtype]))
    enc = layer_codec.encode("int8", raw, shape, native=True)
    assert enc == layer_codec.encode("int8", raw, shape, native=False)
    q = np.frombuffer(enc, dtype=np.int8, count=2 * 64).reshape(2, 8, 8)
    want = [127, 0, 2, 2, 0, -2, 126, -126]
    assert q[0, :, 3].tolist() == want and q[1, 2, :].tolist() == want


# ------------------------------------------------------------------------------ decode_into
INTS = {2: np.int16, 4: np.int32}


def into(name: str, blob: np.ndarray, spans: list, shape: LayerShape, T: int, start: int,
         use: int, native: bool) -> object:
    """(keys, values) [L, H, T, D] (filled with 7 first) after layer_codec.decode_into, or the
    CorruptData it raised."""
    L, H, D = len(spans), shape.num_kv_heads, shape.head_dim
    k = np.full((L, H, T, D), 7, dtype=INTS[shape.itemsize])
    v = np.full((L, H, T, D), 7, dtype=INTS[shape.itemsize])
    try:
        layer_codec.decode_into(name, blob, spans, shape, k, v, start, use, native=native)
    except CorruptData as e:
        return e
    return k, v


def assert_into_same(name: str, blob: np.ndarray, spans: list, shape: LayerShape, T: int,
                     start: int, use: int) -> object:
    """Native decode_into equals the reference loop (native=False) byte for byte, or both
    raise CorruptData; returns the native result."""
    a = into(name, blob, spans, shape, T, start, use, native=True)
    b = into(name, blob, spans, shape, T, start, use, native=False)
    if isinstance(b, CorruptData):
        assert isinstance(a, CorruptData), f"native decoded what the reference refuses: {b}"
    else:
        assert not isinstance(a, CorruptData), f"native refused what the reference decodes: {a}"
        for x, y in zip(a, b, strict=True):  # type: ignore[arg-type]
            assert x.tobytes() == y.tobytes()
    return a


def chunk(layers: list[bytes]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(data, spans) of consecutive encoded layers behind 3 bytes of something else."""
    blob = np.frombuffer(b"pad" + b"".join(layers), dtype=np.uint8)
    offs = np.cumsum([3] + [len(x) for x in layers])
    return blob, [(int(o), len(x)) for o, x in zip(offs, layers, strict=False)]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=odd_shapes, seed=st.integers(0, 2**31), name=st.sampled_from(LOSSY),
       layers=st.integers(1, 3), data=st.data())
def test_native_decode_into_equals_the_reference(simd, shape, seed, name, layers, data):
    """Odd head dims, every dtype, partial chunks at any offset of the output."""
    blob, spans = chunk([layer_codec.encode(name, kv(shape, seed + i, 1.0), shape)
                         for i in range(layers)])
    use = data.draw(st.integers(1, shape.n_tokens), label="use")
    T = data.draw(st.integers(use, use + 40), label="T")
    start = data.draw(st.integers(0, T - use), label="start")
    k, v = assert_into_same(name, blob, spans, shape, T, start, use)  # type: ignore[misc]
    ref = np.empty(layers * shape.raw_bytes, dtype=np.uint8)  # and the extent's own tokens
    layer_codec.decode_layers(name, blob, spans, shape, ref, native=False)
    ext = ref.view(k.dtype).reshape(layers, 2, shape.num_kv_heads, shape.n_tokens, -1)
    assert np.array_equal(k[:, :, start : start + use], ext[:, 0, :, :use])
    assert np.array_equal(v[:, :, start : start + use], ext[:, 1, :, :use])


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=odd_shapes, name=st.sampled_from(LOSSY), data=st.data())
def test_native_decode_into_equals_the_reference_on_forged_bytes(simd, shape, name, data):
    """A good layer, then a forged one: any codes, and scales in range or (sometimes) hard
    bits (subnormal, huge, negative, NaN, inf)."""
    size = layer_codec.encoded_size(name, shape)
    n_scales = n_scales_of(name, shape)
    codes = data.draw(st.binary(min_size=size - 4 * n_scales, max_size=size - 4 * n_scales))
    hard = st.sampled_from([0.0, -0.0, 1.0, 2.0**-149, 3e-39, 1e38, 3.4e38, -1.0,
                            float("inf"), float("-inf"), float("nan")])
    fine = st.floats(0, 2.0**20, width=32)
    bad = data.draw(st.booleans())
    scales = np.array(data.draw(st.lists(st.one_of(fine, hard) if bad else fine,
                                         min_size=n_scales, max_size=n_scales)), dtype="<f4")
    if name == "fp8" and not data.draw(st.booleans()):  # mostly without NaN codes
        codes = bytes(b if (b & 0x7F) != 0x7F else b ^ 1 for b in codes)
    blob, spans = chunk([layer_codec.encode(name, kv(shape, 0, 1.0), shape),
                         codes + scales.tobytes()])
    use = data.draw(st.integers(1, shape.n_tokens), label="use")
    assert_into_same(name, blob, spans, shape, use + 2, 1, use)


def n_scales_of(name: str, shape: LayerShape) -> int:
    """The float32 scales at the end of one encoded layer."""
    h, n, d = shape.num_kv_heads, shape.n_tokens, shape.head_dim
    if name != "int4":
        return h * d + h * n
    groups, g = layer_codec._int4_groups(shape)
    return h * (groups * d + n * (d // g))


def forge(name: str, enc: bytes, shape: LayerShape, what: str) -> bytes:
    """``enc`` with its last scale negative (the last token's V scale: a token a partial
    decode does not write), or with the last V code an e4m3 NaN (fp8)."""
    b = bytearray(enc)
    if what == "scale":
        b[-4:] = np.array([-1.0], dtype="<f4").tobytes()
    else:
        h, n, d = shape.num_kv_heads, shape.n_tokens, shape.head_dim
        b[2 * h * n * d - 1] = 0xFF
    return bytes(b)


@pytest.mark.parametrize("name,what", [("int8", "scale"), ("fp8", "scale"), ("int4", "scale"),
                                       ("fp8", "nan")])
def test_native_decode_into_refuses_bad_bytes_naming_the_layer(simd, name, what):
    """Also where the bad scale or code belongs to a token that is not written."""
    shape = LayerShape("float16", 2, 33, 64)
    enc = [layer_codec.encode(name, kv(shape, i, 1.0), shape) for i in range(3)]
    enc[1] = forge(name, enc[1], shape, what)
    blob, spans = chunk(enc)
    for use in (1, 33):
        got = into(name, blob, spans, shape, 40, 3, use, native=True)
        assert isinstance(got, CorruptData)
        ext = np.empty(3 * shape.raw_bytes, dtype=np.uint8)
        with pytest.raises(CorruptData) as layers_err:
            layer_codec.decode_layers(name, blob, spans, shape, ext, native=True)
        assert str(got) == str(layers_err.value)
        assert "layer 1 " in str(got) and ("NaN" if what == "nan" else "scale") in str(got)
        # the reference refuses the same layer: layer 0 alone decodes, layers 0-1 do not
        assert not isinstance(into(name, blob, spans[:1], shape, 40, 3, use, False),
                              CorruptData)
        assert isinstance(into(name, blob, spans[:2], shape, 40, 3, use, False), CorruptData)


def test_decode_into_falls_back_for_outputs_it_cannot_write_directly():
    """Strided or overlapping outputs: the reference loop, the same bytes."""
    shape = LayerShape("bfloat16", 3, 20, 8)
    blob, spans = chunk([layer_codec.encode("int8", kv(shape, i, 1.0), shape) for i in range(2)])
    want = into("int8", blob, spans, shape, 30, 5, 17, native=False)
    k = np.full((2, 3, 30, 16), 7, dtype=np.int16)
    v = np.full((2, 3, 30, 8), 7, dtype=np.int16)
    layer_codec.decode_into("int8", blob, spans, shape, k[..., ::2], v, 5, 17, native=True)
    assert np.array_equal(k[..., ::2], want[0]) and np.array_equal(v, want[1])  # type: ignore
    assert (k[..., 1::2] == 7).all()
    k0 = np.zeros((0, 3, 30, 8), np.int16)  # no layers: nothing to do on either path
    for native in (True, False):
        layer_codec.decode_into("int8", blob, [], shape, k0, k0.copy(), 5, 17, native=native)


@pytest.mark.parametrize("name", LOSSY)
def test_hostile_decode_into_arguments_never_reach_native_code(name):
    shape = LayerShape("float16", 3, 20, 8)
    enc = layer_codec.encode(name, kv(shape, 1, 1.0), shape)
    n, size = len(enc), layer_codec.encoded_size(name, shape)
    data = np.frombuffer(enc + enc, dtype=np.uint8)
    groups, g = layer_codec._int4_groups(shape)
    kw = dict(table=layer_codec._FP8_VALUES if name == "fp8" else None,
              groups=groups if name == "int4" else 0, g=g if name == "int4" else 0)
    k, v = np.zeros((2, 3, 25, 8), np.int16), np.zeros((2, 3, 25, 8), np.int16)

    def call(offsets=(0, n), sz=size, k_out=k, v_out=v, start=0, use=20, **over):
        native_decoders.decode_into(name, data, list(offsets), shape, sz, k_out, v_out, start,
                                 use, **{**kw, **over})

    call()  # the arguments as given fit
    bad = [
        ("offsets", dict(offsets=(0, n + 1))), ("offsets", dict(offsets=(-1, n))),
        ("offsets", dict(offsets=())), ("encoded_size", dict(sz=size + 1)),
        ("k_out", dict(k_out=k[:, :, :, :4])), ("k_out", dict(k_out=k[:1])),
        ("k_out", dict(k_out=k.astype(np.int32))), ("k_out", dict(k_out=k[:, :, ::2])),
        ("k_out", dict(k_out=list(k))), ("v_out", dict(v_out=np.zeros((2, 3, 25, 9), np.int16))),
        ("differ", dict(v_out=np.zeros((2, 3, 24, 8), np.int16))), ("overlap", dict(v_out=k)),
        ("use=", dict(use=0)), ("use=", dict(use=21)), ("use=", dict(start=-1)),
        ("use=", dict(start=6)), ("start", dict(start=1.0)), ("use", dict(use=True)),
    ]
    if name == "fp8":
        bad.append(("table", dict(table=layer_codec._FP8_VALUES[:255])))
    if name == "int4":
        bad.append(("groups", dict(groups=groups + 1)))
    for match, over in bad:
        with pytest.raises(ValueError, match=match):
            call(**over)
    ro = k.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="k_out must be C-contiguous and writeable"):
        call(k_out=ro)
    with pytest.raises(ValueError, match="data"):
        native_decoders.decode_into(name, data.astype(np.int16), [0], shape, size, k[:1], v[:1],
                                 0, 20, **kw)
    # and through layer_codec.decode_into: spans are checked as decode_layers checks them
    for spans in ([(0, n), (n, n - 1)], [(0, n), (n + 1, n)], [(0, n), (-1, n)]):
        with pytest.raises(CorruptData):
            layer_codec.decode_into(name, data, spans, shape, k, v, 0, 20, native=True)

"""The tensor wire codec: round trips and every kind of malformed stream."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from h3.v1 import tensor_pb2
from stagekit.wire import DTYPES, MAX_CHUNK_BYTES, TensorAssembler, WireError, check_finite, tensor_chunks


def roundtrip(t, chunk_bytes=MAX_CHUNK_BYTES, **kw):
    asm = TensorAssembler(**kw)
    out = None
    for c in tensor_chunks("x", t, chunk_bytes):
        assert c.ByteSize() < 4 << 20
        out = asm.feed(c) or out
    asm.finish(["x"])
    return out[1]


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_roundtrip_every_dtype(dtype):
    t = (torch.randn(3, 5, 7) * 10).to(dtype)
    back = roundtrip(t, chunk_bytes=64)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_bf16_text_states_keep_dtype_and_length():
    t = torch.randn(38, 5120).to(torch.bfloat16)
    back = roundtrip(t)
    assert back.dtype == torch.bfloat16 and back.shape == (38, 5120) and torch.equal(back, t)


def test_large_tensor_chunks_under_limit():
    t = torch.randn(3, 1 << 20)  # 12 MiB
    chunks = list(tensor_chunks("x", t))
    assert len(chunks) == 6 and all(len(c.data) <= MAX_CHUNK_BYTES for c in chunks)
    assert chunks[0].HasField("header") and not chunks[1].HasField("header") and chunks[-1].last


def test_empty_and_scalar():
    assert roundtrip(torch.empty(0, 4)).shape == (0, 4)
    assert roundtrip(torch.tensor(3.5)).item() == 3.5


def _chunks(t=None, n=64):
    return list(tensor_chunks("x", torch.arange(100, dtype=torch.float32) if t is None else t, n))


def feed_all(chunks, **kw):
    asm = TensorAssembler(**kw)
    for c in chunks:
        asm.feed(c)
    return asm.finish(["x"])


def test_checksum_mismatch():
    cs = _chunks()
    cs[1].data = bytes([cs[1].data[0] ^ 1]) + cs[1].data[1:]
    with pytest.raises(WireError, match="checksum"):
        feed_all(cs)


def test_truncated_stream():
    with pytest.raises(WireError, match="incomplete"):
        feed_all(_chunks()[:-1])


def test_duplicated_chunk():
    cs = _chunks()
    with pytest.raises(WireError, match="duplicated"):
        feed_all([cs[0], cs[1], cs[1]] + cs[2:])


def test_out_of_order_chunk():
    cs = _chunks()
    with pytest.raises(WireError, match="missing"):
        feed_all([cs[0], cs[2], cs[1]] + cs[3:])


def test_header_lies_about_size():
    cs = _chunks()
    cs[0].header.nbytes += 4
    with pytest.raises(WireError, match="needs 400"):
        feed_all(cs)


def test_unknown_dtype_and_wrong_expected_shape():
    cs = _chunks()
    cs[0].header.dtype = "complex32"
    with pytest.raises(WireError, match="unknown dtype"):
        feed_all(cs)
    with pytest.raises(WireError, match=r"shape \[100\] but \['\*', 4\]"):
        feed_all(_chunks(), expect={"x": ("float32", (None, 4))})
    with pytest.raises(WireError, match="dtype float32 but bfloat16"):
        feed_all(_chunks(), expect={"x": ("bfloat16", None)})
    with pytest.raises(WireError, match="unexpected tensor"):
        feed_all(_chunks(), expect={"y": (None, None)})


def test_chunk_over_limit_and_tensor_over_limit():
    cs = _chunks(n=400)
    with pytest.raises(WireError, match="exceeds"):
        feed_all(cs, max_chunk_bytes=100)
    with pytest.raises(WireError, match="exceeds the limit"):
        feed_all(_chunks(), max_bytes=100)


def test_chunk_before_header_and_sent_twice():
    cs = _chunks()
    with pytest.raises(WireError, match="before its header"):
        feed_all(cs[1:])
    with pytest.raises(WireError, match="sent twice"):
        feed_all(cs + cs)


def test_nan_rejected():
    with pytest.raises(WireError, match="NaN"):
        check_finite("lat", torch.tensor([1.0, float("nan")]))


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 9), max_size=4), chunk=st.integers(1, 97),
       dtype=st.sampled_from(["float32", "bfloat16", "int8", "int64"]))
def test_fuzz_roundtrip(shape, chunk, dtype):
    t = torch.randint(-100, 100, shape).to(DTYPES[dtype])
    assert torch.equal(roundtrip(t, chunk_bytes=chunk), t)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_fuzz_malformed_streams_never_crash(data):
    """Arbitrary edits to a valid stream either round-trip exactly or raise WireError."""
    t = torch.arange(40, dtype=torch.float32)
    cs = [tensor_pb2.TensorChunk.FromString(c.SerializeToString()) for c in tensor_chunks("x", t, 16)]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(cs) - 1))
        op = data.draw(st.sampled_from(["drop", "dup", "flip", "offset", "shape", "last", "swap"]))
        if op == "drop" and len(cs) > 1:
            cs.pop(i)
        elif op == "dup":
            cs.insert(i, cs[i])
        elif op == "flip" and cs[i].data:
            cs[i].data = bytes([cs[i].data[0] ^ 0xFF]) + cs[i].data[1:]
        elif op == "offset":
            cs[i].offset = data.draw(st.integers(0, 1000))
        elif op == "shape" and cs[0].HasField("header"):
            cs[0].header.shape[:] = data.draw(st.lists(st.integers(-2, 50), max_size=3))
        elif op == "last":
            cs[i].last = not cs[i].last
        elif op == "swap" and len(cs) > 1:
            j = data.draw(st.integers(0, len(cs) - 1))
            cs[i], cs[j] = cs[j], cs[i]
    try:
        out = feed_all(cs)
    except WireError:
        return
    assert torch.equal(out["x"], t)

"""The KV page stream between workers (router/kv_wire.py) and the pull-or-recompute cost model
(router/move_cost.py): pages survive the wire bit for bit in any dtype and however the bytes are cut
into pieces; a changed byte, a page of another block, another layout or a cut stream is caught and
named, and the pages verified before it are kept."""

from __future__ import annotations

import random

import pytest
import torch

from router.kv_wire import (KVPullRequest, KVWireError, StreamReader, WireLayout, decode_request, encode_end,
                            encode_header, encode_page, encode_request, records)
from router.move_cost import plan_move

SHAPE = [2, 3, 2, 16, 8]   # [K/V, layers, Hkv, page size, head dim]


def layout(dtype: str = "float32", shape=SHAPE, fingerprint: str = "0123456789abcdef") -> WireLayout:
    return WireLayout(fingerprint, dtype, list(shape), 16, 3, 2, 8, "HSD")


def pages(n: int, dtype: torch.dtype, shape=SHAPE, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return [torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) for _ in range(n)]
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


def stream(lay: WireLayout, hashes: list[int], data: list[torch.Tensor], start: int = 0, end: bool = True) -> bytes:
    out = encode_header(lay, start) + b"".join(encode_page(h, p) for h, p in zip(hashes, data))
    return out + (encode_end(len(data)) if end else b"")


def feed_in_pieces(reader: StreamReader, data: bytes, seed: int = 1) -> list[torch.Tensor]:
    rng, pos, out = random.Random(seed), 0, []
    while pos < len(data):
        n = rng.randint(1, 5000)
        out.extend(reader.feed(data[pos:pos + n]))
        pos += n
    return out


@pytest.mark.parametrize("dtype,name,shape", [(torch.float32, "float32", SHAPE), (torch.bfloat16, "bfloat16", SHAPE),
                                              (torch.uint8, "uint8", [2, 3, 2, 16 * (8 + 4)])])
def test_pages_cross_the_wire_bit_for_bit(dtype, name, shape):
    lay = layout(name, shape)
    sent = pages(5, dtype, shape)
    hashes = [11, 22, 33, 44, 55]
    reader = StreamReader(lay, 3, hashes)
    got = feed_in_pieces(reader, stream(lay, hashes, sent, start=3))
    assert reader.ended and reader.received == 5 and reader.error is None
    assert len(got) == 5
    for a, b in zip(sent, got):
        assert b.dtype == dtype and list(b.shape) == shape
        assert torch.equal(a.view(torch.uint8) if dtype != torch.uint8 else a,
                           b.view(torch.uint8) if dtype != torch.uint8 else b)


def test_a_changed_byte_is_caught_and_the_pages_before_it_kept():
    lay = layout()
    sent, hashes = pages(4, torch.float32), [1, 2, 3, 4]
    data = bytearray(stream(lay, hashes, sent))
    offsets = [off for off, kind, _, _ in records(bytes(data)) if kind == 1]
    assert len(offsets) == 4
    data[offsets[2] + 100] ^= 0x01                      # the third page's payload
    reader = StreamReader(lay, 0, hashes)
    got = reader.feed(bytes(data))                       # one piece: the two good pages come back
    assert len(got) == 2 and torch.equal(got[1], sent[1])
    assert "block 2: checksum mismatch" in str(reader.error)
    with pytest.raises(KVWireError, match="block 2: checksum"):
        reader.feed(b"")


def test_a_page_of_another_block_is_refused():
    lay = layout()
    reader = StreamReader(lay, 5, [100, 200])
    with pytest.raises(KVWireError, match=r"block 5: hash 0000000000000063, the prompt's is 0000000000000064"):
        reader.feed(stream(lay, [99, 200], pages(2, torch.float32), start=5))


def test_another_layout_is_refused_naming_the_fields():
    theirs = layout("bfloat16", fingerprint="ffffffffffffffff")
    reader = StreamReader(layout(), 0, [1])
    with pytest.raises(KVWireError) as err:
        reader.feed(stream(theirs, [1], pages(1, torch.bfloat16)))
    text = str(err.value)
    assert "model_fingerprint 'ffffffffffffffff' vs '0123456789abcdef'" in text
    assert "page_dtype 'bfloat16' vs 'float32'" in text and "page_size" not in text


def test_a_cut_stream_keeps_its_whole_pages_and_never_ends():
    lay = layout()
    sent, hashes = pages(3, torch.float32), [7, 8, 9]
    data = stream(lay, hashes, sent, end=False)
    offsets = [off for off, kind, _, _ in records(data) if kind == 1]
    reader = StreamReader(lay, 0, hashes)
    got = reader.feed(data[:offsets[2] + 10])           # cut inside the third page
    assert len(got) == 2 and not reader.ended and reader.error is None


def test_an_end_record_must_count_the_pages():
    lay = layout()
    data = encode_header(lay, 0) + encode_page(1, pages(1, torch.float32)[0]) + encode_end(2)
    reader = StreamReader(lay, 0, [1])
    assert len(reader.feed(data)) == 1                  # the page before it is kept
    assert not reader.ended and "the end record counts 2 pages, 1 came" in str(reader.error)


def test_not_a_stream_is_refused():
    with pytest.raises(KVWireError, match="bad magic"):
        StreamReader(layout(), 0, [1]).feed(b'{"error": {"message": "no"}}')


def test_pull_requests_round_trip_and_bad_ones_are_named():
    req = KVPullRequest(list(range(64)), 1, [2**64 - 1, 5], layout(), "tenant-a")
    assert decode_request(encode_request(req)) == req
    with pytest.raises(KVWireError, match="malformed KV pull request"):
        decode_request(b'{"token_ids": "x"}')
    with pytest.raises(KVWireError, match="need more than the 16 token ids"):
        decode_request(encode_request(KVPullRequest(list(range(16)), 1, [5], layout())))
    with pytest.raises(KVWireError, match="page_dtype 'fp8'"):
        decode_request(encode_request(KVPullRequest(list(range(16)), 0, [5], layout("fp8"))))


# ------------------------------------------------------------ the cost model


def test_cost_model_reference_figures():
    # 8,192 tokens of the default model's float32 pages (46,080 B/token) at 1 GB/s against 600 tok/s of prefill
    est = plan_move(8192, 46080, 1e9, 600.0, overhead_s=0.05)
    assert est.pull and est.choice == "pull"
    assert est.pull_s == pytest.approx(0.05 + 8192 * 46080 / 1e9)      # 0.4275 s
    assert est.recompute_s == pytest.approx(8192 / 600.0)              # 13.65 s


def test_cost_model_recomputes_over_a_throttled_link():
    # the same move over a 10 MB/s link: 37.8 s of transfer against 13.7 s of prefill
    est = plan_move(8192, 46080, 1e7, 600.0, overhead_s=0.05)
    assert not est.pull and est.choice == "recompute"
    assert est.pull_s == pytest.approx(37.80, abs=0.01) and est.recompute_s == pytest.approx(13.65, abs=0.01)
    # the break-even bandwidth: bytes / (recompute - overhead)
    even = 8192 * 46080 / (8192 / 600.0 - 0.05)
    assert plan_move(8192, 46080, even * 1.01, 600.0).pull
    assert not plan_move(8192, 46080, even * 0.99, 600.0).pull


def test_cost_model_refuses_figures_that_are_not_rates():
    assert not plan_move(0, 46080, 1e9, 600.0).pull                     # nothing to move
    for args in [(-1, 46080, 1e9, 600.0), (16, 0, 1e9, 600.0), (16, 46080, 0.0, 600.0), (16, 46080, 1e9, -1.0)]:
        with pytest.raises(ValueError):
            plan_move(*args)

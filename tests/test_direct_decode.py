"""A whole chunk decoded straight into the read's output (io.direct_decode) reads what
zarr reads, on the layouts it recognises, and the others take the general path.

The point of the direct path is speed (no fresh array per chunk, no copy: the CosmoFlow
zarr fit on the H200 read 44 samples/s); what these tests hold is that it is never
wrong: the same values as zarr's own read for whole, partial and edge chunks; the
checksums verified; a stored object of the wrong size refused instead of filling the
start of a larger block.
"""

from __future__ import annotations

import numcodecs
import numpy as np
import pytest
import zarr

import dataflow as dfl
from dataflow.io.direct_decode import _decoded_size
from dataflow.io.zarr_decode import ChunkDecoder, ObjectDecodeError, chunk_decoder

# (zarr_format, compressor) -> whether to_zarr's layout decodes straight into the output
DIRECT = {
    (3, "zstd"): True,
    (3, "blosc"): True,
    (3, "lz4"): True,
    (3, None): True,  # crc32c alone
    (3, "gzip"): False,
    (2, "zstd"): True,
    (2, "blosc"): False,  # a shuffle filter and crc32 besides the compressor
    (2, "lz4"): False,
    (2, None): False,  # a crc32 filter
    (2, "gzip"): False,
}


def _store(tmp_path, zarr_format, compressor, n=23, shape=(3, 6, 5), **kwargs):
    rng = np.random.default_rng(zarr_format)
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    y = np.arange(n, dtype=np.int64)
    path = tmp_path / f"v{zarr_format}-{compressor}.zarr"
    dfl.io.to_zarr(
        path, x, y, zarr_format=zarr_format, compressor=compressor, chunk_mb=0.0015, **kwargs
    )
    return path, x


def _decoder(path, name="x") -> tuple[ChunkDecoder, zarr.Array]:
    array = zarr.open_group(str(path), mode="r")[name]
    decoder = chunk_decoder(array)
    assert decoder is not None
    return decoder, array


@pytest.mark.parametrize(("zarr_format", "compressor"), list(DIRECT))
def test_each_written_layout_reads_as_zarr_does_whole_partial_and_edge_chunks(
    tmp_path, zarr_format, compressor
):
    path, x = _store(tmp_path, zarr_format, compressor)
    decoder, array = _decoder(path)
    assert (decoder._decode_into is not None) == DIRECT[(zarr_format, compressor)]
    per_chunk = array.chunks[0]
    assert 1 < per_chunk < len(x) and len(x) % per_chunk  # whole chunks and a short last one
    for lo, hi in [(0, len(x)), (0, per_chunk), (per_chunk, 3 * per_chunk), (1, 7), (5, 23)]:
        selection = (slice(lo, hi), slice(None), slice(None), slice(None))
        out = np.full((hi - lo, *x.shape[1:]), np.nan, np.float32)
        np.testing.assert_array_equal(decoder.read(selection, out), x[lo:hi])
        np.testing.assert_array_equal(out, array[lo:hi])


def test_whole_chunks_skip_the_general_decode_and_cut_ones_use_it(tmp_path, monkeypatch):
    path, x = _store(tmp_path, 3, "zstd")
    decoder, array = _decoder(path)
    per_chunk = array.chunks[0]
    general = []
    original = ChunkDecoder._decode
    monkeypatch.setattr(
        ChunkDecoder, "_decode", lambda self, stored: general.append(1) or original(self, stored)
    )
    whole = (slice(per_chunk, 3 * per_chunk), slice(None), slice(None), slice(None))
    out = np.empty((2 * per_chunk, *x.shape[1:]), np.float32)
    np.testing.assert_array_equal(decoder.read(whole, out), x[per_chunk : 3 * per_chunk])
    assert general == []
    assert decoder.decoded == [out[:per_chunk].nbytes] * 2
    cut = (slice(1, per_chunk + 1), slice(None), slice(None), slice(None))  # two cut chunks
    np.testing.assert_array_equal(
        decoder.read(cut, np.empty((per_chunk, *x.shape[1:]), np.float32)),
        x[1 : per_chunk + 1],
    )
    assert general == [1, 1]
    # the short last chunk is stored at full size: never decoded into the smaller block
    last = len(x) - len(x) % per_chunk
    edge = (slice(last, len(x)), slice(None), slice(None), slice(None))
    out = np.empty((len(x) - last, *x.shape[1:]), np.float32)
    np.testing.assert_array_equal(decoder.read(edge, out), x[last:])
    assert general == [1, 1, 1]


def test_a_chunk_whose_block_in_the_output_is_not_contiguous_takes_the_general_path(tmp_path):
    """Spatial chunks: a whole chunk of (1, 3, 3, 5) is a strided region of a (4, 3, 6, 5)
    output; a wrong direct decode would scramble it."""
    path, x = _store(tmp_path, 3, "zstd", spatial_chunks={1: 3})
    decoder, array = _decoder(path)
    assert array.chunks[2] == 3 and decoder._decode_into is not None
    per_chunk = array.chunks[0]
    selection = (slice(0, per_chunk), slice(None), slice(None), slice(None))
    out = np.empty((per_chunk, *x.shape[1:]), np.float32)
    np.testing.assert_array_equal(decoder.read(selection, out), x[:per_chunk])


def test_chunks_stored_big_endian_or_read_into_another_dtype_take_the_general_path(tmp_path):
    from zarr.codecs import BytesCodec

    data = np.arange(60, dtype=np.float32).reshape(6, 10)
    everything = (slice(0, 6), slice(None))

    def decoder_of(name, **kwargs):
        array = zarr.create_array(
            str(tmp_path / name), shape=data.shape, chunks=(2, 10), dtype="f4", **kwargs
        )
        array[...] = data
        return chunk_decoder(zarr.open_array(str(tmp_path / name), mode="r"))

    big = decoder_of("big.zarr", serializer=BytesCodec(endian="big"))
    assert big is not None and big._decode_into is None
    np.testing.assert_array_equal(big.read(everything, np.empty((6, 10), np.float32)), data)
    little = decoder_of("little.zarr")
    assert little._decode_into is not None
    np.testing.assert_array_equal(little.read(everything, np.empty((6, 10), np.float32)), data)
    as_f8 = little.read(everything, np.empty((6, 10), np.float64))
    np.testing.assert_array_equal(as_f8, data)  # converted by the general path's copy
    # a dtype that names big-endian, stored little-endian (zarr's default codec): direct
    named_big = zarr.create_array(
        str(tmp_path / "nb.zarr"), shape=(6, 10), chunks=(2, 10), dtype=">f4"
    )
    named_big[...] = data
    decoder = chunk_decoder(zarr.open_array(str(tmp_path / "nb.zarr"), mode="r"))
    assert decoder._decode_into is not None
    np.testing.assert_array_equal(decoder.read(everything, np.empty((6, 10), np.float32)), data)
    # zarr v2 stores the bytes in the order the dtype names
    v2 = zarr.open_array(
        str(tmp_path / "v2.zarr"), mode="w", shape=(6, 10), chunks=(2, 10), dtype=">f4",
        zarr_format=2,
    )  # fmt: skip
    v2[...] = data
    decoder = chunk_decoder(zarr.open_array(str(tmp_path / "v2.zarr"), mode="r"))
    assert decoder is not None and decoder._decode_into is None
    np.testing.assert_array_equal(decoder.read(everything, np.empty((6, 10), np.float32)), data)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_stored_object_of_the_wrong_size_is_refused_not_written_into_part_of_a_block(
    tmp_path, zarr_format
):
    """numcodecs decodes a smaller object into the start of a larger block and says
    nothing: the rest would keep the last batch's values. A checksum does not catch it
    (the object is intact, only of the wrong size)."""
    path, _ = _store(tmp_path, zarr_format, "zstd")
    decoder, array = _decoder(path)
    key = decoder.key((1, 0, 0, 0))
    half = np.zeros(int(np.prod(array.chunks)) // 2, np.float32)
    (path / key).write_bytes(numcodecs.Zstd(level=3, checksum=True).encode(half))
    per_chunk = array.chunks[0]
    selection = (slice(per_chunk, 2 * per_chunk), slice(None), slice(None), slice(None))
    with pytest.raises(ObjectDecodeError, match=r"decodes to \d+ bytes, not") as info:
        decoder.read(selection, np.empty((per_chunk, *array.shape[1:]), np.float32))
    assert info.value.key == key
    source = dfl.io.ZarrSource(path, "x", "y", shuffle=False)
    with pytest.raises(dfl.ChunkReadError, match=f"chunk {key!r}"):
        list(dfl.io.stream_batches(source, per_chunk))


def test_the_decoded_size_is_read_from_the_headers_the_compressors_write():
    for n in (0, 1, 255, 256, 257, 65791, 65792, 2**20 + 3):
        data = np.full(n, 7, np.uint8)
        for codec in (
            numcodecs.Zstd(level=3, checksum=True),
            numcodecs.Zstd(level=1),
            numcodecs.Blosc(cname="zstd", clevel=3),
            numcodecs.Blosc(cname="lz4", shuffle=numcodecs.Blosc.SHUFFLE),
        ):
            assert _decoded_size(codec, codec.encode(data)) == n, (n, codec)
    assert _decoded_size(numcodecs.Zstd(), b"not a zstd frame") is None

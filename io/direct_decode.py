"""Decode a stored chunk straight into its place in a read's output.

A chunk decoded the general way (``ChunkDecoder._decode``: zarr's codecs in reverse)
lands in a fresh array that the read then copies into its output. For a chunk of tens
of megabytes (a CosmoFlow sample is 32 MB) the fresh array is mapped anew for every
chunk, so the decode pays a page fault per 4 KiB besides the copy: on the H200 node the
zarr fit of a 4 x 128^3 CNN read 44 samples/s with 4 threads (0.13x its fit from
memory). Where the output's region for a whole chunk is one contiguous block, the
compressor decodes into that block instead (numcodecs' ``decode(buf, out=...)``): no
allocation and no copy. This holds for the common layouts only, which
:func:`direct_decoder` recognises (None otherwise, and the general path reads):

- zarr v3: no array-to-array codec, the ``bytes`` codec in native byte order, then at
  most one of zstd or blosc, and optionally ``crc32c`` after it (``to_zarr``'s layouts);
- zarr v2: C order, a dtype in native byte order, no filters, a numcodecs zstd or
  blosc compressor (or none).

The checksums are verified as on the general path: ``crc32c`` before the decode,
zstd's content checksum by libzstd during it. The ``crc32c`` check runs with the GIL
released (:func:`crc32c_checked`), where zarr's codec holds it: google_crc32c lets go of
the GIL only for a ``bytes`` object, and zarr hands it a numpy view. A decode thread
holding the GIL for the whole CRC of a chunk stalls the replica's step beside it, which
on a GPU is bound by the host (``benchmarks/bench_loader_gil.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numcodecs
import numpy as np

# (stored bytes, the output's block for the whole chunk) -> None; raises if they differ
DecodeInto = Callable[[Any, np.ndarray], None]


def direct_decoder(steps: Sequence[tuple[Any, Any]]) -> DecodeInto | None:
    """A function decoding a chunk's stored bytes into a contiguous block, for the codec
    ``steps`` in decode order (``(codec, spec)`` as ``ChunkDecoder`` runs them), or None
    where a step is not one of the layouts above."""
    names = [type(codec).__name__ for codec, _ in steps]
    if names == ["V2Codec"]:
        return _v2(*steps[0])
    if not names or names[-1] != "BytesCodec" or not _native(steps[-1][0], steps[-1][1]):
        return None
    crc = None
    if names[0] == "Crc32cCodec":
        crc = steps[0]
        steps, names = steps[1:], names[1:]
    if names == ["BytesCodec"]:
        return _with_crc(crc, None)
    if len(names) != 2:
        return None
    inner = _numcodec(steps[0][0])
    return None if inner is None else _with_crc(crc, inner)


def _native(codec: Any, spec: Any) -> bool:
    """Whether the ``bytes`` codec's order is this machine's (always so for 1-byte types)."""
    itemsize = np.dtype(spec.dtype.to_native_dtype()).itemsize
    endian = getattr(getattr(codec, "endian", None), "value", None)
    return itemsize == 1 or endian == sys.byteorder


def _numcodec(codec: Any) -> Any:
    """The numcodecs object behind zarr v3's zstd or blosc codec, else None."""
    name = type(codec).__name__
    attribute = {"ZstdCodec": "_zstd_codec", "BloscCodec": "_blosc_codec"}.get(name)
    inner = getattr(codec, attribute, None) if attribute else None
    return inner if isinstance(inner, (numcodecs.Zstd, numcodecs.Blosc)) else None


def _v2(codec: Any, spec: Any) -> DecodeInto | None:
    """zarr v2 stores the bytes in the order its dtype names (``>f4`` often)."""
    stored = np.dtype(spec.dtype.to_native_dtype())
    if codec.filters or getattr(spec, "order", "C") != "C" or not stored.isnative:
        return None
    compressor = codec.compressor
    if compressor is not None and not isinstance(compressor, (numcodecs.Zstd, numcodecs.Blosc)):
        return None
    return _with_crc(None, compressor)


# crc32c of any bytes followed by their own crc32c (little-endian): a CRC's residue
CRC32C_RESIDUE = 0x48674BC7


def crc32c_checked(data: np.ndarray) -> np.ndarray | None:
    """``data`` (a stored object: bytes, then their crc32c, little-endian) without its
    checksum, verified with the GIL released; ValueError at a mismatch. None when ``data``
    is not a view of a whole ``bytes`` object (google_crc32c would hold the GIL then).

    One pass over the whole object, checksum included, gives ``CRC32C_RESIDUE`` exactly
    when the stored checksum is the data's: for a given prefix, the CRC of the prefix and
    4 more bytes is a bijection of those bytes. So this check equals zarr's, which
    computes the CRC of the data and compares."""
    whole = data.base
    if not isinstance(whole, bytes) or len(whole) != data.nbytes or len(whole) < 4:
        return None
    if data.ndim != 1 or data.ctypes.data != np.frombuffer(whole, np.uint8).ctypes.data:
        return None
    import google_crc32c  # zarr v3's dependency, as its crc32c codec is (v2 has neither)

    if google_crc32c.value(whole) != CRC32C_RESIDUE:
        raise ValueError("Stored and computed checksum do not match (crc32c)")
    return data[:-4]


def _as_array(data: Any) -> Any:
    return data.as_numpy_array() if hasattr(data, "as_numpy_array") else data


def crc32c_decoded(codec: Any, stored: Any, spec: Any) -> Any:
    """zarr's ``crc32c`` codec's decode of ``stored`` (a zarr buffer): its inner bytes,
    checked with the GIL released where :func:`crc32c_checked` can, else by the codec."""
    data = _as_array(stored)
    inner = crc32c_checked(data) if isinstance(data, np.ndarray) else None
    if inner is None:  # zarr's codec, holding the GIL for the check
        return codec._decode_sync(stored, spec)
    return spec.prototype.buffer.from_array_like(inner)


def _with_crc(crc: tuple[Any, Any] | None, compressor: Any) -> DecodeInto:
    def decode_into(stored: Any, block: np.ndarray) -> None:
        if crc is not None:  # raises at a mismatch; the inner bytes follow
            stored = crc32c_decoded(crc[0], stored, crc[1])
        data = _as_array(stored)
        raw = block.reshape(-1).view(np.uint8)
        if compressor is None:
            if data.nbytes != raw.nbytes:
                raise ValueError(f"the chunk holds {data.nbytes} bytes, not {raw.nbytes}")
            raw[...] = np.frombuffer(data, np.uint8)
            return
        size = _decoded_size(compressor, data)
        if size is None:  # a frame that does not say: decoded apart, then copied
            decoded = np.frombuffer(compressor.decode(data), np.uint8)
            if decoded.nbytes != raw.nbytes:
                raise ValueError(f"the chunk decodes to {decoded.nbytes} bytes, not {raw.nbytes}")
            raw[...] = decoded
            return
        if size != raw.nbytes:  # numcodecs would fill a larger block's start silently
            raise ValueError(f"the chunk decodes to {size} bytes, not {raw.nbytes}")
        compressor.decode(data, out=raw)

    return decode_into


ZSTD_MAGIC = 0xFD2FB528


def _decoded_size(compressor: Any, data: Any) -> int | None:
    """The decoded bytes that the stored object's header declares, or None if it does not
    (a zstd frame written without its content size, or several frames)."""
    head = memoryview(data).cast("B")
    if isinstance(compressor, numcodecs.Blosc):  # blosc 1 header: nbytes at bytes 4-8
        return int.from_bytes(head[4:8], "little") if len(head) >= 16 else None
    if len(head) < 6 or int.from_bytes(head[:4], "little") != ZSTD_MAGIC:
        return None
    descriptor = head[4]
    fcs_flag, single_segment, dict_flag = descriptor >> 6, (descriptor >> 5) & 1, descriptor & 3
    fcs_bytes = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if fcs_bytes == 0:
        return None
    start = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[dict_flag]
    if len(head) < start + fcs_bytes:
        return None
    size = int.from_bytes(head[start : start + fcs_bytes], "little")
    return size + 256 if fcs_bytes == 2 else size

"""Checksums on every chunk ``to_zarr`` writes, and how to tell whether a store has them.

A chunk whose bytes change on disk or in a copy may still decode: zstd without its
content checksum turns 64 overwritten bytes into values like 8e37, and training goes
on. So every store the library writes carries a checksum its codecs verify on every
decode (zarr's own reads and ``io.zarr_decode``'s threads alike): zstd's content
checksum (both formats; any zstd reader verifies it), gzip's CRC-32 (always there),
and for blosc or no compressor zarr v3's ``crc32c`` codec after the compressor, or in
zarr v2 (which has no codec after the compressor) a ``crc32`` filter before it, behind
a byte shuffle so blosc still compresses floats as well as with its own shuffle.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from dataflow.core.errors import ConfigError

COMPRESSORS = ("blosc", "gzip", "lz4", "zstd")  # what the writers take, besides None

# What the codecs say when a chunk fails its checksum (zstd, crc32c / crc32, gzip).
_MISMATCH = re.compile(r"checksum|crc check failed", re.IGNORECASE)


def is_checksum_mismatch(error: BaseException) -> bool:
    """Whether a codec's decode error is a failed checksum (the bytes changed)."""
    return bool(_MISMATCH.search(str(error)))


def check_compressor(where: str, compressor: Any) -> None:
    """``compressor`` is one the writers take (ConfigError naming ``where`` otherwise)."""
    if compressor is not None and compressor not in COMPRESSORS:
        raise ConfigError(
            f"{where}(compressor={compressor!r}): use one of {sorted(COMPRESSORS)} or None"
        )


def checksummed_codecs(
    compressor: str | None, zarr_format: int, dtype: np.dtype
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(filters, compressors) for ``create_array``: ``compressor`` ("zstd", "blosc", "lz4",
    "gzip" or None) with a checksum that every decode verifies."""
    check_compressor("checksummed_codecs", compressor)
    # blosc's codec: zstd inside, or lz4 (~2.5x zstd's decode a thread on float fields)
    cname, level = ("lz4", 5) if compressor == "lz4" else ("zstd", 3)
    if zarr_format == 2:
        import numcodecs

        if compressor == "zstd":
            return (), (numcodecs.Zstd(level=3, checksum=True),)
        if compressor == "gzip":
            return (), (numcodecs.GZip(level=5),)
        crc = (numcodecs.CRC32(),)
        if compressor is None:
            return crc, ()
        shuffle = numcodecs.Shuffle(elementsize=np.dtype(dtype).itemsize)
        return (shuffle, *crc), (numcodecs.Blosc(cname=cname, clevel=level, shuffle=0),)
    from zarr.codecs import BloscCodec, Crc32cCodec, GzipCodec, ZstdCodec

    if compressor == "zstd":
        return (), (ZstdCodec(level=3, checksum=True),)
    if compressor == "gzip":
        return (), (GzipCodec(level=5),)
    if compressor is None:
        return (), (Crc32cCodec(),)
    return (), (BloscCodec(cname=cname, clevel=level), Crc32cCodec())  # its byte shuffle


def checksum_of(array: Any) -> str | None:
    """The checksum a zarr array's codecs verify on decode, e.g. "zstd checksum", or None
    (then a corrupted chunk that still decodes goes unnoticed)."""
    for codec in (*array.filters, *array.compressors):  # a sharded array: inside its shards
        name = _name(codec)
        if name == "zstd" and _config(codec).get("checksum"):
            return "zstd checksum"
        if name in ("crc32c", "crc32", "adler32", "fletcher32", "jenkins_lookup3"):
            return name
        if name == "gzip":
            return "gzip crc32"
    return None


def _name(codec: Any) -> str:
    if hasattr(codec, "to_dict"):
        return str(codec.to_dict().get("name", ""))
    return str(getattr(codec, "codec_id", type(codec).__name__)).lower()


def _config(codec: Any) -> dict[str, Any]:
    if hasattr(codec, "to_dict"):
        return dict(codec.to_dict().get("configuration", {}))
    return dict(codec.get_config()) if hasattr(codec, "get_config") else {}

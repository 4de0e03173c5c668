"""What a source says when a stored chunk cannot be read: missing from the store (zarr
would give its fill value) or failing to decode (corrupt, truncated, a checksum that
does not match), each naming the chunk, the array and the store, and what to do."""

from __future__ import annotations

from typing import Any

import zarr

from dataflow.core.errors import ChunkMissingError, ChunkReadError, StoreAccessError
from dataflow.io.checksums import is_checksum_mismatch
from dataflow.io.store_access import store_access_error


def chunk_read_error(
    array: zarr.Array, name: str, key: str, exc: Exception
) -> ChunkReadError | StoreAccessError:
    """Chunk ``key`` of ``array`` did not decode: which, in which store, and what to do
    (a store that refused the read is not a corrupt chunk: ``io.store_access``)."""
    refused = store_access_error("ZarrSource", array, key, exc)
    if refused is not None:
        return refused
    why = (
        "its checksum does not match: the chunk is corrupt (its bytes changed after the "
        "store was written)"
        if is_checksum_mismatch(exc)
        else "the file is corrupt or truncated"
    )
    return ChunkReadError(
        f"ZarrSource: chunk {key!r} of array {name!r} in store "
        f"{str(array.store_path.store)!r} could not be read or decoded ({exc}); {why}. "
        "Re-write (or re-convert) the store, or restore that chunk file from a copy"
    )


def missing_chunk_error(reader: Any, missing: list[str]) -> ChunkMissingError:
    return ChunkMissingError(
        f"ZarrSource: array {reader.name!r} has no chunk {missing[0]!r} "
        f"({len(missing)} missing among the chunks checked); the store is incomplete, and "
        "zarr would return fill values instead. Re-write or re-copy the store (zarr skips "
        "all-fill-value chunks unless written with write_empty_chunks=True, as "
        "dataflow.io.to_zarr does)"
    )

"""A zarr store a tool names (``dataflow info``, ``verify_store``, ``dataflow convert``),
opened as ``ZarrSource`` opens it, with an object store's refusal as one clear error.

The opener is ``ZarrSource``'s own (``zarr_source._open_zarr``: the path or fsspec URL
and its ``storage_options``). What this adds is for a URL only: fsspec's and the
cloud client's failures (no credentials, a forbidden bucket, an unreachable endpoint,
an option the filesystem does not take) become a ``DataError`` naming the command, the
store and what usually fixes it, where the user would otherwise see the client's
traceback. A local path's errors stay each tool's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dataflow.core.errors import ConfigError, DataError, DataflowError, StoreAccessError
from dataflow.io.credentials import StorageOptions
from dataflow.io.store_access import UNAVAILABLE, access_failure
from dataflow.io.zarr_source import _open_zarr

REMOTE_HINT = (
    "an object store outside AWS needs its endpoint (--storage-option "
    "endpoint_url=https://..., or storage_options={'endpoint_url': ...} in Python), a "
    "public bucket anon=true; credentials come from the environment (AWS_ACCESS_KEY_ID, "
    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE) or the key/secret options"
)


def local_path_error(caller: str, path: str | Path) -> str:
    return (
        f"{caller}(--storage-option): {str(path)!r} is a local path, and storage options "
        "are for a store given as a URL (s3://bucket/data.zarr); leave them out"
    )


def is_url(path: Any) -> bool:
    return isinstance(path, str | Path) and "://" in str(path)


def open_zarr(
    caller: str, path: str | Path, storage_options: Mapping[str, Any] | None, hint: str = ""
) -> Any:
    """The zarr group or array at ``path``; ``caller`` (``"info"``) starts the messages,
    ``hint`` ends the one for a folder or object that is not a zarr store. The options
    are kept as :class:`StorageOptions`, so no repr of them shows a secret."""
    options = StorageOptions.of(storage_options)
    if not is_url(path) and options:  # zarr would refuse them with a TypeError
        raise ConfigError(local_path_error(caller, path))
    try:
        return _open_zarr(path, options, caller)
    except StoreAccessError as exc:  # a tool's hint names its --storage-option flag
        cause = exc.__cause__ or exc
        raise DataError(
            f"{caller}: cannot open {str(path)!r} ({type(cause).__name__}: {cause}); {REMOTE_HINT}"
        ) from cause
    except DataflowError:
        raise  # nothing there: _open_zarr said so
    except (ValueError, KeyError) as exc:  # something there, but no zarr metadata
        raise DataError(f"{caller}: {str(path)!r} is not a zarr store ({exc}){hint}") from exc
    except Exception as exc:
        if not is_url(path):
            raise
        # the client's: credentials, permissions, endpoint, options; or a store failing
        # for a while (throttled, a server error), which a later try may pass
        passing = access_failure(exc) == UNAVAILABLE
        hint = "the store is throttling or failing for now: try again later" if passing else ""
        raise DataError(
            f"{caller}: cannot open {str(path)!r} ({type(exc).__name__}: {exc}); "
            f"{hint or REMOTE_HINT}"
        ) from exc

"""Storage options whose credentials never show: in a repr, a log line, an error message.

A source keeps its ``storage_options`` to open the store again on each worker. They
may hold credentials (s3fs's ``key``, ``secret``, ``token``; ``client_kwargs``'
``aws_secret_access_key``; a password). :class:`StorageOptions` is the dict fsspec
gets, whole, but its ``repr`` and ``str`` print ``'***'`` for every value whose
name says it is a credential, nested dicts included, so printing a source, its
state, or an error that quotes the options reveals none. The options reach the
workers inside the fit's spec, which Dask scatters once to a worker and never
puts in a task; with no credentials in them, s3fs (botocore) reads the worker's
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
``AWS_ENDPOINT_URL``), so they need not travel at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HIDDEN = "***"
_SECRET_WORDS = ("secret", "token", "password", "passwd", "credential", "key", "auth")


def is_secret(name: Any) -> bool:
    """Whether an option named ``name`` holds a credential (errs on the side of hiding)."""
    return isinstance(name, str) and any(w in name.lower() for w in _SECRET_WORDS)


def masked(value: Any) -> Any:
    """``value`` with every credential replaced by ``'***'`` (for printing only)."""
    if isinstance(value, Mapping):
        return {k: HIDDEN if is_secret(k) else masked(v) for k, v in value.items()}
    return value


class StorageOptions(dict):
    """fsspec storage options that print with their credentials hidden."""

    @classmethod
    def of(cls, options: Mapping[str, Any] | None) -> StorageOptions | None:
        return None if options is None else cls(options)

    def __repr__(self) -> str:
        return repr(masked(self))

    __str__ = __repr__

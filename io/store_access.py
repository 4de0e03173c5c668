"""An object store that refuses a read, named as such: not a corrupt chunk, not a bare
client traceback from a worker.

A remote store is opened where the fit starts (``ZarrSource`` and ``PatchSource`` read
its metadata on the driver) and its chunks are read on the workers, each with its own
credentials and its own route to the endpoint. So the commonest object-store failure
in a fit on a cluster is a worker that cannot do what the driver could: no
credentials in its environment (a batch job does not inherit the login shell's
``AWS_PROFILE``), an identity the bucket refuses, or no route to the endpoint (compute
nodes often have none outside the cluster). The client says only
``NoCredentialsError: Unable to locate credentials``, and a failed decode would read
as a corrupt chunk. :func:`access_failure` recognises these failures by the client's
exception (botocore's, aiohttp's, or the ``PermissionError`` s3fs and a local file
raise) and :func:`store_access_error` names the object, the store, the process that
failed and what fixes it.

The other kind of failure is passing: a store that throttles its readers (S3's
``SlowDown``), answers with a server error, or drops a connection. The client retries
these for a while (botocore and s3fs for up to about 30 s, fsspec's HTTP not at all);
``io.store_retry`` goes on retrying a read for a source's ``retry_s``, and only then
:func:`store_access_error` names it, a :class:`StoreUnavailableError`.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from dataflow.core.errors import StoreAccessError, StoreUnavailableError

NO_CREDENTIALS = "credentials"
DENIED = "denied"
UNREACHABLE = "unreachable"
UNAVAILABLE = "unavailable"  # passing: throttled, a server error, a dropped connection
# Set on the last error of a read that ``io.store_retry`` sent again: (retries, seconds)
RETRIED = "dataflow_retried"

# botocore's and aiohttp's exception classes, by name (neither is a dependency of ours)
_CREDENTIAL_ERRORS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "NoAuthTokenError",
    "TokenRetrievalError",
    "UnauthorizedSSOTokenError",
    "SSOTokenLoadError",
}
_UNREACHABLE_ERRORS = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ClientConnectorError",
    "ClientConnectorDNSError",
    "ServerTimeoutError",
    "gaierror",
}
_DENIED_CODES = {
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AccountProblem",
    "403",
}

# S3's (and S3-compatible stores') codes of a request worth sending again, and the HTTP
# statuses behind them; clients' exceptions for a connection that broke mid-request
_TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "429",
    "500",
    "502",
    "503",
    "504",
}
_TRANSIENT_ERRORS = {
    "ServerDisconnectedError",
    "ClientPayloadError",
    "ClientOSError",
    "ReadTimeoutError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "FSTimeoutError",
    "ConnectionResetError",
    "ConnectionAbortedError",
    "BrokenPipeError",
    "TimeoutError",
}

ADVICE = {
    NO_CREDENTIALS: (
        "this process found no credentials for the store. Each worker reads them from its "
        "own environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE and "
        "its files), which a batch job does not inherit from the shell the fit started "
        "in: set them where the workers start (dask-jobqueue: job_script_prologue=["
        "'export AWS_PROFILE=...']), or pass key and secret in storage_options (they "
        "travel to the workers and print as '***')"
    ),
    DENIED: (
        "the store refused this process's credentials: check that the workers use the "
        "identity the driver does (the same AWS_PROFILE or keys) and that the bucket's "
        "policy lets it read; a local file needs read permission for the workers' user"
    ),
    UNREACHABLE: (
        "this process cannot reach the store's endpoint: compute nodes often have no "
        "route outside the cluster. Copy the store to a filesystem the workers share "
        "(dataflow convert, or any copy of the folder), or give an endpoint they can "
        "reach (storage_options={'endpoint_url': ...})"
    ),
    UNAVAILABLE: (
        "the store kept failing in a way that passes (throttling, a server error, a "
        "dropped connection). A store read by many workers at once throttles them (S3: "
        "about 5,500 GETs/s per prefix): fewer requests in flight (a smaller "
        "fetch_ahead_mb), larger chunks, or the data spread over more prefixes help; a "
        "longer outage needs a larger retry_s on the source. Training goes on from the "
        "last checkpoint with fit(..., resume=True)"
    ),
}


def access_failure(exc: BaseException) -> str | None:
    """Which access failure ``exc`` (or an exception it was raised from) is: one of
    :data:`NO_CREDENTIALS`, :data:`DENIED`, :data:`UNREACHABLE`, or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        kind = _kind(current)
        if kind is not None:
            return kind
        current = current.__cause__ or current.__context__
    return None


def _kind(exc: BaseException) -> str | None:
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & _CREDENTIAL_ERRORS:
        return NO_CREDENTIALS
    if names & _UNREACHABLE_ERRORS:
        return UNREACHABLE
    if isinstance(exc, PermissionError):  # s3fs's AccessDenied, or a local file's mode
        return DENIED
    response = getattr(exc, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        code = str((response.get("Error") or {}).get("Code", ""))
        if code in _DENIED_CODES:
            return DENIED
        if code in _TRANSIENT_CODES:
            return UNAVAILABLE
    if names & _TRANSIENT_ERRORS:
        return UNAVAILABLE
    status = getattr(exc, "status", None)  # aiohttp's ClientResponseError (fsspec's HTTP)
    if isinstance(status, int) and (status == 429 or 500 <= status < 600):
        return UNAVAILABLE
    return None


def where_this_runs() -> str:
    """This process, as a user finds it in the cluster's logs: its Dask worker's address
    if it is one, else the host and process id."""
    from distributed import Worker, get_worker
    from distributed.core import Status

    try:
        return f"worker {get_worker().address}"
    except ValueError:  # not a task's thread: a reader's, or no worker at all
        # (a worker closed in this process may linger in the weak set until collected)
        live = (Status.running, Status.paused)
        workers = [w for w in list(Worker._instances) if w.address and w.status in live]
        if len(workers) == 1:  # (a worker process holds one)
            return f"worker {workers[0].address}"
    return f"process {os.getpid()} on {socket.gethostname()}"


def store_label(array: Any) -> str:
    """A zarr array's store as its user named it: ``s3://bucket/data.zarr``, a folder."""
    store = array.store_path.store
    fs, path = getattr(store, "fs", None), getattr(store, "path", None)
    if fs is not None and path is not None:
        if "://" in str(path):  # fsspec's HTTP keeps the whole URL as the path
            return str(path)
        protocol = fs.protocol[0] if isinstance(fs.protocol, tuple | list) else fs.protocol
        return f"{protocol}://{path}"
    root = getattr(store, "root", None)
    return str(store) if root is None else str(root)


def store_access_error(
    who: str, store: Any, key: str | None, exc: BaseException
) -> StoreAccessError | None:
    """The error for ``exc`` reading object ``key`` (None: opening the store) of
    ``store`` (a label, or a zarr array: :func:`store_label`), when ``exc`` is an access
    failure; else None (the caller's own error stands). ``who`` (``"ZarrSource"``, or
    "") starts the message, which says how long the read was retried when
    ``io.store_retry`` sent it again (:data:`RETRIED`)."""
    kind = access_failure(exc)
    if kind is None:
        return None
    if hasattr(store, "store_path"):
        store = store_label(store)
    what = "opening" if key is None else f"reading object {key!r} of"
    advice = ADVICE[kind]
    if key is None and kind != DENIED:  # where the fit starts: the options may be wrong
        advice += (
            "; a store outside AWS also needs storage_options={'endpoint_url': ...}, a "
            "public bucket anon=True"
        )
    message = (
        f"{what} store {str(store)!r} failed in {where_this_runs()}{_retried_text(exc)} "
        f"({type(exc).__name__}: {exc}); {advice}"
    )
    error = StoreUnavailableError if kind == UNAVAILABLE else StoreAccessError
    return error(f"{who}: {message}" if who else message[0].upper() + message[1:])


def _retried_text(exc: BaseException) -> str:
    """How long the read that raised ``exc`` was retried (:data:`RETRIED`), or ""."""
    retried = getattr(exc, RETRIED, None)
    if retried is None:
        return ""
    times, seconds = retried
    return f" after {times} {'retry' if times == 1 else 'retries'} over {seconds:.1f} s"

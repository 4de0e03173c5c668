"""A store that refuses a read is named as such (``io/store_access.py``): no
credentials, credentials refused, no route to the endpoint. On a cluster the commonest
case is a worker that lacks what the driver had (a batch job does not inherit the
shell's AWS variables): the error names the object, the store, the process and the
fix, where the client said only ``Unable to locate credentials`` and a decode failure
read as a corrupt chunk. Against moto's real S3 server (``tests/object_store.py``)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from conftest import tiny_pipeline
from distributed import Client, LocalCluster
from object_store import KEY, SECRET, close_sessions

import dataflow as dfl
from dataflow.io.store_access import DENIED, NO_CREDENTIALS, UNREACHABLE, access_failure

botocore = pytest.importorskip("botocore.exceptions")


def test_the_clients_access_failures_are_recognised_and_nothing_else():
    denied = botocore.ClientError({"Error": {"Code": "AccessDenied"}}, "GetObject")
    missing = botocore.ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")
    unreachable = botocore.EndpointConnectionError(endpoint_url="https://s3.example.org")
    assert access_failure(botocore.NoCredentialsError()) == NO_CREDENTIALS
    assert access_failure(denied) == DENIED
    assert access_failure(PermissionError("Access Denied")) == DENIED  # s3fs's, a file's
    assert access_failure(unreachable) == UNREACHABLE
    assert access_failure(missing) is None
    assert access_failure(ValueError("zstd: corrupt frame")) is None
    try:  # a wrapper raised from one (zarr, fsspec) is recognised by its cause
        try:
            raise botocore.NoCredentialsError()
        except Exception as inner:
            raise RuntimeError("get failed") from inner
    except RuntimeError as outer:
        assert access_failure(outer) == NO_CREDENTIALS


@pytest.fixture
def aws_env_only(no_aws_environment):
    """Credentials in this process's environment only (none in files or options)."""
    no_aws_environment.setenv("AWS_ACCESS_KEY_ID", KEY)
    no_aws_environment.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    return no_aws_environment


def _drop_credentials(monkeypatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")


def test_a_copy_that_finds_no_credentials_names_the_object_and_the_fix(s3, s3_stores, aws_env_only):
    """The source opened where the credentials were; its copy (a worker's, pickled)
    opens the store again in a process that has none."""
    _, url = s3_stores
    source = dfl.io.ZarrSource(url, x="x", y="y", storage_options={"endpoint_url": s3.endpoint_url})
    assert source.read(np.arange(4)).size == 4
    _drop_credentials(aws_env_only)
    close_sessions()  # (s3fs caches the filesystem that has them)
    copy = pickle.loads(pickle.dumps(source))
    with pytest.raises(dfl.StoreAccessError) as refused:
        copy.read(np.arange(4))
    message = str(refused.value)
    assert f"store {url!r}" in message and "Reading object 'x/c/" in message
    assert "NoCredentialsError" in message and "AWS_PROFILE" in message
    assert f"process {os.getpid()}" in message  # not a worker here: the process
    assert SECRET not in message and "corrupt" not in message


def test_a_source_opened_without_credentials_says_so_with_the_options_it_may_lack(
    s3, s3_stores, aws_env_only
):
    _, url = s3_stores
    _drop_credentials(aws_env_only)
    with pytest.raises(dfl.StoreAccessError, match=r"ZarrSource: opening store .*endpoint_url"):
        dfl.io.ZarrSource(url, x="x", y="y", storage_options={"endpoint_url": s3.endpoint_url})


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_fit_whose_workers_lack_the_drivers_credentials_fails_naming_the_worker(
    s3, s3_stores, aws_env_only
):
    """The driver opens the store and runs its dry run with credentials from its
    environment; the cluster's workers start without them, as a batch job's would."""
    _, url = s3_stores
    source = dfl.io.ZarrSource(url, x="x", y="y", storage_options={"endpoint_url": s3.endpoint_url})
    source.read(np.arange(4))
    _drop_credentials(aws_env_only)  # the workers start without them
    pipe = tiny_pipeline(None, None, source=source, batch=32)
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        [worker] = client.scheduler_info()["workers"]
        with pytest.raises(dfl.StoreAccessError) as refused:
            pipe.fit(epochs=1, client=client)
    message = str(refused.value)
    assert f"failed in worker {worker}" in message, message
    assert "NoCredentialsError" in message and "job_script_prologue" in message

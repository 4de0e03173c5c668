"""``dataflow info`` and ``dataflow convert`` reach an object store that needs options.

The flag's parsing is checked without a server; the rest against a real S3-compatible
server (moto, ``tests/object_store.py``) that only answers at its own endpoint, with
the CLI called in-process: the store is reported and rechunked with
``--storage-option``, refused with one clear line without them, and the secret given
on the command line never shows in what the commands print.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import zarr
from conftest import make_data
from object_store import SECRET

import dataflow as dfl
from dataflow.tools.cli import main
from dataflow.tools.storage_flags import parse_storage_options, storage_flags


def test_values_are_json_when_they_parse_and_strings_otherwise():
    options = parse_storage_options(
        [
            "anon=true",
            'client_kwargs={"region_name": "x"}',
            "endpoint_url=https://s3.example.org:9000",
            "default_block_size=1048576",
            "profile=a=b",  # only the first '=' splits
            "secret=s3cr3t",
        ]
    )
    assert dict(options) == {
        "anon": True,
        "client_kwargs": {"region_name": "x"},
        "endpoint_url": "https://s3.example.org:9000",
        "default_block_size": 1048576,
        "profile": "a=b",
        "secret": "s3cr3t",
    }
    assert "s3cr3t" not in repr(options) and "s3cr3t" not in str(options)
    # a credential is kept as given, even when it would parse as a number
    assert parse_storage_options(["secret=12345", "key=007"]) == {"secret": "12345", "key": "007"}
    assert parse_storage_options(None) is None and parse_storage_options([]) is None
    # A suggested command carries the options back, credentials left out
    flags = storage_flags({**options, "client_kwargs": {"aws_secret_access_key": "s3cr3t"}})
    assert flags == (
        " --storage-option anon=true --storage-option "
        "endpoint_url=https://s3.example.org:9000 --storage-option default_block_size=1048576"
        " --storage-option profile=a=b"
    )


@pytest.mark.parametrize(
    "item, expected",
    [
        ("anon", r"--storage-option 'anon': no '=' in it; give KEY=VALUE, e.g. --storage-option"),
        ("=s3cr3t", r"--storage-option '=\.\.\.': no KEY before the '='; give KEY=VALUE"),
    ],
)
@pytest.mark.parametrize("command", ["info", "convert"])
def test_a_malformed_storage_option_is_one_line_naming_the_flag(
    command, item, expected, tmp_path, capsys
):
    args = ["s3://data/x.zarr"] + ([str(tmp_path / "out.zarr")] if command == "convert" else [])
    assert main([command, *args, "--storage-option", item]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("dataflow: error: ") and captured.err.count("\n") == 1
    assert re.search(expected, captured.err), captured.err
    assert "s3cr3t" not in captured.err
    assert not (tmp_path / "out.zarr").exists()


def test_an_option_twice_or_on_a_local_store_is_refused(tmp_path, capsys):
    local = dfl.io.to_zarr(tmp_path / "local.zarr", *make_data(16))
    given = ["--storage-option", "anon=true"]
    assert main(["info", "s3://data/x.zarr", *given, *given]) == 1
    assert "--storage-option anon=...: given twice" in capsys.readouterr().err
    assert main(["info", str(local), *given]) == 1
    assert "is a local path, and storage options are for a store given as a URL" in (
        capsys.readouterr().err
    )


def test_convert_refuses_a_url_destination(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the old code wrote such a DEST to ./s3:/...
    local = dfl.io.to_zarr(tmp_path / "local.zarr", *make_data(16))
    assert main(["convert", str(local), "s3://data/copy.zarr"]) == 1
    assert "DEST 's3://data/copy.zarr' is a URL; write to a local path" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local.zarr"]


def test_help_names_the_flag_and_says_to_keep_secrets_in_the_environment(capsys):
    for command in ("info", "convert"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--storage-option KEY=VALUE" in text
        assert "AWS_SECRET_ACCESS_KEY" in text and "not on the command line" in text
    assert "SRC given as a URL (DEST is always a local path)" in text


def flags(s3):
    return [f"--storage-option={k}={v}" for k, v in s3.storage_options.items()]


def test_info_reports_an_s3_store_given_its_options_and_never_prints_the_secret(
    s3, s3_stores, no_aws_environment, capsys
):
    _, url = s3_stores
    assert main(["info", url, *flags(s3), "--verify", "--patch", "2=4,3=4"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{url}: zarr format 3, 2 array(s), 256 samples along axis 0")
    assert "OK: every chunk present and decoded" in captured.out
    assert "windows" in captured.out  # the patch advice read the store too
    # ... and its suggested rewrite reaches the store as this command did
    assert f"--chunks 0=256,1=1,2=8,3=8 --storage-option endpoint_url={s3.endpoint_url}\n" in (
        captured.out
    )
    assert main(["info", url, *flags(s3), "--json", "--no-decode"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == 256 and report["chunks_missing"] == 0
    assert SECRET not in captured.out + captured.err + json.dumps(report)


def test_convert_rechunks_an_s3_store_to_a_local_copy_equal_to_its_source(
    s3, s3_stores, no_aws_environment, tmp_path, capsys
):
    local, url = s3_stores
    dest = tmp_path / "copy.zarr"
    assert main(["convert", url, str(dest), "--chunks", "0=32", *flags(s3)]) == 0
    captured = capsys.readouterr()
    assert f"wrote {dest}" in captured.out and SECRET not in captured.out + captured.err
    source, copy = zarr.open_group(local, mode="r"), zarr.open_group(dest, mode="r")
    assert sorted(copy.array_keys()) == ["x", "y"]
    for name in ("x", "y"):
        assert copy[name].chunks[0] == 32
        assert np.array_equal(copy[name][...], source[name][...])


@pytest.mark.parametrize("command", ["info", "convert"])
def test_without_the_options_an_s3_store_is_refused_in_one_clear_line(
    command, s3, s3_stores, no_aws_environment, tmp_path, capsys
):
    _, url = s3_stores
    dest = tmp_path / "copy.zarr"
    args = [url] + ([str(dest)] if command == "convert" else [])
    assert main([command, *args]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(
        f"dataflow: error: {command}: cannot open {url!r} (NoCredentialsError: "
    )
    assert "needs its endpoint (--storage-option endpoint_url=https://..." in captured.err
    assert not dest.exists()
    # Only the endpoint: the secret's absence is what the server refuses, named as such
    endpoint = f"--storage-option=endpoint_url={s3.endpoint_url}"
    assert main([command, *args, endpoint, "--storage-option=secret=" + SECRET]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dataflow: error: {command}: cannot open {url!r} (")
    assert SECRET not in err

"""``--storage-option KEY=VALUE``: fsspec storage options on the command line.

``dataflow info`` and ``dataflow convert`` open a store given as a URL with the options
``dfl.io.ZarrSource(url, storage_options=...)`` takes: an HPC centre's S3 (Ceph, MinIO)
needs ``endpoint_url``, a public bucket ``anon=true``. A value is read as JSON when it
parses (``anon=true`` is ``True``, ``client_kwargs={"region_name": "x"}`` a dict), else
kept as the string given. The parsed options are a :class:`StorageOptions`, so nothing
that prints them shows a credential; :func:`storage_flags` writes the options back as
flags for a command the tools suggest, leaving credentials out (they belong in the
environment: a command line is kept in the shell's history and shown by ``ps``).
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from dataflow.core.errors import ConfigError
from dataflow.io.credentials import HIDDEN, StorageOptions, is_secret, masked

FLAG = "--storage-option"
EXAMPLE = f"{FLAG} endpoint_url=https://s3.example.org or {FLAG} anon=true"
SECRETS_NOTE = (
    "keep keys and secrets in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
    "AWS_PROFILE), not on the command line, where the shell's history and ps show them"
)


def add_storage_option(parser: argparse.ArgumentParser, which: str) -> None:
    """The repeatable flag; ``which`` says the stores it applies to."""
    parser.add_argument(
        FLAG,
        dest="storage_options",
        action="append",
        metavar="KEY=VALUE",
        help=f"an fsspec storage option for {which} (repeat it for each option): the value "
        'read as JSON when it parses (anon=true, client_kwargs=\'{"region_name": "x"}\'), '
        f"else as a string (endpoint_url=https://s3.example.org); {SECRETS_NOTE}",
    )


def parse_storage_options(items: Sequence[str] | None) -> StorageOptions | None:
    """``["endpoint_url=https://...", "anon=true"]`` as fsspec's dict (None: no flag)."""
    if not items:
        return None
    options = StorageOptions()
    for item in items:
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals:
            raise ConfigError(f"{FLAG} {item!r}: no '=' in it; give KEY=VALUE, e.g. {EXAMPLE}")
        if not key:
            # the value is not echoed: it may be a credential
            raise ConfigError(
                f"{FLAG} '=...': no KEY before the '='; give KEY=VALUE, e.g. {EXAMPLE}"
            )
        if key in options:
            raise ConfigError(f"{FLAG} {key}=...: given twice; give each option once")
        # a credential stays the string given (secret=12345 is not the number 12345)
        options[key] = value if is_secret(key) else _value(value)
    return options


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def storage_flags(options: Mapping[str, Any] | None) -> str:
    """The options as `` --storage-option KEY=VALUE`` flags, credentials left out."""
    flags = []
    for key, value in (options or {}).items():
        if is_secret(key) or masked(value) != value:  # a credential, or one nested in it
            continue
        kept = isinstance(value, str) and _value(value) == value  # reads back as given
        text = value if kept else json.dumps(value)
        flags.append(f" {FLAG} {shlex.quote(f'{key}={text}')}")
    return "".join(flags)


def hide_secrets(text: str, items: Sequence[str] | None) -> str:
    """``text`` with the value of every credential among the ``KEY=VALUE`` flags shown as
    ``'***'``: a message quoting a client's error must not show one either."""
    for item in items or []:
        key, _, value = item.partition("=")
        if value and (is_secret(key.strip()) or not key.strip()):
            text = text.replace(value, HIDDEN)
    return text

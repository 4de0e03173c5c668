"""Emulated nodes on one machine: Dask workers in network namespaces on rate-limited links.

Rehearse a cluster's network before you queue for one: each emulated node is a Linux
network namespace with its own address on a veth link to a bridge, the link's rate
capped in both directions by ``tc``'s token bucket (``tbf``), and one Dask worker (with
its nanny) started inside it. The scheduler listens on the bridge, in the caller's
namespace, so the fit's driver reaches it as it would a remote one::

    from dataflow.tools.emulated_nodes import EmulatedNodes

    with EmulatedNodes(3, rate_mbit=1000) as nodes:      # three nodes, 1 Gbit/s links
        result = pipe.fit(epochs=5, client=nodes.address)
        nodes.set_link(1, up=False)                       # node 1 drops off the network

``decoy=True`` gives each namespace a second interface, brought up first, with an
address on another subnet that reaches nothing: software that picks "the first
interface" instead of the one its address is on (the failures HPC users hit with NCCL
and dask-jobqueue) then fails here. Needs root (or CAP_NET_ADMIN) and ``ip`` and
``tc`` (iproute2); :func:`unavailable` says why not where they are missing. Delays
(``netem``) are not used: not every kernel has them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dataflow.core.errors import ConfigError

STARTUP_S = 120  # for the scheduler and every worker to be up, on a loaded machine


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2's ip and tc"
    name = f"dfprobe{os.getpid()}"
    try:
        made = _ip("netns", "add", name, check=False)
    except OSError as exc:
        return f"ip netns add failed: {exc}"
    if made.returncode != 0:
        return f"ip netns add failed (root or CAP_NET_ADMIN needed): {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class EmulatedNodes:
    """``n`` namespaces, each one node with one Dask worker of one thread.

    ``rate_mbit``: every link's rate in Mbit/s, each direction (None: uncapped).
    ``worker_ttl_s``: how long the scheduler waits for a silent worker before it drops
    it (a node whose link went down sends no reset; Dask's default is minutes; a fit's
    driver probes its own workers sooner).
    ``address``: the scheduler's, for ``fit(client=...)`` or ``distributed.Client``;
    ``node_addresses``: each node's IP. ``set_link`` and ``set_rate`` change a node's
    link while a fit runs."""

    def __init__(
        self,
        n: int,
        *,
        rate_mbit: float | None = None,
        decoy: bool = False,
        worker_ttl_s: float | None = None,
    ) -> None:
        if n < 1:
            raise ConfigError(f"EmulatedNodes(n={n}): give at least one node")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ConfigError(f"EmulatedNodes(rate_mbit={rate_mbit}): give a rate > 0 Mbit/s")
        self.n, self.rate_mbit, self.decoy = n, rate_mbit, decoy
        self.worker_ttl_s = worker_ttl_s
        serial = next(_SERIALS)  # several instances in one process must not collide
        tag = _tag(os.getpid(), serial)  # interface names are at most 15 characters
        self._bridge = f"dfb{tag}"
        self._namespaces = [f"dataflow-{os.getpid()}-{serial}-{i}" for i in range(n)]
        self._host_ends = [f"dfv{tag}n{i}" for i in range(n)]
        self._tag = tag
        octet = 16 + int(tag) % 200  # a /24 of 10.77.0.0/16 each: concurrent runs differ
        self._subnet = f"10.77.{octet}"
        self.scheduler_ip = f"{self._subnet}.1"
        self.node_addresses = [f"{self._subnet}.{i + 2}" for i in range(n)]
        self._processes: list[subprocess.Popen] = []
        self._folder = Path(tempfile.mkdtemp(prefix="dataflow-nodes-"))
        self.address: str | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> EmulatedNodes:
        reason = unavailable()
        if reason is not None:
            raise ConfigError(f"EmulatedNodes: network namespaces cannot be made here: {reason}")
        remove_stale()
        try:
            self._make_network()
            self._start_dask()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for process in self._processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the nanny and its worker
        for process in self._processes:
            with contextlib.suppress(Exception):
                process.wait(timeout=10)
        self._processes = []
        for name in self._namespaces:
            _ip("netns", "del", name, check=False)
        for name in self._host_ends:
            _ip("link", "del", name, check=False)
        _ip("link", "del", self._bridge, check=False)
        shutil.rmtree(self._folder, ignore_errors=True)

    # -- links ----------------------------------------------------------------------------
    def set_link(self, node: int, *, up: bool) -> None:
        """Bring node ``node``'s link down (it drops off the network) or up again."""
        _ip("link", "set", self._host_ends[node], "up" if up else "down")

    def set_rate(self, node: int, rate_mbit: float | None) -> None:
        """Cap node ``node``'s link at ``rate_mbit`` each way (None: uncapped)."""
        for where, device in ((None, self._host_ends[node]), (self._namespaces[node], "eth0")):
            prefix = ["ip", "netns", "exec", where] if where else []
            subprocess.run(
                [*prefix, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True
            )
            if rate_mbit is not None:
                subprocess.run(
                    [*prefix, "tc", "qdisc", "add", "dev", device, "root", *_tbf(rate_mbit)],
                    check=True,
                    capture_output=True,
                )

    # -- inside ---------------------------------------------------------------------------
    def _make_network(self) -> None:
        _ip("link", "add", self._bridge, "type", "bridge")
        _ip("addr", "add", f"{self.scheduler_ip}/24", "dev", self._bridge)
        _ip("link", "set", self._bridge, "up")
        for i, (name, host_end) in enumerate(zip(self._namespaces, self._host_ends, strict=True)):
            _ip("netns", "add", name)
            run = ("netns", "exec", name, "ip")
            if self.decoy:  # first in the namespace's list, on a subnet that reaches nothing
                # (a veth pair whose other end stays in the namespace: every kernel that
                # runs this has veth, not every one has the dummy device)
                _ip(*run, "link", "add", "decoy0", "type", "veth", "peer", "name", "decoy1")
                _ip(*run, "addr", "add", f"10.78.{i}.2/24", "dev", "decoy0")
                _ip(*run, "link", "set", "decoy0", "up")
                _ip(*run, "link", "set", "decoy1", "up")
            inside = f"dfi{self._tag}n{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", name)
            _ip("link", "set", host_end, "master", self._bridge)
            _ip("link", "set", host_end, "up")
            _ip(*run, "link", "set", inside, "name", "eth0")
            _ip(*run, "addr", "add", f"{self.node_addresses[i]}/24", "dev", "eth0")
            _ip(*run, "link", "set", "eth0", "up")
            _ip(*run, "link", "set", "lo", "up")
            if self.rate_mbit is not None:
                self.set_rate(i, self.rate_mbit)

    def _start_dask(self) -> None:
        scheduler_file = self._folder / "scheduler.json"
        python = sys.executable
        self._processes.append(
            self._spawn(
                [
                    python, "-m", "distributed.cli.dask_scheduler",
                    "--host", self.scheduler_ip, "--port", "0", "--no-dashboard",
                    "--scheduler-file", str(scheduler_file),
                ],
                "scheduler",
                ttl=self.worker_ttl_s,
            )
        )  # fmt: skip
        deadline = time.monotonic() + STARTUP_S
        while not scheduler_file.exists():
            self._check_alive(deadline, "the scheduler")
        self.address = json.loads(scheduler_file.read_text())["address"]
        for i, name in enumerate(self._namespaces):
            command = [
                "ip", "netns", "exec", name, python, "-m", "distributed.cli.dask_worker",
                self.address, "--host", self.node_addresses[i], "--nthreads", "1",
                "--nworkers", "1", "--no-dashboard", "--name", f"node{i}",
            ]  # fmt: skip
            self._processes.append(self._spawn(command, f"node{i}"))
        from distributed import Client

        with Client(self.address, timeout=STARTUP_S) as client:
            client.wait_for_workers(self.n, timeout=STARTUP_S)

    def _spawn(self, command: list[str], name: str, ttl: float | None = None) -> subprocess.Popen:
        # the workers import what this process can (as LocalCluster's spawned workers
        # do): a model class defined beside the script unpickles there too
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env = {**os.environ, "PYTHONPATH": path}
        if ttl is not None:
            env["DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL"] = f"{ttl}s"
        with open(self._folder / f"{name}.log", "w") as log:  # the child keeps its copy
            return subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )

    def _check_alive(self, deadline: float, what: str) -> None:
        for process in self._processes:
            if process.poll() is not None:
                raise ConfigError(f"EmulatedNodes: {what} exited: {self.log_tail()}")
        if time.monotonic() > deadline:
            raise ConfigError(f"EmulatedNodes: {what} not up after {STARTUP_S} s")
        time.sleep(0.1)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of every process's log (for a failure message)."""
        parts = []
        for path in sorted(self._folder.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)


def remove_stale() -> list[str]:
    """Remove the namespaces, links and processes of earlier runs whose process is gone
    (killed before it could clean up). Returns the namespaces removed."""
    listed = _ip("netns", "list", check=False).stdout.split()
    removed = []
    for name in listed:
        match = re.fullmatch(r"dataflow-(\d+)-(\d+)-\d+", name)
        if match is None or _alive(int(match.group(1))):
            continue
        for pid in _ip("netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", name, check=False)
        tag = _tag(int(match.group(1)), int(match.group(2)))
        links = _ip("-o", "link", check=False).stdout
        for link in re.findall(rf"\d+: (df[vb]{tag}(?:n\d+)?)[@:]", links):
            _ip("link", "del", link, check=False)
        removed.append(name)
    return removed


_SERIALS = itertools.count()


def _tag(pid: int, serial: int) -> str:
    """Five digits naming one instance's interfaces: the process and its instance."""
    return f"{pid % 10000:04d}{serial % 10}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tbf(rate_mbit: float) -> list[str]:
    """A token bucket at ``rate_mbit``: a burst of 1 ms at that rate (at least 32 KB,
    which a 1500-byte MTU needs at low rates), packets waiting at most 50 ms."""
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 1000))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"]

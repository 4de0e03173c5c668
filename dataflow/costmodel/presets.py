"""Cost models from published hardware constants, each constant with its source.

:data:`INTERCONNECTS` (a hop's latency: NCCL's own tuning constants, NVIDIA/nccl v2.30.7-1
``src/graph/tuning.cc`` hwLatencies Ring/Simple; its bus bandwidth: nccl-tests ``busbw``
per GPU for NVLink/PCIe and per NIC for networks, or NCCL's ``src/graph/topo.h`` model),
:data:`DEVICES` (a GPU's training throughput by network at a stated batch and precision,
and its usual node) and :data:`NETWORKS` (parameters, the bytes a step allreduces).
:func:`model` joins them into a :class:`CostModel`, :func:`cluster` builds a
:class:`Topology`, :func:`names` lists every preset; an unknown name raises
:class:`ConfigError` naming the valid ones. Pure: no torch, no Dask.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from dataflow.core.errors import ConfigError
from dataflow.costmodel.collective import Link, Topology
from dataflow.costmodel.compute import ComputeFit
from dataflow.costmodel.model import MIB, CostModel

US = 1e-6
GB = 1e9  # nccl-tests and NCCL's tuner report GB/s as 1e9 bytes/s

NCCL = "NVIDIA/nccl v2.30.7-1 src/graph/tuning.cc"
NCCL_TOPO = "NVIDIA/nccl v2.30.7-1 src/graph/topo.h"

# NCCL's hwLatencies[hw][Ring][Simple] in microseconds (v2.30.7-1 tuning.cc): the latency of
# one ring step over NVLink, PCIe and the network. (Tree/Simple: 4.0, 4.0 and 14 us; the
# per-collective baseLatencies Ring/Simple is 8.4 us, which the α-β model leaves out.)
NVLINK_LATENCY_S = 3.4 * US
PCI_LATENCY_S = 5.7 * US
NET_LATENCY_S = 14.0 * US

# The share of an Ethernet NIC's line rate a ring allreduce gets: NCCL models a 100 Gbit/s
# NIC at NET_BW = 12.0 GB/s of its 12.5 (topo.h), and NVIDIA quotes 24 GB/s per 200G NIC
# (NVIDIA/nccl-tests#119) and 12 GB/s per 100G NIC (nccl-tests#29): 0.96.
NIC_EFFICIENCY = 12.0 / 12.5


def _nic(gbit: float) -> float:
    return gbit / 8 * NIC_EFFICIENCY * GB


def _link(name: str, latency_s: float, bandwidth: float, source: str) -> Link:
    return Link(latency_s=latency_s, bandwidth=bandwidth, name=name, source=source)


_NVL_LAT = f"latency: {NCCL} hwLatencies[NVLINK][Ring][Simple] = 3.4 us"
_PCI_LAT = f"latency: {NCCL} hwLatencies[PCI][Ring][Simple] = 5.7 us"
_NET_LAT = f"latency: {NCCL} hwLatencies[NET][Ring][Simple] = 14.0 us"

INTERCONNECTS: Mapping[str, Link] = MappingProxyType(
    {
        # -- inside a node: the bus bandwidth one GPU gets in an allreduce ---------------
        "nvlink-p100": _link(
            "NVLink 1 (P100 SXM2, hybrid cube mesh)",
            NVLINK_LATENCY_S,
            4 * 18.0 * GB,
            f"bandwidth: 4 NVLinks x SM60_NVLINK_BW = 18.0 GB/s ({NCCL_TOPO}); {_NVL_LAT}",
        ),
        "nvlink-v100": _link(
            "NVLink 2 (V100 SXM2, DGX-1)",
            NVLINK_LATENCY_S,
            6 * 20.0 * GB,
            f"bandwidth: 6 NVLinks x SM70_NVLINK_BW = 20.0 GB/s ({NCCL_TOPO}); {_NVL_LAT}",
        ),
        "nvlink-a100": _link(
            "NVLink 3 + NVSwitch (A100 SXM4, DGX A100)",
            NVLINK_LATENCY_S,
            200.0 * GB,
            "bandwidth: all_reduce_perf busbw ~200 GB/s on 8x A100 80GB NVLink "
            "(NVIDIA/nccl-tests#149; nccl-tests#178 reports 208); NCCL 2.8 tuning.cc capped "
            f"A100 busBw at 235 GB/s; {_NVL_LAT}",
        ),
        "nvlink-h100": _link(
            "NVLink 4 + NVSwitch (H100 SXM5, DGX H100)",
            NVLINK_LATENCY_S,
            370.0 * GB,
            "bandwidth: 'NCCL can get an effective NVLink bandwidth of 370GB/s' with rings "
            "(S. Jeaugey, NVIDIA/nccl-tests#212; = 18 links x SM90_NVLINK_BW 20.6 GB/s in "
            f"{NCCL_TOPO}; NVLink SHARP reaches ~480 GB/s busbw, not modelled); {_NVL_LAT}",
        ),
        "pcie3": _link(
            "PCIe Gen3 x16",
            PCI_LATENCY_S,
            12.0 * GB,
            f"bandwidth: PCI_BW = 12.0 GB/s, PCI Gen3 x16 ({NCCL_TOPO}); {_PCI_LAT}",
        ),
        # -- between nodes: per NIC (cluster(nics=...) multiplies) -----------------------
        "ib-edr": _link(
            "InfiniBand EDR 100 Gb/s",
            NET_LATENCY_S,
            12.0 * GB,
            "bandwidth: 12 GB/s per 100G NIC (NVIDIA/nccl-tests#29: '12.2 GB/s (for a 100Gbps "
            f"card) is as good as you can get'; nccl-tests#119; NET_BW in {NCCL_TOPO}); "
            f"{_NET_LAT}",
        ),
        "ib-hdr": _link(
            "InfiniBand HDR 200 Gb/s",
            NET_LATENCY_S,
            24.0 * GB,
            "bandwidth: 'we usually consider 24GB/s is the peak performance per 200G NIC' "
            f"(S. Jeaugey, NVIDIA/nccl-tests#119); {_NET_LAT}",
        ),
        "ib-ndr": _link(
            "InfiniBand NDR 400 Gb/s",
            NET_LATENCY_S,
            48.0 * GB,
            "bandwidth: 'CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s per "
            f"NIC' (NVIDIA/nccl-tests#267); {_NET_LAT}",
        ),
        "eth-25g": _link(
            "25 GbE (RoCE)",
            NET_LATENCY_S,
            _nic(25),
            f"bandwidth: 25 Gbit/s x {NIC_EFFICIENCY:.2f} (NET_BW 12.0 of 12.5 GB/s for "
            f"100 Gbit, {NCCL_TOPO}); {_NET_LAT} (RDMA; TCP sockets are slower)",
        ),
        "eth-50g": _link(
            "50 GbE",
            NET_LATENCY_S,
            _nic(50),
            f"bandwidth: 50 Gbit/s x {NIC_EFFICIENCY:.2f} (as eth-25g); {_NET_LAT} "
            "(RDMA; TCP sockets are slower)",
        ),
        "eth-100g": _link(
            "100 GbE (RoCE)",
            NET_LATENCY_S,
            _nic(100),
            f"bandwidth: NET_BW = 12.0 GB/s for 100 Gbit ({NCCL_TOPO}); {_NET_LAT}",
        ),
    }
)


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """One GPU training one network: ``samples_per_second`` at local ``batch``."""

    samples_per_second: float
    batch: int
    precision: str
    source: str


@dataclass(frozen=True, kw_only=True)
class Device:
    """A GPU, its published training throughputs by network name, and the node it usually
    sits in (``per_node`` GPUs joined by ``intra``, ``nics`` NICs of ``inter``)."""

    name: str
    description: str
    throughput: Mapping[str, Throughput]
    per_node: int
    intra: str
    inter: str
    nics: int
    source: str = ""

    def rate(self, network: str, precision: str | None = None) -> Throughput:
        """The throughput for ``network`` (at ``precision``, or the first listed)."""
        found = [
            t
            for key, t in self.throughput.items()
            if key.split("@")[0] == network and precision in (None, t.precision)
        ]
        if not found:
            have = sorted({f"{k.split('@')[0]}@{t.precision}" for k, t in self.throughput.items()})
            raise ConfigError(
                f"device {self.name!r} has no published throughput for network={network!r}"
                f"{'' if precision is None else f' at precision={precision!r}'}; it has {have}"
            )
        return found[0]


_DLE = "NVIDIA/DeepLearningExamples PyTorch/Classification/ConvNets/resnet50v1.5/README.md"
_BATCH = "batch from ConvNets/configs.yml"
_HOROVOD = (
    "uber/horovod README.md (2017): 'Baseline single-GPU (batch size=64)' on the servers "
    "with 4 Pascal GPUs and RoCE-capable 25 Gbit/s network"
)
_GOYAL = (
    "Goyal et al. 2017 (arXiv:1706.02677) sec. 4: backprop of 32 images 'on a single P100 "
    "takes 120 ms'; step = 120 ms / backward fraction 2/3 (the model's default) = 180 ms"
)
_LAMBDA = (
    "derived (no per-GPU table found): A100 mixed precision 2470 img/s ({dle}) x 2, the "
    "H100/A100 speed-up for vision models in lambdalabs.com/blog/"
    "nvidia-h100-gpu-deep-learning-performance-analysis ('vision-based models (~2x)')"
)


def _rate(samples_per_second: float, batch: int, precision: str, source: str) -> Throughput:
    return Throughput(
        samples_per_second=samples_per_second, batch=batch, precision=precision, source=source
    )


DEVICES: Mapping[str, Device] = MappingProxyType(
    {
        "p100": Device(
            name="p100",
            description="Tesla P100 (Big Basin / DGX-1P: 8 per node, NVLink, one 50 GbE NIC)",
            throughput={
                "resnet50": _rate(32 / 0.180, 32, "fp32", _GOYAL),
                "resnet101": _rate(119.4, 64, "fp32", _HOROVOD),
                "inception_v3": _rate(134.4, 64, "fp32", _HOROVOD),
            },
            per_node=8,
            intra="nvlink-p100",
            inter="eth-50g",
            nics=1,
            source="Goyal et al. 2017 sec. 5: Big Basin, 8 P100 with NVLink, ConnectX-4 50 GbE",
        ),
        "v100": Device(
            name="v100",
            description="Tesla V100 16GB (DGX-1V: 8 per node, NVLink 2, 4 EDR NICs)",
            throughput={
                "resnet50": _rate(367.0, 112, "fp32", f"{_DLE}: DGX-1 16GB FP32; {_BATCH}"),
                "resnet50@amp": _rate(1200.0, 256, "amp", f"{_DLE}: DGX-1 16GB AMP; {_BATCH}"),
            },
            per_node=8,
            intra="nvlink-v100",
            inter="ib-edr",
            nics=4,
            source="DGX-1: 4 IB adapters, '47 GB/s on DGX-1 nodes' (NVIDIA/nccl#307)",
        ),
        "a100": Device(
            name="a100",
            description="A100 80GB SXM4 (DGX A100: 8 per node, NVSwitch, 8 HDR NICs)",
            throughput={
                "resnet50": _rate(938.0, 256, "tf32", f"{_DLE}: DGX A100 80GB TF32; {_BATCH}"),
                "resnet50@amp": _rate(2470.0, 256, "amp", f"{_DLE}: DGX A100 80GB AMP; {_BATCH}"),
            },
            per_node=8,
            intra="nvlink-a100",
            inter="ib-hdr",
            nics=8,
            source="DGX A100: 8 ConnectX-6 HDR compute NICs, one per GPU",
        ),
        "h100": Device(
            name="h100",
            description="H100 80GB SXM5 (DGX H100: 8 per node, NVSwitch, 8 NDR NICs)",
            throughput={"resnet50@amp": _rate(2 * 2470.0, 256, "amp", _LAMBDA.format(dle=_DLE))},
            per_node=8,
            intra="nvlink-h100",
            inter="ib-ndr",
            nics=8,
            source="DGX H100: 8 ConnectX-7 NDR 400 Gb/s compute NICs, one per GPU",
        ),
    }
)


@dataclass(frozen=True, kw_only=True)
class Network:
    """A CNN's trainable parameters (what each step allreduces)."""

    parameters: int
    source: str


NETWORKS: Mapping[str, Network] = MappingProxyType(
    {
        "resnet50": Network(
            parameters=25_557_032,
            source="pytorch/vision torchvision/models/resnet.py ResNet50_Weights: "
            "num_params 25557032",
        ),
        "resnet101": Network(
            parameters=44_549_160,
            source="pytorch/vision torchvision/models/resnet.py ResNet101_Weights: "
            "num_params 44549160",
        ),
        "inception_v3": Network(
            parameters=23_851_784,
            source="Keras Applications table: InceptionV3 23,851,784 parameters (no "
            "auxiliary head, as tf_cnn_benchmarks trains it)",
        ),
    }
)

GRADIENT_BYTES = MappingProxyType({"fp32": 4, "fp16": 2})


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A named configuration :func:`model` builds: a network on a device's node."""

    network: str
    device: str
    precision: str | None = None
    intra: str | None = None
    inter: str | None = None
    per_node: int | None = None
    nics: int | None = None
    algorithm: str = "best"
    bucket_bytes: int = 25 * MIB
    gradients: str = "fp32"
    batch: int | None = None
    description: str = ""


_HOROVOD_NODE = dict(per_node=4, intra="pcie3", inter="eth-25g", algorithm="ring")

MODELS: Mapping[str, Preset] = MappingProxyType(
    {
        "resnet50-h100-ndr": Preset(
            network="resnet50", device="h100", description="ResNet-50, AMP, DGX H100, 8x NDR"
        ),
        "resnet50-a100-hdr": Preset(
            network="resnet50",
            device="a100",
            precision="amp",
            description="ResNet-50, AMP, DGX A100, 8x HDR",
        ),
        "resnet50-v100-edr": Preset(
            network="resnet50",
            device="v100",
            precision="fp32",
            description="ResNet-50, FP32, DGX-1V, 4x EDR",
        ),
        "resnet50-p100-50gbe": Preset(
            network="resnet50",
            device="p100",
            algorithm="two_level",
            description="Goyal et al. 2017: ResNet-50, Big Basin (8 P100, NVLink), 50 GbE",
        ),
        "resnet101-p100-25gbe": Preset(
            network="resnet101",
            device="p100",
            bucket_bytes=64 * MIB,  # HOROVOD_FUSION_THRESHOLD's default
            description="Horovod 2018: ResNet-101, 4 Pascal GPUs per server, 25 GbE RoCE",
            **_HOROVOD_NODE,
        ),
        "inception_v3-p100-25gbe": Preset(
            network="inception_v3",
            device="p100",
            bucket_bytes=64 * MIB,
            description="Horovod 2018: Inception V3, 4 Pascal GPUs per server, 25 GbE RoCE",
            **_HOROVOD_NODE,
        ),
    }
)


def names() -> dict[str, list[str]]:
    """Every preset name, by kind: models, devices, interconnects, networks."""
    return {
        "models": sorted(MODELS),
        "devices": sorted(DEVICES),
        "interconnects": sorted(INTERCONNECTS),
        "networks": sorted(NETWORKS),
    }


def _lookup(kind: str, name: str, table: Mapping[str, Any]) -> Any:
    if isinstance(name, str) and name in table:
        return table[name]
    valid = sorted(table)
    close = difflib.get_close_matches(str(name), valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"unknown {kind} preset {name!r}{hint}; valid names: {', '.join(valid)}")


def interconnect(name: str) -> Link:
    """The :class:`Link` of a named interconnect (per GPU inside a node, per NIC between)."""
    return _lookup("interconnect", name, INTERCONNECTS)


def device(name: str) -> Device:
    return _lookup("device", name, DEVICES)


def network(name: str) -> Network:
    return _lookup("network", name, NETWORKS)


def cluster(
    *,
    device: str | None = None,
    intra: str | None = None,
    inter: str | None = None,
    per_node: int | None = None,
    nics: int | None = None,
    algorithm: str = "best",
) -> Topology:
    """A :class:`Topology`: ``per_node`` GPUs joined by ``intra``, nodes joined by ``nics``
    NICs of ``inter`` (the node's network bandwidth is their sum). Unset fields come from
    ``device``'s usual node."""
    node = _lookup("device", device, DEVICES) if device is not None else None
    intra = intra or (node.intra if node else None)
    inter = inter or (node.inter if node else None)
    per_node = per_node or (node.per_node if node else 1)
    nics = nics or (node.nics if node else 1)
    if intra is None:
        raise ConfigError("cluster(): give device= or intra= (an interconnect preset name)")
    if isinstance(nics, bool) or not isinstance(nics, int) or nics < 1:
        raise ConfigError(f"cluster(nics={nics!r}): an int >= 1")
    inside = interconnect(intra)
    between = None
    if inter is not None:
        nic = interconnect(inter)
        between = Link(
            latency_s=nic.latency_s,
            bandwidth=nic.bandwidth * nics,
            name=f"{nics} x {nic.name}",
            source=f"{nics} NIC(s); {nic.source}",
        )
    return Topology(intra=inside, inter=between, per_node=per_node, algorithm=algorithm)


def model(name: str, **overrides: Any) -> CostModel:
    """The :class:`CostModel` of a named preset (see :func:`names`). ``overrides``
    replace the preset's fields (``precision``, ``intra``, ``inter``, ``per_node``,
    ``nics``, ``algorithm``, ``bucket_bytes``, ``gradients`` "fp32"/"fp16", ``batch``)."""
    preset = _lookup("model", name, MODELS)
    unknown = set(overrides) - set(Preset.__dataclass_fields__) - {"network", "device"}
    if unknown:
        raise ConfigError(
            f"model({name!r}): unknown override(s) {sorted(unknown)}; use "
            f"{sorted(set(Preset.__dataclass_fields__) - {'description'})}"
        )
    spec = {**preset.__dict__, **overrides}
    return build(**{k: v for k, v in spec.items() if k != "description"}, name=name)


def build(
    *,
    network: str,
    device: str,
    precision: str | None = None,
    intra: str | None = None,
    inter: str | None = None,
    per_node: int | None = None,
    nics: int | None = None,
    algorithm: str = "best",
    bucket_bytes: int = 25 * MIB,
    gradients: str = "fp32",
    batch: int | None = None,
    name: str = "",
) -> CostModel:
    """A :class:`CostModel` for ``network`` on ``device`` from the tables' constants."""
    gpu = _lookup("device", device, DEVICES)
    net = _lookup("network", network, NETWORKS)
    rate = gpu.rate(network, precision)
    if gradients not in GRADIENT_BYTES:
        raise ConfigError(f"gradients={gradients!r}: use one of {sorted(GRADIENT_BYTES)}")
    topology = cluster(
        device=device,
        intra=intra,
        inter=inter,
        per_node=per_node,
        nics=nics,
        algorithm=algorithm,
    )
    compute = ComputeFit.from_throughput(
        rate.samples_per_second, batch=rate.batch, source=rate.source
    )
    local = batch or rate.batch
    notes = {
        "compute": f"{rate.samples_per_second:.1f} samples/s at batch {rate.batch}, "
        f"{rate.precision}: {rate.source}",
        "gradient_bytes": f"{net.parameters} parameters x {GRADIENT_BYTES[gradients]} bytes "
        f"({gradients}): {net.source}",
        "intra": f"{topology.intra.name}: {topology.intra.source}",
        "inter": "none"
        if topology.inter is None
        else f"{topology.inter.name}: {topology.inter.source}",
        "node": f"{topology.per_node} GPUs per node: {gpu.source}",
        "local_batch": str(local),
        "overhead": "0: published systems' per-step overheads are not in the presets",
    }
    return CostModel(
        compute=compute,
        gradient_bytes=net.parameters * GRADIENT_BYTES[gradients],
        topology=topology,
        bucket_bytes=int(bucket_bytes),
        name=name or f"{network}-{device}",
        notes=notes,
    )


def sources() -> list[tuple[str, str, str]]:
    """(kind, name, source) of every constant in the tables (for docs and tests)."""
    rows: list[tuple[str, str, str]] = []
    rows += [("interconnect", k, v.source) for k, v in INTERCONNECTS.items()]
    for key, dev in DEVICES.items():
        rows.append(("node", key, dev.source))
        rows += [("throughput", f"{key}/{n}", t.source) for n, t in dev.throughput.items()]
    rows += [("network", k, v.source) for k, v in NETWORKS.items()]
    return rows

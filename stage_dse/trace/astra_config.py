"""ASTRA-sim input files for a trace set, generated from the row's cluster and hardware presets.

What lives here: :func:`astra_config` (the network, system and remote-memory settings of one
set for one analytical backend, with notes on what the simulator will model differently) and
:func:`write_astra_config` (``network.yml``, ``system.json``, ``memory.json``). Running the
simulator and reading its output is :mod:`stage_dse.trace.simulate`.

How the presets map (facts from ASTRA-sim's analytical backend source, astra-sim 518bd51 with
astra-network-analytical 599a047, and measured on a build of it):

* One network dimension per tier: ``Switch(gpus_per_node)`` for the NVLink domain and
  ``Switch(ranks / gpus_per_node)`` for the scale-out, so rank ``r`` sits at local index
  ``r % gpus_per_node`` of node ``r // gpus_per_node``, as the cost model places ranks. A set
  inside one domain is one ``Switch(ranks)`` dimension (ASTRA-sim takes no dimension of 1).
* Bandwidth is the cost model's effective one, ``bandwidth x efficiency`` per GPU and
  direction (scale-out divided by ``oversubscription`` when the set spans more than
  ``pod_gpus``), written in the simulator's "GB/s", which are GiB/s (2^30 bytes per second,
  ``bw_GBps_to_Bpns``). Latency is in ns. A switch message crosses two links: the
  congestion-unaware backend charges ``2 x latency`` per message, so each dimension's latency
  is half the cost model's per-step latency; the congestion-aware backend also serializes the
  message on both links (store and forward), so its link bandwidth is twice the GPU's, which
  makes one uncontended message take what the cost model charges a ring step.
* All-to-all is ``direct1``: one message in flight per rank to each peer in turn, ``n - 1``
  steps of ``size / n`` bytes, the cost model's ``(n - 1) / n x size / bandwidth``; ring
  all-to-all would take ``n (n - 1) / 2`` steps. Other collectives are rings. A communicator
  smaller than the world on a network of two dimensions is forced to one ring by the
  simulator (``CommunicatorGroup::get_collective_plan``), all-to-all included: noted.
* The congestion-aware backend takes one dimension only: a set spanning several domains is
  one switch at the scale-out bandwidth, noted.
* ``roofline-enabled`` is 0 by default: COMP nodes take the trace's ``duration_micros`` (the
  cost model's per-op times), so the ratio isolates the network. ``compute="roofline"`` times
  them from ``num_ops`` / ``tensor_size`` at ``peak-perf`` (TFLOPS, the preset's peak x GEMM
  efficiency x sustained clock) and ``local-mem-bw`` (GB/s of 10^9 bytes: HBM bandwidth x
  memory efficiency), always written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from stage_dse.errors import ConfigError
from stage_dse.spec import ClusterSpec, HardwareSpec

__all__ = [
    "ASTRA_BACKENDS",
    "AstraConfig",
    "NetworkDim",
    "astra_config",
    "mistimed_neighbours",
    "network_dims",
    "network_yaml",
    "write_astra_config",
]

ASTRA_BACKENDS = {
    "astra_unaware": "AstraSim_Analytical_Congestion_Unaware",
    "astra_aware": "AstraSim_Analytical_Congestion_Aware",
}
"""Backend name -> the binary's file name in the folder given by ``--astra-bin``."""
GIB = 2**30
COMPUTE_MODES = ("replay", "roofline")


@dataclass(frozen=True)
class NetworkDim:
    tier: str
    """``nvlink`` (the scale-up domain) or ``scale_out``."""
    npus: int
    bandwidth_bytes_per_s: float
    """Per GPU and direction, as the simulator's links carry it."""
    latency_s: float
    """Per link (a switch message crosses two)."""


@dataclass(frozen=True)
class AstraConfig:
    network: list[NetworkDim]
    system: dict
    memory: dict
    notes: list[str] = field(default_factory=list)
    """What the simulator models differently for this set (for the row's ``sim_reason``)."""


def _scale_out_bytes_per_s(cluster: ClusterSpec, ranks: int) -> float:
    bw = cluster.inter_bandwidth_bytes_per_s * cluster.inter_efficiency
    if cluster.pod_gpus and ranks > cluster.pod_gpus:
        bw /= cluster.oversubscription
    return bw


def network_dims(cluster: ClusterSpec, ranks: int, backend: str) -> list[NetworkDim]:
    """The dimensions of the network for ``ranks`` ranks on ``cluster`` (see module doc)."""
    if ranks < 2:
        raise ConfigError(f"a network simulator needs at least 2 ranks, the set has {ranks}")
    g = cluster.gpus_per_node
    intra = cluster.intra_bandwidth_bytes_per_s * cluster.intra_efficiency
    inter = _scale_out_bytes_per_s(cluster, ranks)
    if backend == "astra_aware":
        # one dimension; store and forward over the two links of the switch
        bw, lat = (
            (intra, cluster.intra_latency_s) if ranks <= g else (inter, cluster.inter_latency_s)
        )
        tier = "nvlink" if ranks <= g else "scale_out"
        return [NetworkDim(tier, ranks, 2 * bw, lat / 2)]
    if backend != "astra_unaware":
        raise ConfigError(f"backend {backend!r} is not one of: {', '.join(ASTRA_BACKENDS)}")
    if ranks <= g:
        return [NetworkDim("nvlink", ranks, intra, cluster.intra_latency_s / 2)]
    if ranks % g:
        raise ConfigError(
            f"{ranks} ranks are not whole nodes of gpus_per_node={g}: the simulator's network "
            "needs ranks = nodes x gpus_per_node"
        )
    return [
        NetworkDim("nvlink", g, intra, cluster.intra_latency_s / 2),
        NetworkDim("scale_out", ranks // g, inter, cluster.inter_latency_s / 2),
    ]


def network_yaml(dims: list[NetworkDim]) -> str:
    """``network.yml`` of the analytical backends (bandwidth in GiB/s, latency in ns)."""

    def row(values) -> str:
        return "[ " + ", ".join(values) + " ]"

    return (
        f"topology: {row('Switch' for _ in dims)}\n"
        f"npus_count: {row(str(d.npus) for d in dims)}\n"
        f"bandwidth: {row(f'{d.bandwidth_bytes_per_s / GIB:.6f}' for d in dims)}  # GiB/s\n"
        f"latency: {row(f'{d.latency_s * 1e9:.3f}' for d in dims)}  # ns\n"
    )


def mistimed_neighbours(groups: dict[int, list[int]], ranks: int, gpus_per_node: int) -> int:
    """Communicator groups smaller than the world whose ring has neighbours on different nodes
    at different local indices: the congestion-unaware backend times such a message on the
    first dimension where the two addresses differ, the NVLink one, although it crosses the
    scale-out network."""
    count = 0
    for members in groups.values():
        ms = sorted(members)
        if len(ms) < 2 or len(ms) == ranks:
            continue
        pairs = zip(ms, ms[1:] + ms[:1])
        if any(
            a // gpus_per_node != b // gpus_per_node and a % gpus_per_node != b % gpus_per_node
            for a, b in pairs
        ):
            count += 1
    return count


def astra_config(
    hardware: HardwareSpec,
    cluster: ClusterSpec,
    ranks: int,
    backend: str,
    compute: str = "replay",
    groups: dict[int, list[int]] | None = None,
) -> AstraConfig:
    """Network, system and memory settings of a set of ``ranks`` ranks (see module doc);
    ``groups`` (``comm_groups.json``) lets the notes name what the backend cannot place."""
    if compute not in COMPUTE_MODES:
        raise ConfigError(f"compute={compute!r} is not one of: {', '.join(COMPUTE_MODES)}")
    dims = network_dims(cluster, ranks, backend)
    per_dim = ["ring" for _ in dims]
    system = {
        "scheduling-policy": "FIFO",
        "endpoint-delay": 10,
        # one chunk per collective: phases of a hierarchical collective run one after the
        # other, as the cost model adds them
        "active-chunks-per-dimension": 1,
        "preferred-dataset-splits": 1,
        "all-reduce-implementation": per_dim,
        "all-gather-implementation": per_dim,
        "reduce-scatter-implementation": per_dim,
        "all-to-all-implementation": ["direct1" for _ in dims],
        # all-reduce as reduce-scatter up the dimensions and all-gather down them: the
        # scale-out moves 1/gpus_per_node of the buffer, as in the cost model's hierarchy
        "collective-optimization": "localBWAware",
        "local-mem-bw": hardware.hbm_bandwidth_bytes_per_s * hardware.memory_efficiency / 1e9,
        "peak-perf": hardware.peak_flops
        * hardware.gemm_efficiency
        * hardware.sustained_clock
        / 1e12,
        "roofline-enabled": int(compute == "roofline"),
        "boost-mode": 0,
    }
    notes = []
    g = cluster.gpus_per_node
    if backend == "astra_aware" and ranks > g:
        notes.append(
            f"one dimension (the congestion-aware backend takes no more): all {ranks} ranks on "
            "one switch at the scale-out bandwidth, NVLink traffic included"
        )
    if len(dims) > 1 and groups:
        spanning = sum(
            1 for ms in groups.values() if 1 < len(ms) < ranks and len({m // g for m in ms}) > 1
        )
        if spanning:
            notes.append(
                f"{spanning} communicator groups span nodes but not the world: each runs one "
                "flat ring over its members (all-to-all included), paced by its scale-out hops"
            )
        bad = mistimed_neighbours(groups, ranks, g)
        if bad:
            notes.append(
                f"{bad} groups have ring neighbours on different nodes at different local "
                "indices, timed at NVLink bandwidth (the backend's dimension rule)"
            )
    return AstraConfig(dims, system, {"memory-type": "NO_MEMORY_EXPANSION"}, notes)


def write_astra_config(config: AstraConfig, out: str | Path) -> dict[str, Path]:
    """``network.yml``, ``system.json`` and ``memory.json`` in ``out``; their paths by role."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "network": out / "network.yml",
        "system": out / "system.json",
        "memory": out / "memory.json",
    }
    paths["network"].write_text(network_yaml(config.network))
    paths["system"].write_text(json.dumps(config.system, indent=2) + "\n")
    paths["memory"].write_text(json.dumps(config.memory, indent=2) + "\n")
    return paths

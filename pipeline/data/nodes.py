"""Which node this process runs on, from the launcher's environment: what the node's cache must hold.

The order never depends on it (order.py); it decides what a node fetches: the shards of the
partitions its ranks take. Ranks are numbered node by node (rank = node x ranks per node + local
rank), as the deepspeed launcher, torchrun and srun's block distribution do.

    deepspeed launcher   CROSS_RANK, CROSS_SIZE, LOCAL_SIZE
    torchrun             GROUP_RANK, LOCAL_WORLD_SIZE (nodes = WORLD_SIZE / LOCAL_WORLD_SIZE)
    Slurm (srun)         SLURM_NODEID, SLURM_NNODES
    none of them         one node
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class NodePlace:
    node: int
    """This node's index, 0 <= node < nodes."""
    nodes: int
    """Nodes in the job."""
    source: str
    """Which launcher's variables said so: deepspeed, torchrun, slurm or single."""


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={environ[name]!r} is not an integer") from None


def node_place(environ: Mapping[str, str] | None = None) -> NodePlace:
    env = os.environ if environ is None else environ
    if "CROSS_RANK" in env and "CROSS_SIZE" in env:
        place = NodePlace(_int(env, "CROSS_RANK"), _int(env, "CROSS_SIZE"), "deepspeed")
    elif "GROUP_RANK" in env and "LOCAL_WORLD_SIZE" in env and "WORLD_SIZE" in env:
        place = NodePlace(_int(env, "GROUP_RANK"), max(1, _int(env, "WORLD_SIZE") // _int(env, "LOCAL_WORLD_SIZE")),
                          "torchrun")
    elif "SLURM_NODEID" in env and ("SLURM_NNODES" in env or "SLURM_JOB_NUM_NODES" in env):
        nodes = _int(env, "SLURM_NNODES" if "SLURM_NNODES" in env else "SLURM_JOB_NUM_NODES")
        place = NodePlace(_int(env, "SLURM_NODEID"), nodes, "slurm")
    else:
        return NodePlace(0, 1, "single")
    if not 0 <= place.node < place.nodes:
        raise ValueError(f"node index {place.node} outside the job's {place.nodes} nodes ({place.source} "
                         f"environment variables)")
    return place

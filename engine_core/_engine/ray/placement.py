"""Where a Ray deployment's engines go, decided without Ray: the bundle each engine asks for,
the node label selector that realises the strategy across engines, and the message of a
placement that timed out. ``ray.launch`` applies them.

Each engine has a placement group of its own with one bundle (``{"CPU": 1, "GPU": g}``), so its
devices sit on one node and tensor parallelism never spans nodes. A placement group's strategy
only orders the bundles of that group, so the strategy *across* engines is a label selector on
the node id (``ray.io/node-id``), computed from the nodes' resources and where the deployment's
other engines are:

- ``STRICT_SPREAD``: any node but those holding another engine (``!in(...)``);
- ``SPREAD``: among the nodes that can hold one more engine, those holding the fewest;
- ``PACK``: among them, those holding the most.

``SPREAD`` and ``PACK`` count only this deployment's engines against a node's total resources;
when no node can hold another engine, the group is left to Ray (and times out if it never fits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = [
    "NODE_ID_LABEL",
    "NodeView",
    "PlacementError",
    "engine_bundle",
    "label_selector",
    "placement_error_message",
]

NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node: its id (hex)."""

_SHOWN = ("CPU", "GPU")
"""Resources every placement message shows, beside those the bundle asks for."""


class PlacementError(TimeoutError):
    """The engines' placement groups could not be placed within ``placement_timeout_s``."""


class NodeView(NamedTuple):
    """A live Ray node: its id and its total resources."""

    node_id: str
    total: Mapping[str, float]


def engine_bundle(gpus: int) -> dict[str, float]:
    """One engine's bundle: a CPU for its process and its ``gpus`` devices."""
    bundle = {"CPU": 1.0}
    if gpus:
        bundle["GPU"] = float(gpus)
    return bundle


def _has_room(node: NodeView, bundle: Mapping[str, float], engines: int) -> bool:
    return all(node.total.get(name, 0.0) - engines * need >= need for name, need in bundle.items())


def label_selector(
    strategy: str,
    bundle: Mapping[str, float],
    nodes: Sequence[NodeView],
    engines_on: Mapping[str, int],
) -> dict[str, str]:
    """The label selector of the next engine's bundle (empty: any node), given the live
    ``nodes`` and how many of the deployment's other engines each node holds."""
    if strategy == "STRICT_SPREAD":
        used = sorted(node for node, count in engines_on.items() if count)
        return {NODE_ID_LABEL: f"!in({','.join(used)})"} if used else {}
    if strategy not in ("SPREAD", "PACK"):
        raise ValueError(f"unknown placement strategy {strategy!r}")
    counts = {
        node.node_id: engines_on.get(node.node_id, 0)
        for node in nodes
        if _has_room(node, bundle, engines_on.get(node.node_id, 0))
    }
    if not counts:
        return {}
    target = min(counts.values()) if strategy == "SPREAD" else max(counts.values())
    chosen = sorted(node for node, count in counts.items() if count == target)
    if len(chosen) == len(nodes):
        return {}
    return {NODE_ID_LABEL: f"in({','.join(chosen)})"}


def _show(resources: Mapping[str, float], names: Sequence[str]) -> str:
    return "{" + ", ".join(f"{name}: {resources.get(name, 0.0):g}" for name in names) + "}"


def placement_error_message(
    *,
    rank: int,
    num_engines: int,
    bundle: Mapping[str, float],
    strategy: str,
    timeout_s: float,
    num_nodes: int,
    total: Mapping[str, float],
    available: Mapping[str, float],
    engines_placed: int,
) -> str:
    """Why engine ``rank`` could not be placed: what was asked, what the cluster has, what is
    missing."""
    names = list(dict.fromkeys([*_SHOWN, *bundle]))
    missing = [
        f"{name} (needs {need:g}, {available.get(name, 0.0):g} available)"
        for name, need in bundle.items()
        if available.get(name, 0.0) < need
    ]
    if missing:
        why = "missing: " + ", ".join(missing)
    elif strategy == "STRICT_SPREAD":
        why = "missing: a node that holds no other engine of this deployment (STRICT_SPREAD)"
    else:
        why = (
            "missing: one node with all of the bundle free in time (free resources may be "
            "spread over several nodes, or placing took longer than placement_timeout_s)"
        )
    return (
        f"could not place data-parallel engine {rank} of {num_engines} within "
        f"placement_timeout_s ({timeout_s:g} s): each engine asks for one bundle "
        f"{_show(bundle, list(bundle))} (strategy {strategy}; {engines_placed} placed so far); "
        f"the cluster has {num_nodes} live node(s) with {_show(total, names)} in total and "
        f"{_show(available, names)} available; {why}"
    )

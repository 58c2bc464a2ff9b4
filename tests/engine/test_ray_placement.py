"""Where a Ray deployment's engines go (``ray.placement``), decided without Ray: the bundle, the
node label selector per strategy, the message of a placement that timed out; and what the Ray
backend says where Ray is not installed."""

from __future__ import annotations

import sys

import pytest

from engine_core._engine.ray.placement import (
    NODE_ID_LABEL,
    NodeView,
    engine_bundle,
    label_selector,
    placement_error_message,
)

NODES = [NodeView("a", {"CPU": 2.0}), NodeView("b", {"CPU": 2.0}), NodeView("c", {"CPU": 1.0})]
BUNDLE = engine_bundle(0)


def test_bundle_is_one_cpu_and_the_engines_gpus() -> None:
    assert engine_bundle(0) == {"CPU": 1.0}
    assert engine_bundle(4) == {"CPU": 1.0, "GPU": 4.0}


def test_strict_spread_excludes_every_node_holding_another_engine() -> None:
    assert label_selector("STRICT_SPREAD", BUNDLE, NODES, {}) == {}
    assert label_selector("STRICT_SPREAD", BUNDLE, NODES, {"b": 1, "a": 2, "c": 0}) == {
        NODE_ID_LABEL: "!in(a,b)"
    }


def test_spread_prefers_the_nodes_with_the_fewest_engines_that_have_room() -> None:
    # Nothing placed yet: every node qualifies, so no constraint.
    assert label_selector("SPREAD", BUNDLE, NODES, {}) == {}
    assert label_selector("SPREAD", BUNDLE, NODES, {"a": 1}) == {NODE_ID_LABEL: "in(b,c)"}
    # c is full (one CPU, one engine): b is the only node with fewer engines.
    assert label_selector("SPREAD", BUNDLE, NODES, {"a": 1, "c": 1}) == {NODE_ID_LABEL: "in(b)"}
    assert label_selector("SPREAD", BUNDLE, NODES, {"a": 1, "b": 1, "c": 1}) == {
        NODE_ID_LABEL: "in(a,b)"
    }


def test_pack_prefers_the_nodes_with_the_most_engines_that_have_room() -> None:
    assert label_selector("PACK", BUNDLE, NODES, {"a": 1}) == {NODE_ID_LABEL: "in(a)"}
    # a is full now: among the others, none holds an engine, so any of them.
    assert label_selector("PACK", BUNDLE, NODES, {"a": 2}) == {NODE_ID_LABEL: "in(b,c)"}


def test_no_node_with_room_leaves_the_group_to_ray() -> None:
    full = {"a": 2, "b": 2, "c": 1}
    assert label_selector("SPREAD", BUNDLE, NODES, full) == {}
    assert label_selector("PACK", BUNDLE, NODES, full) == {}
    # A GPU bundle fits no CPU-only node.
    assert label_selector("SPREAD", engine_bundle(1), NODES, {"a": 1}) == {}


def test_unknown_strategy() -> None:
    with pytest.raises(ValueError, match="unknown placement strategy 'STRICT_PACK'"):
        label_selector("STRICT_PACK", BUNDLE, NODES, {})


def test_placement_error_names_what_was_asked_what_the_cluster_has_and_what_is_missing() -> None:
    message = placement_error_message(
        rank=2,
        num_engines=3,
        bundle=engine_bundle(2),
        strategy="SPREAD",
        timeout_s=1.5,
        num_nodes=2,
        total={"CPU": 2.0, "GPU": 2.0, "memory": 1e9},
        available={"CPU": 0.0, "GPU": 1.0},
        engines_placed=2,
    )
    assert message == (
        "could not place data-parallel engine 2 of 3 within placement_timeout_s (1.5 s): each "
        "engine asks for one bundle {CPU: 1, GPU: 2} (strategy SPREAD; 2 placed so far); the "
        "cluster has 2 live node(s) with {CPU: 2, GPU: 2} in total and {CPU: 0, GPU: 1} "
        "available; missing: CPU (needs 1, 0 available), GPU (needs 2, 1 available)"
    )


def test_placement_error_when_the_resources_are_free_but_the_strategy_forbids_them() -> None:
    common = dict(
        rank=1,
        num_engines=2,
        bundle=BUNDLE,
        timeout_s=1.0,
        num_nodes=1,
        total={"CPU": 4.0},
        available={"CPU": 3.0},
        engines_placed=1,
    )
    strict = placement_error_message(strategy="STRICT_SPREAD", **common)  # type: ignore[arg-type]
    assert strict.endswith(
        "missing: a node that holds no other engine of this deployment (STRICT_SPREAD)"
    )
    spread = placement_error_message(strategy="SPREAD", **common)  # type: ignore[arg-type]
    assert spread.endswith(
        "missing: one node with all of the bundle free in time (free resources may be spread "
        "over several nodes, or placing took longer than placement_timeout_s)"
    )


def test_the_ray_backend_without_ray_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine_core import LLM

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as if not installed
    monkeypatch.delitem(sys.modules, "engine_core._engine.ray.launch", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'engine-core\[ray\]'"):
        LLM(backend="mock", multiprocess=True, data_parallel_size=2, data_parallel_backend="ray")

"""Data parallelism on a Ray cluster (``data_parallel_backend="ray"``, marker ``ray``): one local
two-node cluster (``ray.cluster_utils.Cluster``, one CPU per node) for the whole module.

Two engines on two nodes serve as one engine does; more engines than the cluster can place fail
within ``placement_timeout_s`` naming what is missing; the driver's sockets refuse peers without
the deployment's keys; removing a node is its engine's death (failover as usual) and a restart
places the engine on a node that joins later.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import pytest
import zmq

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'engine-core[ray]'")

from ray.cluster_utils import Cluster  # noqa: E402

from engine_core import LLM, AsyncLLM, RequestOutputKind, SamplingParams  # noqa: E402
from engine_core._engine.dp import failover  # noqa: E402
from engine_core._engine.dp.client import DPClient  # noqa: E402
from engine_core._engine.pipes.dial import DialSockets  # noqa: E402
from engine_core._engine.ray.placement import PlacementError  # noqa: E402
from engine_core._engine.wire import EngineDead  # noqa: E402

pytestmark = pytest.mark.ray

OBJECT_STORE_BYTES = 80 * 1024 * 1024
"""Each node's object store: the smallest Ray takes (the engines never use it)."""
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES}
PROMPTS = [f"prompt {i} " * (i % 3 + 1) for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
RAY = {"backend": "mock", "tokenizer": "byte", "data_parallel_backend": "ray"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head and one worker node, one CPU each; the driver (this process) joins it."""
    cluster = Cluster(
        initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False}
    )
    try:
        cluster.add_node(**NODE_ARGS)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _expected(prompts: list[str], params: SamplingParams) -> list[str]:
    with LLM(backend="mock", tokenizer="byte") as single:
        return [o.outputs[0].text for o in single.generate(prompts, params, use_tqdm=False)]


def _node_ids(cluster: Cluster) -> set[str]:
    return {n.node_id for n in cluster.list_all_nodes()}


def test_more_engines_than_the_cluster_can_place_fail_naming_what_is_missing(
    cluster: Cluster,
) -> None:
    started = time.monotonic()
    with pytest.raises(PlacementError) as caught:
        LLM(**RAY, multiprocess=True, data_parallel_size=3, placement_timeout_s=3.0)
    assert time.monotonic() - started < 15.0
    message = str(caught.value)
    assert "could not place data-parallel engine 2 of 3 within placement_timeout_s (3 s)" in message
    assert "each engine asks for one bundle {CPU: 1}" in message
    assert "the cluster has 2 live node(s) with {CPU: 2, GPU: 0} in total" in message
    assert message.endswith("missing: CPU (needs 1, 0 available)")
    # The groups of the engines that were placed are gone again.
    groups = ray.util.placement_group_table().values()
    assert all(group["state"] == "REMOVED" for group in groups)


@pytest.fixture(scope="class")
def llm(cluster: Cluster) -> Iterator[LLM]:
    """Two engines, one on each node, for the tests of one class."""
    with LLM(
        **RAY,
        multiprocess=True,
        data_parallel_size=2,
        ray_placement_strategy="STRICT_SPREAD",
        router="round_robin",
    ) as llm:
        yield llm


class TestTwoEnginesOnTwoNodes:
    """One deployment for the class (released before the node-loss tests need the CPUs)."""

    def test_they_serve_as_one_engine_does(self, cluster: Cluster, llm: LLM) -> None:
        client = llm._client
        assert isinstance(client, DPClient)
        nodes = [entry["node"] for entry in client.engine_status()]
        assert set(nodes) == _node_ids(cluster)  # one engine on each node
        before = [client.metrics.requests[e, "policy"] for e in (0, 1)]
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].text for o in outs] == _expected(PROMPTS, GREEDY)
        after = [client.metrics.requests[e, "policy"] for e in (0, 1)]
        assert [b - a for a, b in zip(before, after, strict=True)] == [4, 4]  # both served
        stats = llm.get_stats()
        assert (stats.num_engines, stats.num_engines_alive) == (2, 2)

    def test_peers_without_the_keys_are_refused(self, llm: LLM) -> None:
        client = llm._client
        assert isinstance(client, DPClient)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            # On each engine's sockets, a thief on the request socket and a forger on the
            # output socket (a fake death notice), both without keys.
            thieves, forgers = [], []
            for engine in client._clients:
                sockets = engine._sockets
                assert isinstance(sockets, DialSockets)
                thief = ctx.socket(zmq.PULL)
                thief.connect(sockets.input_endpoint)
                thieves.append(thief)
                forger = ctx.socket(zmq.PUSH)
                forgers.append(forger)
                forger.connect(sockets.output_endpoint)
                forger.send(msgspec.msgpack.encode(EngineDead(reason="forged")), zmq.NOBLOCK)
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o.outputs[0].text for o in outs] == _expected(PROMPTS, GREEDY)
            assert [thief.poll(100) for thief in thieves] == [0, 0]
            assert llm.get_stats().num_engines_alive == 2
        finally:
            for sock in thieves + forgers:
                sock.close(linger=0)
            ctx.term()


@pytest.mark.anyio
async def test_losing_a_node_is_its_engines_death_and_a_restart_places_it_anew(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The restart's first try comes at once (1 s later by default): it waits for a node anyway.
    monkeypatch.setattr(failover, "RESTART_BACKOFF_S", (0.0, 1.0))
    params = GREEDY.clone(max_tokens=24, output_kind=RequestOutputKind.DELTA)
    expected = _expected(PROMPTS, params.clone(output_kind=RequestOutputKind.FINAL_ONLY))
    head = cluster.head_node.node_id
    async with AsyncLLM(
        **RAY,
        data_parallel_size=2,
        ray_placement_strategy="STRICT_SPREAD",
        dp_failover="resume",
        dp_restart_engines=True,
        placement_timeout_s=60.0,
        max_num_seqs=4,
        backend_options={"latency": {"step_s": 0.02}},
    ) as engine:
        dp = engine.data_parallel
        assert isinstance(dp, DPClient)
        lost, lost_node = next(
            (s["rank"], s["node"]) for s in dp.engine_status() if s["node"] != head
        )
        worker = next(n for n in cluster.worker_nodes if n.node_id == lost_node)
        texts = [""] * len(PROMPTS)
        streaming = anyio.Event()

        async def run(i: int) -> None:
            async for out in engine.generate(PROMPTS[i], params):
                texts[i] += out.outputs[0].text
                streaming.set()

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(run, i)
            await streaming.wait()
            removed = time.monotonic()
            await anyio.to_thread.run_sync(cluster.remove_node, worker)
            with anyio.fail_after(30):
                while dp.engines_alive != [1 - lost]:
                    await anyio.sleep(0.01)
            detected_s = time.monotonic() - removed
        assert detected_s < 2.0
        # Every stream went on on the other engine, as if nothing happened.
        assert dp.metrics.requests[1 - lost, "failover"] > 0
        assert texts == expected
        stats = await engine.get_stats()
        assert (stats.num_engines, stats.num_engines_alive) == (2, 1)
        out = [o async for o in engine.generate("abc", GREEDY)][-1]
        assert out.outputs[0].text == "defghi"
        # A node joins: the engine is restarted in a new placement group there and rejoins.
        cluster.add_node(**NODE_ARGS)  # in the main thread: it sets signal handlers
        with anyio.fail_after(60):
            while (await engine.get_stats()).num_engines_alive != 2:
                await anyio.sleep(0.05)
        assert dp.metrics.engine_restarts[lost] == 1
        assert dp.engine_status()[lost]["node"] not in (head, lost_node)
        pinned = [o async for o in engine.generate("abc", GREEDY, data_parallel_rank=lost)][-1]
        assert pinned.outputs[0].text == "defghi"

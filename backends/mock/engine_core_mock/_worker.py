"""The mock's pretend tensor-parallel worker (``backend_options["tensor_parallel_size"]``): it
receives rank 0's broadcast and models the step — it keeps each request's token count and
computed tokens from the scheduler's diffs and the sampled ids rank 0 sends, checks them as a
real rank would need them, and waits the latency model's step time — so spawning, the broadcast,
KV sizing and worker deaths are exercised without torch. Run as ``python -m`` by the backend.

The sampled ids of step n arrive as a :class:`~engine_core._workers.Sampled` message that rank 0
sends only once step n's results exist on its device timeline (as a device broadcast completes
at the end of the step's stream work). Under async scheduling step n+1 is broadcast before that:
the worker holds it back until step n's ids arrive, as a real rank's stream orders step n+1's
input preparation after the broadcast. A step run on stale ids fails the worker's checks."""

from __future__ import annotations

import time

from engine_core._workers import Sampled, Step, serve
from engine_core._workers.messages import Scalar
from engine_core.config import EngineConfig
from engine_core_mock._options import parse_options

__all__ = ["MockWorker"]


class MockWorker:
    def __init__(self, config: EngineConfig, rank: int, size: int, directory: str) -> None:
        self.config = config
        self.rank = rank
        self.options = parse_options(config)
        self.num_blocks = 0
        self.num_steps = 0
        self.sleeping = False
        self.tokens: dict[str, int] = {}
        """Request -> tokens known (prompt + outputs)."""
        self.computed: dict[str, int] = {}
        self.unsampled: list[str] | None = None
        """The requests of the last step run, until its sampled ids arrive."""
        self.held: list[Step] = []
        """Steps received before the sampled ids of the step before them."""
        self.num_held = 0
        """Steps that had to wait for those ids (async scheduling launches them early)."""

    def step(self, step: Step) -> None:
        if self.num_blocks == 0 or self.sleeping:
            raise RuntimeError("a step reached the worker before initialize_kv_cache or asleep")
        if self.unsampled is not None or self.held:
            self.held.append(step)  # its inputs include the previous step's sampled ids
            self.num_held += 1
            return
        self._run(step)

    def sampled(self, sampled: Sampled) -> None:
        if self.unsampled is None or sampled.step != self.num_steps:
            awaited = self.num_steps if self.unsampled is not None else None
            raise RuntimeError(
                f"the sampled ids of step {sampled.step} arrived; the worker awaits those of "
                f"step {awaited}"
            )
        for req_id, ids in zip(self.unsampled, sampled.token_ids, strict=True):
            if req_id in self.tokens:
                self.tokens[req_id] += len(ids)
        self.unsampled = None
        if self.held:
            self._run(self.held.pop(0))

    def _run(self, step: Step) -> None:
        self.num_steps += 1
        out = step.scheduler_output
        for req_id in [*out.finished_req_ids, *out.preempted_req_ids]:
            self.tokens.pop(req_id, None)
            self.computed.pop(req_id, None)
        context = 0
        cached = out.cached
        for req_id, computed, num in zip(
            cached.req_ids, cached.num_computed_tokens, cached.num_scheduled_tokens, strict=True
        ):
            if self.computed.get(req_id) != computed:
                raise RuntimeError(
                    f"request {req_id!r}: the scheduler says {computed} tokens are computed, "
                    f"the worker computed {self.computed.get(req_id)}"
                )
            self._schedule(req_id, computed, num)
            context += computed + num
        for new in out.new_reqs:
            self.tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self._schedule(new.req_id, new.num_computed_tokens, new.num_scheduled_tokens)
            context += new.num_computed_tokens + new.num_scheduled_tokens
        self.unsampled = out.req_ids
        latency = self.options.latency
        if latency is not None:
            time.sleep(latency.duration(out.total_num_scheduled_tokens, context))

    def _schedule(self, key: str, computed: int, num: int) -> None:
        if computed + num > self.tokens[key]:
            raise RuntimeError(
                f"request {key!r}: {computed + num} tokens scheduled, the worker knows "
                f"{self.tokens[key]}"
            )
        self.computed[key] = computed + num

    def call(self, method: str, args: list[Scalar]) -> Scalar:
        if method == "available_kv_cache_memory":
            g = self.options.geometry
            memory = self.options.rank_memory_bytes
            device = memory[self.rank] if memory is not None else g.device_memory_bytes
            return int(device * self.config.kv_cache_memory_fraction) - g.weight_bytes
        if method == "initialize_kv_cache":
            assert isinstance(args[0], int)
            self.num_blocks = args[0]
            return None
        if method == "sleep":
            self.sleeping = True
            return None
        if method == "wake_up":
            self.sleeping = False
            return None
        if method in ("profile", "close"):
            return None
        if method == "num_live_requests":
            return len(self.computed)
        if method == "num_steps":
            return self.num_steps
        if method == "num_held":
            return self.num_held
        raise ValueError(f"unknown worker call {method!r}")


if __name__ == "__main__":
    serve(MockWorker)

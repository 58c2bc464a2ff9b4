"""Prometheus metrics of the server and its engine (``GET /metrics``, text format).

Each server has its own registry, so several servers can live in one process (tests).

Engine state, read from :meth:`AsyncLLM.get_stats` at each scrape:

- ``engine_core_num_requests_running`` / ``engine_core_num_requests_waiting`` (gauges)
- ``engine_core_kv_cache_usage_perc`` (gauge, 0..1)
- ``engine_core_kv_group_blocks_in_use{group,kind,window}`` (gauge): blocks each KV-cache group
  holds (``kind`` ``full_attention``, ``sliding_attention`` or ``chunked_attention``; ``window``
  empty for full attention)
- ``engine_core_prefix_cache_hit_rate`` (gauge, 0..1), ``engine_core_prefix_cache_queries_total``
  and ``engine_core_prefix_cache_hits_total`` (counters, tokens)
- ``engine_core_num_preemptions_total`` (counter) and ``engine_core_num_recomputed_tokens_total``
  (counter): tokens computed again after a preemption (what preemption cost)
- ``engine_core_seconds_since_progress`` (gauge): seconds since a step last computed a token
  while requests were queued (0 while idle); past ``stall_timeout_s`` ``/health`` answers 503
- ``engine_core_malformed_messages_total`` (counter): messages the engine could not decode
  (answered with an error when their request id was readable, else dropped)
- ``engine_core_device_busy_seconds_total`` (counter): seconds during which the backend had a
  step in flight (under async scheduling, the device time the steps report where the backend
  measures it); its rate against wall time is the fraction of time the host kept the device
  fed (1.0: never idle while there was work)
- the host KV tier (KV connector; 0 while off): ``engine_core_kv_offload_hit_tokens_total``,
  ``engine_core_kv_offload_loaded_bytes_total``, ``engine_core_kv_offload_stored_bytes_total``,
  ``engine_core_kv_offload_load_seconds_total``, ``engine_core_kv_offload_store_seconds_total``,
  ``engine_core_kv_offload_failed_blocks_total``, ``engine_core_kv_loads_cancelled_total``
  (counters), ``engine_core_kv_offload_resident_blocks`` and ``engine_core_kv_parked_requests``
  (gauges)

With speculative decoding on (vLLM's counters, so its PromQL for the acceptance rate, the mean
acceptance length and the per-position rate carries over):

- ``engine_core_spec_decode_num_drafts_total``, ``engine_core_spec_decode_num_draft_tokens_total``
  and ``engine_core_spec_decode_num_accepted_tokens_total`` (counters): verifications (request
  steps with drafts), drafts verified, drafts accepted
- ``engine_core_spec_decode_num_accepted_tokens_per_pos_total{position}`` (counter, 0-based)
- ``engine_core_spec_decode_k`` (gauge): the draft count of the last step (0: not speculating)
- ``engine_core_spec_decode_steps_total{k}`` (counter): steps by the draft count chosen
- ``engine_core_spec_decode_wasted_tokens_total`` (counter): rejected drafts, computed for nothing

With data parallelism each of these has one series per live engine, labelled ``engine``
(its rank), and the router adds:

- ``engine_core_engines_alive`` (gauge) and ``engine_core_engine_restarts_total{engine}``
- ``engine_core_router_requests_total{engine,reason}`` (counter): where requests went and why
  (``affinity``, ``balance``, ``cold``, ``explicit``, ``failover``, ``single``, ``policy``)
- ``engine_core_router_predicted_hit_tokens_total{engine}`` and
  ``engine_core_router_actual_hit_tokens_total{engine}`` (counters): the prefix-cache hits the
  router expected and those the engines reported, a measure of the router's accuracy

With LoRA on (``engine_core_lora_*``, labelled ``lora_name``):

- ``engine_core_lora_requests_running`` / ``engine_core_lora_requests_waiting`` (gauges): each
  adapter's requests in the engine (waiting: for a slot among ``max_loras``, or for its load)
- ``engine_core_lora_loaded`` (gauge, 1 per adapter loaded in the engine)
- ``engine_core_lora_prompt_tokens_total`` / ``engine_core_lora_generation_tokens_total``
  (counters): the tokens of this server's requests per adapter

Requests served by this server, recorded as their outputs stream:

- ``engine_core_prompt_tokens_total`` / ``engine_core_generation_tokens_total`` (counters)
- ``engine_core_request_success_total{finished_reason}`` (counter, one per completion: ``stop``,
  ``length`` or ``abort``, the last for requests whose client went away or that were aborted)
- ``engine_core_time_to_first_token_seconds``, ``engine_core_inter_token_latency_seconds`` and
  ``engine_core_e2e_request_latency_seconds`` (histograms; times from the engine front end's
  clock: arrival, first token, each token, finish). Tokens that reach the server together (the
  engine ran ahead of the stream) share the interval since the previous ones evenly.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine_core._core.engine_io import EngineStats
from engine_core.outputs import RequestOutput

if TYPE_CHECKING:
    from engine_core._engine.dp.stats import RouterMetrics

__all__ = ["Histogram", "RequestRecorder", "ServerMetrics"]

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip


class Histogram:
    """A histogram kept as plain numbers: updated only from the event loop's thread, so it
    needs none of prometheus_client's locks, and ``count`` equal observations cost one update
    (a stream that delivers several tokens at once observes their gaps in one call)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count
        self.count += count

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        cumulative = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            cumulative.append((_bound_label(bound), total))
        return HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=self.sum)


def _bound_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class ServerMetrics:
    """The metrics of one server, in a registry of its own; see the module docstring."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success: dict[str, int] = {}
        self.lora_prompt_tokens: dict[str, int] = {}
        self.lora_generation_tokens: dict[str, int] = {}
        self.time_to_first_token = Histogram(_LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(_ITL_BUCKETS)
        self.e2e_latency = Histogram(_LATENCY_BUCKETS)
        self.stats: EngineStats | None = None
        self.router: RouterMetrics | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))

    def render(self, stats: EngineStats | None, router: RouterMetrics | None = None) -> bytes:
        """The text exposition; ``stats`` None leaves the engine state out (engine dead);
        ``router``: the data-parallel router's counters."""
        self.stats = stats
        self.router = router
        return generate_latest(self.registry)

    def recorder(self, lora_name: str | None = None) -> RequestRecorder:
        """A recorder for one request (one prompt, all its completions; ``lora_name``: its
        LoRA adapter)."""
        return RequestRecorder(self, lora_name)

    def finished(self, reason: str, count: int = 1) -> None:
        self.request_success[reason] = self.request_success.get(reason, 0) + count


class _Collector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        if m.stats is not None:
            yield from _engine_state(m.stats)
            yield from _kv_group_state(m.stats)
            if m.stats.spec_num_speculative_tokens:
                yield from _spec_state(m.stats)
            if m.stats.kv_transfer or any(s.kv_transfer for s in m.stats.engines):
                yield from _transfer_state(m.stats)
        if m.router is not None:
            yield from _router_state(m.router, m.stats)
        if m.lora_generation_tokens or (m.stats is not None and m.stats.lora_loaded):
            yield from _lora_state(m)
        yield CounterMetricFamily(
            "engine_core_prompt_tokens", "Prompt tokens of admitted requests.", m.prompt_tokens
        )
        yield CounterMetricFamily(
            "engine_core_generation_tokens", "Generated tokens.", m.generation_tokens
        )
        success = CounterMetricFamily(
            "engine_core_request_success",
            "Completions that ended, by finish reason.",
            labels=["finished_reason"],
        )
        for reason, count in sorted(m.request_success.items()):
            success.add_metric([reason], count)
        yield success
        yield m.time_to_first_token.family(
            "engine_core_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
        )
        yield m.inter_token_latency.family(
            "engine_core_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
        )
        yield m.e2e_latency.family(
            "engine_core_e2e_request_latency_seconds", "Time from arrival to the end of a request."
        )


_ENGINE_SERIES = (
    (GaugeMetricFamily, "engine_core_num_requests_running", "Requests in the engine's running "
     "batch.", "num_running"),
    (GaugeMetricFamily, "engine_core_num_requests_waiting", "Requests waiting to be scheduled.",
     "num_waiting"),
    (GaugeMetricFamily, "engine_core_kv_cache_usage_perc",
     "Fraction of KV-cache blocks in use (0..1).", "kv_cache_usage"),
    (GaugeMetricFamily, "engine_core_prefix_cache_hit_rate",
     "Prefix-cache hit tokens over queried tokens since start (0..1).", "prefix_cache_hit_rate"),
    (CounterMetricFamily, "engine_core_prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    (CounterMetricFamily, "engine_core_prefix_cache_hits",
     "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    (CounterMetricFamily, "engine_core_num_preemptions",
     "Requests preempted to free KV-cache blocks.", "num_preemptions"),
    (CounterMetricFamily, "engine_core_num_recomputed_tokens",
     "Tokens computed again after a preemption.", "num_recomputed_tokens"),
    (GaugeMetricFamily, "engine_core_seconds_since_progress",
     "Seconds since a step last computed a token while requests were queued.",
     "seconds_since_progress"),
    (CounterMetricFamily, "engine_core_malformed_messages",
     "Messages the engine could not decode.", "num_malformed_messages"),
    (CounterMetricFamily, "engine_core_device_busy_seconds",
     "Seconds during which the backend had a step in flight.", "device_busy_s"),
    (CounterMetricFamily, "engine_core_kv_offload_hit_tokens",
     "Prompt tokens whose KV the host tier (KV connector) loaded instead of computing.",
     "kv_offload_hit_tokens"),
    (CounterMetricFamily, "engine_core_kv_offload_loaded_bytes",
     "Bytes the KV connector loaded into the device cache.", "kv_offload_bytes_loaded"),
    (CounterMetricFamily, "engine_core_kv_offload_stored_bytes",
     "Bytes the KV connector stored from the device cache.", "kv_offload_bytes_stored"),
    (CounterMetricFamily, "engine_core_kv_offload_load_seconds",
     "Seconds the KV connector's finished loads took, summed.", "kv_offload_load_s"),
    (CounterMetricFamily, "engine_core_kv_offload_store_seconds",
     "Seconds the KV connector's finished saves took, summed.", "kv_offload_store_s"),
    (CounterMetricFamily, "engine_core_kv_offload_failed_blocks",
     "Blocks whose KV load failed (dropped, corrupt, late).", "kv_offload_failed_blocks"),
    (GaugeMetricFamily, "engine_core_kv_offload_resident_blocks",
     "Blocks stored in the host tier.", "kv_offload_resident_blocks"),
    (GaugeMetricFamily, "engine_core_kv_parked_requests",
     "Requests waiting for their KV load (WAITING_FOR_REMOTE_KVS).", "kv_parked_requests"),
    (CounterMetricFamily, "engine_core_kv_loads_cancelled",
     "KV loads given up on (their requests recomputed).", "kv_loads_cancelled"),
)  # fmt: skip


def _engine_state(stats: EngineStats) -> Iterator[Metric]:
    """One series per metric, or with data parallelism one per live engine (``engine``)."""
    for family, name, documentation, field in _ENGINE_SERIES:
        if not stats.engines:
            yield family(name, documentation, value=getattr(stats, field))
            continue
        metric = family(name, documentation, labels=["engine"])
        for rank, engine in zip(stats.engine_ranks, stats.engines, strict=True):
            metric.add_metric([str(rank)], getattr(engine, field))
        yield metric


def _kv_group_state(stats: EngineStats) -> Iterator[Metric]:
    """Blocks in use per KV-cache group (``group``, ``kind``, ``window``; ``engine`` with data
    parallelism)."""
    engines = (
        list(zip([str(r) for r in stats.engine_ranks], stats.engines, strict=True))
        if stats.engines
        else [(None, stats)]
    )
    if not any(s.kv_groups for _, s in engines):
        return
    base = ["engine"] if stats.engines else []
    metric = GaugeMetricFamily(
        "engine_core_kv_group_blocks_in_use",
        "KV-cache blocks each group's block tables hold (released ones not counted).",
        labels=[*base, "group", "kind", "window"],
    )
    for rank, s in engines:
        labels = [rank] if rank is not None else []
        for g, group in enumerate(s.kv_groups):
            window = "" if group.window is None else str(group.window)
            metric.add_metric([*labels, str(g), group.kind, window], group.blocks_in_use)
    yield metric


_TRANSFER_SERIES = (
    ("pd_exports", "pd_exports", "Prompts whose KV a prefill engine exported for a decode engine."),
    ("pd_transfers", "pd_transfers", "KV transfers a decode engine pulled whole."),
    ("pd_bytes", "pd_transfer_bytes", "Bytes of KV decode engines pulled."),
    ("pd_transfer_s", "pd_transfer_seconds", "Seconds KV transfers took, summed."),
    ("pd_lease_expired", "pd_lease_expired", "Exports or parked loads whose lease expired."),
    (
        "pd_transfer_failed",
        "pd_recomputes",
        "Transfers that failed (prefill gone, lease expired, dropped): the decode side recomputed.",
    ),
)


def _transfer_state(stats: EngineStats) -> Iterator[Metric]:
    """Prefill/decode disaggregation, per engine (``engine``, ``role``)."""
    engines = (
        list(zip([str(r) for r in stats.engine_ranks], stats.engines, strict=True))
        if stats.engines
        else [(None, stats)]
    )
    base = ["engine", "role"] if stats.engines else ["role"]
    for key, name, doc in _TRANSFER_SERIES:
        metric = CounterMetricFamily(f"engine_core_{name}", doc, labels=base)
        for rank, s in engines:
            labels = [rank, s.engine_role] if rank is not None else [s.engine_role]
            metric.add_metric(labels, s.kv_transfer.get(key, 0.0))
        yield metric


def _spec_state(stats: EngineStats) -> Iterator[Metric]:
    """The speculative decoding series, per live engine (``engine``) with data parallelism."""
    engines = (
        list(zip([str(r) for r in stats.engine_ranks], stats.engines, strict=True))
        if stats.engines
        else [(None, stats)]
    )
    base = ["engine"] if stats.engines else []

    def family(kind: Any, name: str, doc: str, extra: list[str] | None = None) -> Any:
        return kind(f"engine_core_spec_decode_{name}", doc, labels=base + (extra or []))

    drafts = family(CounterMetricFamily, "num_drafts", "Request steps that verified drafts.")
    draft_tokens = family(CounterMetricFamily, "num_draft_tokens", "Drafts verified.")
    accepted = family(CounterMetricFamily, "num_accepted_tokens", "Drafts accepted.")
    per_pos = family(
        CounterMetricFamily,
        "num_accepted_tokens_per_pos",
        "Drafts accepted at each position (0-based).",
        ["position"],
    )
    current_k = family(GaugeMetricFamily, "k", "Draft count of the last step (0: off).")
    steps = family(CounterMetricFamily, "steps", "Steps by the draft count chosen.", ["k"])
    wasted = family(CounterMetricFamily, "wasted_tokens", "Rejected drafts, computed for nothing.")
    for rank, s in engines:
        labels = [rank] if rank is not None else []
        drafts.add_metric(labels, s.spec_num_drafts)
        draft_tokens.add_metric(labels, s.spec_num_draft_tokens)
        accepted.add_metric(labels, s.spec_num_accepted_tokens)
        for position, count in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([*labels, str(position)], count)
        current_k.add_metric(labels, s.spec_current_k)
        for k, count in sorted(s.spec_steps_by_k.items()):
            steps.add_metric([*labels, str(k)], count)
        wasted.add_metric(labels, s.spec_num_draft_tokens - s.spec_num_accepted_tokens)
    yield from (drafts, draft_tokens, accepted, per_pos, current_k, steps, wasted)


def _router_state(router: RouterMetrics, stats: EngineStats | None) -> Iterator[Metric]:
    if stats is not None:
        yield GaugeMetricFamily(
            "engine_core_engines_alive",
            "Engines of the data-parallel deployment that are alive.",
            value=stats.num_engines_alive,
        )
    engines = range(len(router.predicted_hit_tokens))
    restarts = CounterMetricFamily(
        "engine_core_engine_restarts", "Engines restarted after a death.", labels=["engine"]
    )
    predicted = CounterMetricFamily(
        "engine_core_router_predicted_hit_tokens",
        "Prefix-cache hit tokens the router expected for the requests it placed.",
        labels=["engine"],
    )
    actual = CounterMetricFamily(
        "engine_core_router_actual_hit_tokens",
        "Prefix-cache hit tokens the engines reported for the requests they started.",
        labels=["engine"],
    )
    for e in engines:
        restarts.add_metric([str(e)], router.engine_restarts[e])
        predicted.add_metric([str(e)], router.predicted_hit_tokens[e])
        actual.add_metric([str(e)], router.actual_hit_tokens[e])
    requests = CounterMetricFamily(
        "engine_core_router_requests",
        "Requests placed on each engine, by the reason the router chose it.",
        labels=["engine", "reason"],
    )
    for (e, reason), count in sorted(router.requests.items()):
        requests.add_metric([str(e), reason], count)
    yield from (restarts, predicted, actual, requests)
    disagg = router.disagg
    if disagg is not None:
        yield CounterMetricFamily(
            "engine_core_disagg_handoffs",
            "Requests handed from a prefill engine to a decode engine.",
            value=disagg.handoffs,
        )
        degraded = CounterMetricFamily(
            "engine_core_disagg_degraded_requests",
            "Whole requests sent to one role because no engine of the other was alive.",
            labels=["missing"],
        )
        degraded.add_metric(["prefill"], disagg.degraded_no_prefill)
        degraded.add_metric(["decode"], disagg.degraded_no_decode)
        yield degraded
        yield CounterMetricFamily(
            "engine_core_disagg_released_exports",
            "Exports the front end released itself (decode side rejected, aborted, died).",
            value=disagg.released,
        )


def _lora_state(m: ServerMetrics) -> Iterator[Metric]:
    stats = m.stats
    families = [
        (GaugeMetricFamily, "engine_core_lora_requests_running", "Running requests per adapter.",
         {} if stats is None else stats.lora_running),
        (GaugeMetricFamily, "engine_core_lora_requests_waiting", "Waiting requests per adapter.",
         {} if stats is None else stats.lora_waiting),
        (GaugeMetricFamily, "engine_core_lora_loaded", "Adapters loaded in the engine.",
         {} if stats is None else dict.fromkeys(stats.lora_loaded, 1)),
        (CounterMetricFamily, "engine_core_lora_prompt_tokens", "Prompt tokens per adapter.",
         m.lora_prompt_tokens),
        (CounterMetricFamily, "engine_core_lora_generation_tokens",
         "Generated tokens per adapter.", m.lora_generation_tokens),
    ]  # fmt: skip
    for kind, name, doc, values in families:
        family = kind(name, doc, labels=["lora_name"])
        for lora_name, value in sorted(values.items()):
            family.add_metric([lora_name], value)
        yield family


class RequestRecorder:
    """Feeds the metrics from the outputs (DELTA or FINAL_ONLY) of one request as they are
    consumed; :meth:`close` when the request's stream ends, however it ends."""

    __slots__ = ("_metrics", "_last_time", "_admitted", "_closed", "_finished", "_lora")

    def __init__(self, metrics: ServerMetrics, lora_name: str | None = None) -> None:
        self._metrics = metrics
        self._lora = lora_name
        self._last_time: float | None = None
        self._admitted = False
        self._closed = False
        self._finished: set[int] = set()

    def observe(self, output: RequestOutput) -> None:
        """Record one output of the request."""
        metrics = self._metrics
        timing = output.metrics
        if not self._admitted:
            self._admitted = True
            metrics.prompt_tokens += len(output.prompt_token_ids)
            if self._lora is not None:
                counts = metrics.lora_prompt_tokens
                counts[self._lora] = counts.get(self._lora, 0) + len(output.prompt_token_ids)
            if timing is not None and timing.time_to_first_token is not None:
                metrics.time_to_first_token.observe(timing.time_to_first_token)
        new_tokens = 0
        for completion in output.outputs:
            count = len(completion.token_ids)
            metrics.generation_tokens += count
            if self._lora is not None:
                counts = metrics.lora_generation_tokens
                counts[self._lora] = counts.get(self._lora, 0) + count
            if count > new_tokens:
                new_tokens = count
            reason = completion.finish_reason
            if reason is not None and completion.index not in self._finished:
                self._finished.add(completion.index)
                metrics.finished(reason)
        if timing is None:
            return
        if output.finished and timing.finished_time is not None:
            metrics.e2e_latency.observe(timing.finished_time - timing.arrival_time)
        last = timing.last_token_time
        if new_tokens == 0 or last is None:
            return
        previous = self._last_time
        if previous is None:
            # The first of these tokens came at first_token_time, the others after it.
            previous = timing.first_token_time or last
            new_tokens -= 1
        if new_tokens > 0:
            metrics.inter_token_latency.observe((last - previous) / new_tokens, new_tokens)
        self._last_time = last

    def close(self, num_completions: int) -> None:
        """The request's stream ended: completions that never finished count as aborted."""
        if self._closed or not self._admitted:
            return
        self._closed = True
        unfinished = num_completions - len(self._finished)
        if unfinished > 0:
            self._metrics.finished("abort", unfinished)

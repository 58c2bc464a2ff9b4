"""Prefill/decode disaggregation in the data-parallel client (``docs/disaggregation.md``).

With ``engine_roles`` naming prefill and decode engines, :class:`DPClient` sends a new request
in two legs, with no proxy in between:

1. to a prefill engine (prefix-aware routing among the engines that compute prompts) with
   ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}``: the engine computes
   the prompt and the first token, which streams to the caller at once (its TTFT), exports the
   prompt's blocks under a lease and returns the transfer parameters with its ending;
2. :meth:`Disaggregation.on_finished` swallows that ending and sends the original request, the
   parameters and the first token (``resume_output_token_ids``) to the least loaded decode
   engine, whose ``"pd"`` connector pulls the blocks and decodes: the caller sees one stream.

Failures: an abort goes to the request's engine and releases the export (the decode side's
connector releases it too); a decode engine that ends the request before admitting it (an
error, a pause) frees the prefill side at once (:func:`~engine_core._core.pd_connector.release`);
a prefill engine that dies mid-transfer leaves the decode side to recompute (its worker half
sees the owner gone); a decode engine that dies is the usual failover (the moved request drops
the parameters and recomputes). With no prefill engine alive the decode engines take whole
requests, and the reverse (degraded: logged once per change, counted).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from engine_core._core.engine_io import EngineCoreRequest, FinishedRequest
from engine_core._core.pd_connector import REMOTE_DECODE, release
from engine_core._engine.pipes.addresses import DeploymentKeys
from engine_core._engine.pipes.pd_transport import PDClient, remote_release

__all__ = ["Disaggregation", "DisaggMetrics"]

logger = logging.getLogger(__name__)

PREFILL = "prefill"
DECODE = "decode"
WHOLE = "whole"


class DisaggMetrics:
    """What the client did for disaggregation (``/metrics``)."""

    __slots__ = ("handoffs", "degraded_no_prefill", "degraded_no_decode", "released", "failovers")

    def __init__(self) -> None:
        self.handoffs = 0
        """Requests handed from a prefill engine to a decode engine."""
        self.degraded_no_prefill = 0
        """Whole requests sent to a decode engine because no prefill engine was alive."""
        self.degraded_no_decode = 0
        """Whole requests kept on a prefill engine because no decode engine was alive."""
        self.released = 0
        """Exports the client released itself (decode side rejected, aborted, gone)."""
        self.failovers = 0
        """Decode-leg requests moved after their decode engine died."""


class _Leg:
    __slots__ = ("phase", "original", "tokens", "params")

    def __init__(self, phase: str, original: EngineCoreRequest) -> None:
        self.phase = phase
        self.original = original
        self.tokens: list[int] = []
        """Tokens the prefill leg streamed."""
        self.params: dict[str, Any] | None = None
        """The decode leg's transfer parameters (to release when it ends early)."""


class Disaggregation:
    """The client's part of disaggregation (see the module): which leg each request is in,
    where each leg may go."""

    def __init__(
        self, roles: list[str], keys: DeploymentKeys | None = None, *, force_zmq: bool = False
    ) -> None:
        self.roles = roles
        self.force_zmq = force_zmq
        """``kv_connector_options["pd_transport"] == "zmq"``: releases go over ZMQ too."""
        self.keys = keys
        """The deployment's transfer keys (``pd_transport``): releases of exports on other
        hosts go over ZMQ."""
        self._pd_client: PDClient | None = None
        self.prefill_engines = [e for e, r in enumerate(roles) if r in ("prefill", "both")]
        self.decode_engines = [e for e, r in enumerate(roles) if r in ("decode", "both")]
        self.legs: dict[str, _Leg] = {}
        self.metrics = DisaggMetrics()
        self._degraded: str | None = None

    def _live(self, engines: list[int], alive: list[bool]) -> list[int]:
        return [e for e in engines if alive[e]]

    def _note_degraded(self, mode: str | None) -> None:
        if mode != self._degraded:
            if mode is not None:
                logger.warning(
                    "disaggregation degraded: no %s engine is alive; whole requests go to the "
                    "%s engines until one is back",
                    "prefill" if mode == "no_prefill" else "decode",
                    "decode" if mode == "no_prefill" else "prefill",
                )
            else:
                logger.info("disaggregation restored: prefill and decode engines are alive")
            self._degraded = mode

    def plan(
        self, request: EngineCoreRequest, reason: str | None, alive: list[bool]
    ) -> tuple[EngineCoreRequest, list[int] | None, bool]:
        """What to send for ``request`` and where: the request, the engines it may go to
        (None: any), and whether the least loaded of them takes it (else the router's
        policy). ``ValueError`` for a request pinned to a prefill-only engine."""
        req_id = request.request_id
        rank = request.data_parallel_rank
        if rank is not None:
            if 0 <= rank < len(self.roles) and self.roles[rank] == "prefill":
                raise ValueError(
                    f"data_parallel_rank {rank} is a prefill-only engine (engine_roles "
                    f"{self.roles}): it takes no whole request"
                )
            self.legs[req_id] = _Leg(WHOLE, request)
            return request, None, False
        leg = self.legs.get(req_id)
        if reason == "failover" and leg is not None:
            if leg.phase == PREFILL:
                request = leg.original  # the prefill engine died: start again
            elif leg.phase == DECODE:
                self.metrics.failovers += 1
                self.release(leg)
                if request.kv_transfer_params is not None:
                    request = msgspec.structs.replace(request, kv_transfer_params=None)
                decode = self._live(self.decode_engines, alive)
                return request, decode or None, True
            else:
                return request, None, False
        if reason == "handoff" and leg is not None:
            decode = self._live(self.decode_engines, alive)
            return request, decode or None, True
        prefill = self._live(self.prefill_engines, alive)
        decode = self._live(self.decode_engines, alive)
        params = request.sampling_params
        whole = (
            params.max_tokens == 1
            or params.structured_outputs is not None
            or request.resume_output_token_ids
        )
        if not prefill or not decode:
            self._note_degraded("no_prefill" if not prefill else "no_decode")
            if not prefill:
                self.metrics.degraded_no_prefill += 1
            else:
                self.metrics.degraded_no_decode += 1
            self.legs[req_id] = _Leg(WHOLE, request)
            return request, (decode or prefill) or None, False
        self._note_degraded(None)
        if whole:
            self.legs[req_id] = _Leg(WHOLE, request)
            return request, decode, False
        self.legs[req_id] = _Leg(PREFILL, request)
        first = msgspec.structs.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        return (
            msgspec.structs.replace(
                request, sampling_params=first, kv_transfer_params={REMOTE_DECODE: True}
            ),
            prefill,
            False,
        )

    def is_prefill_leg(self, req_id: str) -> bool:
        leg = self.legs.get(req_id)
        return leg is not None and leg.phase == PREFILL

    def record_tokens(self, req_id: str, tokens: list[int]) -> None:
        leg = self.legs.get(req_id)
        if leg is not None and leg.phase == PREFILL:
            leg.tokens.extend(tokens)

    def on_finished(self, finished: FinishedRequest) -> EngineCoreRequest | None:
        """An ending from an engine: the decode leg to send (the prefill leg's ending is then
        not shown to the caller), or None (the ending stands)."""
        req_id = finished.req_id
        leg = self.legs.get(req_id)
        params = finished.kv_transfer_params
        if leg is None:
            if params and "segment" in params:
                self._release(params)  # aborted while its ending was on its way: unread
                self.metrics.released += 1
            return None
        if leg.phase == PREFILL and finished.finish_reason == "length":
            original = leg.original
            leg.phase = DECODE
            leg.params = params if params and "segment" in params else None
            self.metrics.handoffs += 1
            return msgspec.structs.replace(
                original,
                resume_output_token_ids=list(original.resume_output_token_ids) + leg.tokens,
                kv_transfer_params=leg.params,
            )
        if leg.phase == DECODE and finished.finish_reason in ("error", "abort"):
            self.release(leg)  # rejected (or ended) before it read the export: free it now
        del self.legs[req_id]
        return None

    def release(self, leg: _Leg) -> None:
        if leg.params is not None:
            self._release(leg.params)
            leg.params = None
            self.metrics.released += 1

    def aborted(self, req_id: str) -> None:
        leg = self.legs.pop(req_id, None)
        if leg is not None:
            self.release(leg)

    def gone(self, req_id: str) -> None:
        """The client ended the request itself (failover gave up on it)."""
        leg = self.legs.pop(req_id, None)
        if leg is not None:
            self.release(leg)

    def _release(self, params: dict[str, Any]) -> None:
        """Free an export nobody will read: through its segment on this host, else over ZMQ."""
        if self.keys is None or not params.get("address"):
            release(params)
            return
        if not self.force_zmq and release(params):
            return
        if self._pd_client is None:
            self._pd_client = PDClient(self.keys)
        remote_release(self._pd_client, params)

    def close(self) -> None:
        if self._pd_client is not None:
            self._pd_client.close()  # lingers for the last releases
            self._pd_client = None

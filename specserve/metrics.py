"""Every Prometheus object specserve exports, on an injected registry.

``SpecServeMetrics`` implements the engine's ``StatsListener``: the engine
reports raw events (drafts proposed, drafts accepted, tokens, latencies) and
this module only counts them; ratios are derived at query time in PromQL.
No object touches ``prometheus_client``'s global default registry.

All ``specserve_*`` series carry the labels ``model_name`` and ``method`` (the speculative
method, ``none`` without speculation); the ``vllm:*`` twins (below) carry vLLM's labels.

Speculative decoding (vLLM's vocabulary: a *draft* is one proposal round for
one request; *draft tokens* the tokens it proposed; *accepted* those the
target kept)::

    specserve_spec_decode_num_drafts_total
    specserve_spec_decode_num_draft_tokens_total
    specserve_spec_decode_num_accepted_tokens_total
    specserve_spec_decode_num_accepted_tokens_per_pos_total{position="0".."K-1"}
    specserve_spec_decode_acceptance_length          histogram, 1 + accepted per request-step, buckets 1..K+1
    specserve_spec_decode_config_info{num_speculative_tokens, lossless}   1

``lossless="false"`` in ``specserve_spec_decode_config_info`` marks a server
whose rejection sampler is ``synthetic`` (a benchmarking aid that accepts
drafts at a fixed rate, so outputs are not the target model's).  Join on it to
keep such series out of dashboards::

    specserve_spec_decode_num_drafts_total * on(model_name, method) group_left
      specserve_spec_decode_config_info{lossless="true"}

Derived figures (PromQL; use the same range everywhere)::

    # mean acceptance length: tokens emitted per draft round (1 = nothing accepted)
    1 + rate(specserve_spec_decode_num_accepted_tokens_total[5m])
          / rate(specserve_spec_decode_num_drafts_total[5m])

    # acceptance rate: share of proposed draft tokens that were accepted
    rate(specserve_spec_decode_num_accepted_tokens_total[5m])
      / rate(specserve_spec_decode_num_draft_tokens_total[5m])

    # per-position acceptance rate: P(draft at position p accepted) per draft round
    rate(specserve_spec_decode_num_accepted_tokens_per_pos_total[5m])
      / ignoring(position) group_left
      rate(specserve_spec_decode_num_drafts_total[5m])

    # p99 time to first token
    histogram_quantile(0.99, sum by (le) (rate(specserve_time_to_first_token_seconds_bucket[5m])))

Speech (``+method=ctc``)::

    specserve_ctc_requests_total{stage, lossless}   transcriptions (segments) by the stage that settled
                                                   them: entropy (the CTC text, no LLM forward), verified
                                                   (the one-pass verification), decoded; lossless="false"
                                                   under method.ctc_acceptance=relaxed

Kernels (``engine.attention_backend``, ``engine.rejection_backend``)::

    specserve_backend_info{attention, rejection}   1; "triton", or "torch" where the Triton kernel
                                                   failed its start-up check (or "cpu_fused" on the CPU)

    # replicas per attention backend (a "torch" on CUDA fell back: see its start-up log)
    count by (attention) (specserve_backend_info)

Adaptive speculation::

    specserve_spec_decode_num_speculative_tokens   gauge, drafts per request per step chosen now
                                                   (engine.speculation=adaptive; 0 = off, K when fixed)
    specserve_spec_decode_draft_trees              gauge, 1 while those drafts are trees (method.tree)

Serving::

    specserve_num_requests_running      gauge
    specserve_num_requests_waiting      gauge
    specserve_kv_cache_usage_perc       gauge, fraction of KV blocks in use, 0..1 (vLLM's name and unit)
    specserve_prompt_tokens_total       counter, prompt tokens prefilled
    specserve_generation_tokens_total   counter, tokens emitted
    specserve_request_success_total{finished_reason="stop|length|abort"}
    specserve_request_errors_total{reason}     requests answered with an error status (invalid_argument,
                                               queue_full, draining, unauthenticated, engine_dead, ...)
    specserve_time_to_first_token_seconds      histogram, 0.001 .. 2560 s
    specserve_inter_token_latency_seconds      histogram, 0.01 .. 80 s
    specserve_e2e_request_latency_seconds      histogram
    specserve_request_prompt_tokens            histogram, prompt tokens per finished request
    specserve_request_generation_tokens        histogram, generated tokens per finished request
    specserve_iteration_tokens_total           histogram, tokens (prompt + generated) per engine step

Automatic prefix caching (tokens, as vLLM counts them)::

    specserve_prefix_cache_queries_total       counter, prompt tokens looked up in the prefix cache
    specserve_prefix_cache_hits_total          counter, of those, tokens whose K/V was found cached
    # hit rate: rate(specserve_prefix_cache_hits_total[5m]) / rate(specserve_prefix_cache_queries_total[5m])

Suffix decoding's global response cache (all tenants together; 0 for other methods)::

    specserve_suffix_cache_bytes               gauge, estimated memory of the cached responses' trees,
                                               <= method.suffix_decoding_max_cached_bytes
    specserve_suffix_cache_responses           gauge, responses cached (<= suffix_decoding_max_cached_requests)

vLLM's names.  Every series above with a vLLM counterpart is exported a second time under
vLLM v1's name, type, unit and buckets, with vLLM's labels ``model_name`` and ``engine``
(always "0": one engine per server) and no ``method`` label, so dashboards, autoscaling
rules and routers written for vLLM (the Gateway API Inference Extension's endpoint picker
reads ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and
``vllm:kv_cache_usage_perc``) work unchanged.  Both names are updated by the same call, so
they always agree.  ``VLLM_NAMES`` maps each specserve family to its vLLM name(s)::

    vllm:num_requests_running  vllm:num_requests_waiting  vllm:kv_cache_usage_perc
    vllm:gpu_cache_usage_perc                  (vLLM's pre-0.10 name of kv_cache_usage_perc)
    vllm:prompt_tokens_total  vllm:generation_tokens_total  vllm:request_success_total{finished_reason}
    vllm:prefix_cache_queries_total  vllm:prefix_cache_hits_total
    vllm:time_to_first_token_seconds  vllm:inter_token_latency_seconds  vllm:e2e_request_latency_seconds
    vllm:time_per_output_token_seconds         (vLLM's pre-0.11 name of inter_token_latency_seconds)
    vllm:request_prompt_tokens  vllm:request_generation_tokens  vllm:iteration_tokens_total
    vllm:spec_decode_num_drafts_total  vllm:spec_decode_num_draft_tokens_total
    vllm:spec_decode_num_accepted_tokens_total  vllm:spec_decode_num_accepted_tokens_per_pos_total{position}

``specserve_request_prompt_tokens`` / ``specserve_request_generation_tokens`` (histograms,
prompt and generated tokens per finished request, vLLM's 1-2-5 buckets) exist for these twins.
specserve-only (no vLLM counterpart): the acceptance-length histogram, the config info,
the chosen K, request errors and the suffix cache gauges.

``server.metric_names`` chooses the names: ``both`` (the default), ``vllm`` (vLLM's names, and
``specserve_*`` only for the series vLLM has no name for) or ``specserve``.  ``exposition``
renders the registry without prometheus_client's ``*_created`` timestamp series.

``docs/metrics.md`` repeats this list for operators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from specserve.engine.stats import RequestFinishedStats, StepStats

FINISHED_REASONS = ("stop", "length", "abort")

# vLLM's buckets, so dashboards carry over.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Tokens per request: vLLM's 1-2-5 series (it stops at max_model_len; here at 1M tokens).
REQUEST_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))

# vLLM's label values: one engine per server, index 0.
VLLM_ENGINE = "0"

# specserve family -> the vLLM v1 name(s) it is also exported under (same type, unit,
# buckets and label values; vLLM's labels: model_name and engine, no method).  The first
# name is vLLM's current one; a second is the name older vLLM releases used.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "specserve_num_requests_running": ("vllm:num_requests_running",),
    "specserve_num_requests_waiting": ("vllm:num_requests_waiting",),
    "specserve_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "specserve_prompt_tokens": ("vllm:prompt_tokens",),
    "specserve_generation_tokens": ("vllm:generation_tokens",),
    "specserve_request_success": ("vllm:request_success",),
    "specserve_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "specserve_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "specserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "specserve_inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "specserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "specserve_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "specserve_request_generation_tokens": ("vllm:request_generation_tokens",),
    "specserve_iteration_tokens_total": ("vllm:iteration_tokens_total",),
    "specserve_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "specserve_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "specserve_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "specserve_spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
}


METRIC_NAMES = ("both", "vllm", "specserve")  # server.metric_names


class _WithoutCreated:
    """A registry's families without the ``*_created`` samples (creation timestamps that
    prometheus_client adds to every counter and histogram: noise for every dashboard)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def exposition(registry: CollectorRegistry) -> bytes:
    """What ``/metrics`` serves: the Prometheus text format, without ``*_created`` series."""
    return generate_latest(_WithoutCreated(registry))  # type: ignore[arg-type]


class _Twins:
    """Children of one specserve family and of its vLLM-named families, updated together."""

    __slots__ = ("children",)

    def __init__(self, *children: Any):
        self.children = children

    def inc(self, amount: float = 1) -> None:
        for child in self.children:
            child.inc(amount)

    def set(self, value: float) -> None:
        for child in self.children:
            child.set(value)

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)


class _TwinFamilies:
    """A specserve family with an extra label (position, finished_reason) and its vLLM twins:
    ``labels(position="2")`` is the pair of children with that label value."""

    def __init__(self, ours: Any, our_values: dict[str, str], theirs: list[Any], their_values: dict[str, str]):
        self._ours, self._our_values = ours, our_values
        self._theirs, self._their_values = theirs, their_values

    def labels(self, **extra: str) -> _Twins:
        ours = [self._ours.labels(**self._our_values, **extra)] if self._ours is not None else []
        return _Twins(*ours, *(f.labels(**self._their_values, **extra) for f in self._theirs))


@dataclass(frozen=True)
class MetricsIdentity:
    """What the label values and the info metric say about the served model."""

    model_name: str
    method: str  # "none" without speculation
    num_speculative_tokens: int  # K, 0 without speculation
    lossless: bool = True
    # what runs paged attention and draft verification (engine.attention_backend,
    # engine.rejection_backend after the start-up checks): "triton", "torch", "cpu_fused"
    attention_backend: str = "unknown"
    rejection_backend: str = "unknown"


class SpecServeMetrics:
    """All specserve metrics on ``registry``; a ``StatsListener`` for the engine.

    Thread-safe: the engine calls ``on_step``/``on_request_finished`` from its
    own thread while the servers render ``registry`` from the event loop.
    """

    def __init__(self, registry: CollectorRegistry, identity: MetricsIdentity, names: str = "both"):
        if names not in METRIC_NAMES:
            raise ValueError(f"metric names must be one of {', '.join(METRIC_NAMES)}, got {names!r}")
        self.registry = registry
        self.identity = identity
        labels = ("model_name", "method")
        values = {"model_name": identity.model_name, "method": identity.method or "none"}
        k = max(0, int(identity.num_speculative_tokens))

        vllm_labels = ("model_name", "engine")
        vllm_values = {"model_name": identity.model_name, "engine": VLLM_ENGINE}

        def families(cls: type, name: str, doc: str, extra: tuple[str, ...] = (), **kw: Any) -> tuple[Any, list]:
            """The specserve family ``name`` and one family per vLLM name of it (VLLM_NAMES), as
            ``names`` selects them: the specserve one is None under "vllm" when vLLM has a name."""
            vllm_names = VLLM_NAMES.get(name, ()) if names != "specserve" else ()
            ours = None if names == "vllm" and vllm_names else cls(name, doc, labels + extra, registry=registry, **kw)
            theirs = [cls(v, doc, vllm_labels + extra, registry=registry, **kw) for v in vllm_names]
            return ours, theirs

        def twins(cls: type, name: str, doc: str, **kw: Any) -> _Twins:
            ours, theirs = families(cls, name, doc, **kw)
            mine = [ours.labels(**values)] if ours is not None else []
            return _Twins(*mine, *(f.labels(**vllm_values) for f in theirs))

        def labelled(name: str, doc: str, extra: str) -> _TwinFamilies:
            ours, theirs = families(Counter, name, doc, (extra,))
            return _TwinFamilies(ours, values, theirs, vllm_values)

        def counter(name: str, doc: str) -> _Twins:
            return twins(Counter, name, doc)

        def histogram(name: str, doc: str, buckets) -> _Twins:
            return twins(Histogram, name, doc, buckets=buckets)

        def gauge(name: str, doc: str) -> _Twins:
            return twins(Gauge, name, doc)

        info = Info(
            "specserve_spec_decode_config",
            "Speculative-decoding setup; lossless=false when rejection sampling is synthetic.",
            labels,
            registry=registry,
        )
        info.labels(**values).info(
            {"num_speculative_tokens": str(k), "lossless": "true" if identity.lossless else "false"}
        )
        backends = Info("specserve_backend", "What runs the kernels: Triton or the torch twin it fell back to.",
                        labels, registry=registry)
        backends.labels(**values).info(
            {"attention": identity.attention_backend, "rejection": identity.rejection_backend}
        )

        # Prometheus appends _total to counter names.
        self.num_drafts = counter(
            "specserve_spec_decode_num_drafts", "Draft rounds (one per request per step that proposed)."
        )
        self.num_draft_tokens = counter("specserve_spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter(
            "specserve_spec_decode_num_accepted_tokens", "Draft tokens accepted by the target."
        )
        per_pos = labelled(
            "specserve_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based).",
            "position",
        )
        # Children for every position up front, so each series starts at 0.
        self.accepted_per_pos = [per_pos.labels(position=str(p)) for p in range(k)]
        self._per_pos_family = per_pos
        self._values = values
        self.acceptance_length = histogram(
            "specserve_spec_decode_acceptance_length",
            "Tokens emitted per draft round: 1 + accepted drafts (one observation per request per step).",
            tuple(float(b) for b in range(1, k + 2)),
        )

        self.chosen_k = gauge(
            "specserve_spec_decode_num_speculative_tokens",
            "Drafts per request per step the engine currently chooses (adaptive speculation: 0 = off; "
            "fixed: K).",
        )
        self.chosen_k.set(k)
        self.draft_trees = gauge(
            "specserve_spec_decode_draft_trees",
            "1 while the drafts chosen now are trees (method.tree), 0 for chains or speculation off.",
        )
        self.num_running = gauge("specserve_num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("specserve_num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge(
            "specserve_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1, as vLLM's)."
        )
        self.prompt_tokens = counter("specserve_prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("specserve_generation_tokens", "Tokens generated.")
        success = labelled("specserve_request_success", "Finished requests by reason.", "finished_reason")
        self.request_success = {r: success.labels(finished_reason=r) for r in FINISHED_REASONS}
        self._success_family = success
        # +method=ctc: the stage that settled each transcription (entropy gate, one-pass
        # verification, decoding); lossless="false" under relaxed acceptance.
        self._ctc_family = Counter(
            "specserve_ctc_requests", "Transcriptions by the +method=ctc stage that settled them.",
            labels + ("stage", "lossless"), registry=registry,
        )
        self._ctc_lossless = "true" if identity.lossless else "false"
        self._errors_family = Counter(
            "specserve_request_errors", "Requests answered with an error status, by reason.", labels + ("reason",),
            registry=registry,
        )
        self.request_prompt_tokens = histogram(
            "specserve_request_prompt_tokens", "Prompt tokens per finished request.", REQUEST_TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "specserve_request_generation_tokens", "Generated tokens per finished request.", REQUEST_TOKEN_BUCKETS
        )
        self.ttft = histogram("specserve_time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("specserve_inter_token_latency_seconds", "Time between emitted tokens.", ITL_BUCKETS)
        self.e2e = histogram("specserve_e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.prefix_cache_queries = counter(
            "specserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (at admission)."
        )
        self.prefix_cache_hits = counter(
            "specserve_prefix_cache_hits", "Prompt tokens whose K/V was found in the prefix cache."
        )
        self.suffix_cache_bytes = gauge(
            "specserve_suffix_cache_bytes", "Estimated memory of suffix decoding's global response cache (bytes)."
        )
        self.suffix_cache_responses = gauge(
            "specserve_suffix_cache_responses", "Responses in suffix decoding's global response cache."
        )
        self.iteration_tokens = histogram(
            "specserve_iteration_tokens_total", "Tokens (prompt + generated) per engine step.", ITERATION_TOKEN_BUCKETS
        )

    # ------------------------------------------------------------------ StatsListener

    def on_step(self, stats: StepStats) -> None:
        self.set_queue_state(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
        self.chosen_k.set(stats.num_speculative_tokens)
        self.draft_trees.set(1 if stats.draft_trees else 0)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.suffix_cache_bytes.set(stats.suffix_cache_bytes)
        self.suffix_cache_responses.set(stats.suffix_cache_responses)
        if stats.num_prompt_tokens or stats.num_generation_tokens:
            self.iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        for req in stats.requests:
            if req.num_draft_tokens > 0:
                self.num_drafts.inc()
                self.num_draft_tokens.inc(req.num_draft_tokens)
                self.num_accepted_tokens.inc(req.num_accepted_tokens)
                self.acceptance_length.observe(1 + req.num_accepted_tokens)
                for pos, accepted in enumerate(req.accepted_per_position):
                    if accepted:
                        self._per_pos(pos).inc()
            if req.time_to_first_token_s is not None:
                self.ttft.observe(req.time_to_first_token_s)
            if req.inter_token_latency_s is not None:
                self.itl.observe(req.inter_token_latency_s)

    def on_request_finished(self, stats: RequestFinishedStats) -> None:
        reason = stats.finish_reason
        child = self.request_success.get(reason)
        if child is None:  # a reason this build does not know: still count it
            child = self._success_family.labels(finished_reason=str(reason))
        child.inc()
        self.e2e.observe(stats.e2e_latency_s)
        self.request_prompt_tokens.observe(stats.num_prompt_tokens)
        self.request_generation_tokens.observe(stats.num_generation_tokens)
        stage = getattr(stats, "ctc_stage", None)
        if stage is not None:
            self._ctc_family.labels(**self._values, stage=stage, lossless=self._ctc_lossless).inc()

    # ------------------------------------------------------------------ server side

    def set_queue_state(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Set the gauges (from a step, or from the engine's properties at scrape time)."""
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_cache_usage.set(kv_cache_usage)

    def on_request_error(self, reason: str) -> None:
        """Count a request answered with an error (``specserve.server.errors`` kind name)."""
        self._errors_family.labels(**self._values, reason=reason).inc()

    def _per_pos(self, pos: int):
        if pos < len(self.accepted_per_pos):
            return self.accepted_per_pos[pos]
        return self._per_pos_family.labels(position=str(pos))

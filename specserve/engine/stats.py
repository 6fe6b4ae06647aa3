"""Raw engine events for metrics listeners (pure Python).

The engine counts events; ratios such as mean acceptance length are derived
by the consumer (PromQL next to the counters in ``specserve.metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class RequestStepStats:
    """What one request did in one engine step."""

    request_id: str
    num_new_tokens: int  # tokens emitted to the client this step
    num_draft_tokens: int  # drafts proposed (0: no draft round this step)
    num_accepted_tokens: int  # drafts accepted (<= num_draft_tokens)
    # Per draft position i (0-based), whether the draft at i was accepted;
    # length num_draft_tokens.
    accepted_per_position: list[bool] = field(default_factory=list)
    time_to_first_token_s: float | None = None  # set on the step that emitted the first token
    inter_token_latency_s: float | None = None  # seconds per token since the previous emission


@dataclass
class StepStats:
    """One engine step."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_prompt_tokens: int  # prompt tokens prefilled this step
    num_generation_tokens: int  # tokens emitted this step
    requests: list[RequestStepStats] = field(default_factory=list)
    # Drafts per request the engine chose for its latest proposals (adaptive speculation;
    # K when fixed, 0 without speculation or while it is switched off).
    num_speculative_tokens: int = 0
    draft_trees: bool = False  # ... drafted as trees (method.tree), not chains
    # Automatic prefix caching, in tokens (vLLM's unit): prompt tokens looked up in the cache
    # by the requests admitted this step, and those found cached (not computed again).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Suffix decoding's global response cache (all tenants) after this step: its estimated
    # memory in bytes and the responses it holds (0 for other methods).
    suffix_cache_bytes: int = 0
    suffix_cache_responses: int = 0


@dataclass
class RequestFinishedStats:
    request_id: str
    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency_s: float
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    ctc_stage: str | None = None  # +method=ctc: the stage that settled it (SpecDecodeStats.ctc_stage)


class StatsListener(Protocol):
    def on_step(self, stats: StepStats) -> None: ...

    def on_request_finished(self, stats: RequestFinishedStats) -> None: ...

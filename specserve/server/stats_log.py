"""The periodic stats line: what the server did in the last ``server.log_stats_interval_s``.

``StatsLog`` is a ``StatsListener`` (the engine thread feeds it each step, as it feeds
``specserve.metrics``); the servers' event loop calls ``line`` every interval and logs
the result on ``specserve.stats``, in vLLM's words so log searches written for vLLM find it::

    Avg prompt throughput: 52.1 tokens/s, Avg generation throughput: 24.3 tokens/s,
    Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 40.0%;
    SpecDecoding metrics: Mean acceptance length: 2.35, Accepted throughput: 13.50 tokens/s,
    Drafted throughput: 30.00 tokens/s, Accepted: 135 tokens, Drafted: 300 tokens, Drafts: 100,
    Per-position acceptance rate: 0.800, 0.400, 0.150, Avg Draft acceptance rate: 45.0%

(one line).  The figures are those of the interval, counted from the same events as the
``/metrics`` counters, so summed over lines they equal them: ``Accepted`` and ``Drafted``
the increase of ``specserve_spec_decode_num_accepted_tokens_total`` and
``..._num_draft_tokens_total``, ``Drafts`` of ``..._num_drafts_total``; mean acceptance
length = 1 + Accepted / Drafts; per-position rate p = accepted at p / Drafts.  The
SpecDecoding part appears when the interval had drafts.  An idle interval after an idle
one is logged at DEBUG (vLLM does the same), so an idle server does not fill its log.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from specserve.engine.stats import RequestFinishedStats, StepStats


@dataclass
class _Counts:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class StatsLog:
    """Counts the engine's events between two ``line`` calls."""

    def __init__(self, now: float):
        self._lock = threading.Lock()
        self._counts = _Counts()
        self._since = now
        self._last_active = True  # the first line is logged at INFO whatever it says

    # ------------------------------------------------------------------ StatsListener (engine thread)

    def on_step(self, stats: StepStats) -> None:
        with self._lock:
            c = self._counts
            c.prompt_tokens += stats.num_prompt_tokens
            c.generation_tokens += stats.num_generation_tokens
            c.prefix_queries += stats.prefix_cache_queries
            c.prefix_hits += stats.prefix_cache_hits
            for req in stats.requests:
                if req.num_draft_tokens <= 0:
                    continue
                c.drafts += 1
                c.draft_tokens += req.num_draft_tokens
                c.accepted += req.num_accepted_tokens
                if len(c.accepted_per_pos) < len(req.accepted_per_position):
                    c.accepted_per_pos += [0] * (len(req.accepted_per_position) - len(c.accepted_per_pos))
                for pos, ok in enumerate(req.accepted_per_position):
                    c.accepted_per_pos[pos] += 1 if ok else 0

    def on_request_finished(self, stats: RequestFinishedStats) -> None:
        pass

    # ------------------------------------------------------------------ the line (event loop)

    def line(self, now: float, running: int, waiting: int, kv_usage: float) -> tuple[str, bool]:
        """The interval's line and whether it is worth INFO (activity now or in the last one);
        the counts start again from zero."""
        with self._lock:
            c, self._counts = self._counts, _Counts()
        elapsed = max(now - self._since, 1e-9)
        self._since = now
        hit_rate = 100.0 * c.prefix_hits / c.prefix_queries if c.prefix_queries else 0.0
        text = (f"Avg prompt throughput: {c.prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {c.generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {100.0 * kv_usage:.1f}%, "
                f"Prefix cache hit rate: {hit_rate:.1f}%")  # fmt: skip
        if c.drafts:
            per_pos = ", ".join(f"{n / c.drafts:.3f}" for n in c.accepted_per_pos)
            text += (f"; SpecDecoding metrics: Mean acceptance length: {1 + c.accepted / c.drafts:.2f}, "
                     f"Accepted throughput: {c.accepted / elapsed:.2f} tokens/s, "
                     f"Drafted throughput: {c.draft_tokens / elapsed:.2f} tokens/s, "
                     f"Accepted: {c.accepted} tokens, Drafted: {c.draft_tokens} tokens, Drafts: {c.drafts}, "
                     f"Per-position acceptance rate: {per_pos}, "
                     f"Avg Draft acceptance rate: {100.0 * c.accepted / c.draft_tokens:.1f}%")  # fmt: skip
        active = bool(c.prompt_tokens or c.generation_tokens or running or waiting)
        worth_info = active or self._last_active
        self._last_active = active
        return text, worth_info


def startup_line(info: Any, host: str, grpc_port: int, http_port: int, tls: bool, api_key: bool) -> str:
    """What the server says once both ports listen: the model, method and K, dtype and
    device, the kernels' backends, the ports and whether a key is needed."""
    method = info.method or "none"
    spec = f"method {method}, K={int(info.num_speculative_tokens or 0)}" if method != "none" else "method none"
    if method != "none" and not getattr(info, "lossless", True):
        spec += " (LOSSY: synthetic acceptance)"
    scheme = "https" if tls else "http"
    defaults = getattr(info, "sampling_defaults", None)
    if defaults:  # the model's generation_config.json fills what requests leave out
        from specserve.generation_defaults import describe

        spec += f", request defaults from generation_config.json: {describe(defaults)}"
    return (f"serving {info.model_name}: {spec}, dtype {getattr(info, 'dtype', '?')} on {getattr(info, 'device', '?')}, "
            f"attention {getattr(info, 'attention_backend', '?')}, rejection {getattr(info, 'rejection_backend', '?')}, "
            f"tensor parallel {int(getattr(info, 'tensor_parallel_size', 1))}; gRPC on {host}:{grpc_port}"
            f"{' (TLS)' if tls else ''}, HTTP on {scheme}://{host}:{http_port}, API key {'required' if api_key else 'off'}")

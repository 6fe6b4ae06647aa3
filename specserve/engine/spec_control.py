"""How many drafts to verify per step (pure Python): speculation that never loses.

``fixed``: always K (``num_spec_tokens``: ``method.num_speculative_tokens``).
``adaptive``: each step picks its number of drafts k in {0} + candidates (the
verification sizes the runner has captured, so graphs stay full) that maximises
the expected tokens per second of the next step:

    tokens(k) = B * E(k),  E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j
    time(k)   = step(B, k+1) + propose(k)

where a_j is the measured probability that draft j is accepted given drafts
1..j-1 were (counts per position, decayed), step(B, q) the measured wall time
of a step with batch bucket B (``executor.batch.batch_bucket``: the buckets
CUDA graphs are captured for, up to ``max_num_seqs``) and q tokens per
sequence (seeded from timed graph replays when the runner has them, else
learned online; an unmeasured q is assumed to cost what q=1 costs, so it gets
tried), and propose(k) the measured time of proposing k drafts.  k = 0 turns
speculation off; while off, one step runs K after ``probe_every`` steps so
acceptance and costs stay current.
Each probe that leaves speculation off doubles that interval (up to ``probe_max``
steps): a drafter that keeps losing, e.g. one whose drafts cost several target
steps, stops paying a probe every few dozen steps.  Speculating again resets it.
Until ``warmup_rounds`` drafts have been verified every step drafts K (acceptance
is not trusted from a handful of rounds).  The choice is exported as a gauge.  A
change of the choice is logged at INFO at most once per ``log_interval_s`` (by
``clock``): the line says the current choice and how many changes it stands for;
every change and every probe is logged at DEBUG.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from specserve.executor.batch import batch_bucket

log = logging.getLogger(__name__)

DECAY = 0.98  # per observed step: acceptance and cost estimates follow drift over ~50 steps
LOG_INTERVAL_S = 5.0  # at most one INFO line per this many seconds about the choice of K


@dataclass
class _Ema:
    value: float | None = None
    alpha: float = 0.2

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


@dataclass
class SpecController:
    num_spec_tokens: int  # K: the most drafts a step verifies per request
    adaptive: bool = False
    candidates: tuple[int, ...] = ()
    # The engine's max_num_seqs: batches are bucketed as CUDA graphs are (None: powers of two).
    max_num_seqs: int | None = None
    probe_every: int = 32
    probe_max: int = 1024
    # Verified drafts (first position, decayed) before acceptance is trusted: until then
    # every step drafts K, so one unlucky early round cannot switch speculation off.
    warmup_rounds: float = 16.0
    step_cost: dict[tuple[int, int], _Ema] = field(default_factory=dict)
    propose_cost: dict[int, _Ema] = field(default_factory=dict)
    reached: list[float] = field(default_factory=list)  # drafts that reached position i
    accepted: list[float] = field(default_factory=list)  # ... and were accepted there
    num_drafts: int = 0  # the last choice: drafts per request in the step being proposed
    _steps_off: int = 0
    _interval: int = 0  # steps off before the next probe (probe_every, doubling)
    _probed: bool = False  # the previous choice was a probe
    _last_k: int | None = None
    # Logging: INFO about the choice at most once per log_interval_s seconds of clock().
    log_interval_s: float = LOG_INTERVAL_S
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _logged_k: int | None = None  # the choice the last INFO line reported
    _last_decided: int | None = None
    _logged_at: float | None = None
    _changes: int = 0  # changes of the choice since that line

    def __post_init__(self) -> None:
        K = self.num_spec_tokens
        self.candidates = tuple(sorted({k for k in (self.candidates or range(1, K + 1)) if 1 <= k <= K}))
        self.reached = [0.0] * K
        self.accepted = [0.0] * K
        self.num_drafts = K
        self._interval = self.probe_every
        self._logged_k = K

    # ------------------------------------------------------------------ observations
    def seed_costs(self, table: dict[tuple[int, int], float]) -> None:
        """Costs per (batch bucket, q) measured up front (timed CUDA graph replays)."""
        for key, seconds in table.items():
            self.step_cost.setdefault(key, _Ema()).add(seconds)

    def observe_step(self, batch_size: int, q: int | None, step_s: float, propose_s: float | None) -> None:
        """One step's costs; ``propose_s`` None when the step proposed for no request (all
        finished, or all with speculation off)."""
        if batch_size == 0:
            return
        if q is not None:  # only fixed-shape steps say what a (bucket, q) costs
            self.step_cost.setdefault((self.bucket(batch_size), q), _Ema()).add(step_s)
        if propose_s is not None:
            self.propose_cost.setdefault(self.num_drafts, _Ema()).add(propose_s)

    def bucket(self, batch_size: int) -> int:
        """The batch bucket whose costs a batch of ``batch_size`` requests reads and updates."""
        return batch_bucket(batch_size, self.max_num_seqs)

    def observe_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: drafts 1..num_accepted were accepted, and draft
        num_accepted + 1 (if drafted) was the first rejected."""
        if num_drafts == 0:
            return
        for i in range(len(self.reached)):
            self.reached[i] *= DECAY
            self.accepted[i] *= DECAY
        for i in range(min(num_drafts, num_accepted + 1)):
            self.reached[i] += 1.0
            if i < num_accepted:
                self.accepted[i] += 1.0

    # ------------------------------------------------------------------ decision
    def expected_tokens(self, k: int) -> float:
        """E(k) = 1 + sum over i <= k of P(drafts 1..i all accepted); an unseen
        position is assumed to be accepted as often as the last seen one."""
        total, run, last = 1.0, 1.0, 0.5
        for i in range(k):
            a = self.accepted[i] / self.reached[i] if self.reached[i] > 0.5 else last
            last = a
            run *= a
            total += run
        return total

    def _cost(self, bucket: int, q: int) -> float | None:
        ema = self.step_cost.get((bucket, q))
        if ema is not None and ema.value is not None:
            return ema.value
        base = self.step_cost.get((bucket, 1))
        return None if base is None else base.value

    def choose(self, batch_size: int) -> int:
        """Drafts per request for the next step of a batch of ``batch_size`` decoding requests."""
        if not self.adaptive or batch_size == 0 or self.reached[0] < self.warmup_rounds:
            k = self.num_spec_tokens
        else:
            k = self._best(self.bucket(batch_size), batch_size)
            if k > 0:  # speculating again: the next spell off starts probing at probe_every
                self._interval = self.probe_every
            elif self._probed:  # the probe just measured says still off: wait twice as long
                self._interval = min(2 * self._interval, self.probe_max)
            self._probed = False
        decided = k
        if self.adaptive and k == 0:
            self._steps_off += 1
            if self._steps_off >= self._interval:  # look again: acceptance or costs may have moved
                self._steps_off = 0
                self._probed = True
                k = self.num_spec_tokens
        else:
            self._steps_off = 0
        if self.adaptive and batch_size > 0:  # an idle engine decides nothing
            self._log_choice(decided, k, batch_size)
        self._last_k = self.num_drafts = k
        return k

    def _log_choice(self, decided: int, k: int, batch_size: int) -> None:
        """Every change and probe at DEBUG; the decision (probes aside) at INFO when it
        differs from the last INFO line, at most once per ``log_interval_s``."""
        if k != decided:
            log.debug("speculation: probing %d drafts at batch %d", k, batch_size)
        elif self._last_k is not None and k != self._last_k:
            log.debug("speculation: %d drafts per step at batch %d (was %d)", k, batch_size, self._last_k)
        if self._last_decided is not None and decided != self._last_decided:
            self._changes += 1
        self._last_decided = decided
        if decided == self._logged_k:
            return
        now = self.clock()
        if self._logged_at is not None and now - self._logged_at < self.log_interval_s:
            return  # said at the first step past the interval, if it still differs then
        extra = f"; {self._changes} changes since the last report" if self._changes > 1 else ""
        log.info("speculation: %d drafts per step at batch %d (was %d%s)", decided, batch_size, self._logged_k, extra)
        self._logged_k, self._logged_at, self._changes = decided, now, 0

    def _best(self, bucket: int, batch_size: int) -> int:
        base = self._cost(bucket, 1)
        if base is None:
            # Nothing measured yet: speculate and learn.  Once a K step is measured, one
            # plain step measures the base cost (without graph timings, as on the CPU,
            # nothing else would ever measure it and K would stay fixed).
            return 0 if self._cost_known(bucket, self.num_spec_tokens + 1) else self.num_spec_tokens
        best_k, best_rate = 0, batch_size / (base + self._propose(0))
        for k in self.candidates:
            cost = self._cost(bucket, k + 1)
            if cost is None:
                continue
            rate = batch_size * self.expected_tokens(k) / (cost + self._propose(k))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _cost_known(self, bucket: int, q: int) -> bool:
        ema = self.step_cost.get((bucket, q))
        return ema is not None and ema.value is not None

    def _propose(self, k: int) -> float:
        """Measured cost of proposing k drafts; an unmeasured k is interpolated linearly
        between the nearest measured k below and above it (drafting is k steps of the
        same work), else the largest measured cost (0 for k = 0)."""
        ema = self.propose_cost.get(k)
        if ema is not None and ema.value is not None:
            return ema.value
        known = {kk: e.value for kk, e in self.propose_cost.items() if e.value is not None}
        below = [kk for kk in known if kk < k]
        above = [kk for kk in known if kk > k]
        if below and above:
            lo, hi = max(below), min(above)
            return known[lo] + (known[hi] - known[lo]) * (k - lo) / (hi - lo)
        rest = [v for kk, v in known.items() if kk > 0]
        return 0.0 if k == 0 or not rest else max(rest)

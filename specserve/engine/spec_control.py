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
is not trusted from a handful of rounds).  The choice is exported as a gauge.

With draft trees (``trees``: ``method.tree``) each step also chooses the shape: a chain
of k drafts or a tree of k nodes (k + 1 verified tokens), k in the same candidates, and
the tree's depth d (its drafting steps) among ``tree_depths`` (d <= k; the configured
depth is the largest): a deep tree accepts more, a shallow one costs less to draft,
and which wins depends on the drafter and the device.  A tree's E(k, d) is 1 + the
decayed mean accepted length of the tree rounds of that shape (a tree's acceptance is
not a product over positions; a shape's rounds decay only as it is observed, so a shape
tried and found wanting keeps its measure instead of being tried again as soon as other
shapes' rounds pile up); an unmeasured shape takes the nearest measured one's
(the same depth first), capped at min(k, d) + 1, and with no tree measured the chain's
E(k), so trees get tried.  Chains learn per-position acceptance from chain rounds
only.  Both shapes share step(B, k+1) (the same verified tokens); propose costs are
kept per shape (a tree round runs d drafting steps over ``topk``-wide frontiers): an
unmeasured tree shape costs what the nearest measured node count of its depth costs,
else the measured depths' costs interpolated (or scaled by depth), else the chain's.
Every measured cost (steps per q, chains per k, trees per depth) is shrunk toward a
weighted line fitted over all its measured sizes, by a few pseudo-observations: on a
host whose speed moves from one moment to the next, a size measured a few times in a
noisy moment cannot look cheaper than a smaller one and steer every later choice
(unmeasured sizes keep their optimistic assumptions, so they still get tried).  And
every timing is stored relative to the host's current speed
(``level``: each step's time over what its size was measured to cost, followed fast):
sizes are compared at one speed, so a slow spell while one size runs does not make the
sizes timed before it look cheaper, and the choice does not flap with the host's load.
With ``engine.draft_confidence_threshold=auto`` each request's chain also stops early
where its drafter is unsure (``draft_cut``): the cumulative draft probability below which
one more draft is expected to cost more than it saves, from the same measured costs and
acceptance.
Ties go to the tree, then to the deeper one (what the configuration asked for).
Warm-up cycles through the configured tree, a chain and the other depths so each is
measured; probes and ``fixed`` draft the configured tree.  ``choose`` returns a
``Choice``: an int (the drafts) that also says ``tree`` and ``depth``.  A
change of the choice is logged at INFO at most once per ``log_interval_s`` (by
``clock``): the line says the current choice and how many changes it stands for;
every change and every probe is logged at DEBUG.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from specserve.executor.batch import batch_bucket

log = logging.getLogger(__name__)

DECAY = 0.98  # per observed step: acceptance and cost estimates follow drift over ~50 steps
LOG_INTERVAL_S = 5.0  # at most one INFO line per this many seconds about the choice of K


TRUST = 20.0  # observations an estimate counts for at most (a timed graph replay counts this much)
SHRINK = 5.0  # pseudo-observations of the fitted line behind every cost estimate
LEVEL_ALPHA = 0.3  # how fast SpecController.level follows the host's speed
MAX_CUT = 0.5  # the highest derived draft confidence cut (SpecController.draft_cut)


@dataclass
class _Ema:
    value: float | None = None
    alpha: float = 0.2
    n: float = 0.0  # observations behind the value, at most TRUST: its weight beside the others

    def add(self, x: float, weight: float = 1.0) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        self.n = min(self.n + weight, TRUST)


def _line(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Weighted least squares y = a + b x over (x, y, weight), the slope at least 0 (more
    verified tokens or drafting steps never cost less); None with fewer than two distinct x.
    (A decision fits the same points once per candidate size: the fits are remembered.)"""
    return _fit(tuple(points))


@functools.lru_cache(maxsize=256)
def _fit(points: tuple[tuple[float, float, float], ...]) -> tuple[float, float] | None:
    pts = [(x, y, w) for x, y, w in points if w > 0]
    if len({x for x, _, _ in pts}) < 2:
        return None
    W = sum(w for _, _, w in pts)
    mx = sum(w * x for x, _, w in pts) / W
    my = sum(w * y for _, y, w in pts) / W
    sxx = sum(w * (x - mx) ** 2 for x, _, w in pts)
    b = max(sum(w * (x - mx) * (y - my) for x, y, w in pts) / sxx, 0.0)
    return my - b * mx, b


def _between(values: dict[int, float], x: int) -> float | None:
    """``values`` interpolated linearly at ``x`` between the nearest sizes below and above
    it; None unless both exist."""
    below = [v for v in values if v < x]
    above = [v for v in values if v > x]
    if not below or not above:
        return None
    lo, hi = max(below), min(above)
    return values[lo] + (values[hi] - values[lo]) * (x - lo) / (hi - lo)


def _shrunk(own: "_Ema | None", fit: float | None) -> float | None:
    """``own``'s value pulled toward the fitted line's ``fit`` by SHRINK pseudo-observations:
    a cost measured a few times (maybe in a noisy moment) leans on what the other sizes
    say, one measured often (or timed exactly) keeps its own."""
    if own is None or own.value is None:
        return fit
    if fit is None:
        return own.value
    return (own.n * own.value + SHRINK * fit) / (own.n + SHRINK)


class Choice(int):
    """Drafts per request for the next step (an int, so it reads as before), ``tree``:
    whether they are drafted as a tree (only ever True with ``method.tree``), and
    ``depth``: the tree's drafting steps (0: as configured, and for a chain)."""

    tree: bool
    depth: int

    def __new__(cls, num_drafts: int, tree: bool = False, depth: int = 0) -> "Choice":
        c = super().__new__(cls, num_drafts)
        c.tree = bool(tree) and num_drafts > 0
        c.depth = int(depth) if c.tree else 0
        return c

    @property
    def key(self) -> tuple[int, bool, int]:
        return int(self), self.tree, self.depth


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
    # Draft trees (method.tree): the shape is chosen too; K (fixed, warm-up, probes) is a tree.
    trees: bool = False
    # The depths a tree may be given (its drafting steps), the configured one the largest;
    # (0,): only the configured tree (0: as configured).
    tree_depths: tuple[int, ...] = (0,)
    tree: bool = False  # the last choice drafts trees
    depth: int = 0  # ... of this depth (0: as configured)
    # Per tree shape (nodes, depth): rounds (decayed), their accepted drafts, proposing costs.
    tree_rounds: dict[tuple[int, int], float] = field(default_factory=dict)
    tree_accepted: dict[tuple[int, int], float] = field(default_factory=dict)
    tree_propose_cost: dict[tuple[int, int], _Ema] = field(default_factory=dict)
    # The host's speed relative to when the costs were learned (every step's timing over
    # its size's estimate, LEVEL_ALPHA per step): timings are stored divided by it, so a
    # slow spell raises the level instead of the cost of whatever size ran during it.
    level: float = 1.0
    _steps_off: int = 0
    _interval: int = 0  # steps off before the next probe (probe_every, doubling)
    _probed: bool = False  # the previous choice was a probe
    _last_k: tuple[int, bool, int] | None = None
    _warmups: int = 0  # warm-up choices made (they cycle through the shapes)
    # Logging: INFO about the choice at most once per log_interval_s seconds of clock().
    log_interval_s: float = LOG_INTERVAL_S
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _logged_k: tuple[int, bool, int] | None = None  # the choice the last INFO line reported
    _last_decided: tuple[int, bool, int] | None = None
    _logged_at: float | None = None
    _changes: int = 0  # changes of the choice since that line

    def __post_init__(self) -> None:
        K = self.num_spec_tokens
        self.candidates = tuple(sorted({k for k in (self.candidates or range(1, K + 1)) if 1 <= k <= K}))
        self.tree_depths = tuple(sorted(set(self.tree_depths))) or (0,)
        self.reached = [0.0] * K
        self.accepted = [0.0] * K
        self.num_drafts = K
        self.tree = self.trees and K > 0
        self.depth = self.full_depth if self.tree else 0
        self._interval = self.probe_every
        self._logged_k = Choice(K, self.trees, self.full_depth).key

    @property
    def full_depth(self) -> int:
        """The configured tree's depth (0: as configured)."""
        return self.tree_depths[-1]

    def _configured(self, k: int) -> Choice:
        """k drafts in the configured shape: its tree at its depth, else a chain."""
        return Choice(k, self.trees, self.full_depth)

    # ------------------------------------------------------------------ observations
    def seed_costs(self, table: dict[tuple[int, int], float]) -> None:
        """Costs per (batch bucket, q) measured up front (timed CUDA graph replays: exact,
        so each counts as a well-observed cost)."""
        for key, seconds in table.items():
            self.step_cost.setdefault(key, _Ema()).add(seconds, weight=TRUST)

    def observe_step(self, batch_size: int, q: int | None, step_s: float, propose_s: float | None) -> None:
        """One step's costs; ``propose_s`` None when the step proposed for no request (all
        finished, or all with speculation off)."""
        if batch_size == 0:
            return
        if q is not None:  # only fixed-shape steps say what a (bucket, q) costs
            bucket = self.bucket(batch_size)
            expected = self._cost(bucket, q) if self._cost_known(bucket, q) else None
            if expected:  # the host's speed now, against what this size was measured to cost
                self.level += LEVEL_ALPHA * (step_s / expected - self.level)
            self.step_cost.setdefault((bucket, q), _Ema()).add(step_s / self.level)
        if propose_s is not None:
            if self.tree:
                self.tree_propose_cost.setdefault((self.num_drafts, self.depth), _Ema()).add(propose_s / self.level)
            else:
                self.propose_cost.setdefault(self.num_drafts, _Ema()).add(propose_s / self.level)

    def bucket(self, batch_size: int) -> int:
        """The batch bucket whose costs a batch of ``batch_size`` requests reads and updates."""
        return batch_bucket(batch_size, self.max_num_seqs)

    def observe_drafts(self, num_drafts: int, num_accepted: int, tree: bool = False, depth: int = 0) -> None:
        """One request's verification: drafts 1..num_accepted were accepted, and draft
        num_accepted + 1 (if drafted) was the first rejected.  ``tree``: the drafts were
        a tree's ``num_drafts`` nodes drafted at ``depth`` (the choice that proposed them),
        ``num_accepted`` the accepted path's length."""
        if num_drafts == 0:
            return
        if tree:  # each shape's own rounds decay as it is observed: one tried and left stays measured
            key = (num_drafts, depth)
            self.tree_rounds[key] = self.tree_rounds.get(key, 0.0) * DECAY + 1.0
            self.tree_accepted[key] = self.tree_accepted.get(key, 0.0) * DECAY + num_accepted
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

    def expected_tree_tokens(self, k: int, depth: int | None = None) -> float:
        """1 + the mean accepted length of tree rounds of k nodes at ``depth`` (default: the
        configured one); an unmeasured shape takes the nearest measured one's (the same
        depth first, then the nearest node count, the smaller on a tie), at most
        min(k, depth) + 1; none measured: the chain's E(k), so trees get tried."""
        d = self.full_depth if depth is None else depth
        measured = [m for m, w in self.tree_rounds.items() if w > 0.5]
        if not measured:
            return self.expected_tokens(k)
        n = min(measured, key=lambda m: (abs(m[1] - d), abs(m[0] - k), m[0], m[1]))
        cap = min(k, d) if d > 0 else k
        return min(1.0 + self.tree_accepted[n] / self.tree_rounds[n], cap + 1.0)

    def _warm(self) -> bool:
        """Enough drafts verified (chain first positions plus tree rounds, decayed) to
        trust the acceptance estimates."""
        return self.reached[0] + sum(self.tree_rounds.values()) >= self.warmup_rounds

    def _cost(self, bucket: int, q: int) -> float | None:
        """A step of q tokens per sequence in ``bucket``: its measured cost shrunk toward the
        line fitted over every measured q of the bucket (one noisy measurement cannot make
        8 tokens look cheaper than 1); an unmeasured q is assumed to cost what q = 1 costs,
        so it gets tried (None: nothing measured)."""
        ema = self.step_cost.get((bucket, q))
        if ema is not None and ema.value is not None:
            line = self._step_line(bucket)
            return _shrunk(ema, None if line is None else line[0] + line[1] * q)
        base = self.step_cost.get((bucket, 1))
        return None if base is None else base.value

    def choose(self, batch_size: int) -> Choice:
        """Drafts per request for the next step of a batch of ``batch_size`` decoding
        requests, and (``Choice.tree``) whether they are drafted as a tree."""
        K = self.num_spec_tokens
        if not self.adaptive or batch_size == 0:
            c = self._configured(K)
        elif not self._warm():
            c = self._warmup_choice()
        else:
            c = self._best(self.bucket(batch_size), batch_size)
            if c > 0:  # speculating again: the next spell off starts probing at probe_every
                self._interval = self.probe_every
            elif self._probed:  # the probe just measured says still off: wait twice as long
                self._interval = min(2 * self._interval, self.probe_max)
            self._probed = False
        decided = c
        if self.adaptive and c == 0:
            self._steps_off += 1
            if self._steps_off >= self._interval:  # look again: acceptance or costs may have moved
                self._steps_off = 0
                self._probed = True
                c = self._configured(K)
        else:
            self._steps_off = 0
        if self.adaptive and batch_size > 0:  # an idle engine decides nothing
            self._log_choice(decided, c, batch_size)
        self._last_k, self.num_drafts, self.tree, self.depth = c.key, int(c), c.tree, c.depth
        return c

    def _warmup_choice(self) -> Choice:
        """K drafts; with trees, warm-up cycles through the configured tree, a chain and the
        tree at each other depth, so every shape is measured."""
        K = self.num_spec_tokens
        if not self.trees:
            return Choice(K)
        shapes = [(True, self.full_depth), (False, 0)]
        shapes += [(True, d) for d in reversed(self.tree_depths[:-1]) if d <= K]
        tree, depth = shapes[self._warmups % len(shapes)]
        self._warmups += 1
        return Choice(K, tree, depth)

    def _say(self, key: tuple[int, bool, int] | None) -> str:
        """A choice as the log lines write it: the drafts, and with trees the shape."""
        if key is None:
            return "?"
        k, tree, depth = key
        if not self.trees or k == 0:
            return str(k)
        if not tree:
            return f"chain of {k}"
        return f"tree of {k}" + (f" (depth {depth})" if len(self.tree_depths) > 1 else "")

    def _log_choice(self, decided: Choice, c: Choice, batch_size: int) -> None:
        """Every change and probe at DEBUG; the decision (probes aside) at INFO when it
        differs from the last INFO line, at most once per ``log_interval_s``."""
        if c.key != decided.key:
            log.debug("speculation: probing %s drafts at batch %d", self._say(c.key), batch_size)
        elif self._last_k is not None and c.key != self._last_k:
            log.debug("speculation: %s drafts per step at batch %d (was %s)", self._say(c.key), batch_size,
                      self._say(self._last_k))
        if self._last_decided is not None and decided.key != self._last_decided:
            self._changes += 1
        self._last_decided = decided.key
        if decided.key == self._logged_k:
            return
        now = self.clock()
        if self._logged_at is not None and now - self._logged_at < self.log_interval_s:
            return  # said at the first step past the interval, if it still differs then
        extra = f"; {self._changes} changes since the last report" if self._changes > 1 else ""
        log.info("speculation: %s drafts per step at batch %d (was %s%s)", self._say(decided.key), batch_size,
                 self._say(self._logged_k), extra)
        self._logged_k, self._logged_at, self._changes = decided.key, now, 0

    def _best(self, bucket: int, batch_size: int) -> Choice:
        K = self.num_spec_tokens
        base = self._cost(bucket, 1)
        if base is None:
            # Nothing measured yet: speculate and learn.  Once a K step is measured, one
            # plain step measures the base cost (without graph timings, as on the CPU,
            # nothing else would ever measure it and K would stay fixed).
            return Choice(0 if self._cost_known(bucket, K + 1) else K, self.trees)
        best, best_rate = Choice(0), batch_size / (base + self._propose(0))
        # trees first, the deepest first: at an equal rate the configured shape wins
        shapes = [(k, True, d) for d in reversed(self.tree_depths) for k in self.candidates
                  if d <= k] if self.trees else []
        for k, tree, d in shapes + [(k, False, 0) for k in self.candidates]:
            cost = self._cost(bucket, k + 1)  # the same verified tokens: one cost for both shapes
            if cost is None:
                continue
            e = self.expected_tree_tokens(k, d) if tree else self.expected_tokens(k)
            rate = batch_size * e / (cost + self._propose(k, tree, d))
            if rate > best_rate:
                best, best_rate = Choice(k, tree, d), rate
        return best

    def draft_cut(self, batch_size: int) -> float:
        """The confidence below which a chain stops drafting (``DraftRequest.min_confidence``):
        draft i + 1 runs only while the drafter's cumulative probability of drafts 1..i
        (its estimate that all of them are accepted) times the conditional acceptance
        measured past the first position is worth more of a step than one more draft
        costs, i.e. while it is at least

            theta = (propose slope per draft + step slope per verified token) / (a * step(B, 1))

        with both slopes from the weighted lines over the measured sizes.  0 (never cut)
        while speculating at a fixed K, before warm-up, or until two chain lengths and two
        query lengths are measured; at most ``MAX_CUT``."""
        if not self.adaptive or batch_size == 0 or not self._warm():
            return 0.0
        bucket = self.bucket(batch_size)
        base = self._cost(bucket, 1)
        prop, step = self._propose_line(), self._step_line(bucket)
        if not base or prop is None or step is None:
            return 0.0
        reached, accepted = sum(self.reached[1:]), sum(self.accepted[1:])
        if reached < 0.5:
            reached, accepted = self.reached[0], self.accepted[0]
        a = accepted / reached if reached > 0.5 else 0.5
        if a <= 0.0:
            return MAX_CUT
        return min((prop[1] + step[1]) / (a * base), MAX_CUT)

    def _step_line(self, bucket: int) -> tuple[float, float] | None:
        """The weighted line of step cost over the verified tokens per sequence measured in ``bucket``."""
        return _line([(q, e.value, e.n) for (b, q), e in self.step_cost.items() if b == bucket and e.value is not None])

    def _propose_line(self) -> tuple[float, float] | None:
        """The weighted line of a chain's proposing cost over its measured lengths k >= 1."""
        return _line([(k, e.value, e.n) for k, e in self.propose_cost.items() if k > 0 and e.value is not None])

    def _cost_known(self, bucket: int, q: int) -> bool:
        ema = self.step_cost.get((bucket, q))
        return ema is not None and ema.value is not None

    def _propose(self, k: int, tree: bool = False, depth: int | None = None) -> float:
        """Measured cost of proposing k drafts.  A chain's: a measured k's cost shrunk toward
        the line fitted over the measured k >= 1; an unmeasured k is interpolated linearly
        between the nearest measured k below and above it (drafting is k steps of the same
        work), else the largest measured cost (0 for k = 0).  A tree's (``_tree_propose``):
        from its own shapes' costs, the chain's while no tree was measured."""
        if tree:
            known = {m: e for m, e in self.tree_propose_cost.items() if e.value is not None}
            if known:
                return self._tree_propose(k, self.full_depth if depth is None else depth, known)
        known_k = {kk: e for kk, e in self.propose_cost.items() if e.value is not None}
        if k in known_k:
            line = self._propose_line() if k > 0 else None
            return _shrunk(known_k[k], None if line is None else line[0] + line[1] * k)
        between = _between({kk: e.value for kk, e in known_k.items()}, k)
        if between is not None:
            return between
        rest = [e.value for kk, e in known_k.items() if kk > 0]
        return 0.0 if k == 0 or not rest else max(rest)

    @staticmethod
    def _tree_propose(k: int, depth: int, known: dict[tuple[int, int], _Ema]) -> float:
        """A tree shape's proposing cost from the measured ones.  A round drafts the same
        levels whatever it keeps, so the cost follows the depth: a depth measured at some
        node count (the shape's own, else the nearest) gives its cost, shrunk toward the line
        fitted over depth from every measured shape; an unmeasured depth is interpolated
        linearly between the measured depths around it, or outside them scaled by depth
        from the nearest (so a shallower tree than any measured gets tried)."""
        by_depth: dict[int, _Ema] = {}
        for d in {d for _, d in known}:
            by_depth[d] = known.get((k, d)) or known[min((m for m in known if m[1] == d),
                                                         key=lambda m: (abs(m[0] - k), m[0]))]
        if depth in by_depth:
            line = _line([(d, e.value, e.n) for (_, d), e in known.items()])
            return _shrunk(by_depth[depth], None if line is None else line[0] + line[1] * depth)
        between = _between({d: e.value for d, e in by_depth.items()}, depth)
        if between is not None:
            return between
        near = min(by_depth, key=lambda d: (abs(d - depth), d))
        v = by_depth[near].value
        return v * depth / near if near > 0 and depth > 0 else v


def tree_depth_choices(tree) -> tuple[int, ...]:
    """The depths adaptive speculation may give a configured tree (a ``TreeConfig``): 2 up
    to ``method.tree.depth`` for a dynamic tree (a depth-1 tree is the root's siblings
    only), a static tree's own depth alone (its shape was asked for)."""
    t = tree.expanded()
    if t.static is not None or t.depth <= 2:
        return (t.depth,)
    return tuple(range(2, t.depth + 1))

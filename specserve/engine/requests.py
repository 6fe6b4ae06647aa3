"""The engine's per-request state: one owner per request, one teardown (pure Python).

A request's state is one ``RequestState``: its ``Sequence`` (tokens, KV block table,
status: what the scheduler schedules), its output processor, its grammar matcher,
its prompt log-probabilities so far and the drafts waiting for verification
(``Drafts``).  ``RequestTable`` holds them by request id.

Lifecycle:

* admission (``LLMEngine.add_request``): the state is built and filed
  (``RequestTable.add``) and its sequence queued with the scheduler;
* each step: a ``ScheduledSeq`` (``engine.scheduler``) carries the drafts the
  request runs in that step and, once verified, its ``Verified`` result;
* teardown: :meth:`RequestTable.release`, the one place that drops a request's
  state.  Finishing (stop, length, abort, a failure of that request alone, through
  ``LLMEngine._finish``) and preemption both call it.  It drops the pending drafts
  and calls the release hook of every per-method state (``remove(request_id)``: the
  proposer's per-request states and their KV blocks, Predicted Outputs' indexes).
  A finished request also leaves the scheduler, which frees its KV blocks, and the
  table.  A preempted request stays in the table: the scheduler has freed its blocks
  and queued it to be recomputed from its tokens.

Per-method state: each proposer keeps its own state by request id (it alone knows
its shape) and frees it in ``remove``, its release hook (``proposers.base.Proposer``),
which only ``release`` calls.  A proposer whose K/V lives in the engine's cache,
in the requests' own blocks (EAGLE's head layer), asks for blocks through
``RequestBlocks`` (a ``proposers.base.KVBlocks``) rather than growing a block
table itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from specserve.engine.output import OutputProcessor
from specserve.engine.sequence import Sequence
from specserve.request import TokenLogprob

__all__ = ["Drafts", "MethodState", "RequestBlocks", "RequestState", "RequestTable", "Verified"]


@dataclass
class Drafts:
    """Drafts proposed after a verification, to be verified by the request's next step."""

    token_ids: list[int] = field(default_factory=list)
    # (n, V) float32: the distributions the drafts were sampled from (probabilistic
    # verification), or None when they are deterministic (one-hot q).
    probs: Any = None
    num_from_prediction: int = 0  # leading drafts that came from the request's Predicted Output
    # A tree: the parent of each draft (an index into token_ids, -1 = the pending token;
    # parents first), verified as a tree in one forward; None: a chain.
    parents: list[int] | None = None
    depth: int = 0  # a tree's drafting steps as adaptive speculation chose them (0: as configured)
    num_forced: int = 0  # drafts forced by the request's grammar or reasoning gate (none of the method's)

    def first(self, n: int) -> Drafts:
        """The first ``n`` drafts (those the scheduler made room for this step); a tree's
        first ``n`` nodes are a tree too (parents come first)."""
        parents = self.parents[:n] if self.parents is not None else None
        return Drafts(self.token_ids[:n], self.probs, min(self.num_from_prediction, n), parents, self.depth,
                      min(self.num_forced, n))


@dataclass
class Verified:
    """One sampled request's verification in a step: what it emits, or what failed it."""

    tokens: list[int] = field(default_factory=list)  # the accepted drafts, then the recovered or bonus token
    num_accepted: int = 0  # drafts accepted (len(tokens) - 1 when verified)
    logprobs: list[TokenLogprob] | None = None  # per emitted token, when the request asked for logprobs
    # A failure of this request alone (its neighbours carry on), and what the engine was doing.
    failure: Exception | None = None
    stage: str = ""
    # A tree's accepted drafts, as indexes into its drafts (root to leaf); None for a chain.
    path: list[int] | None = None

    @classmethod
    def failed(cls, stage: str, exc: Exception) -> Verified:
        return cls(failure=exc, stage=stage)


@dataclass
class RequestState:
    """Everything the engine keeps for one request."""

    seq: Sequence  # carries the request's Philox key (seq.seed)
    proc: OutputProcessor | None = None  # None when the caller detokenizes (AsyncEngine)
    grammar: Any = None  # specserve.structured.GrammarState with structured_outputs
    prompt_lps: list | None = None  # prompt_logprobs so far (index i: prompt token i; [0] is None)
    prompt_lps_sent: bool = False
    drafts: Drafts = field(default_factory=Drafts)  # waiting for the request's next step
    # A speech request's audio rows once its recording is encoded: (first audio position in
    # the prompt, (n, H) projector outputs), kept until the request ends (a preempted
    # request's prompt is computed again from them).
    audio: Any = None

    @property
    def request_id(self) -> str:
        return self.seq.request_id


class MethodState(Protocol):
    """Per-request state kept by a proposer (or Predicted Outputs), by request id."""

    def remove(self, request_id: str) -> None:
        """Free what is kept for ``request_id`` (nothing if there is none)."""


class Queue(Protocol):
    """What teardown needs of the scheduler."""

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from the queues and free its KV blocks."""


class RequestTable(Mapping[str, RequestState]):
    """The admitted requests' states by id, and their one teardown (:meth:`release`).

    ``method_states``: the per-method states to release with each request (the
    proposer, Predicted Outputs; None entries are skipped)."""

    def __init__(self, scheduler: Queue, method_states: Iterable[MethodState | None] = ()):
        self._states: dict[str, RequestState] = {}
        self._scheduler = scheduler
        self._method_states = [m for m in method_states if m is not None]

    def __getitem__(self, request_id: str) -> RequestState:
        return self._states[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def add(self, st: RequestState) -> None:
        """File an admitted request's state (its id is not in use: ``validate_request``)."""
        self._states[st.request_id] = st

    def num_pending_drafts(self, seq: Sequence) -> int:
        """Drafts waiting for ``seq``'s next step (the scheduler makes KV room for them)."""
        st = self._states.get(seq.request_id)
        return len(st.drafts.token_ids) if st is not None else 0

    def release(self, st: RequestState, *, finished: bool) -> None:
        """The one teardown of a request's state: see the module docstring.

        ``finished``: the request is done (finish, abort, failure, or an admission that
        failed); else it was preempted and will be recomputed."""
        st.drafts = Drafts()
        for m in self._method_states:
            m.remove(st.request_id)
        if finished:
            self._scheduler.remove(st.seq)
            if self._states.get(st.request_id) is st:
                del self._states[st.request_id]


class RequestBlocks:
    """The engine's KV blocks as a proposer asks for them (``proposers.base.KVBlocks``):
    a request's block table grows only through :meth:`ensure`."""

    def __init__(self, blocks: Any):
        self._blocks = blocks  # the engine's kv_blocks.BlockManager

    def ensure(self, request: Any, num_tokens: int) -> bool:
        """Grow ``request``'s block table to hold ``num_tokens`` positions; False (nothing
        allocated) when the cache has too few free blocks.  Blocks past the committed
        positions are trimmed by the next commit and freed with the request."""
        return self._blocks.ensure(request.block_table, num_tokens)

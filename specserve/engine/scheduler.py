"""Continuous-batching scheduler (pure Python).

Each step it decides which sequences run and how many of their uncomputed
tokens: running sequences first (a decode step needs its pending token plus
room for its drafts waiting for verification, up to K: ``pending_drafts``; a prompt's
last chunk carries the drafts a request has before its first step, +method=ctc's
hypothesis, so the prefill's forward verifies them),
then waiting ones in arrival order while the token budget, the sequence cap
and the KV blocks allow.  Long prompts are prefilled in chunks.  When blocks run out for a running sequence, the most recently
admitted one is preempted: its blocks are freed and it is recomputed later
from its tokens (nothing is lost).

Fairness under chunked prefill: the decoding sequences' tokens are set aside
before any prefill chunk takes the budget (a long prompt never starves
decodes), and while other requests wait to be admitted a prefill chunk is
capped at ``long_prefill_token_threshold`` tokens, so they start in the same
step instead of queueing behind the whole prompt.  Background sequences (requests with a
recording) take at most ``background_tokens`` tokens a step on average while a foreground
sequence runs or waits (all of them in one step of every ``background_period``), and
``background_tokens_alone`` a step otherwise (prefill chunks, decode
tokens and their drafts, which are cut to fit; a prompt's last chunk keeps all of its first
drafts, +method=ctc's hypothesis, so it may go past): a long transcription costs each step
of a chat request about that much, and a request arriving mid-transcription waits for a
step of at most ``background_tokens_alone`` tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.engine.requests import Drafts, Verified
from specserve.engine.sequence import Sequence, Status
from specserve.kv_blocks import BlockManager, chain_hashes


@dataclass
class ScheduledSeq:
    """One sequence's part of a step: the scheduler's decision, then what the step made of it."""

    seq: Sequence
    num_new_tokens: int  # uncomputed tokens to run this step
    sample: bool  # this chunk reaches the end of the sequence: sample the next token
    draft_room: int  # pending drafts that run this step (0 for prefill chunks but a prompt's last one)
    # Filled by the engine's step: the drafts run (the first draft_room pending ones), and
    # for a sampled sequence its verification (None until verified, and for prefill chunks).
    drafts: Drafts = field(default_factory=Drafts)
    verified: Verified | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # Preempted this step (blocks freed, queued to be recomputed): the engine releases the
    # rest of their state (``RequestTable.release``).
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


def _no_drafts(seq: Sequence) -> int:
    return 0


def default_long_prefill_token_threshold(max_num_batched_tokens: int) -> int:
    """engine.long_prefill_token_threshold when unset: a quarter of the step's token budget."""
    return max(1, max_num_batched_tokens // 4)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_spec_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int | None = None,
        pending_drafts: Callable[[Sequence], int] | None = None,
        background_tokens: int = 0,
        background_tokens_alone: int = 0,
        background_period: int = 1,
    ):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_spec_tokens = num_spec_tokens  # K: the most draft slots reserved per decode step
        # How many drafts wait for a sequence's next step (the engine's RequestTable); none if unset.
        self.pending_drafts: Callable[[Sequence], int] = _no_drafts if pending_drafts is None else pending_drafts
        self.max_model_len = max_model_len
        # The cap on one sequence's prefill chunk while others wait (0: none); null = a
        # quarter of the step budget, so a few arrivals fit next to a long prompt.
        if long_prefill_token_threshold is None:
            long_prefill_token_threshold = default_long_prefill_token_threshold(max_num_batched_tokens)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # Background sequences' tokens in a step beside a foreground one, and with none (0: no cap).
        self.background_tokens = background_tokens
        self.background_tokens_alone = background_tokens_alone
        # Beside a foreground sequence, background work runs in one step of every
        # background_period, with that many steps' worth of background_tokens: each step that
        # carries another sequence costs a fixed overhead, so fewer, larger shares cost less.
        self.background_period = max(1, background_period)
        self._yield_steps = 0  # consecutive steps with a foreground sequence present
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Prefix caching (blocks.enable_caching): full prompt blocks that an admitted sequence
        # is computing now, by hash.  A waiting sequence whose next uncached block is one of
        # them waits for it (e.g. the n copies of one prompt) instead of computing it again.
        self._inflight: dict[int, Sequence] = {}

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        self.blocks.free(seq.block_table)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ step
    def _draft_room(self, seq: Sequence) -> int:
        """How many of the sequence's pending drafts run this step: all of them, up to
        K and max_model_len (positions must exist).

        max_tokens does not shorten the draft: like vLLM, every round proposes
        K and tokens past max_tokens are dropped at commit, so acceptance
        figures are not biased down by the last round of each request."""
        room = min(self.pending_drafts(seq), self.num_spec_tokens, self.max_model_len - len(seq.token_ids) - 1)
        return max(room, 0)

    # ------------------------------------------------------------------ prefix cache
    def _hashes(self, seq: Sequence, n: int) -> list[tuple[int, tuple]]:
        """The hash chain of the sequence's first n full blocks (extended as it grows), seeded
        with its cache partition: another tenant's equal prompt never matches it."""
        have = len(seq.block_hashes)
        if n > have:
            parent = seq.block_hashes[-1][0] if have else None
            seq.block_hashes.extend(
                chain_hashes(seq.token_ids, self.blocks.block_size, n, parent, have, seq.params.cache_salt)
            )
        return seq.block_hashes[:n]

    def register_computed(self, seq: Sequence) -> None:
        """Put the sequence's full blocks whose K/V is computed into the prefix cache."""
        if not self.blocks.enable_caching:
            return
        n = min(min(seq.num_computed, len(seq.token_ids)) // self.blocks.block_size, len(seq.block_table))
        if n <= seq.num_registered_blocks:
            return
        for i, (h, key) in enumerate(self._hashes(seq, n)[seq.num_registered_blocks :], seq.num_registered_blocks):
            self.blocks.register(seq.block_table[i], h, key)
            if self._inflight.get(h) is seq:
                del self._inflight[h]
        seq.num_registered_blocks = n

    def _release(self, seq: Sequence) -> None:
        """Before freeing a sequence's blocks: cache what it computed, drop its in-flight marks."""
        self.register_computed(seq)
        for h, _ in seq.block_hashes:
            if self._inflight.get(h) is seq:
                del self._inflight[h]
        seq.num_registered_blocks = 0

    def _lookup(self, seq: Sequence) -> bool:
        """Start a fresh sequence on its longest cached prefix (at least one token is left
        to compute: its logits are needed).  False: its next block is being computed by an
        admitted sequence; wait for it."""
        if not self.blocks.enable_caching or seq.block_table or seq.num_computed:
            return True
        if seq.params.prompt_logprobs is not None:
            return True  # every prompt position's logits are wanted
        bs = self.blocks.block_size
        hashes = self._hashes(seq, (len(seq.token_ids) - 1) // bs)
        hits = self.blocks.match(hashes)
        if len(hits) < len(hashes) and self._inflight.get(hashes[len(hits)][0]) not in (None, seq):
            return False
        self.blocks.acquire(hits)
        seq.block_table = list(hits)
        seq.num_computed = seq.num_cached_tokens = len(hits) * bs
        seq.num_registered_blocks = len(hits)
        return True

    def _admitted(self, seq: Sequence) -> None:
        if not self.blocks.enable_caching:
            return
        self.blocks.num_queried_tokens += len(seq.token_ids)
        self.blocks.num_hit_tokens += seq.num_cached_tokens
        for h, _ in seq.block_hashes[seq.num_registered_blocks : len(seq.token_ids) // self.blocks.block_size]:
            self._inflight.setdefault(h, seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _decode_tokens(self, seq: Sequence) -> int:
        """Tokens a running sequence runs this step if it is decoding (its pending token
        plus its drafts); 0 while it is still prefilling."""
        return 1 + self._draft_room(seq) if seq.num_uncomputed == 1 else 0

    def _prefill_cap(self, others_waiting: bool, num_running: int) -> int:
        """The most prompt tokens one sequence prefills this step: all of the budget, unless
        other sequences wait for admission and could be admitted (a free sequence slot)."""
        if others_waiting and num_running < self.max_num_seqs and self.long_prefill_token_threshold > 0:
            return self.long_prefill_token_threshold
        return self.max_num_batched_tokens

    def foreground_present(self) -> bool:
        """A foreground (not background) sequence runs or waits: background work yields to it."""
        return any(not s.background for s in self.running) or any(not s.background for s in self.waiting)

    def _background_budget(self) -> int:
        """Background tokens this step may take: while a foreground sequence runs or waits,
        ``background_tokens`` a step, granted as ``background_period`` steps' worth in the
        first step of each period (none in the others); else ``background_tokens_alone``
        (0: no cap, the step budget).  Called once a step."""
        if self.background_tokens > 0 and self.foreground_present():
            self._yield_steps += 1
            if (self._yield_steps - 1) % self.background_period:
                return 0
            return self.background_tokens * self.background_period
        self._yield_steps = 0
        return self.background_tokens_alone or self.max_num_batched_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in self.running:  # K/V computed by the last step joins the prefix cache
            self.register_computed(seq)
        # Decodes are set aside first: a prefill chunk only takes what they leave.
        reserve = sum(self._decode_tokens(s) for s in self.running)
        cap = self._prefill_cap(bool(self.waiting), len(self.running))
        background = self._background_budget()
        # 1. Running sequences, oldest first; preempt from the newest end.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            decode = self._decode_tokens(seq)
            reserve -= decode
            n = min(seq.num_uncomputed, budget if decode else min(budget - reserve, cap))
            if seq.background:  # runs while background budget is left
                n = min(n, background)
            if n <= 0:  # a prefill chunk with no budget left after the decodes: next step
                i += 1
                continue
            sample = n == seq.num_uncomputed
            room = self._draft_room(seq) if sample else 0
            if seq.background and decode and seq.num_computed >= seq.num_prompt_tokens:  # not a prompt's last token
                room = min(room, max(background - n, 0))
            need = seq.num_computed + n + room
            while not self.blocks.ensure(seq.block_table, need):
                victim = self.running[-1]
                if victim is not seq:
                    reserve -= self._decode_tokens(victim)  # it no longer runs this step
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue  # seq itself was preempted; self.running shifted
            out.scheduled.append(ScheduledSeq(seq, n, sample, room))
            budget -= n + room
            if seq.background:
                background -= n + room
            i += 1
        # 2. Admit waiting sequences in arrival order (one whose next prompt block another
        #    admitted sequence is computing waits for it, and the next in line goes first).
        w = 0
        while w < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[w]
            fresh = not seq.block_table and not seq.num_computed
            if seq.background and background <= 0:  # a later step; foreground arrivals still start
                w += 1
                continue
            if not self._lookup(seq):
                w += 1
                continue
            cap = self._prefill_cap(len(self.waiting) > 1, len(self.running) + 1)
            n = min(seq.num_uncomputed, budget, cap)
            if seq.background:
                n = min(n, background)
            sample = n == seq.num_uncomputed
            room = self._draft_room(seq) if sample else 0
            if not self.blocks.ensure(seq.block_table, seq.num_computed + n + room):
                if fresh and seq.block_table:  # give the cached blocks back (they stay cached)
                    self.blocks.free(seq.block_table)
                    seq.num_computed = seq.num_cached_tokens = seq.num_registered_blocks = 0
                break
            del self.waiting[w]
            if fresh:
                self._admitted(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, sample, room))
            budget -= n + room
            if seq.background:
                background -= n + room
        return out

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Record that `num_computed` tokens have valid K/V; release blocks beyond
        them (rejected drafts)."""
        seq.num_computed = num_computed
        self.blocks.trim(seq.block_table, num_computed)

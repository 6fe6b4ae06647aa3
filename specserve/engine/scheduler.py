"""Continuous-batching scheduler (pure Python).

Each step it decides which sequences run and how many of their uncomputed
tokens: running sequences first (a decode step needs its pending token plus
room for up to K drafts), then waiting ones in arrival order while the token
budget, the sequence cap and the KV blocks allow.  Long prompts are prefilled
in chunks.  When blocks run out for a running sequence, the most recently
admitted one is preempted: its blocks are freed and it is recomputed later
from its tokens (nothing is lost).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.kv_blocks import BlockManager
from specserve.engine.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # uncomputed tokens to run this step
    sample: bool  # this chunk reaches the end of the sequence: sample the next token
    draft_room: int  # pending drafts that run this step (0 for prefill chunks)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_lookahead: int,
        max_model_len: int,
    ):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead = num_lookahead  # K: draft slots reserved per decode step
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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
        room = min(len(seq.draft_token_ids), self.num_lookahead, self.max_model_len - len(seq.token_ids) - 1)
        return max(room, 0)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # 1. Running sequences, oldest first; preempt from the newest end.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            sample = n == seq.num_uncomputed
            room = self._draft_room(seq) if (sample and seq.num_uncomputed == 1) else 0
            need = seq.num_computed + n + room
            while not self.blocks.ensure(seq.block_table, need):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue  # seq itself was preempted; self.running shifted
            out.scheduled.append(ScheduledSeq(seq, n, sample, room))
            budget -= n + room
            i += 1
        # 2. Admit waiting sequences in arrival order.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            sample = n == seq.num_uncomputed
            room = self._draft_room(seq) if (sample and seq.num_uncomputed == 1) else 0
            if not self.blocks.ensure(seq.block_table, seq.num_computed + n + room):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, sample, room))
            budget -= n + room
        return out

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Record that `num_computed` tokens have valid K/V; release blocks beyond
        them (rejected drafts)."""
        seq.num_computed = num_computed
        self.blocks.trim(seq.block_table, num_computed)

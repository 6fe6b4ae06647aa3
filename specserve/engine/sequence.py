"""A request's sequence: its tokens, KV block table and status, as the scheduler sees them (pure Python).

The rest of a request's state (output processing, grammar, drafts waiting for
verification) is its ``engine.requests.RequestState``, which owns the sequence."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specserve.request import FinishReason, SamplingParams, SpecDecodeStats


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request's sequence (``RequestState.seq``); proposers read it as a ``RequestView``.

    ``token_ids`` is prompt + output.  ``num_computed`` tokens have their K/V in
    the cache; the rest (normally just the last sampled token) is fed next step.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # The 64-bit Philox key (int64 pattern) of every random number the request uses, keyed by
    # (seed, output position, purpose): params.seed, or one drawn by the engine at admission.
    seed: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # its drafts and accepted tokens so far
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    # Tokens a method drafts from that the engine derived for this request (the CTC
    # hypothesis of its recording, +method=ctc); kept across preemption.  None: none.
    hypothesis: list[int] | None = None
    # A background sequence's prompt yields to other sequences' decoding: while a foreground
    # sequence decodes, its prefill chunks share the scheduler's small background budget
    # (a request with a recording; ``Scheduler.background_tokens``).
    background: bool = False

    # Prefix caching: the hash chain of full blocks of token_ids (kv_blocks.chain_hashes),
    # how many of the block table's blocks are registered in the cache, and how many
    # prompt tokens this sequence found cached at admission (their K/V was never computed
    # for it: a proposer that needs the target's states of every prompt token must catch up).
    block_hashes: list = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def cache_salt(self) -> str | None:
        """The request's cache partition (SamplingParams.cache_salt): what it may share with others."""
        return self.params.cache_salt

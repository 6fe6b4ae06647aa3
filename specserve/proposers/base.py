"""The proposer protocol and the registry keyed by ``method.method``.

A proposer sees only its own config section and the engine-side sequences;
adding a method is a new module that calls ``register`` plus a YAML preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from torch import Tensor

from specserve.config import SpeculativeConfig
from specserve.engine.sequence import Sequence
from specserve.errors import ConfigError


@dataclass
class DraftRequest:
    seq: Sequence
    max_drafts: int  # 1..K: room left before max_tokens / max_model_len


@dataclass
class Proposal:
    token_ids: list[list[int]]  # per request, 0..max_drafts draft tokens
    # (B, K, V) draft distributions the tokens were sampled from, or None when
    # drafts are deterministic (n-gram, suffix, greedy drafters: one-hot q).
    probs: Tensor | None = None


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> Proposal: ...

    def on_verified(self, seq: Sequence, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        """Called after verification: `num_tokens_before` tokens existed when the
        drafts were proposed, `num_accepted` of `num_drafts` drafts were accepted."""

    def remove(self, request_id: str) -> None:
        """Forget a finished, aborted or preempted request (free its state)."""


@dataclass
class ProposerContext:
    """What a proposer may need from the engine, built by the engine."""

    target: Any  # LoadedModel of the target
    draft_model: Any  # ModelConfig of the draft (draft group) or None
    engine: Any  # EngineConfig
    num_kv_blocks: int  # the target's KV block count (a draft KV cache mirrors it)


Factory = Callable[[SpeculativeConfig, ProposerContext], Proposer]
PROPOSERS: dict[str, Factory] = {}


def register(method: str) -> Callable[[Factory], Factory]:
    def deco(factory: Factory) -> Factory:
        PROPOSERS[method] = factory
        return factory

    return deco


def build_proposer(spec: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    factory = PROPOSERS.get(spec.method)
    if factory is None:
        raise ConfigError("method.method", f"no proposer for {spec.method!r}; available: {', '.join(sorted(PROPOSERS))}")
    return factory(spec, ctx)

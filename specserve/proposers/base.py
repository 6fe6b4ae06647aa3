"""The proposer protocol, and building a method's proposer through the method registry.

A leaf module: it imports nothing of the engine.  A proposer sees only its own
options (``method.*``), a read-only view of each request (``RequestView``) and,
when its K/V lives in the engine's cache, a handle to ask for blocks there
(``KVBlocks``).  Which methods exist,
their options and where their builders live is the registry's (``specserve.methods``):
``build_proposer`` and ``memory_needs`` import a method's proposer module on first use.

Each method also declares the device memory it will hold (``MemoryNeeds``: its own KV
bytes per block, its weights, graphs and temporaries), computed from config files and
checkpoint headers before anything of it is loaded: ``specserve.engine.memory`` sizes
the KV cache after counting them.

When proposers run: AFTER verification.  Each engine step runs one target
forward, verifies, commits the accepted tokens, and then asks the proposer for
the drafts of every request that decodes next, handing it that forward's
output, so a proposer conditioned on the target (EAGLE, MTP) reads the target's
hidden states of the positions just committed (``DraftRequest.hidden_rows``).
The drafts are verified in the next step.

Per-request state: a proposer keeps what it needs per request id (its own KV blocks,
indexes, counters) and frees it in ``remove``, its release hook: the engine calls it
from the one teardown of a request (``engine.requests.RequestTable.release``), when
the request finishes, is aborted or fails, and when it is preempted (recomputed later
from its tokens: the proposer catches up as for a new request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from torch import Tensor

from specserve.methods import SpeculativeConfig, as_method_options, get_method, load


class RequestView(Protocol):
    """What a proposer may read of a request (``engine.sequence.Sequence`` is one).  Read
    only: the block table grows through ``KVBlocks.ensure``, never by a proposer's hand."""

    request_id: str
    params: Any  # its SamplingParams (temperature, top_k, ... for drafts sampled from q)
    seed: int  # its Philox key: drafts sampled from q use u(seed, output position, DRAFT)
    token_ids: list[int]  # prompt + output so far (the committed tokens)
    num_computed: int  # positions whose K/V the target has computed (the committed ones after a step)
    block_table: list[int]  # the request's KV blocks in the engine's cache (its positions' slots)

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def finished(self) -> bool: ...

    @property
    def cache_salt(self) -> str | None: ...


class KVBlocks(Protocol):
    """The engine's KV blocks, for a proposer whose K/V lives in the requests' own blocks
    of the engine's cache (its layers past the target's: ``MethodSpec.kv_layers``)."""

    def ensure(self, request: RequestView, num_tokens: int) -> bool:
        """Make ``request``'s block table hold ``num_tokens`` positions; False (nothing
        allocated) when the cache has too few free blocks.  The engine trims blocks past
        the committed positions at the next commit and frees them with the request."""


@dataclass
class DraftRequest:
    seq: RequestView
    max_drafts: int  # 1..K: drafts wanted for the next step (room before max_model_len)
    # Rows of the step's forward (its T axis: ForwardOutput.aux[layer][row]) that hold
    # the target's states of this sequence's tokens fed in that step and committed,
    # in position order (a range, or a list after a tree: the root and its accepted
    # path); None when the sequence was not in the forward.
    hidden_rows: Sequence[int] | None = None
    # Whether a tree may be drafted for it (the method drafts trees: method.tree); False
    # where its verification needs a chain (grammar, logprobs, penalties, logit_bias).
    tree: bool = True
    # The most drafting steps (levels) a tree gets this round, as adaptive speculation
    # chose (``heads.round_depth``); None: method.tree.depth.
    tree_depth: int | None = None
    # A chain's drafting stops after the draft at which the drafter's cumulative
    # probability of its drafts so far (the product of each draft's probability under
    # the drafter) falls below this (``heads.DraftColumns``); 0: always max_drafts.
    min_confidence: float = 0.0


@dataclass
class Proposal:
    token_ids: list[list[int]]  # per request, 0..max_drafts draft tokens
    # (B, K, V) draft distributions the tokens were sampled from, or None when
    # drafts are deterministic (n-gram, suffix, greedy drafters: one-hot q).
    probs: Tensor | None = None
    # Per request, a tree's structure: the parent of each of its draft tokens (an index
    # into its token_ids, -1 = the request's pending token, the root; parents first), or
    # None for a chain.  None: every request's drafts are a chain.
    parents: list[list[int] | None] | None = None


class Proposer(Protocol):
    # Layers whose INPUT residual stream the proposer reads from each target forward
    # (EAGLE-3's low/mid/high features); () = none.  Read once by the engine.
    aux_layer_ids: tuple[int, ...]

    def propose(self, requests: list[DraftRequest], step: Any = None) -> Proposal:
        """Drafts for the next step; ``step`` is the target forward just verified
        (``executor.runner.ForwardOutput``: logits/hidden by logits row, aux by token row)."""

    def on_verified(self, seq: RequestView, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        """Called after verification: `num_tokens_before` tokens existed when the
        drafts were proposed, `num_accepted` of `num_drafts` drafts were accepted."""

    def remove(self, request_id: str) -> None:
        """The release hook: free everything kept for the request (nothing if there is
        none).  Called by the engine's one teardown, for a finished, aborted, failed or
        preempted request; the proposer never frees a request's state on its own."""


@dataclass
class ProposerContext:
    """What a proposer may need from the engine, built by the engine."""

    target: Any  # LoadedModel of the target
    draft_model: Any  # ModelConfig of the draft (draft group) or None
    engine: Any  # EngineConfig
    num_kv_blocks: int  # the target's KV block count (a draft KV cache mirrors it)
    # The engine's KVCache (its layers past the target's belong to the proposer: see
    # MethodSpec.kv_layers) and the handle that grows a request's blocks there (KVBlocks);
    # None where not built by an engine.
    kv: Any = None
    kv_blocks: KVBlocks | None = None
    cache_dir: Any = None  # model.cache_dir (where the fused CPU kernel library is built), None = default


@dataclass(frozen=True)
class TargetShape:
    """What a method's memory declaration may read of the target (nothing of its own is loaded yet)."""

    arch: Any  # the target's ArchConfig
    dtype_bytes: int  # bytes per weight and KV element (the target's dtype)
    max_model_len: int
    hf_dir: Any = None  # the target's HF checkpoint directory (MTP layers live there)
    cuda: bool = False  # drafting runs on one CUDA device (persistent-buffer runners)
    cuda_graphs: bool = False  # ... and captures its step loops as CUDA graphs


@dataclass(frozen=True)
class MemoryNeeds:
    """Device bytes a method holds beyond the target's (``specserve.engine.memory``)."""

    kv_bytes_per_block: int = 0  # its own KV caches, per block (they mirror the engine's block count)
    weight_bytes: int = 0  # its weights on the device (a draft model, a head; 0 when it shares the target's)
    graph_bytes: int = 0  # its CUDA graphs' outputs and pools and its persistent buffers
    transient_bytes: int = 0  # its largest temporary allocation while drafting (calibration included)
    draft_probs_bytes: int = 0  # the (B, K, V) float32 q it hands to verification (probabilistic), else 0
    scratch_bytes_per_block: int = 0  # temporaries that grow with its cache (dflash's context gather)
    aux_layers: int = 0  # target hidden states it reads from each forward (the step outputs keep them)


Factory = Callable[[SpeculativeConfig, ProposerContext], Proposer]  # MethodSpec.proposer
# (the method's options, target, EngineConfig, the draft group's ModelConfig or None) -> needs: MethodSpec.memory
MemoryFn = Callable[[SpeculativeConfig, TargetShape, Any, Any], MemoryNeeds]


def memory_needs(spec: SpeculativeConfig, target: TargetShape, engine: Any, draft: Any = None) -> MemoryNeeds:
    """What ``spec.method`` will hold on the device, asked before the KV cache is sized."""
    method = get_method(spec.method)
    if method.memory is None:
        return MemoryNeeds()
    fn: MemoryFn = load(method.memory)
    return fn(as_method_options(spec), target, engine, draft)


def build_proposer(spec: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    """The proposer of ``spec.method``, built by its registered builder."""
    factory: Factory = load(get_method(spec.method).proposer)
    return factory(as_method_options(spec), ctx)

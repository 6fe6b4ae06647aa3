"""EAGLE (``+method=eagle``, EAGLE-1/2 heads) and EAGLE-3 (``+method=eagle3``) proposers.

A head (``executor.models.eagle``) drafts from the target's own features, so
it runs after verification on the forward just verified (``base``): for every
request it first consumes the rows of its tokens fed and committed in that
step (``DraftRequest.hidden_rows``: whole prompt chunks, or the pending token
plus the accepted drafts), writing the head's K/V for those positions, then
drafts K tokens autoregressively on its own hidden state.  Row alignment:
head position p reads target feature p and token p + 1.

Prefix caching: cached blocks hold the head's K/V too (written by the request
that computed them; the head's rows there were real).  The one row that may
not fit a new request is a cached block's last position, whose head row read
the token after the block (outside the block's hash): a draft-quality effect
at one position, never an output change.

KV cache: one more layer in the engine's KV cache (the engine allocates
``num_layers + 1`` layers for these methods, inside its KV budget), addressed
by each sequence's own block table; the proposer asks the engine for the blocks
of the K - 1 positions its drafting writes past the committed ones
(``ProposerContext.kv_blocks``; the next verification step needs those blocks
anyway).  Rollback is free: after verification the
head's real rows end where the target's committed positions end, and the next
round overwrites every position after them (draft-written K/V included).

CUDA: the K draft steps of a greedy round replay one CUDA graph per batch bucket
(``executor.backends.head_graphs.HeadDraftGraphs``; a bucket whose capture failed
runs the same loop eagerly); the consuming forward, whose row count varies, runs
eagerly, and every eager forward attends through the paged kernel the target uses
(no padded keys or masks when a step commits a prompt chunk beside decode rows).
CPU: the reference attention; in bf16 the head's projections and LM head run on the
fused decoder's matmul (``kernels.cpu_decoder.FusedLinear``), and an EAGLE-3 head's
greedy draft steps run in one C call (``kernels.cpu_decoder.FusedHeadChain``, in the
graphs' place).  Drafting with confidence cuts runs the eager loop (a cut reads each
column's logits).  All of it is the
backend factory's choice (``executor.backends.factory``), made with the target's.

Trees (``method.tree``): a request that may take one (``DraftRequest.tree``)
gets an EAGLE-2 dynamic tree instead of a chain (``_draft_trees``): ``depth``
expansion steps over the ``topk`` best frontier nodes, each stored past the
committed rows and attending to its ancestors (a tree mask), then the
``num_draft_tokens - 1`` best nodes by cumulative log-probability, parents first
(``Proposal.parents``).  Tree rounds run eagerly on every device.

Drafts: greedy (argmax of the head) for greedy requests and with strict
verification.  With ``rejection_sample_method=probabilistic`` a sampled
request's drafts are drawn from q = the head's distribution under the
request's temperature/top-k/top-p, and q (mapped to the target vocabulary)
goes to the rejection sampler with the drafts: lossless, and higher
acceptance than one-hot q.  Drafts are drawn by every head's sampler
(``heads.HeadSampler``: the request's keyed numbers ``u(seed, output position,
DRAFT)``), so seeded requests are reproducible in any batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from specserve.engine.memory import (VERIFY_BYTES_PER_LOGIT, graph_pool_bytes, kv_bytes_per_block, rotary_bytes,
                                     step_activation_bytes)
from specserve.errors import ConfigError
from specserve.executor.backends.factory import RunnerFactory
from specserve.executor.backends.head_graphs import HeadDraftGraphs
from specserve.executor.batch import SeqInput, StepBatch
from specserve.executor.eagle_loader import build_head, check_against_target, read_head, resolve_head_dir
from specserve.executor.eagle_loader import read_tensors as read_head_tensors
from specserve.executor.kv_cache import KVCache
from specserve.executor.models.eagle import EagleHead
from specserve.methods import SpeculativeConfig, TreeConfig
from specserve.proposers.base import DraftRequest, KVBlocks, MemoryNeeds, Proposal, ProposerContext, TargetShape
from specserve.proposers.heads import (DraftColumns, HeadSampler, choose_nodes, head_attention_bytes, head_metadata,
                                       narrow, read_tensor_shapes, round_depth, step_metadata, tree_levels)

log = logging.getLogger(__name__)


@dataclass
class _HeadState:
    num_fed: int = 0  # target positions whose features the head has consumed (its real rows end here)


class EagleProposer:
    def __init__(self, head: EagleHead, num_spec_tokens: int, kv: tuple[Tensor, Tensor], block_size: int,
                 kv_blocks: KVBlocks, *, probabilistic: bool = False, trash_slot: int | None = None,
                 tree: TreeConfig | None = None):
        self.head = head
        # method.tree: EAGLE-2 dynamic trees for the requests that may take one (else chains).
        self.tree = tree.expanded() if tree is not None and tree.enabled else None  # a static tree's shape
        self.trash_slot = trash_slot  # the head cache's padding slot (for static drafting)
        # The K greedy draft steps over persistent buffers (CUDA graphs per batch bucket;
        # ``RunnerFactory.head_graphs``); None: the eager loop.
        self.static: HeadDraftGraphs | None = None
        # The eager forwards' attention (``RunnerFactory.head_attention``): the paged
        # kernel's implementation on CUDA, None for the reference attention.
        self.attention: str | None = None
        self.num_spec_tokens = num_spec_tokens  # K: the most drafts per request and step
        self.kv = kv
        self.block_size = block_size
        self.kv_blocks = kv_blocks  # the engine's blocks: the head's K/V lives in the requests' own blocks
        self.probabilistic = probabilistic
        self.aux_layer_ids: tuple[int, ...] = tuple(head.c.aux_layer_ids)
        self.device = next(head.parameters()).device
        self.dtype = next(head.parameters()).dtype
        self.vocab_size = head.c.vocab_size
        self.sampler = HeadSampler(probabilistic, self.vocab_size, self.device, head.draft_to_target)
        self.states: dict[str, _HeadState] = {}

    # ------------------------------------------------------------ proposing
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], step=None) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        if step is None:
            return Proposal(token_ids=drafts)
        inputs: list[SeqInput] = []
        row_ids: list[int] = []
        drafting: list[tuple[int, int, int, list[int]]] = []  # (request index, max drafts, last real position, table)
        for i, r in enumerate(requests):
            rows = r.hidden_rows
            if rows is None or len(rows) == 0:
                continue
            st = self.states.setdefault(r.seq.request_id, _HeadState())
            # The rows are the positions just committed: they end at the target's computed
            # count (they start past any prefix-cached blocks, whose head K/V is cached too).
            computed = getattr(r.seq, "num_computed", None)
            p0 = computed - len(rows) if computed is not None else st.num_fed
            toks = r.seq.token_ids[p0 + 1 : p0 + 1 + len(rows)]  # head row p reads token p + 1
            n = len(toks)
            if n == 0:
                continue
            want = r.max_drafts
            # drafting writes positions p0+n .. p0+n+want-2 past the real rows (a tree: the
            # nodes it expands, topk per step after the first)
            end = p0 + n + (self._tree_nodes_run() if self._drafts_tree(r) else want - 1)
            if want > 0 and not self.kv_blocks.ensure(r.seq, end):
                want = 0  # no room in the cache this round: consume the rows, draft nothing
            table = r.seq.block_table
            inputs.append(SeqInput(toks, p0, table, [n - 1] if want > 0 else []))
            row_ids.extend(rows[:n])
            st.num_fed = p0 + n
            if want > 0:
                drafting.append((i, want, p0 + n - 1, table))
        if not inputs:
            return Proposal(token_ids=drafts)
        idx = torch.tensor(row_ids, dtype=torch.int64, device=step.aux[self.aux_layer_ids[0]].device)
        feats = torch.cat([step.aux[l].index_select(0, idx) for l in self.aux_layer_ids], dim=-1)
        hidden = self.head.project(feats.to(device=self.device, dtype=self.dtype))  # (T, H)
        batch = StepBatch.from_inputs(inputs, self.block_size)
        meta, ids, pos = step_metadata(batch, self.block_size, self.device, kernel=self.attention)
        out = self.head(ids, hidden, pos, meta, self.kv)  # (T, H): writes the head's K/V of the real rows
        if not drafting:
            return Proposal(token_ids=drafts)
        last = out.index_select(0, torch.tensor(batch.logits_rows, dtype=torch.int64, device=self.device))
        trees = [n for n, (i, *_) in enumerate(drafting) if self._drafts_tree(requests[i])]
        if not trees:
            return self._draft(requests, drafting, last, drafts)
        chains = sorted(set(range(len(drafting))) - set(trees))
        prop = Proposal(token_ids=drafts)
        if chains:
            prop = self._draft(requests, [drafting[n] for n in chains], last[chains], drafts)
        prop.parents = [None] * len(requests)
        self._draft_trees([drafting[n] for n in trees], last[trees], drafts, prop.parents,
                          [requests[drafting[n][0]] for n in trees])
        return prop

    # ------------------------------------------------------------ trees
    def _drafts_tree(self, r: DraftRequest) -> bool:
        return self.tree is not None and r.tree

    def _tree_nodes_run(self) -> int:
        """Nodes a tree round runs the head over (and stores past the committed rows)."""
        t = self.tree
        return t.topk * (min(t.depth, t.num_draft_tokens - 1) - 1)

    def _draft_trees(self, drafting, hidden: Tensor, drafts: list[list[int]],
                     parents: list[list[int] | None], requests: list[DraftRequest]) -> None:
        """EAGLE-2 dynamic trees (eagerly, whatever the device): from each request's last
        real row, ``depth`` expansion steps; each runs the head once over the frontier (the
        ``topk`` best nodes of the newest level by cumulative draft log-probability; each
        attends to the committed rows and its own ancestors, stored past them) and scores
        its ``topk`` children (``depth``: ``heads.round_depth``).  Then the ``max_drafts``
        best nodes of all levels (a child never outranks its parent: ties keep creation
        order), parents first."""
        k, B = self.tree.topk, len(drafting)
        depth = round_depth(self.tree, [w for _, w, _, _ in drafting], requests)
        tree = tree_levels(self.tree, torch.log_softmax(self.head.logits(hidden).float(), dim=-1))
        # Each frontier node's parent state (the head's output there; the last real row for level 1).
        front_hidden = hidden.repeat_interleave(k, dim=0)  # (B*k, H)
        masks: list[list[int]] = [[] for _ in range(B)]  # per request, its stored nodes' ancestor masks
        parent_slot: list[list[int]] | None = None  # (B, k) each frontier node's parent in the previous one
        for step in range(1, depth):
            stored = (step - 1) * k  # nodes already stored past the committed rows
            for b in range(B):
                for j in range(k):
                    up = masks[b][stored - k + parent_slot[b][j]] if parent_slot is not None else 0
                    masks[b].append(up | (1 << (stored + j)))
            inputs = [SeqInput([0] * k, last + 1 + stored, table, list(range(k)), positions=[last + step] * k,
                               tree_base=last + 1, tree_masks=masks[b][stored:])
                      for b, (_, _, last, table) in enumerate(drafting)]
            batch = StepBatch.from_inputs(inputs, self.block_size)
            meta, pos = head_metadata(batch, self.block_size, self.device, kernel=self.attention)
            ids = self.head.to_target_ids(tree.frontier_tokens())
            out = self.head(ids, front_hidden, pos, meta, self.kv)  # (B*k, H): writes the frontier's K/V
            tree.grow(*torch.log_softmax(self.head.logits(out).float(), dim=-1).topk(k, dim=-1))  # (B*k, k)
            if step + 1 < depth:  # the next frontier: the best k children
                slot = tree.advance()  # the parent's place in the frontier just run
                H = out.shape[-1]
                front_hidden = out.view(B, k, H).gather(1, slot[..., None].expand(B, k, H)).reshape(B * k, H)
                parent_slot = slot.tolist()
        score, tok, parent = tree.pool()
        choose_nodes([(i, w) for i, w, _, _ in drafting], score, self.head.to_target_ids(tok), parent, drafts,
                     parents)

    def _draft(self, requests, drafting, hidden: Tensor, drafts: list[list[int]]) -> Proposal:
        """K autoregressive steps from the last real row of each drafting request; the
        tokens stay on the device until the end (one read per column)."""
        seqs = [requests[i].seq for i, _, _, _ in drafting]
        cuts = any(requests[i].min_confidence > 0.0 for i, _, _, _ in drafting)  # a cut reads every column's logits
        if (not self.sampler.needs_q(seqs) and not cuts and self.static is not None
                and len(drafting) <= self.static.max_num_seqs):
            rows = [(last, want, table) for _, want, last, table in drafting]
            for (i, *_), d in zip(drafting, self.static.draft(hidden, rows)):
                drafts[i] = d
            return Proposal(token_ids=drafts)
        want = [w for _, w, _, _ in drafting]
        out = DraftColumns.of(self.sampler, requests, [i for i, _, _, _ in drafting], want)
        active = list(range(len(drafting)))  # indices into drafting
        step = 1
        while True:
            tokens = out.draw(self.head.logits(hidden), active, step - 1)  # (B',) target ids
            active, (tokens, hidden) = narrow(active, want, step, tokens, hidden)
            if not active:
                break
            inputs = [SeqInput([0], drafting[a][2] + step, drafting[a][3], [0]) for a in active]
            batch = StepBatch.from_inputs(inputs, self.block_size)
            meta, pos = head_metadata(batch, self.block_size, self.device, kernel=self.attention)
            hidden = self.head(tokens, hidden, pos, meta, self.kv)  # (B', H): the head's own state
            step += 1
        return out.proposal(drafts)

    # ------------------------------------------------------------ bookkeeping
    def on_verified(self, seq, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        """Nothing to roll back: the head's real rows end where the target's committed
        positions end, and the next round overwrites every later position."""

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)


def _head_kv(ctx: ProposerContext, head: EagleHead) -> tuple[tuple[Tensor, Tensor], int]:
    """The head's cache layer: the engine's extra layer when its shape fits, else a
    one-layer cache of its own with the same blocks (slot ids are shared either way)."""
    a, c = ctx.target.arch, head.c
    kv = getattr(ctx, "kv", None)
    layers = kv.data.shape[0] if kv is not None else 0
    if kv is not None and layers > a.num_layers and (c.num_kv_heads, c.head_dim) == (a.num_kv_heads, a.head_dim):
        return kv.layer(a.num_layers), kv.trash_slot
    log.warning("the head's attention shape (%d kv heads x %d) differs from the target's: its KV cache is a "
                "separate one-layer cache of %d blocks (counted in the memory budget)", c.num_kv_heads, c.head_dim,
                ctx.num_kv_blocks)
    own = KVCache(1, ctx.num_kv_blocks, ctx.engine.block_size, c.num_kv_heads, c.head_dim, ctx.target.dtype,
                  ctx.target.device)
    return own.layer(0), own.trash_slot


def build_eagle(spec: SpeculativeConfig, ctx: ProposerContext) -> EagleProposer:
    path = spec.model or (ctx.draft_model.path if ctx.draft_model is not None else None)
    key = "method.model" if spec.model else "draft.path"
    if not path:
        raise ConfigError("method.model", f"method {spec.method} needs a head: set method.model=<dir> or draft=<preset>")
    if spec.max_model_len is not None and spec.max_model_len > ctx.target.max_model_len:
        raise ConfigError("method.max_model_len",
                          f"{spec.max_model_len} exceeds the target's max_model_len ({ctx.target.max_model_len})")
    k = spec.num_speculative_tokens
    ck = read_head(path, spec.method, key)
    check_against_target(ck, ctx.target.arch, k, key)
    t = ctx.target
    head = build_head(ck, t.model, t.dtype, t.device, t.max_model_len + k + 1)
    kv_blocks = getattr(ctx, "kv_blocks", None)
    if kv_blocks is None:
        raise ConfigError("method.method", f"{spec.method} needs the engine's KV blocks (ProposerContext.kv_blocks)")
    log.info("%s head from %s (%s layout): target layers %s, draft vocabulary %d of %d", spec.method, ck.path,
             ck.layout, list(ck.config.aux_layer_ids), ck.config.draft_vocab_size, ck.config.vocab_size)
    kv, trash = _head_kv(ctx, head)
    runners = RunnerFactory.from_engine(ctx.engine, ctx.cache_dir)
    runners.fuse_head(head, t, kv, ctx.engine.block_size)
    proposer = EagleProposer(
        head, k, kv, ctx.engine.block_size, kv_blocks,
        probabilistic=spec.samples_drafts, trash_slot=trash, tree=spec.tree,
    )
    proposer.attention = runners.head_attention(t, head)
    proposer.static = runners.head_graphs(head, kv, t, block_size=ctx.engine.block_size, trash_slot=trash,
                                          num_spec_tokens=k, max_seq_len=t.max_model_len)  # fmt: skip
    return proposer


def eagle_memory(spec: SpeculativeConfig, target: TargetShape, engine, draft) -> MemoryNeeds:
    """The head's part, from its config.json and tensor headers (nothing loaded): its
    weights (the target's embeddings and LM head are shared unless it brings its own),
    a cache layer of its own when its attention shape differs from the target's (else
    the engine's extra layer: ``MethodSpec.kv_layers``), the draft graphs on CUDA, and its largest
    temporaries: consuming a step's rows and a draft step's logits (with sampling and q
    when probabilistic).  The consuming forward's attention: ``heads.head_attention_bytes``."""
    path = spec.model or (draft.path if draft is not None else None)
    if not path:
        return MemoryNeeds()
    key = "method.model" if spec.model else "draft.path"
    d = resolve_head_dir(path, key)
    ck = read_head(path, spec.method, key, tensors=read_tensor_shapes(d, fallback=lambda p, w: read_head_tensors(p, key)))
    c, a, dt = ck.config, target.arch, target.dtype_bytes
    k, B = spec.num_speculative_tokens, engine.max_num_seqs
    weights = sum(t.numel() for n, t in ck.tensors.items() if n not in ("d2t", "t2d")) * dt
    if c.reduced_vocab:
        weights += c.draft_vocab_size * 8  # draft_to_target, int64
    max_len = target.max_model_len + k + 1  # the head's positions (drafting runs past the end)
    weights += rotary_bytes(c.head_dim, max_len)
    own_kv = (c.num_kv_heads, c.head_dim) != (a.num_kv_heads, a.head_dim)
    head = SimpleNamespace(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           vocab_size=c.draft_vocab_size)
    graphs = _head_graph_bytes(head, k, B, target.max_model_len, engine.block_size, dt) if target.cuda_graphs else 0
    tokens = max(engine.max_num_batched_tokens, B * (k + 1))  # rows a step may commit
    consume = (step_activation_bytes(head, tokens, B, dt) + 2 * tokens * c.fc_in * dt
               + head_attention_bytes(target, engine, tokens, max_len, k + 1, c.num_kv_heads, c.head_dim))
    probabilistic = spec.samples_drafts
    step = B * c.draft_vocab_size * (4 + dt)
    if probabilistic:  # the head's distribution under each request's filters, and q on the target vocabulary
        step += VERIFY_BYTES_PER_LOGIT * B * c.draft_vocab_size + B * a.vocab_size * 4
    tree = spec.tree
    if tree is not None and tree.enabled:  # a tree round's step: topk frontier rows per request, eagerly
        tree = tree.expanded()  # a static tree's width as topk
        rows = B * tree.topk
        step = max(step, rows * c.draft_vocab_size * (8 + dt) + head_attention_bytes(
            target, engine, rows, max_len, tree.topk, c.num_kv_heads, c.head_dim))
    aux = len(c.aux_layer_ids) or (3 if c.kind == "eagle3" else 1)
    return MemoryNeeds(
        kv_bytes_per_block=kv_bytes_per_block(1, engine.block_size, c.num_kv_heads, c.head_dim, dt) if own_kv else 0,
        weight_bytes=weights, graph_bytes=graphs, transient_bytes=consume + step,
        draft_probs_bytes=B * k * a.vocab_size * 4 if probabilistic else 0, aux_layers=aux,
    )


def _head_graph_bytes(head, num_spec_tokens: int, max_num_seqs: int, max_seq_len: int, block_size: int,
                      dtype_bytes: int) -> int:
    """``HeadDraftGraphs``: its staging (int32 base, want, block tables), hidden states,
    query starts and drafts, and the pool of its largest bucket's K steps (each step's
    temporaries are reused by the next)."""
    B, K = max_num_seqs, num_spec_tokens
    max_blocks = -(-(max_seq_len + K + 1) // block_size) + 1
    staging = sum(-(-4 * n // 16) * 16 for n in (B, B, B * max_blocks))
    buffers = staging + B * head.hidden_size * dtype_bytes + 4 * (B + 1) + 8 * B * K
    return buffers + graph_pool_bytes(B, head, dtype_bytes) + 2 * B * head.vocab_size * 4  # + the float32 logits


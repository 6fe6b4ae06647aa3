"""What the proposers with their own small networks share (EAGLE heads, MTP layers,
the MLP speculator, the DFlash block): attention metadata for their paged KV caches, reading
a few tensors of a checkpoint, fusing one decoder layer's weights, turning their
logits into draft tokens (``HeadSampler``) and a round's drafts into a proposal
(``DraftColumns``, ``narrow``; draft trees: ``TreeLevels``, ``StaticLevels``, ``FrontierMasks``,
``choose_nodes``, ``round_depth``).  ``head_metadata`` with ``FUSED_HEAD`` describes a step
for a head whose layer runs on the fused CPU decoder.

Drafts and draft distributions (``HeadSampler``):

Greedy requests, and every request under strict verification, draft the argmax
(q is one-hot: the sampler needs no q).  With ``rejection_sample_method=
probabilistic`` a sampled request's drafts are drawn from q = the head's
distribution under the request's own temperature / top-k / top-p / min-p, and q
is returned for the rejection sampler (accept d with min(1, p(d)/q(d))):
lossless, and more drafts accepted than with one-hot q (``block`` verification
likewise).  The draws are the request's keyed numbers ``u(seed, step, DRAFT,
lane)`` (:func:`draft_uniforms`): the output position of the round's first draft
and the draft's index + 1, another purpose than verification's, so the drafts
are independent of the accept tests, a seeded request's drafts do not depend on
the batch it is in, and no round reads a number an earlier round drew (block
verification's outcome depends on every draft of its round, the ones past the
emitted tokens included).  A head with a reduced draft vocabulary (EAGLE-3)
gives its ``draft_to_target`` map: drafts come back as target ids and q on the
target's vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from specserve.engine.memory import kernel_args_bytes, padded_attention_bytes
from specserve.executor.attention import AttentionMetadata, batch_metadata, kernel_metadata
from specserve.executor.batch import StepBatch
from specserve.executor.kv_cache import KVCache
from specserve.kv_blocks import BlockManager
from specserve.proposers.base import Proposal
from specserve.request import GREEDY_EPS
from specserve.sampling.philox import DRAFT, keyed_uniforms
from specserve.sampling.filters import SamplingTensors, logits_to_probs, sample_from_probs


def draft_uniforms(seqs: list, positions: list[int], device: torch.device, lanes: list[int] | None = None) -> Tensor:
    """(B,) uniforms ``u(seq.seed, positions[b], DRAFT, lanes[b])`` for drafts sampled from q
    (lane 0 when ``lanes`` is None)."""
    seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=device)
    lane = None if lanes is None else torch.tensor(lanes, dtype=torch.int64, device=device)[:, None]
    return keyed_uniforms(seeds, torch.tensor(positions, dtype=torch.int64, device=device), 1, DRAFT, lane=lane)[:, 0]


class HeadSampler:
    """The one draft sampler of every head: argmax, or a draw from q with the request's keyed numbers.

    ``vocab_size``: the target's; ``draft_to_target``: (Vd,) int64 target id of each of a
    head's draft ids when it drafts over a reduced vocabulary, else None."""

    def __init__(self, probabilistic: bool, vocab_size: int, device: torch.device,
                 draft_to_target: Tensor | None = None):
        self.probabilistic = probabilistic
        self.vocab_size = vocab_size
        self.device = device
        self.draft_to_target = draft_to_target

    def needs_q(self, seqs: list) -> bool:
        """Whether any of these requests drafts by sampling (else argmax everywhere)."""
        return self.probabilistic and any(s.params.temperature >= GREEDY_EPS for s in seqs)

    def draw(self, logits: Tensor, seqs: list, positions: list[int],
             lanes: list[int] | None = None) -> tuple[Tensor, Tensor | None]:
        """Draft tokens (B,) (target ids) from logits (B, Vd), one row per request in ``seqs``;
        ``positions``, ``lanes``: the keys of each row's number (:func:`draft_uniforms`).  Returns the tokens
        and, when some row sampled, q (B, V) on the target's vocabulary (one-hot rows
        for greedy requests)."""
        d2t = self.draft_to_target
        if not self.needs_q(seqs):
            tokens = logits.argmax(dim=-1)
            return (tokens if d2t is None else d2t[tokens]), None
        ps = [s.params for s in seqs]
        st = SamplingTensors.build([p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                                   [p.min_p for p in ps], self.device)
        q = logits_to_probs(logits.float(), st)  # (B, Vd); greedy rows: one-hot at the argmax
        tokens = sample_from_probs(q, draft_uniforms(seqs, positions, self.device, lanes))
        if d2t is None:
            return tokens, q
        q_target = torch.zeros(q.shape[0], self.vocab_size, device=self.device).index_copy_(1, d2t, q)
        return d2t[tokens], q_target


class DraftColumns:
    """One round's drafts, drawn a column (one draft per drafting request) at a time by
    ``sampler``; the tokens stay on the device until ``proposal`` reads them all.
    ``index[a]``, ``seqs[a]``, ``want[a]``: drafter a's request index (its row of the
    proposal), sequence and number of drafts.

    ``cut[a]`` (``DraftRequest.min_confidence``; None: no cuts): once drafter a's
    cumulative draft probability (the product over its drafts so far of each one's
    probability under the drafter's distribution: the argmax's softmax probability for
    a greedy draft, q of the drawn token for a sampled one) falls below it, ``want[a]``
    drops to the drafts drawn so far.  ``want`` is the proposer's own list, so the
    ``narrow`` of its drafting loop stops that drafter there."""

    def __init__(self, sampler: HeadSampler, num_requests: int, index: list[int], seqs: list, want: list[int],
                 cut: list[float] | None = None):
        self.sampler, self.index, self.seqs, self.want = sampler, index, seqs, want
        self.probs = None  # (num_requests, max(want), V) draft distributions when some request samples
        if sampler.needs_q(seqs):
            self.probs = torch.zeros(num_requests, max(want), sampler.vocab_size, device=sampler.device)
        self.columns: list[tuple[list[int], Tensor]] = []
        self.cut = cut if cut is not None and any(c > 0.0 for c in cut) else None
        self.confidence = [1.0] * len(index)  # per drafter: the product of its drafts' probabilities

    @classmethod
    def of(cls, sampler: HeadSampler, requests: list, index: list[int], want: list[int]) -> "DraftColumns":
        """The columns of drafters ``requests[index[a]]`` (``DraftRequest``s): their sequences
        and confidence cuts read from the requests."""
        return cls(sampler, len(requests), index, [requests[i].seq for i in index], want,
                   [requests[i].min_confidence for i in index])

    def draw(self, logits: Tensor, live: list[int], col: int) -> Tensor:
        """Column ``col`` (0-based) of the drafters ``live`` from their logits (len(live), V)."""
        seqs = [self.seqs[a] for a in live]
        # keyed by the round (its first draft's output position) and the column, never reused
        tokens, q = self.sampler.draw(logits, seqs, [s.num_output_tokens for s in seqs], [col + 1] * len(seqs))
        rows = [self.index[a] for a in live]
        if q is not None:
            self.probs[torch.tensor(rows, device=self.sampler.device), col] = q
        self.columns.append((rows, tokens))
        if self.cut is not None:
            self._cut(logits, live, col, tokens, q)
        return tokens

    def _cut(self, logits: Tensor, live: list[int], col: int, tokens: Tensor, q: Tensor | None) -> None:
        """Stop the drafters of ``live`` whose cumulative probability fell below their cut
        with the column ``col`` just drawn (one read of len(live) numbers)."""
        x = logits.float()
        p = torch.exp(x.max(dim=-1).values - torch.logsumexp(x, dim=-1))  # a greedy draft's probability
        if q is not None:  # sampled rows: q of the drawn token (q is one-hot on greedy rows)
            sampled = torch.tensor([self.seqs[a].params.temperature >= GREEDY_EPS for a in live], device=p.device)
            p = torch.where(sampled, q.gather(1, tokens[:, None])[:, 0], p)
        for a, pa in zip(live, p.tolist()):
            self.confidence[a] *= pa
            if self.confidence[a] < self.cut[a]:
                self.want[a] = min(self.want[a], col + 1)

    def proposal(self, drafts: list[list[int]]) -> Proposal:
        read_columns(drafts, self.columns)
        return Proposal(token_ids=drafts, probs=self.probs)


class OwnCacheHead:
    """Base of head proposers whose layers keep a paged KV cache of their own (mtp, dflash):
    per request a state with a block table in ``self.blocks``, and a draft sampler.  Nothing
    is rolled back after verification: K/V past the committed positions are rewritten by
    the next round before anything reads them."""

    def _init_cache(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                    target, probabilistic: bool) -> None:
        self.kv = KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, target.dtype, target.device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.sampler = HeadSampler(probabilistic, target.arch.vocab_size, target.device)
        self.states: dict = {}

    def on_verified(self, seq, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        pass

    def remove(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        if st is not None:
            self.blocks.free(st.block_table)


def read_columns(drafts: list[list[int]], columns: list[tuple[list[int], Tensor]]) -> None:
    """Append each column's tokens to the drafts of its rows: the round's only device -> host reads."""
    for rows, t in columns:
        for i, tok in zip(rows, t.tolist()):
            drafts[i].append(tok)


def narrow(active: list[int], want: list[int], step: int, *tensors: Tensor) -> tuple[list[int], tuple[Tensor, ...]]:
    """The drafters of ``active`` that want more than ``step`` drafts, and ``tensors``
    (one row per drafter of ``active``) cut to their rows; ([], tensors) when none does."""
    keep = [n for n, a in enumerate(active) if want[a] > step]
    if not keep:
        return [], tensors
    if len(keep) < len(active):
        sel = torch.tensor(keep, dtype=torch.int64, device=tensors[0].device)
        tensors = tuple(t.index_select(0, sel) for t in tensors)
        active = [active[n] for n in keep]
    return active, tensors


class TreeLevels:
    """A batch's EAGLE-2 dynamic draft trees, grown a level at a time (one row per request).

    Level 1 is the root's ``k`` best tokens.  Each further level gives every node of the
    frontier (the ``k`` best of the newest level by cumulative draft log-probability) its
    ``k`` best children, a child scored its parent's score plus its own log-probability.
    Tokens are the drafter's ids; ``pool`` returns every node for ``choose_nodes``."""

    def __init__(self, logprobs: Tensor, k: int):
        score, tok = logprobs.topk(k, dim=-1)  # (B, k)
        B = score.shape[0]
        self.k = k
        self.levels = [(score, tok, torch.full((B, k), -1, dtype=torch.int64, device=score.device))]
        self.local = torch.arange(k, device=score.device).expand(B, k)  # the frontier's places in the newest level

    def frontier_tokens(self) -> Tensor:
        """(B * k,) the frontier's tokens, request by request."""
        return self.levels[-1][1].gather(1, self.local).reshape(-1)

    def grow(self, logprobs: Tensor, tokens: Tensor) -> None:
        """A new level: ``logprobs``, ``tokens`` (B * k, k) the children of each frontier
        node (``frontier_tokens`` order)."""
        score = self.levels[-1][0]
        B, k = score.shape[0], self.k
        child_score = (score.gather(1, self.local).reshape(-1, 1) + logprobs).view(B, k * k)
        base = sum(t.shape[1] for _, t, _ in self.levels[:-1])  # the newest level's first pool index
        self.levels.append((child_score, tokens.reshape(B, k * k), (base + self.local).repeat_interleave(k, dim=1)))

    def advance(self) -> Tensor:
        """Make the newest level's ``k`` best nodes the frontier; returns (B, k) each one's
        parent's place in the frontier just expanded (to carry a per-node state along)."""
        self.local = self.levels[-1][0].topk(self.k, dim=-1).indices
        return self.local // self.k

    def pool(self) -> tuple[Tensor, Tensor, Tensor]:
        """(score, token, parent) (B, P) of every node, levels in order; a parent is a pool
        index, -1 for the root."""
        score, tok, parent = (torch.cat(t, dim=1) for t in zip(*self.levels))
        return score, tok, parent


def choose_nodes(rows: list[tuple[int, int]], score: Tensor, tokens: Tensor, parent: Tensor,
                 drafts: list[list[int]], parents: list[list[int] | None]) -> None:
    """Keep each tree's best nodes of a pool (``TreeLevels.pool``; ``tokens``: target ids)
    in creation order, parents first; ``rows[b]``: (tree b's request index, nodes wanted).
    A child never outranks its parent (its score adds a log-probability <= 0; the stable
    sort keeps creation order on ties), so the kept nodes form a tree.  One read."""
    P = tokens.shape[1]
    W = min(max(w for _, w in rows), P)
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :W]
    host = torch.cat([order, tokens, parent], dim=1).tolist()
    for b, (i, w) in enumerate(rows):
        row = host[b]
        toks, par = row[W : W + P], row[W + P :]
        nodes = sorted(row[: min(w, W)])
        where = {p: n for n, p in enumerate(nodes)}
        drafts[i] = [toks[p] for p in nodes]
        parents[i] = [where[par[p]] if par[p] >= 0 else -1 for p in nodes]


class StaticLevels(TreeLevels):
    """A fixed tree (``method.tree.static``) grown through ``TreeLevels``' steps, so a drafter
    follows it with its dynamic-tree loop unchanged.  ``k``: the tree's width
    (``TreeConfig.expanded().topk``); every level is laid out as a dynamic one of that
    width (level 1: the root's k best tokens; a deeper level: k children, by rank, of each
    of the k frontier places).  The frontier is the static nodes that have children (their
    places padded with the first one's), and every node outside the static tree scores
    -inf, so ``choose_nodes`` keeps exactly the static nodes, or the best-scored of them
    (a subtree) when fewer are wanted.  Node (0, 1) is the second-best child of the best
    first-level token, as the drafter scores them."""

    def __init__(self, logprobs: Tensor, paths, k: int):
        super().__init__(logprobs, k)
        self.keep, self.fronts = _static_plan(paths, k, logprobs.device)
        B = logprobs.shape[0]
        if self.fronts:
            self.local = self.fronts[0].expand(B, k)
        self._prune()

    def grow(self, logprobs: Tensor, tokens: Tensor) -> None:
        super().grow(logprobs, tokens)
        self._prune()

    def advance(self) -> Tensor:
        B = self.levels[-1][0].shape[0]
        self.local = self.fronts[len(self.levels) - 1].expand(B, self.k)
        return self.local // self.k

    def _prune(self) -> None:
        """Score the newest level's nodes outside the tree -inf; its nodes keep finite scores
        (a child never above its parent) so none ties with a pruned one."""
        score, tok, parent = self.levels[-1]
        keep = self.keep[len(self.levels) - 1]
        score = torch.where(keep, score.clamp(min=-1e30), torch.full_like(score, float("-inf")))
        self.levels[-1] = (score, tok, parent)


def _static_plan(paths, k: int, device: torch.device) -> tuple[list[Tensor], list[Tensor]]:
    """Per level: which places of its ``TreeLevels`` layout hold the static tree's nodes
    ((1, k) or (1, k * k) bool), and, for the levels that have children, the frontier: the
    places of its nodes with children, padded to k ((k,) int64)."""
    nodes = sorted(set(map(tuple, paths)), key=lambda p: (len(p), p))
    depth = max(len(p) for p in nodes)
    place: dict[tuple[int, ...], int] = {}
    slot: dict[tuple[int, ...], int] = {}  # a node with children: its place in its level's frontier
    keep: list[Tensor] = []
    fronts: list[Tensor] = []
    for d in range(1, depth + 1):
        level = [p for p in nodes if len(p) == d]
        for p in level:
            place[p] = p[0] if d == 1 else slot[p[:-1]] * k + p[-1]
        mask = torch.zeros(1, k if d == 1 else k * k, dtype=torch.bool)
        mask[0, [place[p] for p in level]] = True
        keep.append(mask.to(device))
        parents = [p for p in level if any(len(c) == d + 1 and c[:-1] == p for c in nodes)]
        if parents:
            slot.update({p: j for j, p in enumerate(parents)})
            front = [place[p] for p in parents]
            fronts.append(torch.tensor(front + front[:1] * (k - len(front)), dtype=torch.int64, device=device))
    return keep, fronts


def round_depth(tree, want: list[int], requests) -> int:
    """A tree round's expansion steps: the configured depth, no deeper than the most drafts
    wanted (``want``) nor than the depth adaptive speculation chose for the round
    (``DraftRequest.tree_depth`` of the round's ``requests``)."""
    chosen = [r.tree_depth for r in requests if r.tree_depth]
    return min(tree.depth, max(want), max(chosen) if chosen else tree.depth)


def tree_levels(tree, logprobs: Tensor) -> TreeLevels:
    """The levels a drafter grows for ``tree`` (a ``TreeConfig`` as ``expanded()`` gives it):
    a static tree's fixed shape, else EAGLE-2's dynamic tree of ``topk``."""
    if tree.static is not None:
        return StaticLevels(logprobs, tree.static_paths(), tree.topk)
    return TreeLevels(logprobs, tree.topk)


class FrontierMasks:
    """The tree masks of the frontiers a dynamic-tree round stores past the committed rows
    (``TreeLevels``' order: frontier after frontier, ``k`` nodes each, the first at tree bit
    0): a node sees itself and its ancestors, under a sliding ``window`` only those fewer
    than ``window`` levels up (as plain decoding would)."""

    def __init__(self, num_trees: int, k: int, window: int | None = None):
        self.k, self.window = k, window
        self.paths: list[list[list[int]]] = [[] for _ in range(num_trees)]  # per tree and stored node: its bits

    @property
    def stored(self) -> int:
        """Nodes stored per tree so far."""
        return len(self.paths[0]) if self.paths else 0

    def add(self, parent_slot: list[list[int]] | None) -> list[list[int]]:
        """Store the next frontier (``parent_slot[b][j]``: node j's parent's place in the
        previous frontier, ``TreeLevels.advance``; None for the first) and return each
        tree's masks of it."""
        out = []
        for b, paths in enumerate(self.paths):
            stored = len(paths)
            new = [(paths[stored - self.k + parent_slot[b][j]] if parent_slot is not None else []) + [stored + j]
                   for j in range(self.k)]
            paths.extend(new)
            w = self.window
            out.append([sum(1 << bit for bit in (p if w is None else p[-w:])) for p in new])
        return out


FUSED_HEAD = "cpu_fused"  # ``head_metadata``'s kernel for a head whose layer runs on the fused CPU decoder


def head_metadata(batch: StepBatch, block_size: int, device: torch.device, window: int | None = None,
                  kernel: str | None = None) -> tuple[AttentionMetadata, Tensor]:
    """(attention metadata, positions (T,)) for a forward of a head over ``batch`` in its
    paged cache.  ``kernel``: the paged kernel's implementation where the target runs on
    it (``RunnerFactory.head_attention``: CUDA), so a step that commits a prompt chunk
    beside decode rows gathers and masks nothing (``attention.kernel_metadata``); None:
    the reference attention's padded group (``attention.batch_metadata``: the CPU);
    ``FUSED_HEAD``: the head's layer runs whole on the fused CPU decoder
    (``kernels.cpu_decoder.FusedHead``), which reads the batch's layout as it is."""
    if kernel == FUSED_HEAD:
        from specserve.kernels.cpu_decoder import FusedStepArgs

        meta = AttentionMetadata(slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.int64),
                                 fused=FusedStepArgs.from_batch(batch))
        return meta, torch.tensor(batch.positions, dtype=torch.int64, device=device)
    if kernel is not None:
        return kernel_metadata(batch, block_size, device, kernel, window)
    return batch_metadata(batch, block_size, device, window)


def head_attention_bytes(target, engine, num_tokens: int, max_len: int, query_len: int, num_kv_heads: int,
                         head_dim: int) -> int:
    """The attention temporaries of a head's eager forward over ``num_tokens`` rows with
    contexts up to ``max_len`` (``head_metadata``), for a method's memory declaration
    (``target``: a ``TargetShape``, ``engine``: an ``EngineConfig``).  On CUDA the paged
    kernel's arguments only: it reads the cache in place, so a step that commits a prompt
    chunk beside decode rows costs no padded keys or mask.  Elsewhere the reference
    attention's padded gather of a step of ``query_len`` queries per sequence, a figure
    reported only (the CPU has no device budget)."""
    B = engine.max_num_seqs
    if target.cuda:
        return kernel_args_bytes(B, num_tokens, max_len, engine.block_size)
    return padded_attention_bytes(B, max_len, query_len, num_kv_heads, head_dim, target.dtype_bytes)


def step_metadata(batch: StepBatch, block_size: int, device: torch.device, window: int | None = None,
                  kernel: str | None = None) -> tuple[AttentionMetadata, Tensor, Tensor]:
    """``head_metadata`` with the token ids (T,): (metadata, ids, positions)."""
    meta, pos = head_metadata(batch, block_size, device, window, kernel)
    return meta, torch.tensor(batch.token_ids, dtype=torch.int64, device=device), pos


def read_tensors(hf_dir: Path, wanted) -> dict[str, Tensor]:
    """The tensors of a checkpoint whose names satisfy ``wanted(name)``, reading only
    those from safetensors files (a sharded index says which file holds what)."""
    from safetensors import safe_open

    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if single.is_file() or index.is_file():
        if single.is_file():
            files = {single: None}
        else:
            files = {}
            for name, f in json.loads(index.read_text())["weight_map"].items():
                if wanted(name):
                    files.setdefault(hf_dir / f, []).append(name)
        out: dict[str, Tensor] = {}
        for path, names in files.items():
            with safe_open(str(path), framework="pt") as f:
                for name in names if names is not None else [k for k in f.keys() if wanted(k)]:
                    out[name] = f.get_tensor(name)
        return out
    from specserve.executor.loader import read_state_dict

    return {k: v for k, v in read_state_dict(hf_dir).items() if wanted(k)}


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def read_tensor_shapes(hf_dir: Path, wanted=lambda name: True, fallback=None) -> dict[str, Tensor]:
    """``read_tensors`` without the data: meta tensors with the checkpoint's shapes (and
    dtypes), from the safetensors headers alone, for memory declarations made before
    anything is loaded.  Other formats are read by ``fallback`` (default
    ``read_tensors``) and only their shapes kept."""
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        read = fallback or read_tensors
        return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in read(hf_dir, wanted).items()}
    out: dict[str, Tensor] = {}
    for path in files:
        with open(path, "rb") as f:  # u64 little-endian header length, then the JSON header
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__" and wanted(name):
                dtype = _SAFETENSORS_DTYPES.get(info["dtype"], torch.uint8)
                out[name] = torch.empty(info["shape"], dtype=dtype, device="meta")
    return out


def fuse_layer(sd: dict[str, Tensor], prefix: str, a, out_prefix: str = "") -> dict[str, Tensor]:
    """One HF-named Llama/Qwen decoder layer (``prefix`` + input_layernorm, self_attn.*,
    mlp.*) -> the names of specserve's ``DecoderLayer`` (q/k/v and gate/up fused)."""
    from specserve.errors import ModelLoadError

    def take(key: str) -> Tensor:
        if prefix + key not in sd:
            raise ModelLoadError(f"checkpoint is missing tensor {prefix + key!r}")
        return sd[prefix + key]

    o = out_prefix
    out = {
        o + "input_layernorm.weight": take("input_layernorm.weight"),
        o + "post_attention_layernorm.weight": take("post_attention_layernorm.weight"),
        o + "qkv_proj.weight": torch.cat([take(f"self_attn.{n}_proj.weight") for n in "qkv"], 0),
        o + "o_proj.weight": take("self_attn.o_proj.weight"),
        o + "gate_up_proj.weight": torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")], 0),
        o + "down_proj.weight": take("mlp.down_proj.weight"),
    }
    if a.attention_bias:
        out[o + "qkv_proj.bias"] = torch.cat([take(f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
    if a.qk_norm:
        out[o + "q_norm.weight"] = take("self_attn.q_norm.weight")
        out[o + "k_norm.weight"] = take("self_attn.k_norm.weight")
    return out

"""Suffix decoding (Oliaro et al., arXiv 2411.04975): model-free drafts from suffix trees.

Two kinds of index, both :class:`SuffixIndex`:

* one per request over its prompt + output, extended token by token as the
  request grows (never rebuilt);
* global indexes over the responses of finished requests, one per tenant (the
  request's ``SamplingParams.cache_salt``: its API key and ``cache_salt``), so a
  draft -- and thereby a response's acceptance counts -- never comes from
  another tenant's responses.  All tenants together keep the newest responses
  within ``suffix_decoding_max_cached_bytes`` (estimated memory) and
  ``suffix_decoding_max_cached_requests`` (count); the oldest are evicted
  first, whichever tenant they belong to (either cap 0 turns them off).

Each step the pattern is the end of the request's context.  For every match
length m (1 .. max_tree_depth - 1) whose last-m tokens occur in an index, a
draft is grown from the matched node by always taking the most frequent next
token, for at most ``min(K, max_drafts, floor(max_spec_factor * m),
max_tree_depth - m)`` tokens, and only while the running product of the
frequency estimates P(next | path) stays >= ``suffix_decoding_min_token_prob``.
A draft's score is the sum of those running products (its expected accepted
length); the best-scoring draft over all match lengths and both indexes wins
(ties: the longer match, then the request's own index).

Frequency estimate: P(x | path) = count(path + x) / (occurrences of path that
have a next token).  The request's own last occurrence of the pattern (at the
end of its context, with nothing after it yet) is thus not counted as evidence
against every continuation; apart from that the counts are plain occurrence
counts, as in the paper.

Among continuations with the same count, the smaller token id is taken.

The index is a depth-bounded suffix trie (every substring of length <=
max_tree_depth, with its number of occurrences) stored compactly: an explicit
node is made only once a substring has been seen twice; a substring seen once
is a *tail*, a ``(tokens, pos)`` reference into the one sequence that holds it,
whose continuation is read from that sequence.  Appending a token touches the
<= max_tree_depth suffixes still growing (O(depth) dictionary operations);
removing a sequence walks its suffixes once.

Memory: each index keeps ``num_bytes``, its CPython footprint, up to date as it
changes: ``sys.getsizeof`` of every children dict (its growth measured at each
insertion), plus per node, tail tuple, token list and non-cached int object
their sizes rounded to CPython's 16-byte allocation granule (node counts above
256 are not counted).  Against tracemalloc the estimate is within a few percent.
Measured (SmolLM2 tokens, depth 24): about 0.55-0.85 KiB per cached token on
ShareGPT answers (the first responses cost most), 0.1 KiB on near-copies of one
answer, 3 KiB when every answer recurs exactly once (an explicit node per
substring) -- hence a cap in bytes.  Per-request indexes live only while their
request runs and are not counted against the cap.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Union

from specserve.methods.suffix import SuffixOptions
from specserve.proposers.base import DraftRequest, Proposal, ProposerContext


class _Node:
    """An explicit trie node: a substring with its occurrence count."""

    __slots__ = ("count", "children")

    def __init__(self, count: int):
        self.count = count
        # next token -> explicit node, or a tail (tokens, pos): the single
        # occurrence, whose next token is tokens[pos], then tokens[pos + 1], ...
        self.children: dict[int, Union[_Node, tuple[list[int], int]]] = {}


def _granule(nbytes: int) -> int:
    """What CPython's small-object allocator hands out for an object of nbytes (16-byte granules)."""
    return (nbytes + 15) & ~15


_sizeof = sys.getsizeof
_NODE_BYTES = _granule(_sizeof(_Node(0)))  # the node object; its children dict is measured apart
_TAIL_BYTES = _granule(_sizeof(([], 0)))  # a (tokens, pos) tuple
_INT_BYTES = _granule(_sizeof(1 << 20))


def _int_bytes(value: int) -> int:
    """An int object's size, 0 for the ones CPython shares (-5 .. 256)."""
    return 0 if -5 <= value <= 256 else _INT_BYTES


def _tail_bytes(pos: int) -> int:
    return _TAIL_BYTES + _int_bytes(pos)


def _subtree_bytes(node: _Node) -> int:
    """Bytes of an explicit node and everything below it."""
    total = _NODE_BYTES + _sizeof(node.children)
    for child in node.children.values():
        total += _tail_bytes(child[1]) if type(child) is tuple else _subtree_bytes(child)
    return total


@dataclass
class SuffixDraft:
    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0  # sum of the running probability estimates (expected accepted drafts)
    match_len: int = 0
    source: str = ""  # "request" or "global"


class SuffixIndex:
    """Occurrence counts of every substring (length <= max_depth) of a set of
    token sequences, updated incrementally.

    One sequence at a time is *open* (being appended to); appending to another
    sequence closes it for good.  ``remove`` drops a sequence's occurrences.
    ``num_bytes`` is the index's estimated memory (module docstring).
    """

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(0)  # root.count = number of positions indexed
        self._seqs: dict[object, list[int]] = {}
        self._open: object | None = None
        # Loci (node of the substring, or None once it is a tail) of the open
        # sequence's suffixes shorter than max_depth, oldest (longest) first:
        # _active[-m] is the locus of the last m tokens.
        self._active: list[_Node | None] = []
        self.num_bytes = _NODE_BYTES + _sizeof(self.root.children) + _sizeof(self._seqs)

    # ------------------------------------------------------------ updates
    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def tokens(self, seq_id: object) -> list[int]:
        return self._seqs[seq_id]

    def extend(self, seq_id: object, tokens: list[int]) -> None:
        """Append tokens to sequence `seq_id` (created on first use)."""
        if seq_id != self._open:
            if seq_id in self._seqs:
                raise ValueError(f"sequence {seq_id!r} was closed; it cannot be extended")
            self._open = seq_id
            before = _sizeof(self._seqs)
            self._seqs[seq_id] = []
            self.num_bytes += _sizeof(self._seqs) - before + _granule(_sizeof(self._seqs[seq_id]))
            self._active = []
        seq = self._seqs[seq_id]
        active = self._active
        depth = self.max_depth
        root = self.root
        # Bytes added: each dict insertion measures the dict's growth; the token list at the end.
        added = -_granule(_sizeof(seq))
        for t in tokens:
            n = len(seq)
            seq.append(t)
            added += _int_bytes(t)
            root.count += 1
            active.append(root)
            # Every growing suffix seq[j:n] becomes seq[j:n+1]; active[i] has depth len(active) - i after it.
            for i in range(len(active)):
                node = active[i]
                if node is None:
                    continue  # a tail of this very sequence: it grows with `seq` by itself
                children = node.children
                child = children.get(t)
                if child is None:
                    before = _sizeof(children)
                    children[t] = (seq, n)  # first occurrence: a tail
                    added += _sizeof(children) - before + _tail_bytes(n)
                    active[i] = None
                elif type(child) is tuple:
                    # Seen once before: make it explicit; the earlier occurrence
                    # continues as a tail one token further on (if it goes on).
                    other, p = child
                    fresh = _Node(2)
                    added += _NODE_BYTES - _tail_bytes(p)
                    if len(active) - i < depth and p + 1 < len(other):
                        fresh.children[other[p + 1]] = (other, p + 1)
                        added += _tail_bytes(p + 1)
                    added += _sizeof(fresh.children)
                    children[t] = fresh
                    active[i] = fresh
                else:
                    child.count += 1
                    active[i] = child
            if len(active) == depth:  # the oldest suffix reached max_depth: it stops growing
                active.pop(0)
        self.num_bytes += added + _granule(_sizeof(seq))

    def close(self) -> None:
        self._open = None
        self._active = []

    def remove(self, seq_id: object) -> None:
        """Drop every occurrence contributed by `seq_id`."""
        seq = self._seqs.pop(seq_id)
        if seq_id == self._open:
            self.close()
        depth = self.max_depth
        freed = _granule(_sizeof(seq))  # a dict does not shrink when entries go: only objects count
        for j in range(len(seq)):
            self.root.count -= 1
            freed += _int_bytes(seq[j])
            node = self.root
            for d in range(j, min(j + depth, len(seq))):
                t = seq[d]
                child = node.children[t]
                if type(child) is tuple:  # the tail of this very occurrence
                    del node.children[t]
                    freed += _tail_bytes(child[1])
                    break
                child.count -= 1
                if child.count == 0:
                    del node.children[t]  # only this occurrence went through it
                    freed += _subtree_bytes(child)
                    break
                node = child
        self.num_bytes -= freed

    # ------------------------------------------------------------ queries
    def count(self, path: list[int]) -> int:
        """Occurrences of `path` (0 when longer than max_depth or unseen)."""
        if len(path) > self.max_depth:
            return 0
        node, tail = self._match(path, 0)
        if tail is not None:
            return 1
        return 0 if node is None else node.count

    def _match(self, context: list[int], start: int) -> tuple[_Node | None, tuple[list[int], int] | None]:
        """Locus of context[start:]: (node, None), (None, (tokens, next_pos)) inside a tail, or (None, None)."""
        node = self.root
        for idx in range(start, len(context)):
            t = context[idx]
            child = node.children.get(t)
            if child is None:
                return None, None
            if type(child) is tuple:
                seq, pos = child
                k = len(context) - idx  # tokens left to match, child's first token included
                if seq[pos : pos + k] != context[idx:]:
                    return None, None
                return None, (seq, pos + k)
            node = child
        return node, None

    def speculate(
        self, context: list[int], max_tokens: int, max_spec_factor: float, min_token_prob: float,
        *, own: bool = False, to_beat: tuple[float, int] = (0.0, 0),
    ) -> SuffixDraft:
        """The best draft continuing `context`, or an empty draft.

        Drafts compare by (score, match length).  own=True: `context` is this
        index's open sequence (the request's own index), whose suffix loci are
        already known.  Only a draft better than `to_beat` is returned."""
        depth = self.max_depth
        longest = min(len(context), depth - 1)
        if max_tokens < 1 or longest < 1:
            return SuffixDraft()
        loci: list[tuple[_Node | None, tuple[list[int], int] | None]]
        if own:
            if self._open is None or len(self._seqs[self._open]) != len(context):
                raise ValueError("own=True needs the index's open sequence as the context")
            # _active[-m] is the node of the last m tokens, or None: then that substring
            # occurs only at the very end of the sequence and nothing follows it.
            loci = [(self._active[-m], None) for m in range(1, longest + 1)]
        else:
            loci = []
            for m in range(1, longest + 1):  # a longer pattern matches only if every shorter one does
                node, tail = self._match(context, len(context) - m)
                if node is None and tail is None:
                    break
                loci.append((node, tail))
        best = SuffixDraft()
        for m in range(len(loci), 0, -1):
            budget = min(max_tokens, int(m * max_spec_factor + 1e-9), depth - m)
            if (budget, m) <= to_beat:
                continue  # a score is at most the draft's length: this match cannot win
            node, tail = loci[m - 1]
            if node is None and tail is None:
                continue
            toks, score = _grow(node, tail, budget, min_token_prob)
            if toks and (score, m) > to_beat:
                to_beat = (score, m)
                best = SuffixDraft(toks, score, m)
        return best


def _grow(
    node: _Node | None, tail: tuple[list[int], int] | None, budget: int, min_token_prob: float,
) -> tuple[list[int], float]:
    """Follow the most frequent continuation (ties: the smaller token id) from a locus."""
    out: list[int] = []
    prob = 1.0
    score = 0.0
    while len(out) < budget:
        if tail is not None:  # a single occurrence: its next tokens, each with estimate 1
            seq, pos = tail
            take = seq[pos : pos + budget - len(out)]
            out.extend(take)
            score += prob * len(take)
            break
        best_tok, best_count, best_child, total = -1, 0, None, 0
        for tok, child in node.children.items():
            c = 1 if type(child) is tuple else child.count
            total += c
            if c > best_count or (c == best_count and tok < best_tok):
                best_tok, best_count, best_child = tok, c, child
        if total == 0:
            break
        p = prob * best_count / total
        if p < min_token_prob:
            break
        prob = p
        out.append(best_tok)
        score += prob
        if type(best_child) is tuple:
            tail = (best_child[0], best_child[1] + 1)
        else:
            node = best_child
    return out, score


class SuffixCache:
    """The per-request indexes and, per tenant, a global index of past responses.

    Independent of the engine: ``extend`` a request's tokens as they appear,
    ``speculate`` for it, ``stop`` it (optionally caching its response).  A
    tenant is an opaque partition key (``SamplingParams.cache_salt``; None is
    the requests that carry none): a request drafts only from its own tenant's
    responses."""

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 10000, max_cached_bytes: int = 1 << 30):
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_bytes = max_cached_bytes
        self.requests: dict[str, SuffixIndex] = {}
        self.global_indexes: dict[str | None, SuffixIndex] = {}
        # (tenant, response id) of the cached responses, oldest first, over all tenants.
        self._responses: deque[tuple[str | None, int]] = deque()
        self._next_response = 0
        self.num_bytes = 0  # estimated memory of the global indexes together

    @property
    def global_index(self) -> SuffixIndex:
        """The global index of the requests without a tenant (an empty one when there is none)."""
        return self.global_indexes.get(None) or SuffixIndex(self.max_depth)

    def num_indexed(self, request_id: str) -> int:
        idx = self.requests.get(request_id)
        return len(idx.tokens(request_id)) if idx is not None and request_id in idx else 0

    def extend(self, request_id: str, tokens: list[int]) -> None:
        idx = self.requests.get(request_id)
        if idx is None:
            idx = self.requests[request_id] = SuffixIndex(self.max_depth)
        if tokens:
            idx.extend(request_id, tokens)

    def speculate(self, request_id: str, max_tokens: int, max_spec_factor: float, min_token_prob: float,
                  tenant: str | None = None) -> SuffixDraft:  # fmt: skip
        idx = self.requests[request_id]
        context = idx.tokens(request_id) if request_id in idx else []
        best = idx.speculate(context, max_tokens, max_spec_factor, min_token_prob, own=True)
        best.source = "request"
        shared = self.global_indexes.get(tenant)
        if shared is not None:
            g = shared.speculate(context, max_tokens, max_spec_factor, min_token_prob,
                                 to_beat=(best.score, best.match_len))
            if g.token_ids:  # better than the request's own draft
                g.source = "global"
                best = g
        return best

    def stop(self, request_id: str, response: list[int] | None = None, tenant: str | None = None) -> None:
        """Forget the request; cache `response` in its tenant's global index (oldest evicted
        first, over all tenants, beyond either cap)."""
        self.requests.pop(request_id, None)
        if not response or self.max_cached_requests <= 0 or self.max_cached_bytes <= 0:
            return
        idx = self.global_indexes.get(tenant)
        if idx is None:
            idx = self.global_indexes[tenant] = SuffixIndex(self.max_depth)
            self.num_bytes += idx.num_bytes
        rid = self._next_response
        self._next_response += 1
        before = idx.num_bytes
        idx.extend(rid, list(response))
        idx.close()
        self.num_bytes += idx.num_bytes - before
        self._responses.append((tenant, rid))
        while self._responses and (
            len(self._responses) > self.max_cached_requests or self.num_bytes > self.max_cached_bytes
        ):
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        tenant, rid = self._responses.popleft()
        idx = self.global_indexes[tenant]
        before = idx.num_bytes
        idx.remove(rid)
        if len(idx):
            self.num_bytes -= before - idx.num_bytes
        else:  # its last response: the whole index goes (its dicts never shrink otherwise)
            del self.global_indexes[tenant]
            self.num_bytes -= before

    @property
    def num_cached_responses(self) -> int:
        return len(self._responses)


# ------------------------------------------------------------ proposer protocol glue


class SuffixProposer:
    """Keeps each request's index in step with its committed tokens (at propose
    time: whatever was appended since) and caches a request's output when it
    finishes, in the global index of its tenant (the sequence's ``cache_salt``).
    The engine calls ``remove`` both when a request finishes (or is aborted) and
    when it is preempted; the sequence says which (``finished``, set before
    ``remove``): a preempted request keeps nothing here and is re-indexed from
    its tokens when it is scheduled again."""

    aux_layer_ids: tuple[int, ...] = ()  # reads no target states

    def __init__(self, spec: SuffixOptions):
        self.num_spec_tokens = spec.num_speculative_tokens
        self.factor = spec.suffix_decoding_max_spec_factor
        self.min_prob = spec.suffix_decoding_min_token_prob
        self.cache = SuffixCache(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                                 spec.suffix_decoding_max_cached_bytes)
        self.seqs: dict[str, Any] = {}  # request id -> its sequence (a RequestView)

    def propose(self, requests: list[DraftRequest], step: Any = None) -> Proposal:
        out = []
        for r in requests:
            rid = r.seq.request_id
            self.seqs[rid] = r.seq
            done = self.cache.num_indexed(rid)
            self.cache.extend(rid, r.seq.token_ids[done:])
            n = min(self.num_spec_tokens, r.max_drafts)
            tenant = _tenant(r.seq)
            out.append(self.cache.speculate(rid, n, self.factor, self.min_prob, tenant).token_ids if n > 0 else [])
        return Proposal(token_ids=out)

    def on_verified(self, seq, num_tokens_before, num_drafts, num_accepted) -> None:
        pass  # the index catches up at the next propose

    def remove(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        response = seq.token_ids[seq.num_prompt_tokens :] if seq is not None and seq.finished else None
        self.cache.stop(request_id, response, _tenant(seq) if seq is not None else None)

    def cache_usage(self) -> tuple[int, int]:
        """(estimated bytes, responses) of the global indexes, for the metrics."""
        return self.cache.num_bytes, self.cache.num_cached_responses


def _tenant(seq: Any) -> str | None:
    """A sequence's partition key (views without one share the un-salted partition)."""
    return getattr(seq, "cache_salt", None)


def build(spec: SuffixOptions, ctx: ProposerContext) -> SuffixProposer:
    return SuffixProposer(spec)

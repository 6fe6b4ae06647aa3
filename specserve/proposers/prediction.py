"""Predicted Outputs (OpenAI's ``prediction`` request field): drafts from text the client expects.

A request may carry the tokens of the output it expects (``SamplingParams.
prediction_token_ids``; the servers tokenize ``prediction.content``), typically
the original of a file the model is asked to edit slightly.  Where the output
follows the prediction, the prediction's next tokens are the drafts; the target
verifies them like any other drafts, so the output is exactly what it would be
without a prediction (greedy: token for token; sampled: the same distribution).

Alignment.  Each request keeps a *cursor* into its prediction P: the index of
the token the output is expected to produce next.  After every verification
the tokens just committed are compared with P at the cursor:

* they continue P: the cursor moves past them and the next drafts are
  ``P[cursor : cursor + k]`` (the fast path; no search);
* they depart from P (the model inserted, deleted or replaced something): the
  alignment is lost, and each following step tries to re-synchronise by
  looking the end of the context up in P, the way prompt lookup (n-gram) and
  suffix decoding index their text: the longest suffix of the context (up to
  ``max_match`` tokens) that ends somewhere in P wins, ties going to the
  occurrence nearest at or after the old cursor (edits are local; occurrences
  behind it count as further away than any ahead).  A match must be at least
  ``min_match`` tokens long, except within ``window`` tokens ahead of the old
  cursor, where one token is enough (the first token after a replaced or
  inserted span usually resumes P right there).  Until a match is found the
  request drafts nothing from P.

Draft length follows the evidence: ``min(k, run)`` where ``run`` is how many
tokens the context has followed P without a break (the match length after a
re-synchronisation, growing as the output keeps following P; the client's
prediction is trusted in full at the start).  A weak re-synchronisation (one
common token) thus risks one draft token, not k, while a long run drafts k.

P is indexed once per request (token -> positions); a lookup extends each
candidate position backwards against the context, so it costs
O(occurrences of the last token x max_match), and only while unaligned.

Composition with the configured method (``PredictedOutputs.propose``): a
request whose prediction yields drafts this step uses them (the method's
proposer is asked for none for it: ``max_drafts = 0``, which every proposer
handles, and it is told of no drafts at verification); every other request
gets the method's drafts, capped at the method's K.  With no method configured,
only predictions draft.  How many leading drafts of a step came from the
prediction is returned so that the engine can count accepted and rejected
prediction tokens (OpenAI's ``completion_tokens_details``).

Per-request state: a request's ``PredictionIndex`` is built on its first proposal
and kept by request id; ``remove`` frees it, called only from the engine's one
teardown of a request (``engine.requests.RequestTable.release``: finish, abort,
failure, preemption).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specserve.proposers.base import DraftRequest, Proposal

DEFAULT_MIN_MATCH = 2
DEFAULT_MAX_MATCH = 16
DEFAULT_WINDOW = 16


class PredictionIndex:
    """One request's prediction and its alignment with the request's context."""

    def __init__(self, tokens: list[int], context_len: int, min_match: int = DEFAULT_MIN_MATCH,
                 max_match: int = DEFAULT_MAX_MATCH, window: int = DEFAULT_WINDOW):
        self.tokens = list(tokens)
        self.min_match = min_match
        self.max_match = max_match
        self.window = window
        self.positions: dict[int, list[int]] = {}
        for i, t in enumerate(self.tokens):
            self.positions.setdefault(t, []).append(i)
        self.cursor = 0  # index in tokens of the next expected output token
        self.run = len(self.tokens)  # tokens followed without a break (at the start: trust the prediction)
        # Context length up to which the cursor is known to be aligned; None = lost.
        self.synced: int | None = context_len

    @property
    def aligned(self) -> bool:
        return self.synced is not None

    def update(self, context: list[int]) -> None:
        """Follow the committed context (prompt + output) since the last update."""
        n = len(context)
        if self.synced is not None:
            if n < self.synced:  # cannot happen for a live request; start over
                self.synced = None
            else:
                new = context[self.synced :]
                P, c = self.tokens, self.cursor
                m = 0
                while m < len(new) and c + m < len(P) and P[c + m] == new[m]:
                    m += 1
                self.cursor = c + m
                if m == len(new):
                    self.synced = n
                    self.run += m
                    return
                self.synced = None  # departed from P; the cursor stays a locality hint
        self._resync(context)

    def _resync(self, context: list[int]) -> None:
        if not context:
            return
        P = self.tokens
        best: tuple[int, int] | None = None  # (match length, -distance)
        best_end = -1
        for e in self.positions.get(context[-1], ()):
            length = 1
            while (length < self.max_match and length < len(context) and e - length >= 0
                   and P[e - length] == context[-1 - length]):
                length += 1
            d = e - self.cursor
            if length < self.min_match and not 0 <= d <= self.window:
                continue
            dist = d if d >= 0 else len(P) - d  # any occurrence behind the cursor is further than all ahead
            key = (length, -dist)
            if best is None or key > best:
                best, best_end = key, e
        if best is not None:
            self.cursor = best_end + 1
            self.synced = len(context)
            self.run = best[0]

    def draft(self, k: int) -> list[int]:
        if self.synced is None or k <= 0:
            return []
        return self.tokens[self.cursor : self.cursor + min(k, max(1, self.run))]


class PredictedOutputs:
    """Per-request prediction indexes, composed with the configured proposer (or alone).
    ``num_spec_tokens``: the most drafts a prediction gives per step."""

    def __init__(self, num_spec_tokens: int, min_match: int = DEFAULT_MIN_MATCH, max_match: int = DEFAULT_MAX_MATCH,
                 window: int = DEFAULT_WINDOW):
        self.num_spec_tokens = num_spec_tokens
        self.min_match, self.max_match, self.window = min_match, max_match, window
        self.indexes: dict[str, PredictionIndex] = {}

    def _index(self, seq: Any) -> PredictionIndex | None:
        idx = self.indexes.get(seq.request_id)
        if idx is None:
            params = getattr(seq, "params", None)
            tokens = getattr(params, "prediction_token_ids", None)
            if not tokens:
                return None
            idx = self.indexes[seq.request_id] = PredictionIndex(
                tokens, seq.num_prompt_tokens, self.min_match, self.max_match, self.window
            )
        return idx

    def drafts_for(self, r: DraftRequest) -> list[int]:
        idx = self._index(r.seq)
        if idx is None:
            return []
        idx.update(r.seq.token_ids)
        return idx.draft(min(self.num_spec_tokens, r.max_drafts))

    def propose(self, requests: list[DraftRequest], step: Any, inner: Any,
                inner_num_spec_tokens: int) -> tuple[Proposal, list[int]]:
        """Drafts for every request: its prediction's where it has some, else ``inner``'s
        (capped at ``inner_num_spec_tokens``, the method's K).  Returns the proposal and, per request, how many of its
        drafts came from the prediction."""
        pred = [self.drafts_for(r) if r.max_drafts > 0 else [] for r in requests]
        if inner is None:
            return Proposal(token_ids=pred), [len(p) for p in pred]
        sub = [dataclasses.replace(r, max_drafts=0 if p else min(r.max_drafts, inner_num_spec_tokens))
               for r, p in zip(requests, pred)]
        prop = inner.propose(sub, step)
        tokens = [p if p else list(t[: s.max_drafts]) for p, t, s in zip(pred, prop.token_ids, sub)]
        probs = prop.probs
        if probs is not None and any(pred):
            probs = one_hot_rows(probs, tokens, [bool(p) for p in pred])
        parents = None if prop.parents is None else [None if p else t for p, t in zip(pred, prop.parents)]
        return Proposal(token_ids=tokens, probs=probs, parents=parents), [len(p) for p in pred]

    def remove(self, request_id: str) -> None:
        """The release hook of the request's index (see the module docstring)."""
        self.indexes.pop(request_id, None)


def one_hot_rows(probs: Any, tokens: list[list[int]], rows: list[bool]) -> Any:
    """Draft distributions with the rows of prediction drafts replaced by one-hot ones
    (a prediction is a deterministic draft)."""
    import torch

    width = max([probs.shape[1]] + [len(t) for use, t in zip(rows, tokens) if use])
    if width > probs.shape[1]:  # a prediction drafts more than the method did this round
        probs = torch.cat([probs, probs.new_zeros(probs.shape[0], width - probs.shape[1], probs.shape[2])], dim=1)
    else:
        probs = probs.clone()
    for b, (use, toks) in enumerate(zip(rows, tokens)):
        if use:
            probs[b].zero_()
            if toks:
                idx = torch.tensor(toks, device=probs.device)
                probs[b, torch.arange(len(toks), device=probs.device), idx] = 1.0
    return probs

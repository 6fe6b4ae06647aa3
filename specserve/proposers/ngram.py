"""N-gram (prompt lookup) proposer.

Over prompt + output, find the LONGEST n in [prompt_lookup_min,
prompt_lookup_max] whose last-n tokens occurred earlier, take the EARLIEST such
occurrence and propose up to K tokens that followed it.  Nothing when the
context is shorter than prompt_lookup_min or no n-gram repeats.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specserve.methods.ngram import NgramOptions
from specserve.proposers.base import DraftRequest, Proposal, ProposerContext


def ngram_lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """tokens: (L,) int array. Returns up to k draft tokens."""
    L = tokens.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = tokens[L - n :]
        # Windows starting at 0 .. L-n-1: every earlier occurrence, each followed by >= 1 token.
        windows = sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, spec: NgramOptions):
        self.n_min = spec.prompt_lookup_min or 5
        self.n_max = spec.prompt_lookup_max or self.n_min
        self.num_spec_tokens = spec.num_speculative_tokens

    def propose(self, requests: list[DraftRequest], step=None) -> Proposal:
        out = []
        for r in requests:
            toks = np.asarray(r.seq.token_ids, dtype=np.int64)
            out.append(ngram_lookup(toks, self.n_min, self.n_max, min(self.num_spec_tokens, r.max_drafts)))
        return Proposal(token_ids=out)

    def on_verified(self, seq, num_tokens_before, num_drafts, num_accepted) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass


def build(spec: NgramOptions, ctx: ProposerContext) -> NgramProposer:
    return NgramProposer(spec)

"""Plans each step's per-request logits controls, grammar masks and log-probabilities.

The step loop calls three things here:

* :func:`plan_step` before sampling: per verified request, the logits controls of its
  rows (``specserve.sampling.logits_controls``) and its grammar masks; drafts a
  grammar refuses are cut at the first refused one (they could not be accepted).  A
  position where the grammar allows nothing gets an EOS-only row (finite logits) and
  is remembered: the request fails when it commits that position
  (``GrammarState.advance``), it never ends as a plain "stop";
* :func:`logprob_lists` after the step's one copy back: per request, the
  log-probabilities of the tokens it emitted (and top-k alternatives);
* :func:`prompt_logprob_lists` for prefill chunks of requests that asked for
  ``prompt_logprobs`` (raw model logits: no controls apply to the prompt).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from specserve.request import SamplingParams, TokenLogprob
from specserve.sampling.logits_controls import LogitsPlan, RequestControls, unpack_logprobs

__all__ = ["plan_step", "logprob_lists", "prompt_logprob_lists"]


def plan_step(
    seqs: list[Any], grammars: list[Any], drafts: list[list[int]], rows: list[int], vocab_size: int,
    eos_token_ids: tuple[int, ...],
) -> tuple[LogitsPlan | None, list[list[int]]]:
    """The step's plan (None when no request has controls) and the drafts to verify."""
    plan = LogitsPlan(vocab_size)
    out_drafts: list[list[int]] = []
    for seq, grammar, d, row in zip(seqs, grammars, drafts, rows):
        p: SamplingParams = seq.params
        if not p.has_logits_processors and grammar is None:
            out_drafts.append(d)
            continue
        bitmask = None
        if grammar is not None:
            bitmask, n = grammar.masks(list(d))
            d = d[:n]
        banned: list[int] = []
        if p.min_tokens and seq.num_output_tokens < p.min_tokens:
            banned = sorted(set(eos_token_ids) | set(p.stop_token_ids))
        penal = p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
        plan.add(RequestControls(
            row_start=row, num_rows=len(d) + 1, drafts=list(d),
            output_ids=seq.output_token_ids if penal or p.bad_words else (),
            prompt_ids=seq.prompt_token_ids if p.repetition_penalty != 1.0 else (),
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias, min_tokens=p.min_tokens,
            num_output_tokens=seq.num_output_tokens, banned_until_min=banned, bitmask=bitmask,
            allowed=p.allowed_token_ids, bad_words=p.bad_words_token_ids or (),
        ))  # fmt: skip
        out_drafts.append(d)
    return (None if plan.empty else plan), out_drafts


def logprob_lists(extra: np.ndarray, emitted: list[list[int]], want: list[int | None], num_positions: int,
                  top_k: int) -> list[list[TokenLogprob] | None]:  # fmt: skip
    """Per request (the rows of ``extra``, from ``logprob_columns``), the emitted tokens' log-probabilities."""
    out: list[list[TokenLogprob] | None] = []
    for b, (toks, k) in enumerate(zip(emitted, want)):
        if k is None:
            out.append(None)
            continue
        chosen, top_v, top_i = unpack_logprobs(extra[b], num_positions, top_k)
        out.append([
            TokenLogprob(int(t), float(chosen[j]), [(int(i), float(v)) for i, v in zip(top_i[j, :k], top_v[j, :k])])
            for j, t in enumerate(toks)
        ])  # fmt: skip
    return out


@torch.inference_mode()
def prompt_logprob_lists(logits: Tensor, rows: list[int], next_tokens: list[int], k: int) -> list[TokenLogprob]:
    """Log-probabilities of ``next_tokens[i]`` under row ``rows[i]`` of the raw logits, with top-k."""
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    lp = torch.log_softmax(logits.float().index_select(0, idx), dim=-1)  # (n, V)
    tok = torch.tensor(next_tokens, dtype=torch.int64, device=logits.device)
    chosen = lp.gather(1, tok[:, None])[:, 0]
    ranks = ((lp > chosen[:, None]).sum(dim=1) + 1).cpu().numpy()  # vLLM's rank of the prompt token
    if k > 0:
        top_v, top_i = lp.topk(k, dim=-1)
        host = torch.cat([chosen[:, None], top_v], dim=1).cpu().numpy(), top_i.cpu().numpy()
    else:
        host = chosen[:, None].cpu().numpy(), np.zeros((len(rows), 0), dtype=np.int64)
    vals, ids = host
    return [
        TokenLogprob(int(t), float(vals[j, 0]), [(int(i), float(v)) for i, v in zip(ids[j], vals[j, 1:])],
                     rank=int(ranks[j]))
        for j, t in enumerate(next_tokens)
    ]

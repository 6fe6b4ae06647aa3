"""EAGLE-3's training-time test: the head unrolled over its own predictions.

For a batch of sequences (positions 0..T-1 fed to the target), step 0 runs the
head on every row t as serving does after verification: token t + 1, the fused
target features of position t, rotary position t.  Step j >= 1 runs row t again
one position further (token t + 1 + j, position t + j) with the head's own
output of step j - 1 as its hidden state, and its attention sees exactly what it
would see when drafting from row t: the step-0 keys of rows 0..t (real rows)
plus row t's own keys of steps 1..j (its earlier drafts).  Step j is trained
against the target's distribution at position t + 1 + j (over the draft
vocabulary; the labels are the target's own softened predictions), weighted
``step_weight ** j``.

Tokens stay the target's own (greedy-regenerated) tokens at every step: a draft
only matters while the earlier drafts were right, i.e. equal to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from specserve.executor.models.eagle import EagleHead


@dataclass
class Batch:
    tokens: Tensor  # (B, T + 1) int64: token ids (padded with 0)
    feats: Tensor  # (B, T, 3 * tH) fused-layer features (float)
    final: Tensor  # (B, T, H) the target's final-normed hidden states
    n: Tensor  # (B,) fed positions of each sequence (<= T)
    prompt_len: Tensor  # (B,) prompt tokens of each sequence

    @property
    def num_positions(self) -> int:
        return int(self.n.sum())


def collate(items: list[tuple[Tensor, int, Tensor]], hidden: int, device: torch.device) -> Batch:
    """(tokens, prompt length, (n, 4H) features) -> a padded batch."""
    T = max(f.shape[0] for _, _, f in items)
    B = len(items)
    tokens = torch.zeros(B, T + 1, dtype=torch.int64)
    feats = torch.zeros(B, T, 4 * hidden, dtype=torch.float32)
    n = torch.zeros(B, dtype=torch.int64)
    plen = torch.zeros(B, dtype=torch.int64)
    for b, (toks, p, f) in enumerate(items):
        m = f.shape[0]
        tokens[b, : m + 1] = toks[: m + 1].long()
        feats[b, :m] = f.float()
        n[b], plen[b] = m, p
    feats = feats.to(device)
    return Batch(tokens.to(device), feats[..., : 3 * hidden], feats[..., 3 * hidden :], n.to(device), plen.to(device))


def _shift(x: Tensor, j: int, fill=0) -> Tensor:
    """x[:, j:] padded back to length T along dim 1."""
    if j == 0:
        return x
    pad = x.new_full((x.shape[0], j, *x.shape[2:]), fill)
    return torch.cat([x[:, j:], pad], dim=1)


def unroll(head: EagleHead, batch: Batch, steps: int, first_row: int = 0) -> Iterator[tuple[int, Tensor]]:
    """The head's output (before its final norm) at each unrolled step j = 0 .. steps - 1,
    as (t0, (B, T - t0, H)) for rows t0..T-1 (row t of step j predicts token t + 2 + j).
    Step 0 runs every row (all are keys of later rows); steps >= 1 only rows from
    ``first_row`` on (earlier rows would predict prompt tokens only)."""
    c = head.c
    B, T = batch.feats.shape[:2]
    dev = batch.feats.device
    nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    rep = nh // nkv
    scale = 1.0 / math.sqrt(hd)
    k0 = v0 = None
    diag_k: list[Tensor] = []
    diag_v: list[Tensor] = []
    hidden = head.project(batch.feats.to(head.fc.weight.dtype))  # (B, T, H)
    for j in range(steps):
        t0 = 0 if j == 0 else min(first_row, T - 1)
        if j == 1:
            hidden = hidden[:, t0:]
        n = T - t0
        t = torch.arange(t0, T, device=dev)
        ids = _shift(batch.tokens, 1 + j)[:, t0 : T]  # (B, n): token t + 1 + j
        residual, x = head.step_input(ids.reshape(-1), hidden.reshape(B * n, -1))
        cos, sin = head.rotary.tables((t + j).repeat(B), x.dtype)
        q, k, v = head.layer.qkv(x, cos, sin)  # (B*n, nh|nkv, hd)
        q = q.view(B, n, nh, hd).transpose(1, 2)  # (B, nh, n, hd)
        k = k.view(B, n, nkv, hd).transpose(1, 2).repeat_interleave(rep, dim=1)  # (B, nh, n, hd)
        v = v.view(B, n, nkv, hd).transpose(1, 2).repeat_interleave(rep, dim=1)
        if j == 0:
            k0, v0 = k, v
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        else:
            diag_k.append(k)
            diag_v.append(v)
            s0 = (q @ k0.transpose(-1, -2)) * scale  # (B, nh, n, T): the real rows 0..t
            s0 = s0.masked_fill(torch.arange(T, device=dev)[None, :] > t[:, None], float("-inf"))
            sd = torch.stack([(q * kk).sum(-1) for kk in diag_k], dim=-1) * scale  # (B, nh, n, j): own drafts
            w = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1)
            attn = w[..., :T] @ v0 + (w[..., T:, None] * torch.stack(diag_v, dim=-2)).sum(-2)
        out = head.layer.output(residual, attn.transpose(1, 2).reshape(B * n, nh * hd)).view(B, n, -1)
        yield t0, out
        hidden = out


def ttt_loss(head: EagleHead, batch: Batch, target_lm: Tensor, steps: int, step_weight: float,
             loss_on_prompt: bool = False) -> tuple[Tensor, list[float], list[float]]:
    """Weighted loss over ``steps`` unrolled steps, plus per step the loss and the top-1
    agreement with the target's token (response positions).  ``target_lm``: (Vd, H) the
    target's LM head rows of the draft vocabulary.  Logits are computed only for the
    rows that have a loss (the LM head is most of the head's cost)."""
    B, T = batch.feats.shape[:2]
    dev = batch.feats.device
    first = 0 if loss_on_prompt else max(int(batch.prompt_len.min()) - 1 - steps, 0)
    total = torch.zeros((), device=dev)
    # The target's distribution at every position some step is trained against, computed
    # once (step j of row t reads position t + 1 + j: the same positions recur across steps).
    q = torch.arange(T, device=dev)[None, :]
    need = (q < batch.n[:, None]) & (q >= 1)
    if not loss_on_prompt:
        need &= (q + 1) >= batch.prompt_len[:, None]
    bq, rq = need.nonzero(as_tuple=True)
    target_p = torch.zeros(B, T, target_lm.shape[0], device=dev)
    with torch.no_grad():
        target_p[bq, rq] = torch.softmax(batch.final[bq, rq].float() @ target_lm.T, dim=-1)
    losses, agree = [], []
    for j, (t0, out) in enumerate(unroll(head, batch, steps, first)):
        t = torch.arange(t0, T, device=dev)
        # row t at step j predicts token t + 2 + j from the target's distribution at t + 1 + j
        valid = (t[None, :] + 1 + j) < batch.n[:, None]  # (B, n)
        resp = (t[None, :] + 2 + j) >= batch.prompt_len[:, None]
        mask = valid if loss_on_prompt else valid & resp
        b, r = mask.nonzero(as_tuple=True)  # rows with a loss
        if b.numel() == 0:
            losses.append(0.0)
            agree.append(0.0)
            continue
        pos = r + t0
        logits = head.logits(out[b, r])  # (N, Vd) float32
        ce = -(target_p[b, pos + 1 + j] * F.log_softmax(logits, dim=-1)).sum(-1)  # (N,)
        loss_j = ce.mean()
        total = total + (step_weight**j) * loss_j
        with torch.no_grad():
            hit = head.to_target_ids(logits.argmax(-1)) == batch.tokens[b, pos + 2 + j]
            keep = resp[b, r]
            agree.append(float((hit & keep).sum()) / max(int(keep.sum()), 1))
        losses.append(float(loss_j.detach()))
    return total, losses, agree

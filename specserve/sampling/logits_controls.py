"""Per-request logits controls at every verified position, and log-probabilities.

What is applied
---------------
For a request with drafts d_1..d_n, verification reads n+1 logits rows: row j
(0..n) predicts the token after the committed tokens plus d_1..d_j.  Every
control below is applied to row j as plain decoding would apply it after those
same tokens, so greedy output with speculation equals greedy output without it,
and sampled output follows the same processed distribution:

1. ``repetition_penalty`` r (vLLM's): for every token seen in the prompt or in the
   output so far, logit / r where the logit is > 0, logit * r otherwise;
2. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): logit -= f * count
   + p * (count > 0), counting the output tokens so far (drafts d_1..d_j included);
3. ``logit_bias`` (OpenAI's): a constant added per token id;
4. ``min_tokens``: while fewer tokens than that have been emitted (j included), EOS
   and the request's stop_token_ids get -inf;
5. ``allowed_token_ids`` (vLLM's): every other token gets -inf; ``bad_words``
   (vLLM's, tokenized): a word's last token gets -inf where the output so far ends
   with its other tokens (a one-token word: always);
6. a grammar (``specserve.structured``): tokens the grammar does not allow after
   those tokens get -inf.  A draft the grammar refuses at its own position is never
   accepted (the target gives it probability 0), so the caller truncates the drafts
   there: later rows would be read after a token that cannot be emitted.

Then the sampler applies temperature, top-k, top-p, min-p (or argmax) as before.

How it runs
-----------
:class:`LogitsPlan` is built on the host per step from Python lists; ``apply``
moves it to the device in three copies (one int64 buffer of indices, one float32
buffer of values, the grammar bitmask) and processes the (R, V) rows of the
requests that have controls with index operations (no per-token loop on the
device and no device-to-host read): penalty counts are a scatter of the committed
output tokens per request, expanded to its rows, plus a scatter of the draft
prefixes per row.  Rows of requests without controls are copied unchanged.

Log-probabilities (:func:`logprob_columns`)
-------------------------------------------
The log-probability of an emitted token is ``log_softmax`` of the row's PROCESSED
logits (after 1-5 above) at temperature 1, before temperature/top-k/top-p/min-p:
the model's distribution under the request's controls (vLLM's ``processed_logprobs``
minus the sampling filters; OpenAI's logprobs are the model's distribution).  So
they are defined for greedy requests and identical with and without speculation:
a token's row is computed over the same preceding tokens either way.  Tokens a
grammar or min_tokens forbids have -inf; serialisers clamp them to -9999.0 as vLLM
does.  The top-k alternatives come from the same row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

__all__ = ["LogitsPlan", "RequestControls", "bitmask_allows", "logprob_columns", "unpack_logprobs"]

LOGPROB_FLOOR = -9999.0  # what -inf becomes on the wire (JSON has no infinities)


@dataclass
class RequestControls:
    """One request's controls for one step, on the host."""

    row_start: int  # first row of the request in the logits tensor
    num_rows: int  # verified positions: drafts + 1
    drafts: Sequence[int]  # the drafts whose prefixes precede rows 1..num_rows-1
    output_ids: Sequence[int] = ()  # committed output tokens (penalties)
    prompt_ids: Sequence[int] = ()  # prompt tokens (repetition penalty only)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    num_output_tokens: int = 0  # emitted so far (min_tokens)
    banned_until_min: Sequence[int] = ()  # EOS + stop ids while under min_tokens
    allowed: Sequence[int] | None = None  # allowed_token_ids: the only tokens that may come
    bad_words: Sequence[Sequence[int]] = ()  # bad_words, tokenized
    bitmask: np.ndarray | None = None  # (num_rows, W) int32 grammar bitmask, or None

    def bad_word_bans(self) -> list[tuple[int, int]]:
        """(local row, token) pairs banned by ``bad_words``: row j follows the committed
        output and d_1..d_j."""
        out = []
        if not self.bad_words:
            return out
        tail = max(len(w) for w in self.bad_words) - 1  # the output tokens a word can look back on
        past = list(self.output_ids[len(self.output_ids) - tail :]) if tail else []
        for j in range(self.num_rows):
            if j:
                past.append(self.drafts[j - 1])
            for word in self.bad_words:
                n = len(word) - 1
                if n <= len(past) and (n == 0 or past[len(past) - n :] == list(word[:n])):
                    out.append((j, word[-1]))
        return out

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass
class LogitsPlan:
    """The controls of one step, built on the host and applied on the device."""

    vocab_size: int
    requests: list[RequestControls] = field(default_factory=list)

    def add(self, controls: RequestControls) -> None:
        if controls.num_rows < 1 or controls.num_rows != len(controls.drafts) + 1:
            raise ValueError(f"num_rows: must be len(drafts) + 1 >= 1, got {controls.num_rows} and "
                             f"{len(controls.drafts)} drafts")
        if controls.bitmask is not None and controls.bitmask.shape[0] != controls.num_rows:
            raise ValueError(f"bitmask: expected {controls.num_rows} rows, got {controls.bitmask.shape[0]}")
        self.requests.append(controls)

    @property
    def empty(self) -> bool:
        return not self.requests

    def apply(self, logits: Tensor) -> Tensor:
        """A float32 copy of ``logits`` (N, V) with every planned row processed."""
        out = logits.float().clone() if logits.dtype != torch.float32 else logits.clone()
        if self.empty:
            return out
        dev = logits.device
        V = self.vocab_size
        reqs = self.requests
        ints, floats = _Packer(), _Packer()

        rows = np.concatenate([np.arange(c.row_start, c.row_start + c.num_rows) for c in reqs])  # (R,)
        row_req = np.concatenate([np.full(c.num_rows, q) for q, c in enumerate(reqs)])
        first = np.cumsum([0] + [c.num_rows for c in reqs])[:-1]  # first local row per request
        ints.put("rows", rows)

        pen = [q for q, c in enumerate(reqs) if c.penalised]
        if pen:
            # committed output tokens per penalised request, and the draft prefix of each row
            oq = np.concatenate([np.full(len(reqs[q].output_ids), i) for i, q in enumerate(pen)] + [np.zeros(0)])
            ot = np.concatenate([np.asarray(reqs[q].output_ids, dtype=np.int64) for q in pen] + [np.zeros(0)])
            dr, dt = [], []
            pen_rows = []
            for q in pen:
                c = reqs[q]
                base = first[q]
                pen_rows.append(np.arange(base, base + c.num_rows))
                for j in range(1, c.num_rows):  # row j follows d_1..d_j
                    dr.extend([base + j] * j)
                    dt.extend(c.drafts[:j])
            ints.put("pen_rows", np.concatenate(pen_rows))
            ints.put("oq", oq)
            ints.put("ot", ot)
            ints.put("dr", np.asarray(dr, dtype=np.int64))
            ints.put("dt", np.asarray(dt, dtype=np.int64))
            rep = [q for q in pen if reqs[q].repetition_penalty != 1.0]
            pq = np.concatenate([np.full(len(reqs[q].prompt_ids), pen.index(q)) for q in rep] + [np.zeros(0)])
            pt = np.concatenate([np.asarray(reqs[q].prompt_ids, dtype=np.int64) for q in rep] + [np.zeros(0)])
            ints.put("pq", pq)
            ints.put("pt", pt)
            ints.put("pen_req_of_row", np.concatenate([np.full(reqs[q].num_rows, i) for i, q in enumerate(pen)]))
            for name, attr in (("freq", "frequency_penalty"), ("pres", "presence_penalty"),
                               ("rep", "repetition_penalty")):  # fmt: skip
                floats.put(name, np.concatenate([np.full(reqs[q].num_rows, getattr(reqs[q], attr)) for q in pen]))

        br, bt, bv = [], [], []
        for q, c in enumerate(reqs):
            if c.logit_bias:
                toks = list(c.logit_bias)
                vals = [c.logit_bias[t] for t in toks]
                for j in range(c.num_rows):
                    br.extend([first[q] + j] * len(toks))
                    bt.extend(toks)
                    bv.extend(vals)
        ints.put("br", np.asarray(br, dtype=np.int64))
        ints.put("bt", np.asarray(bt, dtype=np.int64))
        floats.put("bv", np.asarray(bv, dtype=np.float32))

        xr, xt = [], []
        for q, c in enumerate(reqs):
            if c.min_tokens and c.banned_until_min:
                for j in range(c.num_rows):
                    if c.num_output_tokens + j < c.min_tokens:
                        xr.extend([first[q] + j] * len(c.banned_until_min))
                        xt.extend(c.banned_until_min)
            for j, t in c.bad_word_bans():
                xr.append(first[q] + j)
                xt.append(t)
        ints.put("xr", np.asarray(xr, dtype=np.int64))
        ints.put("xt", np.asarray(xt, dtype=np.int64))

        limited = [q for q, c in enumerate(reqs) if c.allowed is not None]
        if limited:  # allowed_token_ids: per limited row, its allowed tokens
            ints.put("arows", np.concatenate([np.arange(first[q], first[q] + reqs[q].num_rows) for q in limited]))
            ar, at, base = [], [], 0
            for q in limited:
                c = reqs[q]
                for j in range(c.num_rows):
                    ar.extend([base + j] * len(c.allowed))
                    at.extend(c.allowed)
                base += c.num_rows
            ints.put("ar", np.asarray(ar, dtype=np.int64))
            ints.put("at", np.asarray(at, dtype=np.int64))

        masked = [q for q, c in enumerate(reqs) if c.bitmask is not None]
        bitmask = None
        if masked:
            ints.put("mrows", np.concatenate([np.arange(first[q], first[q] + reqs[q].num_rows) for q in masked]))
            bitmask = torch.from_numpy(np.concatenate([reqs[q].bitmask for q in masked])).to(dev)

        it = ints.to(dev, torch.int64)
        ft = floats.to(dev, torch.float32)
        x = out.index_select(0, it["rows"])  # (R, V)
        if pen:
            P = len(pen)
            prow = it["pen_rows"]
            counts_req = torch.zeros(P, V, dtype=torch.float32, device=dev)
            counts_req.index_put_((it["oq"], it["ot"]), torch.ones_like(it["ot"], dtype=torch.float32), accumulate=True)
            counts = counts_req.index_select(0, it["pen_req_of_row"])  # (Rp, V)
            local = torch.full((x.shape[0],), -1, dtype=torch.int64, device=dev)
            local[prow] = torch.arange(prow.shape[0], device=dev)
            counts.index_put_((local[it["dr"]], it["dt"]), torch.ones_like(it["dt"], dtype=torch.float32),
                              accumulate=True)  # fmt: skip
            xp = x.index_select(0, prow)
            rep = ft["rep"][:, None]
            seen_prompt = torch.zeros(P, V, dtype=torch.bool, device=dev)
            seen_prompt[it["pq"], it["pt"]] = True
            seen = (counts > 0) | seen_prompt.index_select(0, it["pen_req_of_row"])
            xp = torch.where(seen & (rep != 1.0), torch.where(xp > 0, xp / rep, xp * rep), xp)
            xp = xp - ft["freq"][:, None] * counts - ft["pres"][:, None] * (counts > 0).float()
            x.index_copy_(0, prow, xp)
        if it["br"].numel():
            x.index_put_((it["br"], it["bt"]), ft["bv"], accumulate=True)
        if it["xr"].numel():
            x[it["xr"], it["xt"]] = float("-inf")
        if limited:
            arows = it["arows"]
            keep = torch.zeros(arows.shape[0], V, dtype=torch.bool, device=dev)
            keep[it["ar"], it["at"]] = True
            x.index_copy_(0, arows, x.index_select(0, arows).masked_fill(~keep, float("-inf")))
        if bitmask is not None:
            mrows = it["mrows"]
            allowed = unpack_bitmask(bitmask, V)  # (Rm, V) bool
            x.index_copy_(0, mrows, x.index_select(0, mrows).masked_fill(~allowed, float("-inf")))
        out.index_copy_(0, it["rows"], x)
        return out


class _Packer:
    """Named 1-D arrays concatenated into one buffer: one host-to-device copy."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, np.ndarray]] = []

    def put(self, name: str, arr: np.ndarray) -> None:
        self.parts.append((name, np.asarray(arr).reshape(-1)))

    def to(self, device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
        np_dtype = np.int64 if dtype == torch.int64 else np.float32
        if not self.parts:
            return {}
        flat = np.concatenate([a.astype(np_dtype, copy=False) for _, a in self.parts])
        t = torch.from_numpy(flat).to(device)
        out, o = {}, 0
        for name, a in self.parts:
            out[name] = t[o : o + a.size]
            o += a.size
        return out


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """(R, W) int32 bitmask (bit t % 32 of word t // 32 = token t allowed) -> (R, V) bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # (R, W, 32)
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    V = vocab_size
    if allowed.shape[1] < V:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], V - allowed.shape[1])], dim=1)
    return allowed[:, :V]


def bitmask_allows(row: np.ndarray, token: int) -> bool:
    """Whether one (W,) int32 bitmask row allows ``token``."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def logprob_columns(logits: Tensor, row_index: Tensor, tokens: Tensor, top_k: int) -> Tensor:
    """Log-probabilities of the verified rows, packed as int64 columns to ride on the step's copy.

    Args:
        logits: (N, V) processed logits (what the sampler read).
        row_index: (B, K+1) rows of ``logits`` per request and position.
        tokens: (B, K+1) the tokens emitted at those positions (-1 where none).
        top_k: how many alternatives per position (the batch's largest request).

    Returns:
        (B, (K+1) * (1 + 2 * top_k)) int64: per position, the float32 bits of the
        token's log-probability and of the top_k log-probabilities, then the top_k
        token ids.  :func:`unpack_logprobs` reads them back.
    """
    B, P = row_index.shape
    lp = torch.log_softmax(logits.float()[row_index.reshape(-1)], dim=-1).view(B, P, -1)  # (B, P, V)
    chosen = lp.gather(2, tokens.clamp(min=0)[:, :, None])  # (B, P, 1)
    if top_k > 0:
        top_v, top_i = lp.topk(top_k, dim=-1)  # (B, P, k)
        values = torch.cat([chosen, top_v], dim=2)
    else:
        values, top_i = chosen, None
    bits = values.contiguous().view(torch.int32).to(torch.int64).reshape(B, -1)
    if top_i is None:
        return bits
    return torch.cat([bits, top_i.reshape(B, -1)], dim=1)


def unpack_logprobs(cols: np.ndarray, num_positions: int, top_k: int,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Host side of :func:`logprob_columns` for one request: (chosen (P,), top values (P, k), top ids (P, k))."""
    P, k = num_positions, top_k
    nbits = P * (1 + k)
    values = cols[:nbits].astype(np.int32).view(np.float32).reshape(P, 1 + k)
    ids = cols[nbits : nbits + P * k].reshape(P, k)
    return values[:, 0], values[:, 1:], ids

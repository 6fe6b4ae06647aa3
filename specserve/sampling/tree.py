"""Verification of draft trees on the device: one call per step, one packed result.

A request's tree is its pending token (the root, node 0) and its drafts (nodes 1..N),
each draft the child of an earlier node: ``parents[i]`` is the parent of draft i as an
index into the drafts, -1 for the root, and ``parents[i] < i`` (parents first).  The
target ran every node in one forward, so node n's logits row is the target's
distribution of the token after the root-to-n path.  :func:`verify_trees` walks each
tree from the root: at the current node it decides whether one of its children is
accepted (then moves there) or which token the node emits (then stops).  Every node's
decision is computed in parallel; the walk is ``max depth`` gathers, no host sync.

The decision at a node, by verification method:

* greedy rows (temperature < GREEDY_EPS, in every method): the first child whose token
  is the target's argmax there; else the argmax is emitted.  The output is exactly plain
  greedy decoding's: the accepted path is the longest root path the target agrees with,
  followed by the target's token after it.
* ``strict`` (the default): the target's token there is drawn as plain decoding draws
  it, by inverse CDF with ``u(seed, m, SAMPLE)`` (m: the output position the node
  decides); the first child with that token is accepted, else the token is emitted.
  So a seeded request emits plain decoding's tokens for its seed, as chains do.
* ``probabilistic``: multi-draft verification over the siblings, target-only (the
  children are the drafter's top-k, not samples from q): the children are tried in
  order, child c accepted with probability r(c) / sum(r) where r is the target's
  distribution with the children tried before c zeroed (the residual), each test with
  its own number ``u(seed, m, TREE_ACCEPT, lane = c's rank among its siblings)``; when
  every child is rejected, the emitted token is drawn from the final residual (all
  children zeroed) with ``u(seed, m, SAMPLE)``.  Lossless: at every node the token
  that follows is distributed as the target's (child c is chosen with probability
  p(c), any other token t with p(t)); and reproducible for a seeded request.

Both sampled rules accept a child with the same probability, sum of p over the
children; they differ in which numbers decide.  A step whose trees are all greedy needs
only each node's argmax: :func:`node_argmax` on the device, one copy back, and the walk on
the host (:func:`greedy_tree_paths`), the same decisions in a few microseconds.

The packed result, (B, N+2) int64 with N the most drafts of any request in the step::

    packed[b, :N]   the accepted drafts' indexes (into request b's drafts), root to leaf, -1 after
    packed[b, N]    the token the last accepted node emits (the recovered or bonus token)
    packed[b, N+1]  num_accepted (the accepted path's length)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.sampling.filters import sample_from_probs
from specserve.sampling.philox import SAMPLE, TREE_ACCEPT, keyed_uniforms
from specserve.sampling.sampler import RequestTensors, process_logits

__all__ = ["TREE_METHODS", "TreeInputs", "greedy_tree_paths", "node_argmax", "tree_inputs", "unpack_trees",
           "verify_trees"]

TREE_METHODS = ("strict", "probabilistic")


@dataclass
class TreeInputs:
    """One step's trees as device tensors (node 0 of each is its root, the pending token)."""

    row_index: Tensor  # (B, N+1) int64: the logits row of each node (padding nodes: the root's)
    tokens: Tensor  # (B, N+1) int64: each node's token (-1 for the root and padding)
    children: Tensor  # (B, N+1, S) int64: each node's children in the order they are tried, -1 after
    depth: Tensor  # (B, N+1) int64: nodes from the root (the root: 0)
    max_depth: int  # the deepest node of any tree (the walk's length)


def _check_tree(b: int, drafts: Sequence[int], parents: Sequence[int]) -> None:
    if len(parents) != len(drafts):
        raise ValueError(f"parents[{b}]: {len(parents)} parents for {len(drafts)} drafts")
    for i, p in enumerate(parents):
        if not -1 <= int(p) < i:
            raise ValueError(f"parents[{b}][{i}]: must be in [-1, {i}) (parents come first), got {p}")


def tree_inputs(rows: Sequence[int], drafts: Sequence[Sequence[int]], parents: Sequence[Sequence[int]],
                device: torch.device | str = "cpu") -> TreeInputs:
    """The device tensors of B trees, built on the host and moved by one copy.

    ``rows[b]``: the logits row of request b's root; its drafts' rows follow it
    (``rows[b] + 1 + i`` for draft i).  ``drafts[b]``: its draft tokens; ``parents[b]``:
    the parent of each draft (-1 = the root, else an earlier draft's index)."""
    B = len(rows)
    if len(drafts) != B or len(parents) != B:
        raise ValueError(f"rows/drafts/parents: expected {B} of each, got {len(drafts)} and {len(parents)}")
    for b in range(B):
        _check_tree(b, drafts[b], parents[b])
    N = max((len(d) for d in drafts), default=0)
    kids: list[list[list[int]]] = []
    depths: list[list[int]] = []
    for d, par in zip(drafts, parents):
        ch: list[list[int]] = [[] for _ in range(N + 1)]
        dep = [0] * (N + 1)
        for i, p in enumerate(par):
            ch[p + 1].append(i + 1)
            dep[i + 1] = dep[p + 1] + 1
        kids.append(ch)
        depths.append(dep)
    S = max((len(c) for ch in kids for c in ch), default=0) or 1
    host = torch.full((4, B, N + 1, S), -1, dtype=torch.int64)  # one buffer, one copy
    for b, (row, d, ch, dep) in enumerate(zip(rows, drafts, kids, depths)):
        n = len(d)
        host[0, b, :, 0] = row
        host[0, b, 1 : n + 1, 0] += torch.arange(1, n + 1)
        host[1, b, 1 : n + 1, 0] = torch.tensor(list(d), dtype=torch.int64)
        host[3, b, :, 0] = torch.tensor(dep, dtype=torch.int64)
        for node, c in enumerate(ch):
            host[2, b, node, : len(c)] = torch.tensor(c, dtype=torch.int64)
    dev = host.to(device, non_blocking=True)
    return TreeInputs(row_index=dev[0, :, :, 0], tokens=dev[1, :, :, 0], children=dev[2], depth=dev[3, :, :, 0],
                      max_depth=max((max(dep) for dep in depths), default=0))


def _expand(t: Tensor, n: int) -> Tensor:
    # (B,) -> (B * n,): each request's value on each of its nodes
    return t[:, None].expand(t.shape[0], n).reshape(-1)


def _first(hit: Tensor, children: Tensor) -> Tensor:
    """(B, N+1) the first child (a node index) whose ``hit`` is set, -1 where none is."""
    first = hit.to(torch.uint8).argmax(dim=-1, keepdim=True)  # argmax returns the first maximum
    chosen = children.gather(-1, first).squeeze(-1)
    return torch.where(hit.any(dim=-1), chosen, torch.full_like(chosen, -1))


def _residual_decisions(probs: Tensor, tree: TreeInputs, child_tok: Tensor, valid: Tensor, req: RequestTensors,
                        positions: Tensor) -> tuple[Tensor, Tensor]:
    """(accepted child, emitted token), each (B, N+1), by the residual rule over siblings."""
    B, N1, V = probs.shape
    S = child_tok.shape[-1]
    # a sibling repeating an earlier sibling's token has no mass left in the residual
    same = child_tok[..., :, None] == child_tok[..., None, :]  # (B, N1, S, S)
    earlier = torch.ones(S, S, dtype=torch.bool, device=probs.device).tril(-1)
    repeat = (same & earlier & valid[..., None, :]).any(dim=-1)
    p_c = probs.gather(-1, child_tok.clamp(min=0))  # (B, N1, S)
    p_c = torch.where(valid & ~repeat, p_c, torch.zeros_like(p_c))
    total = probs.sum(dim=-1, keepdim=True)  # (B, N1, 1)
    left = total - (p_c.cumsum(dim=-1) - p_c)  # the residual's mass when sibling j is tried
    lane = torch.arange(S, device=probs.device)
    u = keyed_uniforms(_expand(req.seed, N1 * S), positions[..., None].expand(B, N1, S).reshape(-1), 1,
                       TREE_ACCEPT, lane.repeat(B * N1)[:, None]).view(B, N1, S)
    accepted = _first((u * left < p_c) & (p_c > 0), tree.children)
    # zero every child's token (amin: empty child slots, clamped to token 0, keep their factor 1)
    keep = torch.ones_like(probs).scatter_reduce(-1, child_tok.clamp(min=0), (~valid).to(probs.dtype), "amin")
    residual = probs * keep
    # children holding all the mass (up to rounding) leave nothing: emit from p itself
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
    u_s = keyed_uniforms(_expand(req.seed, N1), positions.reshape(-1), 1, SAMPLE)[:, 0]
    emitted = sample_from_probs(residual.reshape(B * N1, V), u_s).view(B, N1)
    return accepted, emitted


def verify_trees(logits: Tensor, tree: TreeInputs, req: RequestTensors, *, method: str = "strict") -> Tensor:
    """Verify every request's tree; returns packed (B, N+2) int64 on the device (module docstring).

    Args:
        logits: (R, V) float, the step's forward rows (``tree.row_index`` points into them).
        tree: the trees (:func:`tree_inputs`).
        req: per-request sampling tensors (B,) and host flags; ``req.position[b]``: the output
            index of the token request b's root decides.
        method: "strict" or "probabilistic" (greedy rows follow the argmax in both).
    """
    if method not in TREE_METHODS:
        raise ValueError(f"method: trees are verified by one of {', '.join(TREE_METHODS)}; got {method!r}")
    B, N1 = tree.row_index.shape
    if req.num_rows != B:
        raise ValueError(f"req: {req.num_rows} rows for {B} trees")
    V = logits.shape[1]
    valid = tree.children >= 0  # (B, N1, S)
    child_tok = torch.where(valid, tree.tokens.gather(1, tree.children.clamp(min=0).view(B, -1)).view(valid.shape),
                            torch.full_like(tree.children, -1))  # fmt: skip
    positions = req.position[:, None] + tree.depth  # (B, N1): the output position each node decides
    if req.flags.all_greedy:
        target = logits.argmax(dim=-1)[tree.row_index]  # (B, N1)
        accepted, emitted = _first(child_tok == target[..., None], tree.children), target
    else:
        rows = logits[tree.row_index.reshape(-1)]  # (B*N1, V)
        probs = process_logits(rows, _expand(req.temperature, N1), _expand(req.top_k, N1), _expand(req.top_p, N1),
                               _expand(req.min_p, N1), req.flags)  # (B*N1, V)
        if method == "probabilistic":
            accepted, emitted = _residual_decisions(probs.view(B, N1, V), tree, child_tok, valid, req, positions)
        else:
            u = keyed_uniforms(_expand(req.seed, N1), positions.reshape(-1), 1, SAMPLE)[:, 0]
            emitted = sample_from_probs(probs, u).view(B, N1)
            accepted = _first(child_tok == emitted[..., None], tree.children)
    return _walk(accepted, emitted, tree.max_depth, N1 - 1)


def _walk(accepted: Tensor, emitted: Tensor, max_depth: int, N: int) -> Tensor:
    """From each root, follow the accepted children: packed (B, N+2)."""
    B = accepted.shape[0]
    cur = torch.zeros(B, 1, dtype=torch.int64, device=accepted.device)
    path = torch.full((B, N + 2), -1, dtype=torch.int64, device=accepted.device)
    count = torch.zeros(B, dtype=torch.int64, device=accepted.device)
    for d in range(max_depth):
        nxt = accepted.gather(1, cur)  # (B, 1); once a node accepts nothing it stays -1
        moved = nxt >= 0
        path[:, d : d + 1] = torch.where(moved, nxt - 1, path[:, d : d + 1])
        cur = torch.where(moved, nxt, cur)
        count += moved[:, 0]
    path[:, N] = emitted.gather(1, cur)[:, 0]
    path[:, N + 1] = count
    return path


def node_argmax(logits: Tensor, rows: Sequence[int], drafts: Sequence[Sequence[int]]) -> Tensor:
    """(B, N+1) int64 on the logits' device: the target's argmax at every node of every tree
    (``rows[b]``: tree b's root row, its drafts' rows after it; padding repeats the root):
    all greedy verification needs, for one copy back and :func:`greedy_tree_paths`."""
    N = max((len(d) for d in drafts), default=0)
    index = [[row + (i if i <= len(d) else 0) for i in range(N + 1)] for row, d in zip(rows, drafts)]
    idx = torch.tensor(index, dtype=torch.int64).to(logits.device, non_blocking=True)
    return logits.index_select(0, idx.view(-1)).argmax(dim=-1).view(len(rows), N + 1)


def greedy_tree_paths(argmax: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]],
                      parents: Sequence[Sequence[int]]) -> list[tuple[list[int], int, list[int]]]:
    """Greedy verification on the host from each node's argmax (:func:`node_argmax`, copied
    back): from the root, the first child holding the target's token there, until none
    does; then that node's argmax.  The rule of :func:`verify_trees` for greedy rows, in
    :func:`unpack_trees`' form: (emitted tokens, num_accepted, the accepted drafts' indexes)."""
    out = []
    for b, (top, d, par) in enumerate(zip(argmax, drafts, parents)):
        _check_tree(b, d, par)
        children: list[list[int]] = [[] for _ in range(len(d) + 1)]
        for i, p in enumerate(par):
            children[p + 1].append(i + 1)
        cur, path = 0, []
        while True:
            nxt = next((c for c in children[cur] if d[c - 1] == top[cur]), None)
            if nxt is None:
                break
            path.append(nxt - 1)
            cur = nxt
        out.append(([d[i] for i in path] + [int(top[cur])], len(path), path))
    return out


def unpack_trees(packed_host: Tensor | Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]
                 ) -> list[tuple[list[int], int, list[int]]]:
    """Per request: (emitted tokens: the accepted drafts then the last node's token,
    num_accepted, the accepted drafts' indexes) from a packed result on the host."""
    rows = packed_host.tolist() if isinstance(packed_host, Tensor) else packed_host
    out = []
    for row, d in zip(rows, drafts):
        n = row[-1]
        path = row[:n]
        out.append(([d[i] for i in path] + [row[-2]], n, path))
    return out

"""What the draft-tree tests share: an engine on a target loaded once, a tree config, a
recorder of the trees a proposer hands the engine, and the check that a tree run's cache
holds a chain run's K/V at the committed positions."""

from __future__ import annotations

from typing import Callable

import torch

from specserve.engine.engine import LLMEngine
from specserve.executor.loader import load_model

_LOADED: dict[str, object] = {}


def engine(cfg) -> LLMEngine:
    """An engine on the configured target, the target loaded once per test session."""
    path = cfg.model.path
    if path not in _LOADED:
        _LOADED[path] = load_model(path, "float32", torch.device("cpu"))
    return LLMEngine(cfg, target=_LOADED[path])


def tree(topk: int, depth: int, n: int) -> dict:
    return {"topk": topk, "depth": depth, "num_draft_tokens": n}


def record_trees(eng) -> list[tuple[list[int], list[int] | None]]:
    """Every (drafts, parents) the proposer hands the engine."""
    seen = []
    propose = eng.proposer.propose

    def recording(reqs, step=None):
        prop = propose(reqs, step)
        for i, (r, toks) in enumerate(zip(reqs, prop.token_ids)):
            if r.max_drafts > 0 and toks:
                seen.append((list(toks), prop.parents[i] if prop.parents is not None else None))
        return prop

    eng.proposer.propose = recording
    return seen


def follow_chain_cache(eng: LLMEngine, ref: LLMEngine, prompt: list[int], params,
                       read_kv: Callable[[LLMEngine, str, int], torch.Tensor], steps: int = 10) -> tuple[int, int]:
    """Step the tree engine ``eng`` and the chain engine ``ref`` on ``prompt``; after each
    tree step, compare ``read_kv(engine, request id, n)`` (a cache's K/V at the first n
    positions) at the tree's committed positions.  Returns (steps checked, steps whose
    accepted path sat off the first nodes, so compaction moved K/V)."""
    eng.add_request("t", prompt, params)
    ref.add_request("r", prompt, params)
    seq, rseq = eng.requests["t"].seq, ref.requests["r"].seq
    moved = checked = 0
    compact = eng._compact_trees

    def spy(scheduled):
        nonlocal moved
        moved += sum(1 for s in scheduled if s.verified is not None and s.verified.path
                     and s.verified.path != list(range(len(s.verified.path))))
        compact(scheduled)

    eng._compact_trees = spy
    while eng.has_unfinished() and checked < steps:
        eng.step()
        if not eng.has_unfinished():
            break
        n = seq.num_computed
        while rseq.num_computed < n:
            ref.step()
        assert rseq.token_ids[:n] == seq.token_ids[:n]
        torch.testing.assert_close(read_kv(eng, "t", n), read_kv(ref, "r", n), atol=1e-4, rtol=1e-4)
        checked += 1
    return checked, moved

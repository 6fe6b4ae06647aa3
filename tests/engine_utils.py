"""Helpers to build engines on tiny models for tests."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from specserve.config import Config, ModelConfig, validate_config
from specserve.engine.engine import LLMEngine
from specserve.methods import method_options
from specserve.request import SamplingParams


def tiny_config(model_dir: Path, method: str | None = None, k: int = 3, num_blocks: int = 256,
                block_size: int = 4, draft_dir: Path | None = None, speculation: str = "fixed",
                **spec_kw) -> Config:
    """A tiny model's config.  Speculation is fixed (K every step) unless asked: tests count
    drafts, and adaptive choices follow wall-clock timings."""
    cfg = Config(model=ModelConfig(name="tiny", path=str(model_dir), dtype="float32"))
    cfg.engine.speculation = speculation
    cfg.engine.num_kv_blocks = num_blocks
    cfg.engine.block_size = block_size
    if method == "ngram":
        spec_kw.setdefault("prompt_lookup_min", 1)
        spec_kw.setdefault("prompt_lookup_max", 3)
    if method is not None:
        cfg.method = method_options(method, num_speculative_tokens=k, model=str(draft_dir) if draft_dir else None,
                                    **spec_kw)
    return validate_config(cfg)


_TARGETS: dict[str, object] = {}


def engine_on_cached_target(cfg: Config) -> LLMEngine:
    """An engine on the configured (float32) target, each target directory loaded once."""
    from specserve.executor.loader import load_model

    path = cfg.model.path
    if path not in _TARGETS:
        _TARGETS[path] = load_model(path, "float32", torch.device("cpu"))
    return LLMEngine(cfg, target=_TARGETS[path])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: torch's intra-op threads only contend (on a shared box, badly).
    A test module that imports this fixture runs on one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def draw_k_every_step(engine, k: int, seed: int) -> list[int]:
    """Replace the engine's choice of drafts per step by a seeded draw from 0..k (what
    adaptive speculation may do, at its most erratic); with a tree configured, its depth
    is drawn too from the depths adaptive speculation may give it (another stream of the
    same seed, so the drafts drawn are the same with or without trees).  Returns the
    list of drafts drawn."""
    import random

    from specserve.engine.spec_control import Choice

    c, rng, picked = engine.spec_control, random.Random(seed), []
    depths = random.Random(seed + 1)

    def choose(batch_size: int) -> Choice:
        c.num_drafts = rng.randint(0, k)
        picked.append(c.num_drafts)
        depth = depths.choice(c.tree_depths) if c.trees else 0
        return Choice(c.num_drafts, c.trees, depth)  # trees, where configured, as the fixed choice

    c.choose = choose
    return picked


def random_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 24, vocab: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    # A small alphabet makes n-grams repeat, so drafts get both accepted and rejected.
    return [torch.randint(5, vocab, (m,), generator=g).tolist() for m in lens]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine: LLMEngine, prompts, params):
    return [o.token_ids for o in engine.generate(prompts, params)]


def plain_outputs(model_dir: Path, prompts, max_tokens: int) -> list[list[int]]:
    """The greedy outputs of plain decoding (no method, no Predicted Outputs drafts)."""
    cfg = tiny_config(model_dir)
    cfg.engine.num_prediction_tokens = 0
    return run(LLMEngine(cfg), prompts, [greedy(max_tokens) for _ in prompts])


def sample_outputs(model_dir: Path, method: str | None, n: int, seed: int, k: int = 2, draft_dir: Path | None = None,
                   prompt: tuple[int, ...] = (11, 12, 13, 14), **engine_kw):
    """n seeded requests (temperature 0.05, 4 tokens, seeds seed .. seed + n - 1) of one
    prompt, plainly or by ``method`` under probabilistic verification; ``engine_kw``:
    engine.* settings."""
    kw = {"rejection_sample_method": "probabilistic"} if method else {}
    cfg = tiny_config(model_dir, method, k=k, num_blocks=2048, block_size=4, draft_dir=draft_dir if method else None,
                      **kw)
    cfg.engine.max_num_seqs = 200
    cfg.engine.num_prediction_tokens = 0
    for key, v in engine_kw.items():
        setattr(cfg.engine, key, v)
    ps = [SamplingParams(temperature=0.05, max_tokens=4, seed=seed + i, ignore_eos=True) for i in range(n)]
    return LLMEngine(cfg).generate([list(prompt)] * n, ps)


def total_variation(a, b, pos: int) -> float:
    """The total variation distance between the tokens at ``pos`` of two equally long lists of outputs."""
    ca = Counter(o.token_ids[pos] for o in a)
    cb = Counter(o.token_ids[pos] for o in b)
    return 0.5 * sum(abs(ca[t] - cb[t]) for t in set(ca) | set(cb)) / len(a)


def head_forwards(monkeypatch) -> list[tuple[str, list[int], list[int]]]:
    """Every forward of a head's own layers (``proposers.heads.head_metadata``), as
    (attention: "reference" or "kernel", query lengths, context lengths) per batch."""
    import specserve.proposers.heads as heads

    seen: list[tuple[str, list[int], list[int]]] = []
    for name, path in (("batch_metadata", "reference"), ("kernel_metadata", "kernel")):
        def spy(batch, *args, _fn=getattr(heads, name), _path=path, **kw):
            qs = batch.query_start
            seen.append((_path, [qs[b + 1] - qs[b] for b in range(len(batch.seq_lens))], list(batch.seq_lens)))
            return _fn(batch, *args, **kw)

        monkeypatch.setattr(heads, name, spy)
    return seen


def record_drafts(eng) -> list[list[list[int]]]:
    """Every round's drafts, as the engine's proposer returns them."""
    seen: list[list[list[int]]] = []
    propose = eng.proposer.propose

    def recording(reqs, step=None):
        prop = propose(reqs, step)
        seen.append([list(d) for d in prop.token_ids])
        return prop

    eng.proposer.propose = recording
    return seen

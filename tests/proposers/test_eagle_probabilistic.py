"""Probabilistic verification with a sampling EAGLE-3 head: drafts are drawn from the
head's q and q reaches the rejection sampler, and the emitted tokens follow the
target's distribution exactly (convergence on a 16-token vocabulary)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from eagle_heads import write_head  # noqa: E402
from engine_utils import one_thread, tiny_config  # noqa: E402, F401 (one_thread: an autouse fixture)
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.executor.batch import SeqInput  # noqa: E402
from specserve.executor.loader import load_model  # noqa: E402
from specserve.request import SamplingParams  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

V = 16
PROMPT = [5, 9, 3, 12, 7]
N = 4000


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-prob")
    tdir = make_tiny_model(root / "target", "llama", seed=5, vocab_size=V, num_key_value_heads=4)
    head = write_head(root / "head", "eagle3", seed=3, aux_ids=[0, 1, 1], vocab=V, draft_vocab=12)
    target = load_model(str(tdir), "float32", torch.device("cpu"))
    return tdir, head, target


def _engine(setup, method="probabilistic", k=2) -> LLMEngine:
    tdir, head, target = setup
    cfg = tiny_config(tdir, "eagle3", k=k, draft_dir=head, num_blocks=4096, rejection_sample_method=method)
    cfg.engine.max_num_seqs = 512
    return LLMEngine(cfg, target=target)


def _exact_marginals(target, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """P(t2) and P(t3) of plain sampling after PROMPT (exact, by enumeration)."""
    from specserve.executor.kv_cache import KVCache
    from specserve.executor.backends.torch_backend import TorchRunner
    from specserve.kv_blocks import BlockManager

    a = target.arch
    kv = KVCache(a.num_layers, 64, 4, a.num_kv_heads, a.head_dim, target.dtype, target.device)
    runner, blocks = TorchRunner(target, kv), BlockManager(64, 4)

    def dist(ids):
        table: list[int] = []
        blocks.ensure(table, len(ids))
        try:
            logits = runner.forward([SeqInput(ids, 0, table, [len(ids) - 1])]).logits[0]
        finally:
            blocks.free(table)
        return torch.softmax(logits.double() / temperature, -1)

    p1 = dist(PROMPT)
    p2 = torch.zeros(V, dtype=torch.float64)
    p3 = torch.zeros(V, dtype=torch.float64)
    for t1 in range(V):
        c2 = dist(PROMPT + [t1])
        p2 += p1[t1] * c2
        for t2 in range(V):
            p3 += p1[t1] * c2[t2] * dist(PROMPT + [t1, t2])
    return p2, p3


def _sample(eng: LLMEngine, n: int, temperature: float, seed0: int = 0) -> list[list[int]]:
    outs = eng.generate([PROMPT] * n, [SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True,
                                                      seed=seed0 + i) for i in range(n)])
    return [o.token_ids for o in outs]


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_sampled_output_follows_the_target(setup):
    temperature = 1.0
    eng = _engine(setup)
    drafted = []
    orig = eng.proposer.propose

    def spy(reqs, step=None):
        prop = orig(reqs, step)
        if prop.probs is not None:
            for r, toks, q in zip(reqs, prop.token_ids, prop.probs):
                if r.max_drafts > 0 and toks:
                    drafted.append((toks, q[: len(toks)].clone()))
        return prop

    eng.proposer.propose = spy
    samples = _sample(eng, N, temperature)
    assert all(len(s) == 3 for s in samples)
    # q is a distribution over the target vocabulary, the drafts lie in its support,
    # and drafts were really sampled (several distinct first drafts for one context)
    assert drafted
    for toks, q in drafted[:50]:
        assert torch.allclose(q.sum(-1), torch.ones(len(toks)), atol=1e-5)
        assert all(float(q[i, t]) > 0 for i, t in enumerate(toks))
    assert len({toks[0] for toks, _ in drafted}) > 1
    spec = [o for o in eng.generate([PROMPT] * 8, [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                                                                    seed=i) for i in range(8)])]
    accepted = sum(o.spec.num_accepted_tokens for o in spec)
    assert 0 < accepted < sum(o.spec.num_draft_tokens for o in spec)

    p2, p3 = _exact_marginals(setup[2], temperature)
    c2 = torch.bincount(torch.tensor([s[1] for s in samples]), minlength=V).double()
    c3 = torch.bincount(torch.tensor([s[2] for s in samples]), minlength=V).double()
    # sampling noise at N=4000 on 16 outcomes is about 0.02-0.03 in total variation
    assert _tv(c2, p2) < 0.05 and _tv(c3, p3) < 0.05, (_tv(c2, p2), _tv(c3, p3))
    # ... while the drafts' own distribution is far from the target's
    q1 = torch.stack([q[0] for _, q in drafted]).double().mean(0)
    assert 0.5 * float((q1 - p2).abs().sum()) > 0.15


def test_seeded_requests_reproduce_in_any_batch(setup):
    eng = _engine(setup)
    alone = _sample(eng, 1, 0.8, seed0=123)[0]
    params = [SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, seed=123 if i == 7 else 1000 + i)
              for i in range(16)]
    crowd = [o.token_ids for o in eng.generate([PROMPT] * 16, params)]
    assert crowd[7] == alone


def test_greedy_rows_next_to_sampled_ones_stay_exact(setup):
    plain = LLMEngine(tiny_config(setup[0]), target=setup[2])
    want = plain.generate([PROMPT], [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])[0].token_ids
    eng = _engine(setup, k=3)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=12, ignore_eos=True, seed=i)
              for i in range(8)]
    outs = eng.generate([PROMPT] * 8, params)
    assert all(o.token_ids == want for o in outs[::2])
    assert eng.blocks.num_free == eng.blocks.num_blocks

"""PARD parallel drafting (+method=draft_model method.parallel_drafting=true): a tiny
draft whose config.json has pard_token, built here; greedy output equals plain
decoding; all K drafts come from ONE draft forward per round; a draft that is the
target always gets its first draft accepted (the newest token's slot is aligned);
long catch-ups (chunked) too; a draft without a mask token is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from engine_utils import greedy, plain_outputs, random_prompts, tiny_config
from engine_utils import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from tiny_models import make_tiny_model

from specserve.config import ConfigError
from specserve.engine.engine import LLMEngine

MAX_TOKENS = 24
MASK = 511


def with_pard_token(src: Path, dst: Path, token: int | None = MASK) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if token is not None:
        cfg["pard_token"] = token
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def pard_draft(tmp_path_factory):
    root = tmp_path_factory.mktemp("pard")
    return with_pard_token(make_tiny_model(root / "d0", "llama", seed=7, num_hidden_layers=1), root / "draft")


@pytest.fixture(scope="module")
def pard_self(tiny_llama, tmp_path_factory):
    """The target itself with a pard_token: its first draft is always the target's token."""
    return with_pard_token(tiny_llama, tmp_path_factory.mktemp("pard-self") / "self")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, seed=41)


@pytest.fixture(scope="module")
def plain(tiny_llama, prompts):
    return plain_outputs(tiny_llama, prompts, MAX_TOKENS)


def _engine(target, draft, k, **engine_kw):
    cfg = tiny_config(target, "draft_model", k=k, draft_dir=draft, parallel_drafting=True)
    for key, v in engine_kw.items():
        setattr(cfg.engine, key, v)
    return LLMEngine(cfg)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_plain_with_one_forward_per_round(tiny_llama, pard_draft, prompts, plain, k):
    eng = _engine(tiny_llama, pard_draft, k)
    runner = eng.proposer.runner
    calls = []
    forward = runner.forward
    runner.forward = lambda seqs, *a, **kw: calls.append(len(seqs)) or forward(seqs, *a, **kw)
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == plain
    rounds = sum(o.spec.num_drafts for o in outs)
    assert rounds > 0 and len(calls) <= rounds  # one draft forward per round (batched over requests)
    assert eng.proposer.mask_token_id == MASK
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.proposer.blocks.num_free == eng.proposer.blocks.num_blocks


@pytest.mark.parametrize("chunked", [False, True])
def test_first_draft_of_a_self_draft_is_always_accepted(tiny_llama, pard_self, prompts, plain, chunked):
    kw = {"max_num_batched_tokens": 8} if chunked else {}
    eng = _engine(tiny_llama, pard_self, 4, **kw)
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == plain
    for o in outs:
        assert o.spec.num_accepted_tokens >= o.spec.num_drafts > 0


def test_parallel_drafting_without_a_mask_token_is_one_line(tiny_llama, tmp_path):
    draft = with_pard_token(tiny_llama, tmp_path / "nomask", token=None)
    with pytest.raises(ConfigError) as e:
        _engine(tiny_llama, draft, 3)
    assert str(e.value) == "method.parallel_drafting: needs a draft whose config.json has pard_token (the mask token id)"

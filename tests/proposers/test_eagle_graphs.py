"""The EAGLE head's K draft steps over persistent buffers (``executor.backends.head_graphs``,
captured as CUDA graphs on CUDA), checked on the CPU with the paged kernel's torch twin:

* an engine drafting through it gives exactly the drafts of the eager loop (same
  output, same accepted counts) for eagle and eagle3, with batch buckets padded and
  sequences near max_model_len wanting fewer than K drafts; every KV block comes back;
* the loop compiles with ``torch.compile(fullgraph=True)`` (no graph break: no host
  synchronisation or data-dependent shape, what a CUDA graph needs) and gives the same
  drafts compiled as eager;
* a batch bucket whose capture fails (injected, with a graph double standing in for
  CUDA's) drafts eagerly from the same buffers, one warning at start-up, the same output.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from eagle_heads import make_bigram_target, write_head  # noqa: E402
from engine_utils import greedy, random_prompts, tiny_config  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.executor.backends.head_graphs import HeadDraftGraphs  # noqa: E402

K = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eagle-graphs")


@pytest.fixture(scope="module")
def target(root) -> Path:
    return make_bigram_target(root / "target", leak=0.05)


def _heads(root, target):
    from safetensors.torch import load_file

    lm = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    return {
        "eagle3": write_head(root / "e3", "eagle3", oracle=True, aux_ids=[0, 1, 1], draft_vocab=300,
                             target_lm_head=lm),
        "eagle3-full-vocab": write_head(root / "e3s", "eagle3", seed=2, aux_ids=[0, 1, 1]),
        "eagle": write_head(root / "e1", "eagle", oracle=True),
    }


def _engine(target, head, method, static: bool) -> LLMEngine:
    cfg = tiny_config(target, method, k=K, draft_dir=head)
    cfg.engine.max_num_seqs = 3  # 3 drafting rows: bucket 4 has a padding row
    cfg.model.max_model_len = 40  # sequences end at 40 tokens: the last rounds want fewer than K drafts
    eng = LLMEngine(cfg)
    if static:  # the head's persistent-buffer loop, run eagerly on the CPU
        p = eng.proposer
        p.static = HeadDraftGraphs(p.head, p.kv, block_size=p.block_size, trash_slot=p.trash_slot, num_spec_tokens=K,
                                   max_num_seqs=4, max_seq_len=eng.max_model_len, impl="torch", use_graphs=False)
    return eng


@pytest.mark.parametrize("name", ["eagle3", "eagle3-full-vocab", "eagle"])
def test_static_drafting_equals_the_eager_loop(root, target, name):
    head = _heads(root, target)[name]
    method = "eagle" if name == "eagle" else "eagle3"
    prompts = random_prompts(6, seed=3)
    params = [greedy(40 - len(p)) for p in prompts]  # up to max_model_len
    runs, proposals = {}, {}
    for static in (False, True):
        eng = _engine(target, head, method, static)
        calls, seen = [], []
        propose = eng.proposer.propose

        def recording(reqs, step=None, propose=propose, seen=seen):
            prop = propose(reqs, step)
            seen.append([list(d) for d in prop.token_ids])
            return prop

        eng.proposer.propose = recording
        if static:
            orig = eng.proposer.static.draft
            eng.proposer.static.draft = lambda h, rows: calls.append(rows) or orig(h, rows)
        outs = eng.generate(prompts, params)
        runs[static] = [(o.token_ids, o.spec.num_draft_tokens, o.spec.num_accepted_tokens) for o in outs]
        proposals[static] = seen
        assert eng.blocks.num_free == eng.blocks.num_blocks
        if static:
            assert calls and all(len(r) <= 3 for r in calls)
            assert any(w < K for rows in calls for _, w, _ in rows)  # a row near max_model_len
    assert proposals[True] == proposals[False]  # every draft of every round
    assert runs[True] == runs[False]
    assert sum(a for _, _, a in runs[True]) > 0 or name == "eagle3-full-vocab"


@pytest.mark.timeout(600)
def test_draft_loop_compiles_without_graph_breaks(root, target):
    head = _heads(root, target)["eagle3"]
    eng = _engine(target, head, "eagle3", static=True)
    eng.generate(random_prompts(3, seed=1), [greedy(8) for _ in range(3)])  # real K/V in the head's cache
    st = eng.proposer.static
    table: list[int] = []
    eng.blocks.ensure(table, 20)
    rows = [(9, K, table), (12, 2, table)]  # the second row wants 2 drafts: its later writes go to trash
    st._stage(rows, 2)
    st.hidden[:2].copy_(torch.randn(2, st.hidden.shape[1], generator=torch.Generator().manual_seed(0)))
    kv = [t.clone() for t in st.kv]
    with torch.inference_mode():
        eager = st.loop_fn(2).clone()
        for t, saved in zip(st.kv, kv):
            t.copy_(saved)
        torch._dynamo.reset()
        compiled = torch.compile(st.loop_fn, fullgraph=True, dynamic=False)(2).clone()
    assert torch.equal(compiled, eager)


class GraphDouble:
    """A CPU stand-in for CUDA graphs (``HeadDraftGraphs.graphs_api``): capture runs the
    loop once and keeps it; replay runs it again over the same static buffers."""

    def __init__(self):
        self.replays = 0

    def __call__(self):
        return self

    def synchronize(self) -> None:
        pass

    def capture(self, fn):
        outer, out = self, fn()

        class Replay:
            def replay(self):
                outer.replays += 1
                fn()

        return Replay(), out


def test_a_failed_capture_leaves_that_bucket_drafting_eagerly(root, target, caplog):
    head = _heads(root, target)["eagle3"]
    prompts = random_prompts(3, seed=4, hi=12)
    params = [greedy(n) for n in (6, 14, 22)]  # the batch shrinks: buckets 4, 2 and 1 all draft
    want = _engine(target, head, "eagle3", static=False).generate(prompts, params)
    eng = _engine(target, head, "eagle3", static=True)
    p, graphs = eng.proposer, GraphDouble()
    st = HeadDraftGraphs(p.head, p.kv, block_size=p.block_size, trash_slot=p.trash_slot, num_spec_tokens=K,
                         max_num_seqs=4, max_seq_len=eng.max_model_len, impl="torch", use_graphs=True,
                         graphs_api=graphs)
    capture_one = st._capture_one

    def capture_or_fail(maker, bucket):
        if bucket == 4:  # e.g. a stray synchronisation inside the loop
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return capture_one(maker, bucket)

    st._capture_one = capture_or_fail
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        st.capture()  # start-up goes on
    assert st.eager_buckets == [4] and set(st.graphs) == {1, 2}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["CUDA graph capture of the head's draft steps failed for 1 of 3 batch buckets [4] (first: "
                        "RuntimeError: CUDA error: operation not permitted when stream is capturing); those rounds "
                        "draft eagerly"]
    p.static = st
    buckets = []
    loop_fn = st.loop_fn
    st.loop_fn = lambda n: buckets.append(n) or loop_fn(n)  # every run of the loop, replayed or eager
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert [o.spec.num_accepted_tokens for o in outs] == [o.spec.num_accepted_tokens for o in want]
    assert set(buckets) == {1, 2, 4}
    assert graphs.replays == len(buckets) - buckets.count(4) > 0  # buckets 2 and 1 replayed, bucket 4 eagerly
    assert eng.blocks.num_free == eng.blocks.num_blocks

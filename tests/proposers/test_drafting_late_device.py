"""Drafters' staging checked against a device that runs late
(``deferred_device.DeferredDevice``: every torch operation queued, a non-blocking
copy reading its pinned host buffer only when the queue reaches it):

* draft_model's K-step loop on the persistent-buffer runner (catch-up in chunks,
  then K-1 one-token steps fed back on the device, nothing read by the host until
  the drafts are complete): every round's drafts equal those of the same runner on
  an in-order device, and greedy output equals plain decoding;
* an EAGLE-3 head's K draft steps over persistent buffers (``head_graphs``): the
  same drafts as the eager loop.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from deferred_device import DeferredDevice  # noqa: E402
from eagle_heads import make_bigram_target, write_head  # noqa: E402
from engine_utils import greedy, plain_outputs, random_prompts, tiny_config  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.executor.backends.cuda_graphs import CudaGraphRunner  # noqa: E402
from specserve.executor.backends.head_graphs import HeadDraftGraphs  # noqa: E402
from specserve.executor.static_runner import StaticStepRunner  # noqa: E402

K = 4


def _recording(eng: LLMEngine) -> list[list[list[int]]]:
    """Every round's drafts, as the proposer returned them."""
    seen: list[list[list[int]]] = []
    propose = eng.proposer.propose

    def recording(reqs, step=None):
        prop = propose(reqs, step)
        seen.append([list(d) for d in prop.token_ids])
        return prop

    eng.proposer.propose = recording
    return seen


def _draft_engine(tiny_llama, transfer: DeferredDevice | None) -> LLMEngine:
    # the target drafts for itself: drafts it accepts unless they were computed wrong
    eng = LLMEngine(tiny_config(tiny_llama, "draft_model", k=K, draft_dir=tiny_llama))
    prop = eng.proposer
    prop.runner = CudaGraphRunner(StaticStepRunner(prop.runner.loaded, prop.runner.kv, max_num_seqs=8,
                                                   max_num_tokens=16, graph_query_lens=(1,), attention_impl="torch",
                                                   use_graphs=False, transfer=transfer))  # fmt: skip
    prop.max_step_tokens = 16  # smaller than the prompts together: the catch-up runs in chunks
    return eng


def test_draft_model_loop_is_exact_when_the_device_runs_late(tiny_llama):
    prompts = random_prompts(5, seed=9)
    params = [greedy(16) for _ in prompts]
    runs, drafts = {}, {}
    dev = DeferredDevice()
    for late in (False, True):
        eng = _draft_engine(tiny_llama, dev if late else None)
        drafts[late] = _recording(eng)
        with dev if late else nullcontext():
            outs = eng.generate(prompts, params)
        runs[late] = [(o.token_ids, o.spec.num_draft_tokens, o.spec.num_accepted_tokens) for o in outs]
        assert eng.blocks.num_free == eng.blocks.num_blocks
    assert drafts[True] == drafts[False]  # every draft of every round
    assert runs[True] == runs[False]
    assert [t for t, _, _ in runs[True]] == plain_outputs(tiny_llama, prompts, 16)
    drafted, accepted = (sum(r[i] for r in runs[True]) for i in (1, 2))
    assert drafted > 0 and accepted == drafted  # the target drafting for itself: every draft accepted
    assert dev.waits > 0  # the loop ran two uploads ahead of the device: the case a race needs


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("late-eagle")
    target = make_bigram_target(root / "target", leak=0.05)
    from safetensors.torch import load_file

    lm = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    head = write_head(root / "e3", "eagle3", oracle=True, aux_ids=[0, 1, 1], draft_vocab=300, target_lm_head=lm)
    return target, head


def test_head_draft_steps_are_exact_when_the_device_runs_late(eagle3):
    """Each round ends with the host reading the drafts, so the head's one upload per
    round is waited for anyway; the double buffers and their events still must
    give the eager loop's drafts."""
    target, head = eagle3
    prompts = random_prompts(6, seed=3)
    params = [greedy(40 - len(p)) for p in prompts]
    runs, drafts = {}, {}
    dev = DeferredDevice()
    for late in (False, True):
        cfg = tiny_config(target, "eagle3", k=K, draft_dir=head)
        cfg.engine.max_num_seqs = 3  # bucket 4 has a padding row
        cfg.model.max_model_len = 40  # the last rounds want fewer than K drafts
        eng = LLMEngine(cfg)
        p = eng.proposer
        if late:
            p.static = HeadDraftGraphs(p.head, p.kv, block_size=p.block_size, trash_slot=p.trash_slot,
                                       num_spec_tokens=K, max_num_seqs=4, max_seq_len=eng.max_model_len,
                                       impl="torch", use_graphs=False, transfer=dev)  # fmt: skip
        drafts[late] = _recording(eng)
        with dev if late else nullcontext():
            outs = eng.generate(prompts, params)
        runs[late] = [(o.token_ids, o.spec.num_draft_tokens, o.spec.num_accepted_tokens) for o in outs]
        assert eng.blocks.num_free == eng.blocks.num_blocks
    assert drafts[True] == drafts[False]
    assert runs[True] == runs[False]
    assert sum(a for _, _, a in runs[True]) > 0
    assert dev.copies > 0

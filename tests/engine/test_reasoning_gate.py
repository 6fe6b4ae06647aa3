"""The engine's reasoning gate and grammar-forced drafts (specserve/engine/reasoning_gate.py).

* A thinking budget spends exactly that many reasoning tokens, then forces the end marker;
  with speculation (n-gram, any number of drafts per step, drawn at random) the output is
  plain decoding's under the same budget.
* A grammar starts where the reasoning ends, whether the prompt leaves the reasoning open,
  closed, or optional (the first token may open it).
* Grammar-forced drafts: the tokens a grammar forces are drafted and all accepted; greedy
  output is the same with them and without, with no method and beside n-gram drafts.
* A drafted end of sequence after a complete grammar is accepted (llguidance cannot roll
  one back: it is never consumed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import draw_k_every_step, engine_on_cached_target, one_thread, tiny_config  # noqa: E402,F401
from tiny_chat_models import make_qwen_chat_model  # noqa: E402

from specserve.engine.reasoning_gate import ReasoningGate  # noqa: E402
from specserve.request import ReasoningParams, SamplingParams, StructuredOutputsParams  # noqa: E402

pytestmark = pytest.mark.timeout(300)
THINK, END = 261, 262  # <think>, </think> in the tiny Qwen tokenizer
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}, "unit": {"enum": ["c", "f"]}},
          "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_qwen_chat_model(tmp_path_factory.mktemp("qwen-gate") / "m")


def engine(model_dir, method=None, k=4, grammar_drafts=True):
    cfg = tiny_config(model_dir, method, k=k, num_blocks=512)
    cfg.engine.grammar_drafts = grammar_drafts
    return engine_on_cached_target(cfg)


def prompt(e, thinking: bool = True) -> list[int]:
    kw = {} if thinking else {"template_kwargs": {"enable_thinking": False}}
    return e.tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], **kw)


def params(state: str, budget=None, schema=None, max_tokens=40) -> SamplingParams:
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=schema is None, structured_outputs=so,
                          thinking_token_budget=budget,
                          reasoning=ReasoningParams([[THINK]], [[END]], state, [END]))  # fmt: skip


@pytest.mark.parametrize("budget", [0, 1, 5, 13])
def test_budget_is_exact_and_speculation_keeps_the_output(model_dir, budget):
    plain = engine(model_dir)
    ids = prompt(plain)
    ref = plain.generate([ids], [params("open", budget)])[0]
    assert ref.token_ids.index(END) == budget  # exactly `budget` reasoning tokens, then the end
    for seed in (1, 2):
        spec = engine(model_dir, "ngram", k=4)
        draw_k_every_step(spec, 4, seed)
        out = spec.generate([ids], [params("open", budget)])[0]
        assert out.token_ids == ref.token_ids
    assert out.spec.num_drafts > 0


def test_grammar_starts_after_the_reasoning(model_dir):
    e = engine(model_dir)
    ids = prompt(e)
    out = e.generate([ids], [params("open", 6, SCHEMA, 80)])[0]
    k = out.token_ids.index(END)
    assert k == 6
    import json

    assert set(json.loads(e.tokenizer.decode(out.token_ids[k + 1 :]))) == {"city", "unit"}
    # the prompt closed the reasoning: the grammar constrains the first token
    closed = e.generate([prompt(e, thinking=False)], [params("closed", None, SCHEMA, 80)])[0]
    assert e.tokenizer.decode(closed.token_ids).startswith('{"city":"')


def test_optional_reasoning_row_allows_the_grammar_and_the_start_marker(model_dir):
    e = engine(model_dir)
    so = StructuredOutputsParams(json=SCHEMA)
    grammar = e.grammar_backend.compile(so, 10**6).new_state()
    words = (e.target.arch.vocab_size + 31) // 32
    gate = ReasoningGate(ReasoningParams([[THINK]], [[END]], "optional", [END]), 2, grammar, words)
    brace = e.tokenizer.encode("{", add_special_tokens=False)[0]
    rows, n = gate.masks([THINK, 7, 8, 9])  # open, two reasoning tokens, then the budget forces </think>
    allowed = lambda r, t: bool((int(r[t >> 5]) >> (t & 31)) & 1)  # noqa: E731
    assert allowed(rows[0], THINK) and allowed(rows[0], brace) and not allowed(rows[0], 7)
    assert rows[1].tolist() == rows[2].tolist() == [-1] * words  # inside the reasoning: free
    assert n == 3 and [t for t in range(512) if allowed(rows[3], t)] == [END]  # draft 9 cut: </think> forced
    assert gate.forced(8) == []  # the reasoning may open, or the grammar start: nothing is certain
    gate.advance([THINK, 7, 8])
    assert gate.phase == "forcing" and gate.forced(3)[0] == END
    gate.advance([END])
    assert gate.phase == "closed" and gate.forced(3) == e.tokenizer.encode('{"c', add_special_tokens=False)[:3]


@pytest.mark.parametrize("method", [None, "ngram"])
def test_grammar_forced_drafts_keep_the_output(model_dir, method):
    ids = prompt(engine(model_dir), thinking=False)
    outs = {}
    for on in (True, False):
        e = engine(model_dir, method, grammar_drafts=on)
        outs[on] = e.generate([ids] * 2, [params("closed", None, SCHEMA, 60)] * 2)
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert all(o.failure is None and o.finish_reason.value == "stop" for o in outs[True])
    with_forced = outs[True][0].spec
    if method is None:  # every draft is forced: all accepted
        assert with_forced.num_draft_tokens > 10 and with_forced.num_accepted_tokens == with_forced.num_draft_tokens
        assert outs[False][0].spec.num_drafts == 0


def test_end_of_sequence_drafted_after_a_complete_grammar(model_dir):
    e = engine(model_dir)
    grammar = e.grammar_backend.compile(StructuredOutputsParams(regex="ab"), 10**6).new_state()
    tok = e.tokenizer.encode("ab", add_special_tokens=False)
    grammar.advance(tok)
    eos = e.tokenizer.eos_token_ids[0]
    assert grammar.forced(4) == [eos]
    rows, n = grammar.masks([eos])
    assert n == 1
    grammar.advance([eos])  # the state survived the masks: no failure
    assert np.array_equal(rows[0], rows[1])

"""EAGLE / EAGLE-3 proposers: every published head layout loads and keeps greedy output
equal to plain decoding (float32), heads that predict well are accepted, the head's KV
lives in the engine's cache and blocks, and bad heads fail with one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from eagle_heads import make_bigram_target, write_head  # noqa: E402
from engine_utils import draw_k_every_step, greedy, head_forwards, random_prompts, record_drafts, run, tiny_config  # noqa: E402
from engine_utils import engine_on_cached_target  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)
from specserve.config import Config, ModelConfig, SpeculativeConfig, validate_config  # noqa: E402
from specserve.errors import ConfigError  # noqa: E402
from specserve.executor.batch import SeqInput  # noqa: E402

K = 4


engine = engine_on_cached_target


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eagle")


@pytest.fixture(scope="module")
def target(root) -> Path:
    """Almost a bigram model: attention and MLP contribute a little (some drafts fail)."""
    return make_bigram_target(root / "target", leak=0.05)


@pytest.fixture(scope="module")
def exact_bigram(root) -> Path:
    return make_bigram_target(root / "bigram", leak=0.0)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, seed=3)


@pytest.fixture(scope="module")
def plain(target, prompts):
    return run(engine(tiny_config(target)), prompts, [greedy(24) for _ in prompts])


def _method(layout: str) -> str:
    return "eagle" if layout in ("eagle", "speculators-eagle") else "eagle3"


def _check_lossless(target_dir, head, method, prompts, expected, max_tokens=24, **cfg_kw):
    eng = engine(tiny_config(target_dir, method, k=K, draft_dir=head, **cfg_kw))
    outs = eng.generate(prompts, [greedy(max_tokens) for _ in prompts])
    assert [o.token_ids for o in outs] == expected
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert not eng.proposer.states  # every request's head state was dropped
    return eng, outs


LAYOUTS = [
    ("eagle", {}),
    ("eagle", {"own_embed": True}),
    ("eagle3", {"aux_ids": [0, 1, 1]}),
    ("eagle3", {"aux_ids": [1, 0, 1], "draft_vocab": 96}),
    ("specforge", {"aux_ids": [0, 1, 1], "draft_vocab": 200}),
    ("vllm-eagle3", {"aux_ids": [0, 0, 1]}),
    ("speculators", {"aux_ids": [0, 1, 1], "draft_vocab": 64}),
    ("speculators-eagle", {}),
    ("speculators-eagle", {"config_over": {"layernorms": True}}),
    ("eagle3", {"aux_ids": [0, 1, 1], "fmt": "bin"}),
]


@pytest.mark.parametrize("layout,kw", LAYOUTS, ids=[f"{lay}-{'-'.join(k)}" for lay, k in LAYOUTS])
def test_every_layout_is_lossless(root, target, prompts, plain, layout, kw):
    head = write_head(root / f"head-{layout}-{'-'.join(kw)}-{len(str(kw))}", layout, seed=1, **kw)
    eng, outs = _check_lossless(target, head, _method(layout), prompts, plain)
    assert sum(o.spec.num_draft_tokens for o in outs) > 0
    # the head's K/V is one more layer of the engine's cache, inside its budget
    assert eng.kv.data.shape[0] == 2 + 1


@pytest.mark.parametrize("method,kw", [("eagle", {}), ("eagle3", {"aux_ids": [0, 1, 1]})])
def test_a_head_that_predicts_the_target_is_accepted(root, exact_bigram, prompts, method, kw):
    head = write_head(root / f"oracle-{method}", "eagle" if method == "eagle" else "eagle3", oracle=True, **kw)
    expected = run(engine(tiny_config(exact_bigram)), prompts, [greedy(24) for _ in prompts])
    _, outs = _check_lossless(exact_bigram, head, method, prompts, expected)
    drafts = sum(o.spec.num_drafts for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert accepted == sum(o.spec.num_draft_tokens for o in outs)  # every draft of an exact head
    assert 1 + accepted / drafts > K  # (the last round of a request may draft fewer than K)


@pytest.mark.parametrize("method,kw", [("eagle", {}), ("eagle3", {"aux_ids": [0, 1, 1]})])
def test_drafts_per_step_changing_every_step(root, exact_bigram, prompts, method, kw):
    """Adaptive speculation (the default with a method) changes K between steps, down to 0
    and back: the head must pick up the rows verified while it did not draft.  K drawn at
    random every step; an exact head's drafts are all accepted and the output is exact."""
    head = write_head(root / f"oracle-{method}", "eagle" if method == "eagle" else "eagle3", oracle=True, **kw)
    expected = run(engine(tiny_config(exact_bigram)), prompts, [greedy(24) for _ in prompts])
    eng = engine(tiny_config(exact_bigram, method, k=K, draft_dir=head, speculation="auto"))
    assert eng.spec_control.adaptive
    picked = draw_k_every_step(eng, K, seed=5)
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == expected and set(picked) == set(range(K + 1))
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert 0 < accepted == sum(o.spec.num_draft_tokens for o in outs)
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.proposer.states


def test_partly_right_head_exercises_accept_and_reject(root, target, prompts, plain):
    """Reduced vocabulary (some target tokens undraftable) and a leaky target: drafts are
    accepted and rejected, and rollback keeps the output exact."""
    from safetensors.torch import load_file

    lm = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    head = write_head(root / "oracle-reduced", "eagle3", oracle=True, aux_ids=[0, 1, 1], draft_vocab=300,
                      target_lm_head=lm)
    _, outs = _check_lossless(target, head, "eagle3", prompts, plain)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert 0 < accepted < sum(o.spec.num_draft_tokens for o in outs)


def test_chunked_prefill_and_preemption(root, target, prompts, plain):
    head = write_head(root / "oracle-chunk", "eagle", oracle=True)
    cfg = tiny_config(target, "eagle", k=K, draft_dir=head, num_blocks=30, block_size=4)
    cfg.engine.max_num_batched_tokens = 7  # prompts split into chunks; the head consumes every chunk
    eng = engine(cfg)
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == plain
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0


def test_gqa_target_with_default_layers(tmp_path, prompts):
    """A 6-layer GQA llama and a head without layer ids: EAGLE-3's default (2, 3, 3)."""
    from tiny_models import make_tiny_model

    tdir = make_tiny_model(tmp_path / "gqa", "llama", seed=4, num_hidden_layers=6)
    head = write_head(tmp_path / "head", "eagle3", seed=2, config_over={"num_key_value_heads": 2})
    expected = run(engine(tiny_config(tdir)), prompts, [greedy(16) for _ in prompts])
    eng = engine(tiny_config(tdir, "eagle3", k=3, draft_dir=head))
    assert eng.proposer.aux_layer_ids == (2, 3, 3)
    assert eng.kv.data.shape[0] == 7
    assert run(eng, prompts, [greedy(16) for _ in prompts]) == expected
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_final_hidden_state_as_aux_layer(target):
    """aux id num_layers is the final-normed hidden state of every token (EAGLE-1's feature)."""
    eng = engine(tiny_config(target))
    table: list[int] = []
    eng.blocks.ensure(table, 9)
    ids = list(range(5, 14))
    out = eng.runner.forward([SeqInput(ids, 0, table, list(range(9)))], aux_layer_ids=(0, 2))
    assert torch.equal(out.aux[2], out.hidden)
    assert torch.equal(out.aux[0], eng.target.model.embed_tokens(torch.tensor(ids)))


def test_speculators_directory_alone_enables_speculation(root, target, prompts, plain):
    head = write_head(root / "spec-alone", "speculators", aux_ids=[0, 1, 1], speculative_tokens=3,
                      verifier=str(target))
    cfg = Config(model=ModelConfig(name="tiny", path=str(head), dtype="float32"))
    cfg.engine.num_kv_blocks, cfg.engine.block_size = 256, 4
    cfg = validate_config(cfg)
    assert cfg.method.method == "eagle3" and cfg.method.num_speculative_tokens == 3
    assert cfg.method.model == str(head) and cfg.model.path == str(target)
    outs = engine(cfg).generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == plain
    assert sum(o.spec.num_draft_tokens for o in outs) > 0


def test_speculators_verifier_must_be_local(root):
    head = write_head(root / "spec-hub", "speculators", verifier="meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(ConfigError) as e:
        validate_config(Config(model=ModelConfig(name="x", path=str(head))))
    msg = str(e.value)
    assert msg.startswith("model.path:") and "not a local model" in msg and "\n" not in msg


def test_eagle3_on_the_embedded_model_defaults_to_the_shipped_head():
    cfg = validate_config(Config(method=SpeculativeConfig(method="eagle3", num_speculative_tokens=4)))
    assert cfg.method.model == "embedded:smollm2-135m-instruct-eagle3"
    with pytest.raises(ConfigError, match="method.model"):  # elsewhere a head is required
        validate_config(Config(model=ModelConfig(path="/some/dir"),
                               method=SpeculativeConfig(method="eagle3", num_speculative_tokens=4)))


BAD = [
    ("wrong-hidden", "eagle3", dict(aux_ids=[0, 1, 1], tensor_over={"fc.weight": torch.zeros(64, 96)}),
     "method.model: wrong hidden size"),
    ("wrong-hidden-eagle", "eagle", dict(tensor_over={"fc.weight": torch.zeros(64, 100)}),
     "method.model: wrong hidden size"),
    ("vocab", "eagle3", dict(aux_ids=[0, 1, 1], config_over={"vocab_size": 1000}),
     "method.model: vocabulary mismatch"),
    ("lm-rows", "eagle3", dict(aux_ids=[0, 1, 1], draft_vocab=64, tensor_over={"lm_head.weight": torch.zeros(65, 64)}),
     "method.model: vocabulary mismatch"),
    ("no-d2t", "eagle3", dict(aux_ids=[0, 1, 1], draft_vocab=64, drop=("d2t", "t2d")), "method.model: missing d2t"),
    ("k-limit", "speculators", dict(aux_ids=[0, 1, 1], speculative_tokens=2),
     "method.num_speculative_tokens: 4 exceeds the 2 speculative tokens"),
    ("kind", "eagle", dict(), "select it with +method=eagle"),
    ("two-layers", "eagle3", dict(aux_ids=[0, 1, 1], tensor_over={"layers.1.mlp.up_proj.weight": torch.zeros(1)}),
     "more than one decoder layer"),
    ("layer-ids", "eagle3", dict(aux_ids=[0, 1, 5]), "eagle_aux_hidden_state_layer_ids"),
    ("pickle", "eagle3", dict(aux_ids=[0, 1, 1], fmt="pickle"), "refused"),
]


@pytest.mark.parametrize("name,layout,kw,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_heads_fail_with_one_line(root, target, name, layout, kw, expected):
    head = write_head(root / f"bad-{name}", layout, **kw)
    method = "eagle3" if name == "kind" else _method(layout)
    with pytest.raises(ConfigError) as e:
        engine(tiny_config(target, method, k=K, draft_dir=head))
    msg = str(e.value)
    assert expected in msg and "\n" not in msg, msg


def test_prefix_cached_prompts(root, exact_bigram):
    """Prompts sharing cached blocks: the head's rows start past the cached prefix."""
    common = random_prompts(1, seed=9, lo=10, hi=11)[0]
    prompts = [common + tail for tail in random_prompts(5, seed=10, lo=1, hi=6)]
    expected = run(engine(tiny_config(exact_bigram)), prompts, [greedy(16) for _ in prompts])
    head = write_head(root / "oracle-cache", "eagle", oracle=True)
    eng, outs = _check_lossless(exact_bigram, head, "eagle", prompts, expected, max_tokens=16)
    assert eng.blocks.num_hit_tokens > 0
    assert sum(o.spec.num_accepted_tokens for o in outs) == sum(o.spec.num_draft_tokens for o in outs)


def test_on_the_paged_kernel_a_prompt_chunk_beside_decode_rows_pads_nothing(root, target, monkeypatch):
    """The head's forwards on the paged kernel (what CUDA runs: ``RunnerFactory.head_attention``;
    here the kernel's torch twin): a step that commits a prompt chunk beside another request's
    verified rows goes through the kernel, never through the reference attention's padded
    group, and every round's drafts are those of the reference attention."""
    head = write_head(root / "oracle-kernel", "eagle3", oracle=True, aux_ids=[0, 1, 1])
    prompts = random_prompts(2, seed=5, lo=3, hi=6) + random_prompts(1, seed=6, lo=40, hi=41)
    params = [greedy(24) for _ in prompts]
    plain = run(engine(tiny_config(target)), prompts, params)
    cfg = tiny_config(target, "eagle3", k=K, draft_dir=head)
    cfg.engine.max_num_batched_tokens = 16  # the long prompt runs in chunks beside the short ones' rows
    forwards = head_forwards(monkeypatch)
    runs = {}
    for attention in (None, "torch"):
        eng = engine(cfg)
        assert eng.proposer.attention is None  # the CPU's choice: the reference attention
        eng.proposer.attention = attention
        drafts = record_drafts(eng)
        forwards.clear()
        assert run(eng, prompts, params) == plain
        assert eng.blocks.num_free == eng.blocks.num_blocks
        runs[attention] = (drafts, list(forwards))
    assert runs["torch"][0] == runs[None][0] and any(any(d) for d in runs["torch"][0])
    assert {path for path, _, _ in runs[None][1]} == {"reference"}
    kernel = runs["torch"][1]
    assert {path for path, _, _ in kernel} == {"kernel"}
    # a chunk longer than any verification, with context before it, beside another request's rows:
    # the reference's padded group would be (sequences x the chunk's length x the longest context)
    assert any(len(q) > 1 and any(n > K + 1 and ctx > n for n, ctx in zip(q, lens)) for _, q, lens in kernel)

"""A draft head's layer on the fused CPU decoder (``kernels.cpu_decoder.FusedHead``)
against the head's torch ops: the same outputs and K/V (to bf16 rounding) for ragged
steps mixing a consumed chunk, decode rows and draft-tree frontiers, on both attention
paths of the kernel (grouped for head_dim 64, per head otherwise), GQA, EAGLE-1 and
EAGLE-3 (its input built in C, with and without norm_before_residual); nothing outside
the step's slots is written; the head's norm and LM head; bad inputs raise.  Then the
engine: EAGLE and EAGLE-3 trees drafted by fused heads leave greedy output equal to plain
decoding, up to the end of the context."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from specserve.executor.attention import batch_metadata
from specserve.executor.backends.factory import RunnerFactory
from specserve.executor.batch import SeqInput, StepBatch, tree_masks
from specserve.executor.models.eagle import EagleHead, HeadConfig
from specserve.kernels.cpu_decoder import FusedHead, KernelUnavailable, load_library
from specserve.proposers.heads import FUSED_HEAD, head_metadata

BS = 4  # block size
V = 300  # target vocabulary


@pytest.fixture(scope="module")
def kcache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="module", autouse=True)
def lib(kcache):
    try:
        return load_library(kcache)
    except KernelUnavailable as e:
        pytest.skip(f"fused CPU decoder unavailable here: {e}")


def _head(kind: str, nh: int, nkv: int, hd: int, *, nbr: bool = False, seed: int = 0) -> EagleHead:
    """A random bf16 head over a target of hidden size 96 (its embeddings shared)."""
    g = torch.Generator().manual_seed(seed)
    H = 96
    rope = SimpleNamespace(rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, head_dim=hd,
                           hidden_size=H, num_attention_heads=nh)
    c = HeadConfig(kind=kind, hidden_size=H, intermediate_size=160, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                   rms_norm_eps=1e-6, vocab_size=V, draft_vocab_size=120 if kind == "eagle3" else V,
                   target_hidden_size=H, aux_layer_ids=(0, 1, 1) if kind == "eagle3" else (2,),
                   norm_before_residual=nbr, input_layernorm=kind == "eagle", rope_config=rope)
    head = EagleHead(c, max_positions=64)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else 0.15 * torch.randn(p.shape, generator=g))
    if kind == "eagle3":
        head.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        with torch.no_grad():
            head.lm_head.weight.copy_(0.3 * torch.randn(head.lm_head.weight.shape, generator=g))
    target = nn.Module()
    target.embed_tokens = nn.Embedding(V, H)
    with torch.no_grad():
        target.embed_tokens.weight.copy_(torch.randn(V, H, generator=g))
    target.to(torch.bfloat16)
    head.to(torch.bfloat16).eval()
    head.attach_target(target)
    return head


def _cache(nkv: int, hd: int, blocks: int = 24, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(blocks * BS, nkv, hd, generator=g).to(torch.bfloat16) for _ in range(2))


def _fuse(head: EagleHead, kv, kcache) -> FusedHead:
    loaded = SimpleNamespace(tp=None, device=torch.device("cpu"), dtype=torch.bfloat16)
    RunnerFactory(cpu_kernel="fused", cache_dir=kcache).fuse_head(head, loaded, kv, BS)
    assert head.fused is not None
    return head.fused


def _step(tree: bool) -> list[SeqInput]:
    """A consumed chunk of 3 rows, a decode row, and (``tree``) a draft tree's frontier of
    3 nodes stored past its committed rows: the first node and its two children."""
    seqs = [SeqInput([5, 17, 42], 6, [3, 4, 5], [2]), SeqInput([9], 10, [7, 8, 9], [0])]
    if tree:
        last = 8  # the request's last real row; its nodes sit at 9, 10, 11 by depth
        seqs.append(SeqInput([11, 12, 13], last + 1, [12, 13, 14, 15], [0, 1, 2], positions=[9, 10, 10],
                             tree_base=last + 1, tree_masks=tree_masks([-1, 0, 0])))
    return seqs


GEOMETRIES = [(4, 2, 64), (2, 1, 64), (4, 4, 16), (3, 1, 32)]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"nh{a}-nkv{b}-hd{c}" for a, b, c in GEOMETRIES])
@pytest.mark.parametrize("kind,nbr", [("eagle3", False), ("eagle3", True), ("eagle", False)])
@pytest.mark.parametrize("tree", [False, True], ids=["chains", "tree"])
def test_the_fused_layer_matches_the_heads_torch_ops(kcache, geometry, kind, nbr, tree):
    nh, nkv, hd = geometry
    head = _head(kind, nh, nkv, hd, nbr=nbr)
    ref_kv, fused_kv = _cache(nkv, hd), _cache(nkv, hd)
    before = ref_kv[0].clone(), ref_kv[1].clone()
    f = _fuse(head, fused_kv, kcache)
    assert (f.eagle3 is not None) == (kind == "eagle3")
    batch = StepBatch.from_inputs(_step(tree), BS)
    T = batch.num_tokens
    ids = torch.tensor(batch.token_ids)
    hidden = torch.randn(T, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        meta, pos = batch_metadata(batch, BS, torch.device("cpu"))
        want = head(ids, hidden, pos, meta, ref_kv)
        fmeta, fpos = head_metadata(batch, BS, torch.device("cpu"), kernel=FUSED_HEAD)
        assert fmeta.fused is not None and torch.equal(fpos, pos)
        got = head(ids, hidden, fpos, fmeta, fused_kv)
    assert got.dtype == want.dtype and got.shape == want.shape == (T, 96)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert err < 3e-2, err
    slots = torch.tensor(batch.slot_mapping)
    for r, fz, b in zip(ref_kv, fused_kv, before):
        kv_err = float((fz[slots].float() - r[slots].float()).abs().max() / r[slots].float().abs().max())
        assert kv_err < 3e-2, kv_err
        keep = torch.ones(r.shape[0], dtype=torch.bool)
        keep[slots] = False
        assert torch.equal(fz[keep], b[keep])  # nothing outside the step's slots is written


@pytest.mark.parametrize("nbr", [False, True])
def test_eagle3_input_built_in_c_matches_the_heads_step_input(kcache, nbr):
    """``ss_eagle3_layer`` (the input built in C) against ``ss_head_layer`` fed the head's
    own ``step_input``: the same layer, so the same output to bf16 rounding of the norms."""
    head = _head("eagle3", 4, 2, 64, nbr=nbr)
    a, b = _cache(2, 64), _cache(2, 64)
    f = _fuse(head, a, kcache)
    g = FusedHead(f.lib, head.layer, head.rotary, b, BS, hidden_size=96, intermediate_size=160, num_heads=4,
                  num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, num_positions=64)
    batch = StepBatch.from_inputs(_step(True), BS)
    step = head_metadata(batch, BS, torch.device("cpu"), kernel=FUSED_HEAD)[0].fused
    ids = torch.tensor(batch.token_ids)
    hidden = torch.randn(batch.num_tokens, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.inference_mode():
        built = f.eagle3_layer(ids, hidden, step)
        residual, x = head.step_input(ids, hidden)
        given = g(x, residual, step)
    assert built.dtype == given.dtype == torch.float32
    assert float((built - given).abs().max() / given.abs().max()) < 2e-2


def test_the_fused_norm_and_lm_head_match_torch(kcache):
    head = _head("eagle3", 4, 2, 64)
    f = _fuse(head, _cache(2, 64), kcache)
    assert f.has_logits and f.vocab == 120
    out = torch.randn(5, 96, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.inference_mode():
        got = head.logits(out)  # through the fused head
        want = head.lm_head(head.norm(out))  # the head's torch norm and fused LM head
    assert got.dtype == torch.float32 and got.shape == (5, 120)
    assert float((got - want.float()).abs().max() / want.float().abs().max()) < 2e-2
    assert head.logits(out[:0]).shape == (0, 120)


def test_bad_inputs_raise_and_write_nothing(kcache):
    head = _head("eagle3", 4, 2, 64)
    kv = _cache(2, 64)
    before = kv[0].clone()
    f = _fuse(head, kv, kcache)
    batch = StepBatch.from_inputs(_step(False), BS)
    step = head_metadata(batch, BS, torch.device("cpu"), kernel=FUSED_HEAD)[0].fused
    hidden = torch.zeros(batch.num_tokens, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        f.eagle3_layer(torch.tensor([1, 2, V, 3]), hidden, step)
    with pytest.raises(ValueError, match="residuals"):
        f.eagle3_layer(torch.tensor([1, 2, 3]), hidden[:3], step)
    with pytest.raises(ValueError, match="features"):
        f(torch.zeros(4, 96), hidden, step)
    assert torch.equal(kv[0], before)
    with pytest.raises(ValueError, match="fused head"):  # the reference attention refuses fused metadata
        from specserve.executor.attention import write_and_attend

        meta = head_metadata(batch, BS, torch.device("cpu"), kernel=FUSED_HEAD)[0]
        q = torch.zeros(4, 4, 64)
        write_and_attend(q, q[:, :2], q[:, :2], *kv, meta)


def _eager_chain(head: EagleHead, hidden: torch.Tensor, rows) -> list[list[int]]:
    """The proposer's eager greedy loop, a column at a time through the fused head's
    logits and layer calls (``EagleProposer._draft`` without its static drafter)."""
    drafts: list[list[int]] = [[] for _ in rows]
    active = [b for b, (_, w, _) in enumerate(rows) if w > 0]
    hidden = hidden[active]
    step = 1
    while active:
        tokens = head.to_target_ids(head.logits(hidden).argmax(dim=-1))
        for a, t in zip(active, tokens.tolist()):
            drafts[a].append(t)
        keep = [n for n, a in enumerate(active) if rows[a][1] > step]
        active, tokens, hidden = [active[n] for n in keep], tokens[keep], hidden[keep]
        if not active:
            break
        batch = StepBatch.from_inputs([SeqInput([0], rows[a][0] + step, rows[a][2], [0]) for a in active], BS)
        meta, pos = head_metadata(batch, BS, torch.device("cpu"), kernel=FUSED_HEAD)
        hidden = head(tokens, hidden, pos, meta, None)
        step += 1
    return drafts


@pytest.mark.parametrize("nbr", [False, True])
@pytest.mark.parametrize("d2t", [False, True], ids=["draft-ids", "mapped"])
def test_the_fused_chain_drafts_what_the_eager_loop_drafts(kcache, nbr, d2t):
    """``FusedHeadChain`` (every column in one C call) against the eager loop over the same
    fused head: the same drafts and the same K/V, bit for bit, for rows wanting 0 to K
    drafts (the live rows shrink column by column), ragged positions and block tables;
    nothing outside the drafted positions' slots is written."""
    from specserve.kernels.cpu_decoder import FusedHeadChain

    K = 4
    head = _head("eagle3", 4, 2, 64, nbr=nbr, seed=7)
    if d2t:  # a reduced draft vocabulary mapped into the target's
        head.draft_to_target = torch.randperm(V, generator=torch.Generator().manual_seed(8))[:120]
    a, b = _cache(2, 64, seed=9), _cache(2, 64, seed=9)
    f_eager = _fuse(head, a, kcache)
    chain = FusedHeadChain(_fuse(head, b, kcache), head.draft_to_target, K)
    # (last real position, drafts wanted, block table): drafting writes last+1 .. last+want-1
    rows = [(6, 4, [3, 4, 5]), (9, 2, [7, 8, 9]), (2, 0, [10]), (4, 1, [11, 2]), (12, 3, [0, 1, 6, 13, 14])]
    hidden = torch.randn(len(rows), 96, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    before = a[0].clone(), a[1].clone()
    with torch.inference_mode():
        head.fused = f_eager
        want = _eager_chain(head, hidden, rows)
        got = chain.draft(hidden, rows)
    assert got == want
    assert [len(d) for d in got] == [w for _, w, _ in rows]
    vocab = set(head.draft_to_target.tolist()) if d2t else set(range(120))
    assert all(t in vocab for d in got for t in d)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    written = {t[(p + s) // BS] * BS + (p + s) % BS for p, w, t in rows for s in range(1, w)}
    keep = torch.ones(a[0].shape[0], dtype=torch.bool)
    keep[sorted(written)] = False
    assert not torch.equal(a[0][sorted(written)], before[0][sorted(written)])
    assert torch.equal(a[0][keep], before[0][keep]) and torch.equal(a[1][keep], before[1][keep])


def test_the_fused_chain_refuses_more_drafts_than_k(kcache):
    from specserve.kernels.cpu_decoder import FusedHeadChain

    head = _head("eagle3", 4, 2, 64)
    chain = FusedHeadChain(_fuse(head, _cache(2, 64), kcache), None, 2)
    hidden = torch.zeros(1, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 2"):
        chain.draft(hidden, [(3, 3, [0, 1])])
    with pytest.raises(ValueError, match="states"):
        chain.draft(hidden, [(3, 1, [0, 1]), (3, 1, [2, 3])])
    assert chain.draft(hidden, []) == []
    eagle1 = _head("eagle", 4, 2, 64)
    with pytest.raises(KernelUnavailable, match="EAGLE-3"):
        FusedHeadChain(_fuse(eagle1, _cache(2, 64), kcache), None, 2)


# ---------------------------------------------------------------------------- the engine

sys.path.insert(0, str(Path(__file__).parents[1] / "proposers"))
sys.path.insert(0, str(Path(__file__).parents[1]))


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    from eagle_heads import make_bigram_target, write_head
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("fused-head")
    target = make_bigram_target(root / "target", leak=0.3)
    lm = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    return target, {
        "eagle": write_head(root / "eagle", "eagle", oracle=True),
        "eagle3": write_head(root / "eagle3", "eagle3", oracle=True, aux_ids=[0, 1, 1], draft_vocab=300,
                             target_lm_head=lm),
        "eagle3-random": write_head(root / "eagle3-random", "eagle3", seed=5, aux_ids=[0, 1, 1], draft_vocab=96),
    }


def _bf16(target, kcache, method=None, max_model_len=None, **kw):
    from engine_utils import tiny_config

    from specserve.engine.engine import LLMEngine

    cfg = tiny_config(target, method, **kw)
    cfg.model.max_model_len = max_model_len
    cfg.model.dtype = "bfloat16"
    cfg.model.cache_dir = str(kcache)
    cfg.engine.cpu_kernel = "fused"
    return LLMEngine(cfg)


@pytest.mark.parametrize("head", ["eagle", "eagle3", "eagle3-random"])
@pytest.mark.parametrize("shape", [None, {"topk": 3, "depth": 3, "num_draft_tokens": 6}], ids=["chain", "tree"])
def test_fused_heads_draft_losslessly_on_the_fused_path(bigram, kcache, head, shape):
    """Greedy output equals plain decoding, and an oracle head drafts what the same head
    on its torch ops drafts (its guesses have wide margins): exactly as many accepted."""
    from engine_utils import greedy, random_prompts, run

    target, heads = bigram
    method = "eagle" if head == "eagle" else "eagle3"
    prompts = random_prompts(5, seed=3)
    want = run(_bf16(target, kcache), prompts, [greedy(24) for _ in prompts])
    kw = {"tree": shape} if shape else {}
    k = shape["num_draft_tokens"] - 1 if shape else 3
    accepted = []
    for fused in (True, False):
        eng = _bf16(target, kcache, method, k=k, draft_dir=heads[head], **kw)
        p = eng.proposer
        assert p.head.fused is not None and p.attention == FUSED_HEAD
        if not fused:  # the same head on its torch ops
            p.head.fused, p.attention, p.static = None, None, None
        outs = eng.generate(prompts, [greedy(24) for _ in prompts])
        assert [o.token_ids for o in outs] == want
        assert sum(o.spec.num_draft_tokens for o in outs) > 0
        accepted.append(sum(o.spec.num_accepted_tokens for o in outs))
        assert eng.blocks.num_free == eng.blocks.num_blocks
    if head != "eagle3-random":
        assert accepted[0] == accepted[1] > 0


@pytest.mark.parametrize("head", ["eagle3", "eagle3-random"])
def test_the_engine_drafts_eagle3_chains_in_one_call(bigram, kcache, head):
    """An EAGLE-3 head on the fused path drafts its greedy chains through
    ``FusedHeadChain``; the eager loop over the same head (no static drafter) proposes
    the same drafts: the same outputs and the same draft and acceptance counts, per
    request.  A request with a confidence cut drafts through the eager loop."""
    from engine_utils import greedy, random_prompts

    from specserve.kernels.cpu_decoder import FusedHeadChain

    target, heads = bigram
    prompts = random_prompts(4, seed=6)
    runs = []
    for chain in (True, False):
        eng = _bf16(target, kcache, "eagle3", k=3, draft_dir=heads[head])
        p = eng.proposer
        assert isinstance(p.static, FusedHeadChain)
        calls = []
        if chain:
            real = p.static.draft
            p.static.draft = lambda *a: calls.append(1) or real(*a)
        else:
            p.static = None
        outs = eng.generate(prompts, [greedy(20) for _ in prompts])
        assert bool(calls) == chain
        runs.append([(o.token_ids, o.spec.num_draft_tokens, o.spec.num_accepted_tokens) for o in outs])
        assert eng.blocks.num_free == eng.blocks.num_blocks
    assert runs[0] == runs[1]
    assert sum(r[1] for r in runs[0]) > 0
    eng = _bf16(target, kcache, "eagle3", k=3, draft_dir=heads[head])
    eng.cfg.engine.draft_confidence_threshold = 0.5
    calls = []
    real = eng.proposer.static.draft
    eng.proposer.static.draft = lambda *a: calls.append(1) or real(*a)
    outs = eng.generate(prompts, [greedy(20) for _ in prompts])
    assert not calls and [o.token_ids for o in outs] == [r[0] for r in runs[0]]


def test_deep_trees_run_to_the_end_of_the_context(bigram, kcache):
    """A tree stores more nodes past the committed rows than the head's rotary tables
    have positions past the context's end: requests that run into max_model_len still
    draft (on the fused head) and equal plain decoding."""
    from engine_utils import greedy, random_prompts, run

    target, heads = bigram
    prompts = random_prompts(3, seed=4)
    shape = {"topk": 4, "depth": 4, "num_draft_tokens": 5}
    limit = 48
    params = [greedy(limit - len(p)) for p in prompts]  # every request runs to the end of the context
    want = run(_bf16(target, kcache, max_model_len=limit), prompts, params)
    eng = _bf16(target, kcache, "eagle3", k=4, draft_dir=heads["eagle3"], tree=shape, max_model_len=limit)
    assert eng.proposer.head.fused is not None and eng.max_model_len == limit
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert any(len(p) + len(o.token_ids) == limit for p, o in zip(prompts, outs))
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    assert eng.blocks.num_free == eng.blocks.num_blocks

"""Medusa: tiny heads built here and written tensor by tensor in the Medusa repo's and
vLLM's key layouts (safetensors, .bin, .pt); every layout loads to the same heads and the
head formula; greedy output equals plain decoding (K fixed and K drawn every step) with
every KV block freed; heads that predict a bigram target exactly have every draft
accepted; drafts sampled from q under probabilistic verification keep the target's
distribution; bad heads fail in one line."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from eagle_heads import TARGET, make_bigram_target  # noqa: E402
from engine_utils import draw_k_every_step, greedy, random_prompts, run, tiny_config  # noqa: E402
from engine_utils import engine_on_cached_target  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)
from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.errors import ConfigError, ModelLoadError  # noqa: E402
from specserve.executor.loader import load_model  # noqa: E402
from specserve.proposers.base import TargetShape  # noqa: E402
from specserve.proposers.medusa import load_medusa, memory  # noqa: E402
from specserve.request import SamplingParams  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

H, V = TARGET["hidden_size"], TARGET["vocab_size"]
K = 3
MAX_TOKENS = 20


# --------------------------------------------------------------------------- writing heads


@dataclass
class Head:
    blocks: list[tuple[torch.Tensor, torch.Tensor]]  # per residual block: W (H, H), b (H,)
    lm: torch.Tensor  # (rows, H)


def random_heads(num_heads: int, num_layers: int, seed: int, hidden: int = H, rows: int = V) -> list[Head]:
    g = torch.Generator().manual_seed(seed)
    return [Head([(torch.randn(hidden, hidden, generator=g) / hidden**0.5, 0.1 * torch.randn(hidden, generator=g))
                  for _ in range(num_layers)], torch.randn(rows, hidden, generator=g) * 3 / hidden**0.5)
            for _ in range(num_heads)]


def write_medusa(out: Path, layout: str, heads: list[Head], *, fmt: str = "safetensors", bias: bool = True,
                 shared_lm_head: bool = False, token_map: torch.Tensor | None = None, config_over: dict | None = None,
                 drop: tuple[str, ...] = ()) -> Path:
    """``heads`` in ``layout``: "medusa" (FasterDecoding/Medusa: medusa_num_* and
    medusa_head.{k}.{l}.linear.*, the LM head at index num_layers; fmt "safetensors" or
    "bin" for a whole-model file with the medusa_head. prefix, "head-safetensors" or "pt"
    for medusa_lm_head.* without it) or "vllm" (MedusaConfig: num_heads, hidden_size, ...
    and blocks.{k}.layers.{l}.* / lm_heads.{k}.weight; fmt "bin" adds the medusa_heads. prefix)."""
    L = len(heads[0].blocks)
    t: dict[str, torch.Tensor] = {}
    if layout == "medusa":
        p = "medusa_head." if fmt in ("safetensors", "bin") else ""
        for k, head in enumerate(heads):
            for l, (w, b) in enumerate(head.blocks):
                t[f"{p}{k}.{l}.linear.weight"] = w
                t[f"{p}{k}.{l}.linear.bias"] = b
            t[f"{p}{k}.{L}.weight"] = head.lm
        cfg = {"medusa_num_heads": len(heads), "medusa_num_layers": L, "base_model_name_or_path": "target",
               "transformers_version": "4.41.0"}
        if fmt in ("safetensors", "bin"):  # a whole Medusa-2 model: the target's own tensors beside the heads
            t["lm_head.weight"] = torch.zeros(4, 4)
            t["model.norm.weight"] = torch.ones(4)
    else:
        p = "medusa_heads." if fmt == "bin" else ""
        for k, head in enumerate(heads):
            for l, (w, b) in enumerate(head.blocks):
                t[f"{p}blocks.{k}.layers.{l}.weight"] = w
                if bias:
                    t[f"{p}blocks.{k}.layers.{l}.bias"] = b
            if k == 0 or not shared_lm_head:
                t[f"{p}lm_heads.{k}.weight"] = head.lm
        if token_map is not None:
            t[f"{p}token_map"] = token_map
        cfg = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": len(heads),
               "num_hidden_layers": L, "hidden_size": heads[0].lm.shape[1], "vocab_size": V, "medusa_fc_bias": bias,
               "original_lm_head": shared_lm_head, "max_paths": 64, "topk": 10,
               "truncated_vocab_size": len(token_map) if token_map is not None else None}
    cfg.update(config_over or {})
    for name in drop:
        del t[name]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    t = {k: v.contiguous() for k, v in t.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(t, str(out / "model.safetensors"))
    elif fmt == "head-safetensors":
        from safetensors.torch import save_file

        save_file(t, str(out / "medusa_lm_head.safetensors"))
    elif fmt == "bin":
        torch.save(t, out / "pytorch_model.bin")
    else:
        torch.save(t, out / "medusa_lm_head.pt")
    return out


# --------------------------------------------------------------------------- heads that predict a bigram target


def bigram_map(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, f): the final-normed hidden state (V, H) float64 of each token of a bigram target
    (attention and MLP contribute nothing: the residual is the embedding) and the token
    its LM head picks after it (V,)."""
    from safetensors.torch import load_file

    sd = load_file(str(target_dir / "model.safetensors"))
    e = sd["model.embed_tokens.weight"].double()
    h = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + TARGET["rms_norm_eps"]) * sd["model.norm.weight"].double()
    return h, (h @ sd["lm_head.weight"].double().T).argmax(-1)


def residual_blocks(h: torch.Tensor, blocks) -> torch.Tensor:
    for w, b in blocks:
        h = h + F.silu(h @ w.double().T + b.double())
    return h


def oracle_heads(target_dir: Path, prompts, num_heads: int, num_layers: int,
                 seed: int = 0) -> tuple[list[Head], list[list[int]]]:
    """Heads whose head k maps the hidden state of token v to f^(k+2)(v) (k + 1 tokens past
    the target's own next token) for every token v the greedy runs of ``prompts`` draft
    from: random residual blocks, then an LM head solved by least squares so that head
    k's logits are 10 at the right token and 0 elsewhere (exact for up to H tokens: the
    states are linearly independent).  Also returns the greedy outputs that f implies."""
    h, f = bigram_map(target_dir)
    chains, seen = [], []
    for p in prompts:
        t, chain = p[-1], []
        for _ in range(MAX_TOKENS + 1):
            seen.append(t)
            t = int(f[t])
            chain.append(t)
        chains.append(chain[:MAX_TOKENS])
    tokens = sorted(set(seen))
    assert len(tokens) <= H - 8, f"{len(tokens)} states in {H} dimensions: the least squares would not be exact"
    heads = random_heads(num_heads, num_layers, seed)
    for k, head in enumerate(heads):
        head.blocks = [(0.5 * w, b) for w, b in head.blocks]
        z = residual_blocks(h[tokens], head.blocks)  # (S, H)
        want = torch.tensor(tokens)
        for _ in range(k + 2):
            want = f[want]
        y = torch.zeros(len(tokens), V, dtype=torch.float64)
        y[torch.arange(len(tokens)), want] = 10.0
        head.lm = torch.linalg.lstsq(z, y).solution.T.float().contiguous()  # (V, H): lm @ z_v = y_v
    return heads, chains


# --------------------------------------------------------------------------- fixtures


engine = engine_on_cached_target


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("medusa")


@pytest.fixture(scope="module")
def exact_bigram(root) -> Path:
    return make_bigram_target(root / "bigram", leak=0.0)


@pytest.fixture(scope="module")
def leaky(root) -> Path:
    """The same embeddings and LM head with a little attention and MLP: the bigram
    heads are partly right on it (drafts accepted and rejected)."""
    return make_bigram_target(root / "leaky", leak=0.05)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=31)


@pytest.fixture(scope="module")
def oracle(exact_bigram, prompts):
    return oracle_heads(exact_bigram, prompts, num_heads=4, num_layers=1)


@pytest.fixture(scope="module")
def leaky_plain(leaky, prompts):
    return run(engine(tiny_config(leaky)), prompts, [greedy(MAX_TOKENS) for _ in prompts])


# --------------------------------------------------------------------------- layouts and the formula


LAYOUTS = {
    "medusa": ("medusa", {}),
    "medusa-bin": ("medusa", {"fmt": "bin"}),
    "medusa-lm-head-pt": ("medusa", {"fmt": "pt"}),
    "medusa-lm-head-safetensors": ("medusa", {"fmt": "head-safetensors"}),
    "vllm": ("vllm", {}),
    "vllm-bin-no-bias": ("vllm", {"fmt": "bin", "bias": False}),
    "vllm-original-lm-head": ("vllm", {"shared_lm_head": True}),
    "vllm-truncated-vocab": ("vllm", {"truncated": 300}),
    "vllm-truncated-vocab-full-rows": ("vllm", {"truncated": 300, "full_rows": True}),
}


def write_layout(out: Path, name: str, heads: list[Head]) -> Path:
    layout, kw = LAYOUTS[name]
    kw = dict(kw)
    truncated, full_rows = kw.pop("truncated", None), kw.pop("full_rows", False)
    if truncated:
        g = torch.Generator().manual_seed(11)
        token_map = torch.sort(torch.randperm(V, generator=g)[:truncated]).values
        kw["token_map"] = token_map
        if not full_rows:
            heads = [Head(hd.blocks, hd.lm[token_map]) for hd in heads]
    return write_medusa(out, layout, heads, **kw)


def test_every_layout_loads_the_same_heads_and_the_formula(root):
    heads = random_heads(3, 2, seed=4)
    x = torch.randn(5, H)
    for name in LAYOUTS:
        model, token_map = load_medusa(str(write_layout(root / f"formula-{name}", name, heads)), "method.model", H, V)
        kw = LAYOUTS[name][1]
        bias = kw.get("bias", True)
        for k in range(3):
            z = x
            for w, b in heads[k].blocks:
                z = z + F.silu(z @ w.T + (b if bias else 0))
            lm = heads[0 if kw.get("shared_lm_head") else k].lm
            want = z @ (lm if token_map is None else lm[token_map]).T
            assert torch.allclose(model(k, x), want, atol=1e-4), (name, k)
        assert (token_map is not None) == ("truncated" in kw), name


# --------------------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("speculation", ["fixed", "k-every-step"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_greedy_equals_plain_decoding(root, leaky, prompts, leaky_plain, oracle, name, speculation):
    heads, _ = oracle  # built for the exact bigram: partly right on the leaky target
    head = write_layout(root / f"greedy-{name}", name, heads)
    eng = engine(tiny_config(leaky, "medusa", k=K, draft_dir=head,
                             speculation="auto" if speculation == "k-every-step" else "fixed"))
    picked = draw_k_every_step(eng, K, seed=2) if speculation == "k-every-step" else None
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == leaky_plain
    drafted = sum(o.spec.num_draft_tokens for o in outs)
    assert 0 < sum(o.spec.num_accepted_tokens for o in outs) < drafted  # accepted and rejected drafts
    assert eng.blocks.num_free == eng.blocks.num_blocks
    if picked is not None:
        assert set(picked) == set(range(K + 1))


@pytest.mark.parametrize("speculation", ["fixed", "k-every-step"])
@pytest.mark.parametrize("name", ["medusa", "vllm"])
def test_heads_that_predict_the_target_are_accepted(root, exact_bigram, prompts, oracle, name, speculation):
    heads, chains = oracle
    expected = run(engine(tiny_config(exact_bigram)), prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert chains == expected  # the heads were built from the target's own greedy choices
    head = write_layout(root / f"oracle-{name}", name, heads)
    eng = engine(tiny_config(exact_bigram, "medusa", k=K, draft_dir=head,
                             speculation="auto" if speculation == "k-every-step" else "fixed"))
    picked = draw_k_every_step(eng, K, seed=5) if speculation == "k-every-step" else None
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == expected
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert 0 < accepted == sum(o.spec.num_draft_tokens for o in outs)  # every draft of an exact head
    if picked is None:
        assert 1 + accepted / sum(o.spec.num_drafts for o in outs) > K  # K drafts from one hidden state
    else:
        assert set(picked) == set(range(K + 1))
    assert eng.blocks.num_free == eng.blocks.num_blocks


# --------------------------------------------------------------------------- probabilistic verification

V_SMALL = 16
PROMPT = [5, 9, 3, 12, 7]
N = 4000


@pytest.fixture(scope="module")
def small(root):
    tdir = make_tiny_model(root / "small-target", "llama", seed=5, vocab_size=V_SMALL, num_key_value_heads=4)
    return tdir, load_model(str(tdir), "float32", torch.device("cpu"))


def exact_marginals(target_dir: Path, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """P(second output token) and P(third) of plain sampling after PROMPT, by enumerating
    the first two tokens through the transformers model of the same checkpoint."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float64).eval()

    def last(ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, V) next-token distributions
        with torch.no_grad():
            return torch.softmax(m(ids).logits[:, -1] / temperature, -1)

    p1 = last(torch.tensor([PROMPT]))[0]  # (V,)
    t1 = torch.arange(V_SMALL)
    c2 = last(torch.cat([torch.tensor(PROMPT).expand(V_SMALL, -1), t1[:, None]], 1))  # (V: t1, V: t2)
    pairs = torch.cartesian_prod(t1, t1)  # (V*V, 2): (t1, t2)
    c3 = last(torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], 1)).view(V_SMALL, V_SMALL, V_SMALL)
    p2 = p1 @ c2
    p3 = torch.einsum("a,ab,abc->c", p1, c2, c3)
    return p2, p3


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


@pytest.mark.parametrize("name", ["medusa", "vllm-truncated-vocab"])
def test_sampled_drafts_keep_the_target_distribution(root, small, name):
    tdir, target = small
    heads = random_heads(2, 1, seed=8, rows=V_SMALL)
    layout, kw = LAYOUTS[name]
    token_map = torch.tensor([0, 2, 3, 5, 7, 8, 9, 11, 12, 14]) if "truncated" in kw else None
    if token_map is not None:
        heads = [Head(hd.blocks, hd.lm[token_map]) for hd in heads]
    head = write_medusa(root / f"prob-{name}", layout, heads, token_map=token_map,
                        config_over={"vocab_size": V_SMALL} if layout == "vllm" else None)
    cfg = tiny_config(tdir, "medusa", k=2, draft_dir=head, num_blocks=4096, rejection_sample_method="probabilistic")
    cfg.engine.max_num_seqs = 512
    eng = LLMEngine(cfg, target=target)
    drafted = []
    propose = eng.proposer.propose

    def spy(reqs, step=None):
        prop = propose(reqs, step)
        if prop.probs is not None:
            for r, toks, q in zip(reqs, prop.token_ids, prop.probs):
                if r.max_drafts > 0 and toks:
                    drafted.append((toks, q[: len(toks)].clone()))
        return prop

    eng.proposer.propose = spy
    outs = eng.generate([PROMPT] * N, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i)
                                       for i in range(N)])
    samples = [o.token_ids for o in outs]
    assert all(len(s) == 3 for s in samples)
    # q is a distribution over the target's vocabulary, the drafts lie in its support (in
    # the token map's ids when there is one), and they were sampled (several distinct)
    assert drafted
    for toks, q in drafted[:50]:
        assert torch.allclose(q.sum(-1), torch.ones(len(toks)), atol=1e-5)
        assert all(float(q[i, t]) > 0 for i, t in enumerate(toks))
        if token_map is not None:
            assert set(toks) <= set(token_map.tolist())
    assert len({toks[0] for toks, _ in drafted}) > 1
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert 0 < accepted < sum(o.spec.num_draft_tokens for o in outs)

    p2, p3 = exact_marginals(tdir, 1.0)
    c2 = torch.bincount(torch.tensor([s[1] for s in samples]), minlength=V_SMALL).double()
    c3 = torch.bincount(torch.tensor([s[2] for s in samples]), minlength=V_SMALL).double()
    # sampling noise at N=4000 on 16 outcomes is about 0.02-0.03 in total variation
    assert tv(c2, p2) < 0.05 and tv(c3, p3) < 0.05, (tv(c2, p2), tv(c3, p3))
    # ... while the drafts' own distributions are far from the target's, so a q other than
    # the one each draft was drawn from (another head's, another column's) would show above
    q1 = torch.stack([q[0] for _, q in drafted]).double().mean(0)
    q2 = torch.stack([q[1] for toks, q in drafted if len(toks) > 1]).double().mean(0)
    assert 0.5 * float((q1 - p2).abs().sum()) > 0.15 and 0.5 * float((q2 - p3).abs().sum()) > 0.15


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("name", ["medusa", "vllm-original-lm-head", "vllm-truncated-vocab"])
def test_memory_declaration_counts_the_loaded_weights(root, exact_bigram, name):
    head = write_layout(root / f"memory-{name}", name, random_heads(4, 2, seed=6))
    model, _ = load_medusa(str(head), "method.model", H, V)
    loaded = sum(p.numel() * 4 for p in model.parameters())
    arch = load_model(str(exact_bigram), "float32", torch.device("cpu")).arch
    engine_cfg = EngineConfig(max_num_seqs=8)
    spec = tiny_config(exact_bigram, "medusa", k=3, draft_dir=head).method
    needs = memory(spec, TargetShape(arch=arch, dtype_bytes=4, max_model_len=512), engine_cfg, None)
    assert needs.weight_bytes == loaded and needs.aux_layers == 1 and needs.draft_probs_bytes == 0
    spec.rejection_sample_method = "probabilistic"
    needs = memory(spec, TargetShape(arch=arch, dtype_bytes=4, max_model_len=512), engine_cfg, None)
    assert needs.draft_probs_bytes == 8 * 3 * V * 4


# --------------------------------------------------------------------------- bad heads


def _one_line_error(cls, target_dir: Path, head: Path, k: int = 2) -> str:
    with pytest.raises(cls) as e:
        engine(tiny_config(target_dir, "medusa", k=k, draft_dir=head))
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_bad_heads_fail_in_one_line(root, exact_bigram):
    heads = random_heads(3, 1, seed=9)
    t = exact_bigram

    msg = _one_line_error(ConfigError, t, write_layout(root / "bad-k", "medusa", heads), k=4)
    assert msg == "method.num_speculative_tokens: 4 exceeds the Medusa checkpoint's 3 heads; use K <= 3"

    for layout, key, spelled in (("medusa", "medusa_num_heads", "'medusa_num_heads' or 'num_heads'"),
                                 ("vllm", "num_hidden_layers", "'medusa_num_layers' or 'num_hidden_layers'")):
        head = write_medusa(root / f"bad-no-{key}", layout, heads)
        cfg = json.loads((head / "config.json").read_text())
        del cfg[key]
        (head / "config.json").write_text(json.dumps(cfg))
        msg = _one_line_error(ConfigError, t, head)
        assert msg == f"method.model: {head}/config.json lacks {spelled}: not a Medusa checkpoint"
    assert _one_line_error(ConfigError, t, t).endswith("lacks 'medusa_num_heads' or 'num_heads': not a Medusa "
                                                       "checkpoint")  # a plain model directory

    msg = _one_line_error(ConfigError, t, write_medusa(root / "bad-hidden-config", "vllm", random_heads(3, 1, 9, 32)))
    assert msg == "method.model: the Medusa heads' hidden_size 32 differs from the target's hidden size 64"
    msg = _one_line_error(ConfigError, t, write_medusa(root / "bad-hidden", "medusa", random_heads(3, 1, 9, 32)))
    assert msg == ("method.model: the Medusa heads' hidden size (medusa_head.0.0.linear.weight is [32, 32]) differs "
                   "from the target's hidden size 64")

    msg = _one_line_error(ConfigError, t, write_medusa(root / "bad-vocab-config", "vllm", heads,
                                                       config_over={"vocab_size": 600}))
    assert msg == "method.model: the Medusa heads' vocab_size 600 differs from the target's 512"
    msg = _one_line_error(ConfigError, t, write_medusa(root / "bad-vocab", "medusa",
                                                       random_heads(3, 1, seed=9, rows=500)))
    assert msg == ("method.model: the Medusa LM head medusa_head.0.1.weight has 500 rows; the target's vocabulary "
                   "has 512")

    msg = _one_line_error(ModelLoadError, t, write_medusa(root / "bad-missing", "medusa", heads,
                                                          drop=("medusa_head.2.0.linear.bias",)))
    assert msg.endswith("the Medusa checkpoint lacks 'medusa_head.2.0.linear.bias' (config.json: 3 heads of "
                        "1 layers)")
    msg = _one_line_error(ModelLoadError, t, write_medusa(root / "bad-missing-vllm", "vllm", heads, fmt="bin",
                                                          drop=("medusa_heads.lm_heads.1.weight",)))
    assert msg.endswith("the Medusa checkpoint lacks 'medusa_heads.lm_heads.1.weight' (config.json: 3 heads of "
                        "1 layers)")
    msg = _one_line_error(ModelLoadError, t, write_medusa(root / "bad-no-token-map", "vllm",
                                                          [Head(h.blocks, h.lm[:300]) for h in heads],
                                                          config_over={"truncated_vocab_size": 300}))
    assert msg.endswith("the Medusa checkpoint lacks 'token_map' (config.json: 3 heads of 1 layers)")
    empty = root / "bad-empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    assert "holds no Medusa weights" in _one_line_error(ModelLoadError, t, empty)

"""The device memory budget (``specserve.engine.memory``) checked on the CPU with meta tensors.

Llama-3.1-8B- and Qwen3-8B-shaped targets (weights on the meta device: no memory) on an
80 GB device, max_num_seqs 32/128/256, K 4/16, every method: the parts and the KV cache
add up to at most the budget; each method's declared cache bytes equal what its caches
allocate when it is built on the meta device; the graph-output term is the largest
graph's output (one buffer shared by every graph); verification's factor is what
verify_step allocates; a configuration that cannot fit fails with one line naming the
key to change; the CPU keeps its KV size; layer_skip allocates no cache while serving.
"""

from __future__ import annotations

import json
import logging
import weakref
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, random_prompts, tiny_config
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoConfig

from specserve.config import Config, EngineConfig, ModelConfig
from specserve.engine import memory as M
from specserve.engine.engine import LLMEngine, memory_budget
from specserve.errors import ConfigError
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel
from specserve.executor.models.eagle import EagleHead, HeadConfig
from specserve.executor.models.llama import ArchConfig, LlamaModel, Rotary
from specserve.methods import get_method, method_options
from specserve.proposers.base import ProposerContext, TargetShape, build_proposer, memory_needs

GB = 10**9
DEVICE = M.DeviceFigures(total_bytes=80 * GB)
MAX_LEN = 8192

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False}
LLAMA_1B = {**LLAMA_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "tie_word_embeddings": True}
TARGETS = {"llama-3.1-8b": LLAMA_8B, "qwen3-8b": QWEN3_8B}
METHODS = ("none", "ngram", "suffix", "draft_model", "eagle3", "mtp", "mlp_speculator", "dflash", "layer_skip")


# ---------------------------------------------------------------- checkpoints without data
def write_header_only(d: Path, tensors: dict[str, tuple[list[int], str]]) -> None:
    """A valid safetensors file whose data is a hole (sparse): shapes for the headers,
    no disk or memory spent on the bytes."""
    size = {"BF16": 2, "F32": 4, "I64": 8, "BOOL": 1}
    header, at = {}, 0
    for name, (shape, dtype) in tensors.items():
        n = size[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(d / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + at)


def decoder_layer_tensors(prefix: str, c: dict, in_features: int | None = None, qk_norm: bool = False) -> dict:
    H, I = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv, i = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, in_features or H
    t = {f"{prefix}self_attn.q_proj.weight": [q, i], f"{prefix}self_attn.k_proj.weight": [kv, i],
         f"{prefix}self_attn.v_proj.weight": [kv, i], f"{prefix}self_attn.o_proj.weight": [H, q],
         f"{prefix}mlp.gate_proj.weight": [I, H], f"{prefix}mlp.up_proj.weight": [I, H],
         f"{prefix}mlp.down_proj.weight": [H, I], f"{prefix}input_layernorm.weight": [H],
         f"{prefix}post_attention_layernorm.weight": [H]}
    if qk_norm:
        t[f"{prefix}self_attn.q_norm.weight"] = [hd]
        t[f"{prefix}self_attn.k_norm.weight"] = [hd]
    return {k: (v, "BF16") for k, v in t.items()}


def write_json(d: Path, cfg: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """Targets (config + a header-only DeepSeek-style MTP layer), a 1B draft, an EAGLE-3
    head for Llama-3.1-8B, an MLP speculator and a DFlash drafter per target."""
    root = tmp_path_factory.mktemp("shapes")
    out = {}
    for name, c in TARGETS.items():
        d = write_json(root / name, {**c, "num_nextn_predict_layers": 1})
        L, H = c["num_hidden_layers"], c["hidden_size"]
        p = f"model.layers.{L}."
        mtp = decoder_layer_tensors(p, c, qk_norm=c["model_type"] == "qwen3")
        mtp.update({p + "enorm.weight": ([H], "BF16"), p + "hnorm.weight": ([H], "BF16"),
                    p + "eh_proj.weight": ([H, 2 * H], "BF16"), p + "shared_head.norm.weight": ([H], "BF16")})
        write_header_only(d, mtp)
        out[name] = d
        mlp = write_json(root / f"{name}-mlp", {"model_type": "mlp_speculator", "emb_dim": H, "inner_dim": 3072,
                                                "n_predict": 16, "vocab_size": c["vocab_size"], "tie_weights": False})
        out[f"{name}-mlp"] = mlp
        ids = [1, L // 4, L // 2, 3 * L // 4, L - 3]
        dcfg = {**QWEN3_8B, "architectures": ["DFlashDraftModel"], "num_hidden_layers": 5, "block_size": 17,
                "vocab_size": c["vocab_size"], "dflash_config": {"mask_token_id": 0, "target_layer_ids": ids}}
        df = write_json(root / f"{name}-dflash", dcfg)
        t = {"fc.weight": ([H, len(ids) * H], "BF16"), "hidden_norm.weight": ([H], "BF16"),
             "norm.weight": ([H], "BF16")}
        for i in range(5):
            t.update(decoder_layer_tensors(f"layers.{i}.", dcfg, qk_norm=True))
        write_header_only(df, t)
        out[f"{name}-dflash"] = df
    out["draft-1b"] = write_json(root / "llama-3.2-1b", LLAMA_1B)
    head = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "draft_vocab_size": 32000, "target_hidden_size": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 131072, "num_hidden_layers": 1}
    d = write_json(root / "eagle3-llama-3.1-8b", head)
    t = decoder_layer_tensors("midlayer.", head, in_features=2 * 4096)
    t.update({"fc.weight": ([4096, 3 * 4096], "BF16"), "midlayer.hidden_norm.weight": ([4096], "BF16"),
              "norm.weight": ([4096], "BF16"), "lm_head.weight": ([32000, 4096], "BF16"),
              "d2t": ([32000], "I64"), "t2d": ([128256], "BOOL")})
    write_header_only(d, t)
    out["eagle3"] = d
    return out


def meta_model(c: dict, max_positions: int = 1) -> LlamaModel:
    """A LlamaModel of config ``c`` with bf16 weights and float32 rotary tables on the meta
    device (built with the default rope: llama3's initialiser cannot run there)."""
    hf = AutoConfig.for_model(**{**c, "rope_scaling": None})
    with torch.device("meta"):
        model = LlamaModel(ArchConfig.from_hf(hf), hf, 1).to(torch.bfloat16)
        model.rotary = Rotary(hf, max_positions)
    return model


def meta_target(name: str, d: Path) -> LoadedModel:
    """The target with its weights on the meta device (its rotary tables real: they are small)."""
    hf = AutoConfig.from_pretrained(str(d))
    arch = ArchConfig.from_hf(hf)
    model = meta_model(TARGETS[name])
    model.rotary = Rotary(hf, MAX_LEN)
    return LoadedModel(model=model, arch=arch, hf_config=hf, tokenizer=None, hf_dir=d, dtype=torch.bfloat16,
                       device=torch.device("meta"), max_model_len=MAX_LEN, eos_token_ids=(0,))


@pytest.fixture(scope="module")
def targets(dirs) -> dict[str, LoadedModel]:
    return {name: meta_target(name, dirs[name]) for name in TARGETS}


def config(name: str, dirs, method: str, B: int, K: int, **spec) -> Config:
    e = EngineConfig(device="cuda", max_num_seqs=B, block_size=16)
    cfg = Config(model=ModelConfig(name=name, path=str(dirs[name]), dtype="bfloat16", max_model_len=MAX_LEN),
                 engine=e)
    model = {"draft_model": dirs["draft-1b"], "eagle3": dirs["eagle3"], "mlp_speculator": dirs[f"{name}-mlp"],
             "dflash": dirs[f"{name}-dflash"]}.get(method)
    if method != "none":
        cfg.method = method_options(method, num_speculative_tokens=K, model=str(model) if model else None, **spec)
    else:
        e.num_prediction_tokens = K  # Predicted Outputs: K drafts without a method
    return cfg


def budget(cfg: Config, target: LoadedModel, device=DEVICE) -> M.MemoryBudget:
    spec, e = cfg.method, cfg.engine
    k = spec.num_speculative_tokens if spec is not None else e.num_prediction_tokens
    extra = get_method(spec.method).kv_layers if spec is not None else 0
    return memory_budget(cfg, target, k, graphs=True, static=True, extra_layers=extra, device=device)


# ---------------------------------------------------------------- the budget adds up
def suggested(e: ConfigError) -> int:
    return int(str(e).split("lower it to about ")[1].split(",")[0])


@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize("B", [32, 128, 256])
@pytest.mark.parametrize("K", [4, 16])
def test_every_part_fits_the_device_budget(dirs, targets, name, B, K):
    """Every method fits at 32 sequences; where more do not fit, the error names
    engine.max_num_seqs in one line, and the value it suggests fits."""
    target = targets[name]
    a = target.arch
    for method in METHODS:
        if method == "eagle3" and name != "llama-3.1-8b":
            continue  # the head is Llama-3.1-8B's
        cfg = config(name, dirs, method, B, K)
        try:
            mem = budget(cfg, target)
        except ConfigError as e:
            assert B > 32 and e.key == "engine.max_num_seqs" and "\n" not in str(e), str(e)
            cfg.engine.max_num_seqs = suggested(e)
            assert 1 <= cfg.engine.max_num_seqs < B
            mem = budget(cfg, target)
        assert mem.total_bytes <= mem.budget_bytes == int(0.9 * 80 * GB), (method, mem.line())
        assert mem.num_blocks * 16 >= MAX_LEN + K, method  # at least one longest request
        # the target's weights: the 8B models' published parameter counts, in bf16, plus rotary tables
        params = {"llama-3.1-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360}[name]
        assert mem.parts["weights"] == 2 * params + M.rotary_bytes(128, MAX_LEN)
        # graph outputs: the largest graph's (max_num_seqs x (K+1) rows), shared by all
        aux = {"none": 0, "ngram": 0, "suffix": 0, "draft_model": 0, "layer_skip": 0, "eagle3": 3, "mtp": 1,
               "mlp_speculator": 1, "dflash": 5}[method]
        rows = cfg.engine.max_num_seqs * (K + 1)
        assert mem.parts["graph outputs"] == rows * (a.vocab_size * 4 + a.hidden_size * 2 * (1 + aux))
        assert mem.parts["verification"] >= rows * a.vocab_size * M.VERIFY_BYTES_PER_LOGIT
        kv = mem.kv_per_block
        assert kv["target"] == (a.num_layers + (method == "eagle3")) * 2 * 16 * 8 * 128 * 2
        # (layers, head_dim) of its own caches: the 1B draft's 16 (head_dim 64), one MTP layer, DFlash's 5 and
        # one more for its context gather, the kept half of the target's layers
        own = {"draft_model": (16, 64), "mtp": (1, 128), "dflash": (5 + 1, 128),
               "layer_skip": (a.num_layers - round(0.5 * a.num_layers), 128)}
        layers, hd = own.get(method, (0, 128))
        assert kv["proposer"] == layers * 2 * 16 * 8 * hd * 2, method


def test_graph_outputs_shared_versus_one_set_per_graph(dirs, targets):
    """Llama-3.1-8B, max_num_seqs 128, no method, K = num_prediction_tokens = 16: one set
    of outputs per captured graph was 7.7 GiB live; the shared buffer is the largest's."""
    from specserve.executor.batch import draft_sizes
    from specserve.executor.static_runner import batch_buckets

    a = targets["llama-3.1-8b"].arch
    mem = budget(config("llama-3.1-8b", dirs, "none", 128, 16), targets["llama-3.1-8b"])
    qs = (1, *(k + 1 for k in draft_sizes(16)))
    per_graph = sum(M.graph_output_bytes(b * q, a, 2) for b in batch_buckets(128) for q in qs)
    assert round(per_graph / M.GIB, 1) == 7.7
    assert mem.parts["graph outputs"] == M.graph_output_bytes(128 * 17, a, 2) == 128 * 17 * (128256 * 4 + 4096 * 2)


def test_a_configuration_that_cannot_fit_names_the_key(dirs, targets):
    """Qwen3-8B, 256 sequences, 16 predicted drafts: verifying 256 x 17 x 151936 logits
    takes about 40 GiB of temporaries alone."""
    target = targets["qwen3-8b"]
    cfg = config("qwen3-8b", dirs, "none", 256, 16)
    with pytest.raises(ConfigError) as e:
        budget(cfg, target)
    assert e.value.key == "engine.max_num_seqs" and "\n" not in str(e.value)
    assert "256 does not fit" in str(e.value) and "verification 40.03" in str(e.value)
    assert "0.9 x 74.51 GiB = 67.06 GiB" in str(e.value)  # the numbers are in the line
    cfg.engine.max_num_seqs = suggested(e.value)
    assert budget(cfg, target).num_blocks > 0
    cfg.engine.gpu_memory_utilization = 0.2  # 14.9 GiB: less than the weights alone
    with pytest.raises(ConfigError) as e:
        budget(cfg, target)
    assert e.value.key == "engine.gpu_memory_utilization" and "0.2 does not fit" in str(e.value)


# ---------------------------------------------------------------- each method's caches, as built
class KVSpy:
    """Every KVCache constructed while active: (layers, blocks, bytes)."""

    def __init__(self, monkeypatch):
        self.made: list[tuple[int, int, int]] = []
        init = KVCache.__init__

        def spy(cache, num_layers, num_blocks, *a, **k):
            init(cache, num_layers, num_blocks, *a, **k)
            self.made.append((num_layers, num_blocks, cache.data.numel() * cache.data.element_size()))

        monkeypatch.setattr(KVCache, "__init__", spy)

    @property
    def bytes(self) -> int:
        return sum(b for _, _, b in self.made)


def build_on_meta(method: str, cfg: Config, target: LoadedModel, dirs, name: str, num_blocks: int):
    """The method's proposer over a meta target, built as its builder builds it, minus
    reading weights: modules made on the meta device from the same configs."""
    from specserve.proposers.dflash import DFlashCheckpoint, DFlashDraft, DFlashProposer
    from specserve.proposers.draft_model import DraftModelProposer
    from specserve.proposers.eagle import _head_kv
    from specserve.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorProposer
    from specserve.proposers.mtp import MTPLayer, MTPProposer

    spec, e, a = cfg.method, cfg.engine, target.arch
    k, bs = spec.num_speculative_tokens, e.block_size
    engine_kv = KVCache(a.num_layers + get_method(method).kv_layers, num_blocks, bs, a.num_kv_heads, a.head_dim,
                        target.dtype, target.device)
    ctx = ProposerContext(target=target, draft_model=None, engine=e, num_kv_blocks=num_blocks, kv=engine_kv)
    if method in ("ngram", "suffix", "layer_skip"):
        return build_proposer(spec, ctx), ()
    if method == "draft_model":
        model = meta_model(LLAMA_1B, MAX_LEN)
        hf = AutoConfig.from_pretrained(str(dirs["draft-1b"]))
        draft = LoadedModel(model, ArchConfig.from_hf(hf), hf, None, dirs["draft-1b"], torch.bfloat16,
                            torch.device("meta"), MAX_LEN, (0,))
        return DraftModelProposer(draft, k, num_blocks, bs, max_num_seqs=e.max_num_seqs), (model,)
    if method == "eagle3":
        c = HeadConfig(kind="eagle3", hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                       head_dim=128, rms_norm_eps=1e-5, vocab_size=128256, draft_vocab_size=32000,
                       target_hidden_size=4096, aux_layer_ids=(2, 16, 29),
                       rope_config=AutoConfig.from_pretrained(str(dirs["eagle3"])))
        with torch.device("meta"):
            head = EagleHead(c, 1)
            head.lm_head = nn.Linear(4096, 32000, bias=False)
            head = head.to(torch.bfloat16)
            head.draft_to_target = torch.zeros(32000, dtype=torch.int64)
            head.rotary = Rotary(c.rope_config, MAX_LEN + k + 1)
        _head_kv(ctx, head)  # the engine's extra layer (its shape matches)
        return head, (head,)
    if method == "mtp":
        qwen = a.model_type == "qwen3"
        with torch.device("meta"):
            layers = nn.ModuleList([MTPLayer(a, 0, "deepseek", own_head=False)])
        assert layers[0].block.q_norm is not None if qwen else True
        return MTPProposer(target, layers, k, num_blocks, bs, probabilistic=False), (layers,)
    if method == "mlp_speculator":
        with torch.device("meta"):
            model = MLPSpeculator(a.hidden_size, 3072, a.vocab_size, 16, False)
        return MLPSpeculatorProposer(model, target, k, False), (model,)
    if method == "dflash":
        d = dirs[f"{name}-dflash"]
        hf = AutoConfig.from_pretrained(str(d))
        with torch.device("meta"):
            model = DFlashDraft(ArchConfig.from_hf(hf), hf, 5, a.hidden_size, MAX_LEN + 17)
        ids = json.loads((d / "config.json").read_text())["dflash_config"]["target_layer_ids"]
        return DFlashProposer(DFlashCheckpoint(model, 17, 0, ids), target, k, num_blocks, bs, False), (model,)
    raise AssertionError(method)


@pytest.mark.parametrize("method", METHODS[1:])
def test_declared_bytes_are_what_the_proposer_allocates(dirs, targets, method, monkeypatch):
    """Built on the meta device, each proposer's caches hold exactly its declared KV bytes
    per block (x the blocks + the trash block) and its modules its declared weights."""
    name = "llama-3.1-8b" if method in ("eagle3", "draft_model") else "qwen3-8b"
    target, blocks = targets[name], 1000
    cfg = config(name, dirs, method, 32, 4)
    shape = TargetShape(target.arch, 2, MAX_LEN, target.hf_dir, cuda=True, cuda_graphs=True)
    needs = memory_needs(cfg.method, shape, cfg.engine, cfg.draft)
    spy = KVSpy(monkeypatch)
    proposer, modules = build_on_meta(method, cfg, target, dirs, name, blocks)
    engine_cache = spy.made.pop(0)
    assert engine_cache[0] == target.arch.num_layers + get_method(method).kv_layers
    assert spy.bytes == needs.kv_bytes_per_block * (blocks + 1), spy.made
    assert needs.weight_bytes == sum(M.module_bytes(m) for m in modules)
    if method == "layer_skip":  # calibrating: the compact cache exists before any request
        assert [layers for layers, _, _ in spy.made] == [target.arch.num_layers // 2]
        assert proposer.inner is None


def test_a_head_with_its_own_attention_shape_declares_its_cache(dirs, targets, tmp_path, monkeypatch):
    """A head whose K/V shape differs from the target's keeps a one-layer cache of its own:
    declared, and equal to what ``_head_kv`` allocates."""
    from specserve.proposers.eagle import _head_kv

    d = tmp_path / "head4"
    d.mkdir()
    head_cfg = json.loads((dirs["eagle3"] / "config.json").read_text())
    write_json(d, {**head_cfg, "num_key_value_heads": 4})
    t = decoder_layer_tensors("midlayer.", {**head_cfg, "num_key_value_heads": 4}, in_features=2 * 4096)
    t.update({"fc.weight": ([4096, 3 * 4096], "BF16"), "midlayer.hidden_norm.weight": ([4096], "BF16"),
              "norm.weight": ([4096], "BF16"), "lm_head.weight": ([32000, 4096], "BF16"), "d2t": ([32000], "I64")})
    write_header_only(d, t)
    target = targets["llama-3.1-8b"]
    cfg = config("llama-3.1-8b", dirs, "eagle3", 32, 4)
    cfg.method.model = str(d)
    needs = memory_needs(cfg.method, TargetShape(target.arch, 2, MAX_LEN), cfg.engine)
    a = target.arch
    engine_kv = KVCache(a.num_layers + 1, 100, 16, a.num_kv_heads, a.head_dim, target.dtype, target.device)
    ctx = ProposerContext(target=target, draft_model=None, engine=cfg.engine, num_kv_blocks=100, kv=engine_kv)
    c = HeadConfig(kind="eagle3", hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=4,
                   head_dim=128, rms_norm_eps=1e-5, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096,
                   aux_layer_ids=(2, 16, 29), rope_config=AutoConfig.from_pretrained(str(d)))
    with torch.device("meta"):
        head = EagleHead(c, 1)
    spy = KVSpy(monkeypatch)
    _head_kv(ctx, head)
    assert spy.bytes == needs.kv_bytes_per_block * 101 == 2 * 16 * 4 * 128 * 2 * 101


# ---------------------------------------------------------------- the arithmetic against the allocations
def test_runner_and_sampler_buffers_match_their_allocations(targets):
    from specserve.executor.staging import Transfer
    from specserve.executor.static_runner import StaticStepRunner
    from specserve.kernels.paged_attention import make_split_scratch
    from specserve.sampling.sampler import DeviceSampler

    class NoEvents(Transfer):
        def event(self):
            return None

    target = targets["qwen3-8b"]
    a = target.arch
    kv = KVCache(a.num_layers, 10, 16, a.num_kv_heads, a.head_dim, target.dtype, target.device)
    B, K = 128, 16
    runner = StaticStepRunner(target, kv, max_num_seqs=B, max_num_tokens=2048, graph_query_lens=(1, K + 1),
                              aux_layer_ids=(2, 18, 33), use_graphs=False, transfer=NoEvents())
    split = make_split_scratch(M.SPLIT_KV_SPLITS, B, a.num_heads, a.head_dim, target.device)
    dev = runner.staging.dev.nbytes + sum(t.nbytes for t in split)
    assert dev == M.runner_buffer_bytes(B, runner.max_tokens, MAX_LEN, 16, a.num_heads, a.head_dim)
    out = runner.alloc_outputs()
    got = out.logits.nbytes + out.hidden.nbytes + sum(t.nbytes for t in out.aux.values())
    assert got == M.graph_output_bytes(B * (K + 1), a, 2, num_aux=3)
    sampler = DeviceSampler(B, K, torch.device("meta"), transfer=NoEvents())
    assert sampler._staging.dev.nbytes == M.sampler_buffer_bytes(B, K)


def test_a_heads_eager_forward_on_the_kernel_allocates_its_declared_arguments_and_no_padded_keys():
    """A mixed step of the largest shape (a 2017-token prompt chunk beside 31 decode rows,
    every context 8192 long), as an EAGLE head or MTP forward builds it on CUDA
    (``attention.kernel_metadata``): its tensors are ``kernel_args_bytes``, no gathered
    keys and no mask (the reference attention's padded group would be 32 x 2017 x 8192)."""
    from specserve.executor.attention import kernel_metadata
    from specserve.executor.batch import StepBatch

    B, T, L, bs = 32, 2048, MAX_LEN, 16
    chunk = T - (B - 1)
    starts = [0] + [chunk + i for i in range(B)]
    batch = StepBatch(
        token_ids=[0] * T, positions=list(range(L - chunk, L)) + [L - 1] * (B - 1), slot_mapping=[0] * T,
        query_start=starts, seq_lens=[L] * B, block_tables=[list(range(L // bs))] * B, logits_rows=[],
        row_offsets=[0] * B, num_drafts=[0] * B,
    )
    meta, pos = kernel_metadata(batch, bs, torch.device("meta"), "triton")
    k = meta.kernel
    assert meta.padded is None and not meta.causal and k.max_query_len == chunk and k.max_seq_len == L
    tensors = (meta.slot_mapping, pos, k.block_tables, k.query_start, k.seq_lens)
    assert sum(t.nbytes for t in tensors) == M.kernel_args_bytes(B, T, L, bs)


def test_every_graph_writes_into_one_output_buffer(tiny_llama):
    """What capture does for each (bucket, q), run eagerly on the CPU: the step writes
    its logits, hidden and aux states into the shared buffers (the same storage for
    every shape) and they equal the step's own outputs."""
    from specserve.executor.loader import load_model
    from specserve.executor.static_runner import StaticStepRunner

    model = load_model(str(tiny_llama), "float32", torch.device("cpu"), max_model_len=128)
    a = model.arch
    kv = KVCache(a.num_layers, 32, 4, a.num_kv_heads, a.head_dim, model.dtype, model.device)
    static = StaticStepRunner(model, kv, max_num_seqs=4, max_num_tokens=32, graph_query_lens=(1, 3),
                              aux_layer_ids=(1, a.num_layers), attention_impl="torch", use_graphs=False)
    out = static.alloc_outputs()
    assert out.logits.shape == (4 * 3, a.vocab_size) and out.logits.dtype == torch.float32
    with torch.inference_mode():
        for bucket, q in [(4, 3), (2, 3), (4, 1), (1, 1)]:  # largest first, as captured
            static._stage(static._dummy_batch(bucket, q), bucket, bucket * q)
            static._upload()
            ref = static.step_fn(bucket, bucket * q, q, None)
            got = static.step_fn(bucket, bucket * q, q, None, out)
            assert got.logits.data_ptr() == out.logits.data_ptr() and got.hidden.data_ptr() == out.hidden.data_ptr()
            assert all(got.aux[i].data_ptr() == out.aux[i].data_ptr() for i in (1, a.num_layers))
            torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=0)
            torch.testing.assert_close(got.hidden, ref.hidden, rtol=0, atol=0)
            for i in (1, a.num_layers):
                torch.testing.assert_close(got.aux[i], ref.aux[i], rtol=0, atol=0)


def test_decoder_weights_are_llama_models_parameters(dirs):
    for c in (LLAMA_8B, QWEN3_8B, LLAMA_1B):
        model = meta_model(c)
        params = sum(p.numel() for p in model.parameters())
        assert M.decoder_weight_bytes(model.a, 2) == 2 * params
    assert params == 1_235_814_400  # Llama-3.2-1B


class LiveBytes(TorchDispatchMode):
    """The peak of bytes held by tensors created inside (freed ones leave when their storage dies)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.ids: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.ids.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if id(st) not in self.ids:
                    n = st.nbytes()
                    self.ids.add(id(st))
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, id(st), n)
        return out


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_verification_factor_is_what_verify_step_allocates(method):
    """verify_step's temporaries at their peak, with every filter on and greedy rows mixed
    in, per logit of the (B*(K+1), V) rows: the budget's factor (less the controls'
    copy, made outside verify_step)."""
    from specserve.sampling.sampler import RequestTensors, SamplerFlags, verify_step

    B, K, V = 6, 4, 20000
    N = B * (K + 1)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g)
    req = RequestTensors.build([0.0, 0.7, 1.0, 0.0, 0.5, 1.2], [50] * B, [0.9] * B, [0.05] * B, list(range(B)),
                               [3] * B)
    req.flags = SamplerFlags.conservative()
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1) if method == "probabilistic" else None
    has_q = torch.tensor([True, False] * (B // 2)) if q is not None else None
    spy = LiveBytes()
    with spy:
        verify_step(logits, torch.arange(N).view(B, K + 1), torch.randint(0, V, (B, K), generator=g),
                    torch.full((B,), K), req, method=method, draft_probs=q, draft_has_q=has_q, use_kernel=False)
    visible = M.VERIFY_STEP_BYTES_PER_LOGIT * N * V
    assert 0.95 * visible <= spy.peak <= visible + 64 * 1024


def test_the_cuda_profile_runs_on_a_device_double(tiny_llama, monkeypatch):
    """profile_cuda_memory with torch.cuda's memory counters answered by the live-bytes
    meter: the step with logits at every row and the verification of max_num_seqs x
    (K+1) sampled rows are what it measures."""
    from specserve.executor.loader import load_model
    from specserve.executor.device_profile import profile_cuda_memory

    model = load_model(str(tiny_llama), "float32", torch.device("cpu"), max_model_len=64)
    meter = LiveBytes()
    counters = {"mem_get_info": lambda d=None: (0, 80 * GB), "memory_allocated": lambda d=None: meter.live,
                "max_memory_allocated": lambda d=None: meter.peak, "synchronize": lambda d=None: None,
                "reset_peak_memory_stats": lambda d=None: setattr(meter, "peak", meter.live),
                "empty_cache": lambda: None}
    for name, fn in counters.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    with meter:
        p = profile_cuda_memory(model, 32, 4, max_num_seqs=4, k=3)
    V = model.arch.vocab_size
    assert p.total_bytes == 80 * GB and p.held_bytes == 0  # the weights were made before the meter
    assert p.activation_bytes >= 32 * V * 4  # float32 logits of all 32 rows
    visible = M.VERIFY_STEP_BYTES_PER_LOGIT * 4 * 4 * V
    assert 0.95 * visible <= p.verify_bytes <= visible + 64 * 1024


# ---------------------------------------------------------------- engines on the CPU
def test_the_cpu_keeps_its_kv_size_and_reports_the_breakdown(tiny_llama, tiny_draft, caplog):
    cfg = tiny_config(tiny_llama, "draft_model", k=3, draft_dir=tiny_draft)
    cfg.engine.num_kv_blocks = None
    with caplog.at_level(logging.INFO, logger="specserve.engine.engine"):
        eng = LLMEngine(cfg)
    a = eng.target.arch
    per_block = KVCache.bytes_per_block(a.num_layers, 4, a.num_kv_heads, a.head_dim, torch.float32)
    assert eng.memory_budget.num_blocks == eng.blocks.num_blocks == int(M.CPU_KV_CACHE_GIB * M.GIB) // per_block
    mem = eng.memory_budget.as_dict()
    d = eng.proposer.runner.loaded.arch
    assert mem["kv_bytes_per_block"] == {
        "target": per_block,
        "proposer": KVCache.bytes_per_block(d.num_layers, 4, d.num_kv_heads, d.head_dim, torch.float32)}
    assert mem["parts"]["weights"] == M.module_bytes(eng.target.model)
    assert mem["parts"]["draft weights"] == M.module_bytes(eng.proposer.runner.loaded.model) > 0
    assert mem["device_bytes"] is None
    assert [r.message for r in caplog.records if r.message.startswith("memory: ")] == [eng.memory_budget.line()]


def test_layer_skip_allocates_no_cache_while_serving(tiny_llama, monkeypatch):
    """The kept layers' cache exists once the engine is built; serving (calibration,
    the draft's build) allocates only calibration's scratch, within its declared size."""
    cfg = tiny_config(tiny_llama, "layer_skip", k=3, skip_ratio=0.5, skip_calibration_tokens=24)
    eng = LLMEngine(cfg)
    L = eng.target.arch.num_layers
    assert eng.proposer.kv.data.shape[0] == L - round(0.5 * L)
    spy = KVSpy(monkeypatch)
    eng.generate(random_prompts(3, seed=2, lo=10, hi=14), [greedy(6) for _ in range(3)])
    assert eng.proposer.inner is not None and eng.proposer.inner.runner.kv is eng.proposer.kv
    assert [layers for layers, _, _ in spy.made] == [L]  # calibration's scratch only
    from specserve.proposers.layer_skip import calibration_bytes

    assert spy.bytes <= calibration_bytes(eng.target.arch, 24, 4)

"""Tiny EAGLE / EAGLE-3 heads written in the published key layouts (for the tests).

Written here tensor by tensor under each layout's own names (not through
specserve's exporter), so loading them checks the readers against the formats:

  eagle         EAGLE-1/2 release: fc [H, 2H], layers.0.* (no input norm), no embeddings / LM head
  eagle3        EAGLE-3 release: midlayer.*, fc [H, 3H], norm, lm_head, d2t/t2d, draft_vocab_size
  specforge     SpecForge export: as eagle3 plus embed_tokens, architectures LlamaForCausalLMEagle3
  vllm-eagle3   vLLM-style: layers.0.* and architectures Eagle3LlamaForCausalLM
  speculators   speculators eagle3: transformer_layer_config, speculators_config, layers.0.*
  speculators-eagle  speculators eagle: fusion_fc, transformer.*, (layernorms)

``oracle=True`` builds heads that predict a bigram target exactly (see
``make_bigram_target``): EAGLE-1 copies the next token's embedding through fc and
the layer's residual; EAGLE-3 makes each head attend to its own row (q = k = a
large multiple of the normed embedding, v = the normed embedding) with a zero
hidden_norm and norm_before_residual, so its output is the next token's normed
embedding, and the target's LM head does the rest.  That head has one attention
head of width H (so every row's query meets its own key at the full norm of the
normed embedding): its cache shape differs from the target's, which also covers
the separate-cache path.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_models import make_tiny_model

TARGET = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=512,
              intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512)


def make_bigram_target(out: Path, leak: float = 0.0, seed: int = 0) -> Path:
    """A tiny llama whose attention and MLP outputs are scaled by ``leak``: with 0 the
    next token is a function of the current one (a bigram model)."""
    from safetensors.torch import load_file, save_file

    make_tiny_model(out, "llama", seed=seed, num_key_value_heads=4)
    f = out / "model.safetensors"
    sd = load_file(str(f))
    for k in list(sd):
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            sd[k] = sd[k] * leak
    save_file(sd, str(f), metadata={"format": "pt"})
    return out


def _layer_cfg(**over) -> dict:
    c = dict(TARGET, model_type="llama", num_hidden_layers=1, tie_word_embeddings=False)
    c.update(over)
    return c


def _rand(g, *shape, scale=0.2):
    return torch.randn(*shape, generator=g) * scale


def _eagle3_layer(g, H, I, nh, nkv, hd, oracle: bool, alpha: float = 30.0) -> dict[str, torch.Tensor]:
    q, kv = nh * hd, nkv * hd
    t = {
        "input_layernorm.weight": torch.ones(H),
        "hidden_norm.weight": torch.zeros(H) if oracle else 1 + _rand(g, H, scale=0.05),
        "post_attention_layernorm.weight": torch.ones(H),
        "self_attn.q_proj.weight": _rand(g, q, 2 * H), "self_attn.k_proj.weight": _rand(g, kv, 2 * H),
        "self_attn.v_proj.weight": _rand(g, kv, 2 * H), "self_attn.o_proj.weight": _rand(g, H, q),
        "mlp.gate_proj.weight": _rand(g, I, H), "mlp.up_proj.weight": _rand(g, I, H),
        "mlp.down_proj.weight": _rand(g, H, I),
    }
    if oracle:  # one head of width H (nh == nkv == 1, hd == H)
        eye = torch.eye(H)
        zero = torch.zeros(H, H)
        t["self_attn.q_proj.weight"] = torch.cat([alpha * eye, zero], 1)
        t["self_attn.k_proj.weight"] = torch.cat([alpha * eye, zero], 1)
        t["self_attn.v_proj.weight"] = torch.cat([eye, zero], 1)
        t["self_attn.o_proj.weight"] = eye.clone()
        t["mlp.down_proj.weight"] = torch.zeros(H, I)
    return t


def _eagle1_layer(g, H, I, nh, nkv, hd, oracle: bool, input_norm: bool) -> dict[str, torch.Tensor]:
    q, kv = nh * hd, nkv * hd
    t = {
        "post_attention_layernorm.weight": torch.ones(H),
        "self_attn.q_proj.weight": _rand(g, q, H), "self_attn.k_proj.weight": _rand(g, kv, H),
        "self_attn.v_proj.weight": _rand(g, kv, H), "self_attn.o_proj.weight": _rand(g, H, q),
        "mlp.gate_proj.weight": _rand(g, I, H), "mlp.up_proj.weight": _rand(g, I, H),
        "mlp.down_proj.weight": _rand(g, H, I),
    }
    if input_norm:
        t["input_layernorm.weight"] = torch.ones(H)
    if oracle:
        t["self_attn.o_proj.weight"] = torch.zeros(H, q)
        t["mlp.down_proj.weight"] = torch.zeros(H, I)
    return t


def write_head(
    out: Path, layout: str, *, seed: int = 0, oracle: bool = False, draft_vocab: int | None = None,
    aux_ids: list[int] | None = None, fmt: str = "safetensors", own_embed: bool | None = None,
    speculative_tokens: int = 5, verifier: str = "target", drop: tuple[str, ...] = (),
    config_over: dict | None = None, tensor_over: dict | None = None, target_lm_head: torch.Tensor | None = None,
    vocab: int | None = None,
) -> Path:
    """Write a head for a target shaped like ``TARGET`` in ``layout``.  An oracle EAGLE-3
    head with a reduced vocabulary takes its LM head rows from ``target_lm_head``."""
    g = torch.Generator().manual_seed(seed)
    H, I, V = TARGET["hidden_size"], TARGET["intermediate_size"], vocab or TARGET["vocab_size"]
    nh, hd = TARGET["num_attention_heads"], TARGET["head_dim"]
    heads = {"vocab_size": V}
    nkv = (config_over or {}).get("num_key_value_heads", TARGET["num_key_value_heads"])
    eagle3 = layout not in ("eagle", "speculators-eagle")
    t: dict[str, torch.Tensor] = {}
    if eagle3 and oracle:
        nh, nkv, hd = 1, 1, H
        heads.update(num_attention_heads=1, num_key_value_heads=1, head_dim=H)
    if eagle3:
        layer = _eagle3_layer(g, H, I, nh, nkv, hd, oracle)
        prefix = "midlayer." if layout in ("eagle3", "specforge") else "layers.0."
        t.update({prefix + k: v for k, v in layer.items()})
        t["fc.weight"] = _rand(g, H, 3 * H)
        t["norm.weight"] = torch.ones(H)
        dv = draft_vocab or V
        if dv != V:
            ids = torch.sort(torch.randperm(V, generator=g)[:dv]).values
            ids[0] = 2  # keep </s>
            ids = torch.sort(ids).values
            t["d2t"] = ids - torch.arange(dv)
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[ids] = True
            t["t2d"] = t2d
        if oracle and dv != V:
            t["lm_head.weight"] = target_lm_head[ids].clone()
        elif not oracle:
            t["lm_head.weight"] = _rand(g, dv, H, scale=0.5)
        if layout == "specforge" if own_embed is None else own_embed:
            t["embed_tokens.weight"] = _rand(g, V, H, scale=1.0)
    else:
        layernorms = layout == "speculators-eagle" and bool((config_over or {}).get("layernorms"))
        layer = _eagle1_layer(g, H, I, nh, nkv, hd, oracle, input_norm=layernorms)
        prefix = "transformer." if layout == "speculators-eagle" else "layers.0."
        t.update({prefix + k: v for k, v in layer.items()})
        fc = _rand(g, H, 2 * H)
        if oracle:
            fc = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
        t["fusion_fc.weight" if layout == "speculators-eagle" else "fc.weight"] = fc
        if layernorms:
            t["embedding_layernorm.weight"] = torch.ones(H)
            t["pre_lm_head_layernorm.weight"] = torch.ones(H)
        if own_embed:
            t["embed_tokens.weight"] = _rand(g, V, H, scale=1.0)
    for k in drop:
        t.pop(k, None)
    t.update(tensor_over or {})

    if layout in ("speculators", "speculators-eagle"):
        cfg = {
            "architectures": ["Eagle3Speculator" if eagle3 else "EagleSpeculator"],
            "speculators_model_type": "eagle3" if eagle3 else "eagle",
            "transformer_layer_config": _layer_cfg(**heads),
            "speculators_config": {
                "algorithm": "eagle3" if eagle3 else "eagle",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
            },
        }
        if eagle3:
            cfg.update({"draft_vocab_size": draft_vocab or V, "norm_before_residual": oracle,
                        "target_hidden_size": None})
            if aux_ids is not None:
                cfg["eagle_aux_hidden_state_layer_ids"] = aux_ids
        else:
            cfg.update({"layernorms": False, "fusion_bias": False})
    elif eagle3:
        arch = {"eagle3": "LlamaForCausalLM", "specforge": "LlamaForCausalLMEagle3",
                "vllm-eagle3": "Eagle3LlamaForCausalLM"}[layout]
        cfg = _layer_cfg(architectures=[arch], draft_vocab_size=draft_vocab or V, norm_before_residual=oracle,
                         **heads)
        if aux_ids is not None:
            if layout == "eagle3":
                cfg["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": aux_ids}
            else:
                cfg["eagle_aux_hidden_state_layer_ids"] = aux_ids
    else:
        cfg = _layer_cfg(architectures=["LlamaForCausalLM"], **heads)
    cfg.update(config_over or {})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    elif fmt == "bin":
        torch.save(t, out / "pytorch_model.bin")
    else:  # "pickle": a .bin that needs full unpickling (an object, not just tensors)
        torch.save({"state": t, "meta": _Opaque()}, out / "pytorch_model.bin")
    return out


class _Opaque:
    """An arbitrary object: loading it needs full unpickling."""

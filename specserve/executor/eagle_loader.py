"""Load (and write) EAGLE / EAGLE-3 draft heads in their published layouts.

Layouts read (safetensors first; a ``.bin`` is read with ``weights_only=True``
or refused, never unpickled):

* EAGLE-1/2 releases: a 1-layer Llama config; ``fc.weight [H, 2H]`` (+ ``fc.bias``
  in some), ``layers.0.*``; ``embed_tokens``/``lm_head`` absent = the target's.
* EAGLE-3 releases and SpecForge exports: ``midlayer.*`` (= ``layers.0.*``, q/k/v
  read 2H), ``fc.weight [H, 3*target_H]``, ``norm``, ``lm_head [draft_vocab, H]``,
  ``d2t``/``t2d``; SpecForge also saves its (frozen) ``embed_tokens``; vLLM-style
  exports (``Eagle3LlamaForCausalLM``) use ``layers.0.*``.
* vllm-project/speculators: ``config.json`` with ``speculators_model_type``
  (``eagle3`` or ``eagle``), ``transformer_layer_config`` and
  ``speculators_config``; eagle3 keys as vLLM's, eagle keys ``fusion_fc.*``,
  ``transformer.*``, ``embedding_layernorm``/``pre_lm_head_layernorm``.

A leading ``model.`` on keys is dropped.  The EAGLE-3 target layers are read
from ``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``)
in vLLM's convention: id i = the residual stream ENTERING target layer i
(HF ``hidden_states[i]``); absent = (2, L//2, L-3).  SGLang reads explicit
ids one layer later (i + 1); a head trained for SGLang's convention needs its
ids shifted by one.

Every bad head fails with one ``ConfigError`` line naming ``method.model``.
"""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specserve.errors import ConfigError
from specserve.executor.models.eagle import EagleHead, HeadConfig
from specserve.executor.models.llama import Rotary

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# Heads shipped inside the package: embedded:<name> -> specserve/assets/<name>
EMBEDDED_HEADS = {"smollm2-135m-instruct-eagle3": "smollm2-135m-instruct-eagle3"}
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


@dataclass
class HeadCheckpoint:
    path: Path
    kind: str  # "eagle" | "eagle3"
    layout: str  # "eagle", "eagle3", "specforge", "speculators"
    config: HeadConfig
    tensors: dict[str, Tensor]  # specserve names (see _normalise)
    max_speculative_tokens: int | None  # what the format allows (speculators proposal), None = no limit
    verifier: str | None  # speculators: the verifier's name_or_path


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default low/mid/high target layers (inputs of these layers)."""
    return (2, num_layers // 2, num_layers - 3)


def shipped_heads() -> str:
    """The shipped heads as a user selects them: ``draft=<preset>`` where a built-in draft
    preset names the head, and ``method.model=embedded:<name>`` always."""
    import re

    from specserve.compose import conf_dir

    presets: dict[str, list[str]] = {}
    for f in sorted((conf_dir() / "draft").glob("*.yaml")):
        m = re.search(r"^path:\s*embedded:(\S+)\s*$", f.read_text(), re.MULTILINE)
        if m:
            presets.setdefault(m.group(1), []).append(f.stem)
    return "; ".join(" or ".join([f"draft={p}" for p in presets.get(name, [])] + [f"method.model=embedded:{name}"])
                     for name in EMBEDDED_HEADS)


def resolve_head_dir(path: str, key: str = "method.model") -> Path:
    if path.startswith("embedded:"):
        name = path.split(":", 1)[1]
        if name not in EMBEDDED_HEADS:
            raise ConfigError(key, f"unknown embedded head {name!r}; shipped: {shipped_heads()}")
        d = ASSETS / EMBEDDED_HEADS[name]
        if not (d / "config.json").is_file():
            raise ConfigError(key, f"the shipped head {name!r} is missing from this installation ({d})")
        return d
    d = Path(path).expanduser()
    if not d.is_dir():
        raise ConfigError(key, f"{path!r} is not a local directory (an EAGLE head: config.json + weights; "
                               "nothing is downloaded)")
    if not (d / "config.json").is_file():
        raise ConfigError(key, f"{d} has no config.json: not a draft-head directory")
    return d


def read_tensors(d: Path, key: str = "method.model") -> dict[str, Tensor]:
    """Every tensor of a checkpoint directory: safetensors (single, sharded or any
    *.safetensors), else pytorch_model*.bin through ``torch.load(weights_only=True)``."""
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if files:
        sd: dict[str, Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    bins = sorted(d.glob("*.bin"))
    if not bins:
        raise ConfigError(key, f"{d} holds no weights (*.safetensors or pytorch_model*.bin)")
    sd = {}
    for b in bins:
        try:
            obj = torch.load(b, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(key, f"{b.name}: refused: it needs full unpickling, which specserve never does "
                                   f"({first[:160]}); convert it to safetensors") from None
        if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
            raise ConfigError(key, f"{b.name}: not a plain state dict of tensors; convert it to safetensors")
        sd.update(obj)
    return sd


# ---------------------------------------------------------------- layouts -> specserve names

_LAYER_RENAMES = {
    "input_layernorm.weight": "layer.input_layernorm.weight",
    "hidden_norm.weight": "layer.hidden_norm.weight",
    "post_attention_layernorm.weight": "layer.post_attention_layernorm.weight",
    "self_attn.o_proj.weight": "layer.o_proj.weight",
    "mlp.down_proj.weight": "layer.down_proj.weight",
}


def _canonical_names(sd: dict[str, Tensor], layout: str) -> dict[str, Tensor]:
    """Published names -> one vocabulary: fc.*, layers.0.*, norm, embed_tokens, lm_head, d2t, t2d."""
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        if name.startswith("verifier.") or name.endswith("rotary_emb.inv_freq"):
            continue
        n = name.removeprefix("model.")
        n = n.replace("midlayer.", "layers.0.", 1) if n.startswith("midlayer.") else n
        if layout == "speculators-eagle":
            for old, new in (("fusion_fc.", "fc."), ("transformer.", "layers.0."),
                             ("embedding_layernorm.", "enorm."), ("pre_lm_head_layernorm.", "norm.")):
                if n.startswith(old):
                    n = new + n[len(old):]
        out[n] = t
    return out


def _fuse(sd: dict[str, Tensor], key: str) -> dict[str, Tensor]:
    """Canonical names -> the module's (q/k/v and gate/up fused); unknown names fail."""
    sd = dict(sd)
    out: dict[str, Tensor] = {}

    def pop(n: str) -> Tensor:
        if n not in sd:
            raise ConfigError(key, f"the head checkpoint is missing tensor {n!r}")
        return sd.pop(n)

    p = "layers.0."
    out["layer.qkv_proj.weight"] = torch.cat([pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"], 0)
    if p + "self_attn.q_proj.bias" in sd:
        out["layer.qkv_proj.bias"] = torch.cat([pop(p + f"self_attn.{x}_proj.bias") for x in "qkv"], 0)
    out["layer.gate_up_proj.weight"] = torch.cat([pop(p + "mlp.gate_proj.weight"), pop(p + "mlp.up_proj.weight")], 0)
    for old, new in _LAYER_RENAMES.items():
        if p + old in sd:
            out[new] = sd.pop(p + old)
    for n in ("fc.weight", "fc.bias", "norm.weight", "enorm.weight", "embed_tokens.weight", "lm_head.weight",
              "d2t", "t2d"):
        if n in sd:
            out[n] = sd.pop(n)
    if sd:
        extra = sorted(sd)
        if any(n.startswith("layers.") and not n.startswith("layers.0.") for n in extra):
            raise ConfigError(key, "the head has more than one decoder layer; EAGLE heads here have exactly one")
        raise ConfigError(key, f"unexpected tensors in the head checkpoint: {', '.join(extra[:4])}"
                               + (" ..." if len(extra) > 4 else ""))
    return out


# ---------------------------------------------------------------- config

def _get(c: dict, name: str, default: Any = None) -> Any:
    v = c.get(name)
    return default if v is None else v


def _layout_and_kind(cfg: dict, keys: set[str]) -> tuple[str, str]:
    spec_type = cfg.get("speculators_model_type")
    if spec_type is not None:
        if spec_type not in ("eagle", "eagle3"):
            raise ConfigError("method.model", f"a speculators checkpoint of type {spec_type!r}; "
                                              "the eagle proposers read types eagle and eagle3")
        return ("speculators-eagle" if spec_type == "eagle" else "speculators"), spec_type
    archs = tuple(cfg.get("architectures") or ())
    eagle3 = (
        any(a in EAGLE3_ARCHITECTURES for a in archs)
        or any(k.startswith("midlayer.") or k.endswith("hidden_norm.weight") for k in keys)
        or "draft_vocab_size" in cfg or "eagle_config" in cfg
    )
    if not eagle3:
        return "eagle", "eagle"
    if "embed_tokens.weight" in keys or "model.embed_tokens.weight" in keys:
        return "specforge", "eagle3"
    return "eagle3", "eagle3"


def _aux_ids(cfg: dict) -> list[int] | None:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    ec = cfg.get("eagle_config")
    if ids is None and isinstance(ec, dict):
        ids = ec.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids is not None else None


def _rope_config(layer: dict) -> Any:
    from transformers import LlamaConfig

    keep = {k: v for k, v in layer.items() if k not in ("architectures", "auto_map", "model_type", "eagle_config")}
    keep["num_hidden_layers"] = 1
    return LlamaConfig(**keep)


def read_head(path: str, method: str, key: str = "method.model", tensors: dict[str, Tensor] | None = None,
              ) -> HeadCheckpoint:
    """Read a head directory (no target needed): its layout, config and tensors.
    ``tensors``: the directory's tensors already read (meta tensors from the headers
    for a memory declaration), instead of reading them here."""
    d = resolve_head_dir(path, key)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except ValueError as e:
        raise ConfigError(key, f"{d}/config.json is not valid JSON ({e})") from None
    raw = read_tensors(d, key) if tensors is None else tensors
    layout, kind = _layout_and_kind(cfg, set(raw))
    if kind != method:
        other = "eagle3" if kind == "eagle3" else "eagle"
        raise ConfigError(key, f"{d} is an {'EAGLE-3' if kind == 'eagle3' else 'EAGLE-1/2'} head; "
                               f"select it with +method={other}")
    sd = _fuse(_canonical_names(raw, layout), key)
    spec_cfg = cfg.get("speculators_config") if layout.startswith("speculators") else None
    layer = cfg.get("transformer_layer_config") if spec_cfg is not None or layout.startswith("speculators") else cfg
    if not isinstance(layer, dict):
        raise ConfigError(key, f"{d}/config.json: a speculators config needs transformer_layer_config (a dict)")
    try:
        H = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        vocab = int(layer["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(key, f"{d}/config.json lacks {e} (hidden_size, num_attention_heads, vocab_size)") from None
    top = cfg
    lm_rows = sd["lm_head.weight"].shape[0] if "lm_head.weight" in sd else None
    hc = HeadConfig(
        kind=kind,
        hidden_size=H,
        intermediate_size=int(_get(layer, "intermediate_size", sd["layer.down_proj.weight"].shape[1])),
        num_heads=heads,
        num_kv_heads=int(_get(layer, "num_key_value_heads", heads)),
        head_dim=int(_get(layer, "head_dim", H // heads)),
        rms_norm_eps=float(_get(layer, "rms_norm_eps", 1e-6)),
        vocab_size=vocab,
        draft_vocab_size=int(_get(top, "draft_vocab_size", lm_rows if lm_rows is not None else vocab)),
        target_hidden_size=int(_get(top, "target_hidden_size", H)),
        aux_layer_ids=tuple(_aux_ids(top) or ()),
        norm_before_residual=bool(_get(top, "norm_before_residual", False)),
        fc_bias="fc.bias" in sd,
        attention_bias="layer.qkv_proj.bias" in sd,
        input_layernorm=kind == "eagle" and bool(_get(top, "layernorms", False)),
        embed_norm="enorm.weight" in sd,
        pre_head_norm=kind == "eagle" and "norm.weight" in sd,
        rope_config=_rope_config(layer),
    )
    if kind == "eagle" and not hc.input_layernorm:
        sd.pop("layer.input_layernorm.weight", None)  # EAGLE-1's layer 0 does not apply it
    max_k = verifier = None
    if spec_cfg is not None:
        methods = spec_cfg.get("proposal_methods") or []
        default = spec_cfg.get("default_proposal_method")
        chosen = next((m for m in methods if m.get("proposal_type") == default), methods[0] if methods else None)
        if chosen is not None and chosen.get("speculative_tokens") is not None:
            max_k = int(chosen["speculative_tokens"])
        verifier = (spec_cfg.get("verifier") or {}).get("name_or_path")
    return HeadCheckpoint(d, kind, layout, hc, sd, max_k, verifier)


def check_against_target(ck: HeadCheckpoint, arch: Any, k: int, key: str = "method.model") -> HeadConfig:
    """Validate a head against its target (``ArchConfig``) and K; fill defaults.  One
    ConfigError line per problem."""
    c, sd, d = ck.config, ck.tensors, ck.path
    V, tH, L = arch.vocab_size, arch.hidden_size, arch.num_layers
    if c.vocab_size != V:
        raise ConfigError(key, f"vocabulary mismatch: the head was built for a {c.vocab_size}-token vocabulary, "
                               f"the target has {V}")
    if ck.max_speculative_tokens is not None and k > ck.max_speculative_tokens:
        raise ConfigError("method.num_speculative_tokens",
                          f"{k} exceeds the {ck.max_speculative_tokens} speculative tokens this speculators "
                          "checkpoint allows (speculators_config.proposal_methods)")
    H = c.hidden_size
    fc = sd.get("fc.weight")
    if fc is None:
        raise ConfigError(key, "the head checkpoint is missing tensor 'fc.weight'")
    if c.kind == "eagle3":
        if c.target_hidden_size != tH or fc.shape[1] != 3 * tH:
            raise ConfigError(key, f"wrong hidden size: fc.weight takes {fc.shape[1]} features; an EAGLE-3 head "
                                   f"for this target needs 3 x {tH} = {3 * tH} (a head trained for another target?)")
        ids = c.aux_layer_ids or default_eagle3_layers(L)
        if len(ids) != 3 or any(not 0 <= i < L for i in ids):
            raise ConfigError(key, f"eagle_aux_hidden_state_layer_ids {list(ids)}: need 3 layer ids in [0, {L})")
        c.aux_layer_ids = tuple(int(i) for i in ids)
    else:
        if H != tH or c.target_hidden_size != tH or fc.shape[1] != 2 * tH:
            raise ConfigError(key, f"wrong hidden size: an EAGLE head for this target needs hidden_size {tH} and "
                                   f"fc.weight [{tH}, {2 * tH}]; got hidden_size {H}, fc.weight {list(fc.shape)}")
        c.aux_layer_ids = (L,)
    if fc.shape[0] != H:
        raise ConfigError(key, f"wrong hidden size: fc.weight has {fc.shape[0]} rows, the config says {H}")
    if "embed_tokens.weight" not in sd and H != tH:
        raise ConfigError(key, f"wrong hidden size: the head shares the target's embeddings ({tH} wide) "
                               f"but its hidden_size is {H}")
    emb = sd.get("embed_tokens.weight")
    if emb is not None and tuple(emb.shape) != (V, H):
        raise ConfigError(key, f"embed_tokens.weight is {list(emb.shape)}, expected [{V}, {H}]")
    lm = sd.get("lm_head.weight")
    if lm is None:
        if c.reduced_vocab:
            raise ConfigError(key, f"draft_vocab_size {c.draft_vocab_size} needs the head's own lm_head.weight")
        if H != tH:
            raise ConfigError(key, f"wrong hidden size: the head shares the target's LM head ({tH} wide) "
                                   f"but its hidden_size is {H}")
    elif tuple(lm.shape) != (c.draft_vocab_size, H):
        raise ConfigError(key, f"vocabulary mismatch: lm_head.weight is {list(lm.shape)}, expected "
                               f"[draft_vocab_size={c.draft_vocab_size}, {H}]")
    if c.draft_vocab_size > V:
        raise ConfigError(key, f"vocabulary mismatch: draft_vocab_size {c.draft_vocab_size} exceeds the target's {V}")
    if c.reduced_vocab:
        d2t = sd.get("d2t")
        if d2t is None:
            raise ConfigError(key, f"missing d2t: the head drafts over a reduced vocabulary ({c.draft_vocab_size} "
                                   f"of {V} tokens) but has no d2t tensor mapping draft ids to target ids")
        if tuple(d2t.shape) != (c.draft_vocab_size,):
            raise ConfigError(key, f"d2t has shape {list(d2t.shape)}, expected [{c.draft_vocab_size}]")
        ids = torch.arange(c.draft_vocab_size) + d2t.long()
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ConfigError(key, f"d2t maps draft ids outside the target vocabulary [0, {V})")
    t2d = sd.get("t2d")
    if t2d is not None and t2d.numel() != V:
        raise ConfigError(key, f"vocabulary mismatch: t2d covers {t2d.numel()} target tokens, the target has {V}")
    return c


def build_head(
    ck: HeadCheckpoint, target_model: Any, dtype: torch.dtype, device: torch.device, max_positions: int
) -> EagleHead:
    """An ``EagleHead`` with the checkpoint's weights (``check_against_target`` first)."""
    c, sd = ck.config, dict(ck.tensors)
    with torch.device("meta"):
        head = EagleHead(c, 1)
    if "embed_tokens.weight" in sd:
        with torch.device("meta"):
            head.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
    if "lm_head.weight" in sd:
        with torch.device("meta"):
            head.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
    d2t = sd.pop("d2t", None)
    sd.pop("t2d", None)
    try:
        head.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True, assign=True)
    except RuntimeError as e:  # a tensor's shape disagrees with config.json
        detail = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln or "Missing" in ln), str(e))
        raise ConfigError("method.model", f"{ck.path}: tensors do not match its config.json ({detail[:200]})") from None
    head.rotary = Rotary(c.rope_config, max_positions)
    head = head.to(device).eval().requires_grad_(False)
    if d2t is not None and c.reduced_vocab:
        head.draft_to_target = (torch.arange(c.draft_vocab_size) + d2t.long()).to(device)
    head.attach_target(target_model)
    return head


# ---------------------------------------------------------------- writing (the trainer's exports)

def _split_state(head: EagleHead, dtype: torch.dtype, layer_prefix: str) -> dict[str, Tensor]:
    """The module's tensors under published names (q/k/v and gate/up split)."""
    c = head.c
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    L = head.layer
    p = layer_prefix
    out: dict[str, Tensor] = {}
    wq, wk, wv = L.qkv_proj.weight.detach().split([q, kv, kv], 0)
    out.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": L.o_proj.weight.detach()})
    gate, up = L.gate_up_proj.weight.detach().chunk(2, 0)
    out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": L.down_proj.weight.detach(),
                p + "post_attention_layernorm.weight": L.post_attention_layernorm.weight.detach()})
    if L.input_layernorm is not None:
        out[p + "input_layernorm.weight"] = L.input_layernorm.weight.detach()
    if L.hidden_norm is not None:
        out[p + "hidden_norm.weight"] = L.hidden_norm.weight.detach()
    out["fc.weight"] = head.fc.weight.detach()
    if head.fc.bias is not None:
        out["fc.bias"] = head.fc.bias.detach()
    if head.norm is not None:
        out["norm.weight"] = head.norm.weight.detach()
    if head.lm_head is not None:
        out["lm_head.weight"] = head.lm_head.weight.detach()
    out = {k: v.to(dtype).contiguous().cpu() for k, v in out.items()}
    if head.draft_to_target is not None:
        ids = head.draft_to_target.cpu()
        out["d2t"] = (ids - torch.arange(ids.numel())).to(torch.int64)
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return out


def _layer_config(c: HeadConfig, target_hf: Any) -> dict[str, Any]:
    base = {k: v for k, v in target_hf.to_dict().items()
            if k in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "bos_token_id",
                     "eos_token_id", "pad_token_id", "hidden_act", "tie_word_embeddings")}
    base.update({
        "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
        "attention_bias": c.attention_bias, "tie_word_embeddings": False,
    })
    return base


def save_eagle3(head: EagleHead, target_hf: Any, out: Path, dtype: torch.dtype = torch.bfloat16,
                extra: dict[str, Any] | None = None) -> Path:
    """The EAGLE-3 release layout: config.json (LlamaForCausalLMEagle3) + model.safetensors
    with midlayer.*, fc, norm, lm_head, d2t, t2d (embeddings shared with the target)."""
    from safetensors.torch import save_file

    c = head.c
    out.mkdir(parents=True, exist_ok=True)
    cfg = _layer_config(c, target_hf)
    cfg.update({
        "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size, "norm_before_residual": c.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids)},
        "torch_dtype": str(dtype).removeprefix("torch."),
    })
    cfg.update(extra or {})
    save_file(_split_state(head, dtype, "midlayer."), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def save_speculators(head: EagleHead, target_hf: Any, out: Path, verifier: str, k: int,
                     dtype: torch.dtype = torch.bfloat16) -> Path:
    """The speculators layout (speculators_model_type eagle3): serving this directory alone
    enables speculation with ``verifier`` as the target."""
    from safetensors.torch import save_file

    c = head.c
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": _layer_config(c, target_hf),
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    save_file(_split_state(head, dtype, "layers.0."), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out

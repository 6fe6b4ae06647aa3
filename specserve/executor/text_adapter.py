"""A speech model's text adapter: low-rank factors merged into its text model's weights.

A speech model directory may carry, in specserve's own ``config.json`` block,
``"text_adapter": {"file": "text_adapter.safetensors", "scale": s}``: for each adapted
weight ``<name>.weight`` of the text model (transformers' causal-LM names) the file holds
``<name>.lora_A.weight`` (rank x in) and ``<name>.lora_B.weight`` (out x rank), and the
text model is served with ``W + s * B @ A`` (merged once at load time, in float32, before
any fusing; every backend then runs plain weights).  The adapter is part of that model:
it applies to every request the model serves, with audio or without (unlike Granite's
``has_lora_adapter``, which transformers switches on only with audio and specserve
refuses).  ``train.speech`` writes such adapters (``adapter`` and stage ``adapt``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specserve.errors import ModelLoadError


def read_text_adapter(hf_dir: Path, spec: Any, field: str = "model.path") -> tuple[dict[str, torch.Tensor], float, Path]:
    """The factors the adapter ``spec`` (config.json's ``specserve.text_adapter``) names,
    its scale and its file; clear errors naming ``field`` (the config key that named
    the model directory), the file and the key."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not isinstance(spec, dict) or not isinstance(spec.get("file"), str):
        raise ModelLoadError(f"{field}: {hf_dir}/config.json: specserve.text_adapter must be "
                             '{"file": <safetensors file in the directory>, "scale": <number>}')
    scale = spec.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ModelLoadError(f"{field}: {hf_dir}/config.json: specserve.text_adapter.scale must be a number")
    path = hf_dir / spec["file"]
    if path.parent.resolve() != hf_dir.resolve() or not path.is_file():
        raise ModelLoadError(f"{field}: specserve.text_adapter.file {spec['file']!r} is not a file in {hf_dir}")
    try:
        factors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{field}: cannot read {path}: {e}") from e
    return factors, float(scale), path


def merge_text_adapter(sd: dict[str, torch.Tensor], hf_dir: Path, spec: Any, key: str = "model") -> dict[str, torch.Tensor]:
    """``sd`` (the text model's tensors) with the adapter that ``spec`` (config.json's
    ``specserve.text_adapter``) names merged in; clear errors naming the file and key."""
    factors, scale, path = read_text_adapter(hf_dir, spec, f"{key}.path")
    out = dict(sd)
    names = sorted(k.removesuffix(".lora_A.weight") for k in factors if k.endswith(".lora_A.weight"))
    stray = set(factors) - {f"{n}.lora_{x}.weight" for n in names for x in "AB"}
    if stray or not names:
        raise ModelLoadError(f"{key}.path: {path}: expected <weight>.lora_A.weight / .lora_B.weight pairs, "
                             f"got {sorted(stray)[:3] or 'none'}")
    for n in names:
        a, b, w = factors[f"{n}.lora_A.weight"], factors.get(f"{n}.lora_B.weight"), out.get(f"{n}.weight")
        if b is None:
            raise ModelLoadError(f"{key}.path: {path}: {n}.lora_A.weight has no {n}.lora_B.weight")
        if w is None:
            raise ModelLoadError(f"{key}.path: {path}: {n}.weight is not a weight of the text model")
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ModelLoadError(f"{key}.path: {path}: the factors of {n} ({tuple(b.shape)} x {tuple(a.shape)}) "
                                 f"do not fit its weight {tuple(w.shape)}")
        delta = (b.float() @ a.float()) * scale
        out[f"{n}.weight"] = (w.float() + delta).to(w.dtype)
    return out

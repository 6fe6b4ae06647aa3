"""Low-rank adapters (LoRA) on a transformers causal LM, for training only.

``add_lora(llm, rank, alpha, modules)`` wraps every ``nn.Linear`` whose attribute name is
in ``modules`` (``q_proj``, ``v_proj``, ...) so that it computes ``W x + (alpha / rank)
B A x``; the base weights stay frozen, ``A`` starts small and random, ``B`` at zero (the
wrapped model starts as the unwrapped one).  ``lora_state_dict(llm)`` names the trained
factors after the base weight they adapt, ``<module>.lora_A.weight`` (rank, in) and
``<module>.lora_B.weight`` (out, rank), PEFT's convention without its
``base_model.model.`` prefix; the serving side merges them into the weights at load time
(``executor.text_adapter``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


def add_lora(llm: nn.Module, rank: int, alpha: float, modules: list[str]) -> list[nn.Parameter]:
    """Wrap the named linear layers of ``llm`` in place; returns the new trainable
    parameters (A and B of every wrapped layer)."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    wanted = set(modules)
    targets = [(name, parent, attr) for name, parent in llm.named_modules()
               for attr, child in parent.named_children()
               if attr in wanted and isinstance(child, nn.Linear)]
    if not targets:
        raise ValueError(f"no linear layer named any of {sorted(wanted)}")
    params: list[nn.Parameter] = []
    for _, parent, attr in targets:
        base = getattr(parent, attr)
        wrapped = LoraLinear(base, rank, alpha).to(device=base.weight.device, dtype=base.weight.dtype)
        setattr(parent, attr, wrapped)
        params += [wrapped.lora_A.weight, wrapped.lora_B.weight]
    return params


def lora_state_dict(llm: nn.Module) -> dict[str, Tensor]:
    """The factors of every wrapped layer, keyed by the adapted weight's name with
    ``.weight`` replaced by ``.lora_A.weight`` / ``.lora_B.weight``."""
    out: dict[str, Tensor] = {}
    for name, mod in llm.named_modules():
        if isinstance(mod, LoraLinear):
            out[f"{name}.lora_A.weight"] = mod.lora_A.weight.detach().clone()
            out[f"{name}.lora_B.weight"] = mod.lora_B.weight.detach().clone()
    return out


def load_lora_state_dict(llm: nn.Module, sd: dict[str, Tensor]) -> None:
    """Set the factors of the wrapped layers from ``lora_state_dict``'s output."""
    for name, mod in llm.named_modules():
        if isinstance(mod, LoraLinear):
            with torch.no_grad():
                mod.lora_A.weight.copy_(sd[f"{name}.lora_A.weight"])
                mod.lora_B.weight.copy_(sd[f"{name}.lora_B.weight"])

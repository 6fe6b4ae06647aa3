"""``+method=layer_skip``: self-speculation with skipped layers (the proposer:
``specserve.proposers.layer_skip``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specserve.errors import ConfigError
from specserve.methods import MethodSpec, SpeculativeConfig, register


@dataclass
class LayerSkipOptions(SpeculativeConfig):
    # Target layer ids the draft skips, or null = choose round(skip_ratio * layers) by
    # calibrating on about skip_calibration_tokens prompt tokens of the first requests.
    skip_layers: Optional[list[int]] = None
    skip_ratio: float = 0.5
    skip_calibration_tokens: int = 128

    def validate(self) -> None:
        r = self.skip_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r < 1.0:
            raise ConfigError("method.skip_ratio", f"must be in (0, 1) (1 would skip every layer), got {r!r}")
        n = self.skip_calibration_tokens
        if isinstance(n, bool) or not isinstance(n, int):
            raise ConfigError("method.skip_calibration_tokens", f"must be an integer, got {n!r}")
        if n < 16:
            raise ConfigError("method.skip_calibration_tokens", f"must be >= 16, got {n}")


register(MethodSpec(
    name="layer_skip",
    summary="the target itself with some of its layers skipped, a draft KV cache of its own",
    proposer="specserve.proposers.layer_skip:build",
    memory="specserve.proposers.layer_skip:memory",
    options=LayerSkipOptions,
    needs_model=False,
    tree=True,  # the draft_model proposer's trees, over the kept layers
))

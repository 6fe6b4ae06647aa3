"""``+method=ngram``: prompt lookup (the proposer: ``specserve.proposers.ngram``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specserve.errors import ConfigError
from specserve.methods import MethodSpec, SpeculativeConfig, register


@dataclass
class NgramOptions(SpeculativeConfig):
    # The n-gram window: the longest n in [min, max] whose last n tokens occurred earlier.
    # One key left null mirrors the other; both null means 5 and 5.
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None

    def validate(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        for key, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"method.{key}", f"must be an integer, got {value!r}")
            if value < 1:
                raise ConfigError(f"method.{key}", f"must be >= 1, got {value}")
        if lo > hi:
            raise ConfigError("method.prompt_lookup_min", f"must be <= method.prompt_lookup_max ({hi}), got {lo}")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi


register(MethodSpec(
    name="ngram",
    summary="the tokens that followed the last n tokens' earliest earlier occurrence (prompt lookup)",
    proposer="specserve.proposers.ngram:build",
    options=NgramOptions,
    needs_model=False,
))

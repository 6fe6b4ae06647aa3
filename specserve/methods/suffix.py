"""``+method=suffix``: suffix decoding (the proposer: ``specserve.proposers.suffix``)."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import ConfigError
from specserve.methods import MethodSpec, SpeculativeConfig, register


@dataclass
class SuffixOptions(SpeculativeConfig):
    suffix_decoding_max_tree_depth: int = 24  # max prefix-match + draft length
    # Past responses kept in the global trees, all tenants together (0 = none).
    suffix_decoding_max_cached_requests: int = 10000
    # Estimated memory (bytes) of the global suffix trees, all tenants together; the
    # oldest responses are evicted first beyond it or beyond max_cached_requests.
    suffix_decoding_max_cached_bytes: int = 1 << 30
    suffix_decoding_max_spec_factor: float = 1.0  # draft length <= factor x match length
    suffix_decoding_min_token_prob: float = 0.1  # stop drafting below this estimated probability

    def validate(self) -> None:
        for key, minimum in (("suffix_decoding_max_tree_depth", 1), ("suffix_decoding_max_cached_requests", 0),
                             ("suffix_decoding_max_cached_bytes", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"method.{key}", f"must be an integer, got {value!r}")
            if value < minimum:
                raise ConfigError(f"method.{key}", f"must be >= {minimum}, got {value}")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ConfigError("method.suffix_decoding_max_spec_factor", "must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ConfigError("method.suffix_decoding_min_token_prob", "must be in [0, 1]")


register(MethodSpec(
    name="suffix",
    summary="suffix trees over the request's own tokens and past responses (suffix decoding)",
    proposer="specserve.proposers.suffix:build",
    options=SuffixOptions,
    needs_model=False,
))

"""Sampling: logits processing, inverse-CDF sampling and draft verification."""

from specserve.sampling.processors import SamplingTensors, draw_uniforms, logits_to_probs, sample_from_probs
from specserve.sampling.rejection import (
    REJECTION_METHODS,
    RejectionOutput,
    RejectionUniforms,
    rejection_sample,
    rejection_sample_greedy,
)

__all__ = [
    "REJECTION_METHODS",
    "RejectionOutput",
    "RejectionUniforms",
    "SamplingTensors",
    "draw_uniforms",
    "logits_to_probs",
    "rejection_sample",
    "rejection_sample_greedy",
    "sample_from_probs",
]

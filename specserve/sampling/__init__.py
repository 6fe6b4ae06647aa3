"""Sampling: logits processing, inverse-CDF sampling and draft verification."""

from specserve.sampling.filters import SamplingTensors, logits_to_probs, sample_from_probs
from specserve.sampling.philox import keyed_uniforms, philox_uniforms, random_seed, seed_to_int64
from specserve.sampling.rejection import REJECTION_METHODS, RejectionOutput, RejectionUniforms, verify_chain
from specserve.sampling.sampler import (
    DeviceSampler,
    RequestTensors,
    SamplerFlags,
    StepInputs,
    process_logits,
    step_uniforms,
    unpack,
    verify_step,
)

__all__ = [
    "DeviceSampler",
    "REJECTION_METHODS",
    "RejectionOutput",
    "RejectionUniforms",
    "RequestTensors",
    "SamplerFlags",
    "SamplingTensors",
    "StepInputs",
    "keyed_uniforms",
    "logits_to_probs",
    "philox_uniforms",
    "process_logits",
    "random_seed",
    "sample_from_probs",
    "seed_to_int64",
    "step_uniforms",
    "unpack",
    "verify_chain",
    "verify_step",
]

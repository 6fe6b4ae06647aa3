"""Device memory that start-up measures before the KV cache exists (CUDA only).

``profile_cuda_memory`` runs the two transients ``engine.memory`` budgets on the
device itself and reads torch's allocator counters around them: the largest eager
step (a prefill of ``max_tokens`` tokens with logits at every row, as
prompt_logprobs steps have) and one verification of max_num_seqs x (K+1) sampled
rows with every filter on.  The engine calls it once, with the target loaded and
nothing else allocated yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.executor.batch import SeqInput
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel
from specserve.executor.backends.factory import RunnerFactory
from specserve.sampling.sampler import RequestTensors, SamplerFlags, verify_step


@dataclass(frozen=True)
class DeviceProfile:
    """What ``profile_cuda_memory`` measured (bytes)."""

    total_bytes: int  # the device's memory
    held_bytes: int  # what this process holds now (the target's weights)
    activation_bytes: int  # peak of an eager step of ``max_tokens`` tokens with logits of every row
    verify_bytes: int  # peak of verifying max_num_seqs x (K+1) rows with every filter on


def profile_cuda_memory(loaded: LoadedModel, max_tokens: int, block_size: int, max_num_seqs: int,
                        k: int) -> DeviceProfile:
    """Measure, before the KV cache exists, the transients ``engine.memory`` budgets: a
    dummy prefill of ``max_tokens`` tokens (the largest eager step) whose logits are
    wanted at every row (prompt_logprobs steps), and one verification of
    max_num_seqs x (K+1) sampled rows with temperature, top-k, top-p and min-p."""
    dev = loaded.device
    a = loaded.arch
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(dev)
    held = torch.cuda.memory_allocated(dev)
    blocks = -(-max_tokens // block_size) + 1
    scratch = KVCache(a.num_layers, blocks, block_size, a.num_kv_heads, a.head_dim, loaded.dtype, dev)
    runner = RunnerFactory(cpu_kernel="torch").runner(loaded, scratch)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    runner.forward([SeqInput([0] * max_tokens, 0, list(range(blocks)), list(range(max_tokens)))])
    torch.cuda.synchronize(dev)
    activations = torch.cuda.max_memory_allocated(dev) - base
    del runner, scratch
    B, K1 = max_num_seqs, k + 1
    logits = torch.randn(B * K1, a.vocab_size, device=dev)  # (B*(K+1), V): the graph output, counted apart
    req = RequestTensors.build([1.0] * B, [50] * B, [0.9] * B, [0.05] * B, list(range(B)), [0] * B, dev)
    req.flags = SamplerFlags.conservative()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    # the torch twin: its temporaries bound the kernel's, and no Triton kernel runs before its check
    verify_step(logits, torch.arange(B * K1, device=dev).view(B, K1), torch.zeros(B, k, dtype=torch.int64, device=dev),
                torch.full((B,), k, dtype=torch.int64, device=dev), req, use_kernel=False)
    torch.cuda.synchronize(dev)
    verify = torch.cuda.max_memory_allocated(dev) - base
    del logits, req
    torch.cuda.empty_cache()
    return DeviceProfile(int(total), int(held), int(max(activations, 0)), int(max(verify, 0)))

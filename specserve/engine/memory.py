"""The device memory budget: every allocation the engine keeps on the device, sized
before the KV cache, which gets what is left.

``plan_memory`` asks each part for its bytes and fits the KV cache last:

    budget = engine.gpu_memory_utilization x device memory
           = weights (the target's)
           + draft weights        (a draft model or a head: the method's declaration)
           + activations          (the profiled peak of the largest eager step)
           + verification         (the sampler's temporaries at max_num_seqs x (K+1) x V)
           + graph outputs        (ONE buffer every captured graph writes into)
           + graph pools          (the largest captured step's temporaries)
           + buffers              (the step runner's staging and split-KV scratch, the sampler's)
           + proposer graphs      (the method's own graphs: outputs, pools, buffers)
           + proposer transient   (the method's largest temporary while drafting)
           + (num_blocks + 1) x (target KV bytes per block + the method's own KV bytes per block)

Each method declares its part (``specserve.proposers.base.MemoryNeeds``, named by its
registration: ``specserve.methods.MethodSpec.memory``), from config files and checkpoint headers only, because a method
loads its weights and allocates its caches after the KV cache is sized.  The +1
block is each cache's trash block (padding writes).  Transients of different phases
(the forward, verification, drafting) are added, not overlapped: the caching
allocator cannot always carve one phase's request out of the blocks another freed.

Where the configuration cannot fit a KV cache of one ``max_model_len`` request,
``ConfigError`` names the key to change (``engine.max_num_seqs`` when the parts that
grow with it are what overflows, else ``engine.gpu_memory_utilization``) with the
numbers.  Without a device budget (the CPU, or ``engine.kv_cache_memory_gib`` /
``engine.num_kv_blocks`` given) the KV cache has its configured size and the other
parts are reported only; on CUDA a given size that overflows the budget is logged.

A leaf module without torch: it reads shapes, counts and the duck-typed objects it is
handed, so proposers may use its arithmetic and tests run it on meta tensors.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from specserve.errors import ConfigError

log = logging.getLogger(__name__)

GIB = 1 << 30
CPU_KV_CACHE_GIB = 0.5  # the CPU's default KV cache size

# Verification temporaries, bytes per logit of the verified (B*(K+1), V) rows, fp32:
# verify_step's own (measured on the torch reference with every filter on: the gathered
# rows 4, the shifted and scaled logits 4, sort values 4 + int64 indices 8, the removal
# mask 1, top-p's softmax, cumsum and mass 12, the probabilities 4, min-p/greedy
# rewrites 4: 41 at the peak, inside logits_to_probs), plus the logits controls' float32
# copy of the logits (LogitsPlan.apply: 4), which lives through verification.
VERIFY_STEP_BYTES_PER_LOGIT = 41
VERIFY_BYTES_PER_LOGIT = VERIFY_STEP_BYTES_PER_LOGIT + 4
# On CUDA, torch's segmented sort adds an int64 iota of the input and cub's double
# buffers for keys and values beside its outputs (not visible to a CPU measurement; an
# estimate: on CUDA the engine profiles verification and uses the measured peak instead).
CUDA_SORT_BYTES_PER_LOGIT = 8 + 12
# A graph pool holds the largest captured step's temporaries; counted twice for the
# pool's fragmentation (an estimate, not a measurement).
GRAPH_POOL_FACTOR = 2
SPLIT_KV_SPLITS = 16  # the static runner's split-KV scratch (make_split_scratch(16, ...))

# Parts that grow with engine.max_num_seqs (what lowering it frees).
SEQ_SCALED_PARTS = ("verification", "graph outputs", "graph pools", "buffers", "proposer graphs",
                    "proposer transient")


# ---------------------------------------------------------------- each part's arithmetic
def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of ``num_layers`` layers for one block (``KVCache.bytes_per_block`` without torch)."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype_bytes


def decoder_weight_bytes(a: Any, dtype_bytes: int) -> int:
    """The parameters of ``executor.models.llama.LlamaModel`` for an ``ArchConfig``
    (fused q/k/v and gate/up; q/k norms for Qwen3; an LM head unless tied)."""
    H, I, hd = a.hidden_size, a.intermediate_size, a.head_dim
    q, kv = a.num_heads * hd, a.num_kv_heads * hd
    layer = H * (q + 2 * kv) + q * H + 2 * H * I + I * H + 2 * H
    if a.attention_bias:
        layer += q + 2 * kv
    if a.qk_norm:
        layer += 2 * hd
    head = 0 if a.tie_word_embeddings else a.vocab_size * H
    return (a.vocab_size * H + a.num_layers * layer + H + head) * dtype_bytes


def rotary_bytes(head_dim: int, max_positions: int) -> int:
    """``Rotary``'s float32 cos and sin tables, (P, head_dim / 2) each."""
    return 2 * max_positions * (head_dim // 2) * 4


def step_activation_bytes(a: Any, tokens: int, logit_rows: int, dtype_bytes: int) -> int:
    """An estimate of one eager forward's peak: the live per-token tensors of one layer
    (residual, norms, q/k/v, attention output: about 8 hidden widths; gate/up and the
    activation: about 4 MLP widths) and the logits of ``logit_rows`` rows (the LM
    head's output plus its float32 copy)."""
    per_token = (8 * a.hidden_size + 4 * a.intermediate_size) * dtype_bytes
    return tokens * per_token + logit_rows * a.vocab_size * (dtype_bytes + 4)


def graph_output_bytes(rows: int, a: Any, dtype_bytes: int, num_aux: int = 0) -> int:
    """The step runner's ONE output buffer every captured graph writes into: float32
    logits, hidden states and ``num_aux`` aux hidden states of ``rows`` rows."""
    return rows * (a.vocab_size * 4 + a.hidden_size * dtype_bytes * (1 + num_aux))


def graph_pool_bytes(rows: int, a: Any, dtype_bytes: int) -> int:
    """The graph pool: the largest captured step's temporaries (its LM head's output in
    the model dtype; the float32 logits go to the output buffer), counted twice."""
    per_token = (8 * a.hidden_size + 4 * a.intermediate_size) * dtype_bytes
    return GRAPH_POOL_FACTOR * rows * (per_token + a.vocab_size * dtype_bytes)


def runner_buffer_bytes(max_num_seqs: int, max_tokens: int, max_seq_len: int, block_size: int, num_heads: int,
                        head_dim: int) -> int:
    """The static step runner's device staging (int32 ids, positions, slots, rows, query
    starts, lengths, block tables) and its split-KV scratch (float32 partial outputs and
    log-sum-exps)."""
    max_blocks = -(-max_seq_len // block_size) + 1
    fields = [max_tokens] * 4 + [max_num_seqs + 1, max_num_seqs, max_num_seqs * max_blocks]
    staging = sum(-(-4 * n // 16) * 16 for n in fields)  # int32 fields, each 16-byte aligned
    scratch = 4 * SPLIT_KV_SPLITS * max_num_seqs * num_heads * (head_dim + 1)
    return staging + scratch


def sampler_buffer_bytes(max_num_seqs: int, num_spec_tokens: int) -> int:
    """``DeviceSampler``'s persistent device inputs: int64 top_k, seed, position,
    num_drafts, row_index (B, K+1), draft_ids (B, K); float32 temperature, top_p, min_p."""
    B, K = max_num_seqs, num_spec_tokens
    fields = [8 * B] * 4 + [8 * B * (K + 1), 8 * B * K] + [4 * B] * 3
    return sum(-(-n // 16) * 16 for n in fields)  # each field 16-byte aligned (StagingBuffer)


def verify_bytes(max_num_seqs: int, num_spec_tokens: int, vocab_size: int, cuda: bool) -> int:
    """Verification temporaries of a full step (every request with K drafts, some sampled)."""
    per_logit = VERIFY_BYTES_PER_LOGIT + (CUDA_SORT_BYTES_PER_LOGIT if cuda else 0)
    return max_num_seqs * (num_spec_tokens + 1) * vocab_size * per_logit


def padded_attention_bytes(num_seqs: int, max_len: int, query_len: int, num_kv_heads: int, head_dim: int,
                           dtype_bytes: int) -> int:
    """The reference attention's gather of a padded group (``executor.attention``): K and V
    of ``num_seqs`` x ``max_len`` positions, their int64 slots and the boolean mask."""
    keys = num_seqs * max_len
    return keys * (2 * num_kv_heads * head_dim * dtype_bytes + 8 + query_len)


def kernel_args_bytes(num_seqs: int, num_tokens: int, max_len: int, block_size: int) -> int:
    """An eager forward's paged-kernel arguments (``attention.kernel_metadata``): int32 block
    tables of ``num_seqs`` contexts up to ``max_len``, query starts and lengths, and the
    int64 slot and position of each of ``num_tokens`` tokens.  The kernel reads the cache
    in place: no gathered keys, no mask."""
    blocks = -(-max_len // block_size)
    return 4 * (num_seqs * blocks + 2 * num_seqs + 1) + 16 * num_tokens


def module_bytes(module: Any) -> int:
    """Bytes of a module's parameters and buffers (meta tensors count their size too)."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------- the budget
@dataclass(frozen=True)
class DeviceFigures:
    """What the device reports (profiled on CUDA, given by tests)."""

    total_bytes: int
    held_bytes: int | None = None  # this process's allocations now (the target's weights); None: its parameters
    activation_bytes: int | None = None  # the largest eager step's peak; None: the analytic estimate
    verify_bytes: int | None = None  # verification's profiled peak (CUDA's sort workspace included); None: estimate


@dataclass
class MemoryBudget:
    """The breakdown: fixed parts (bytes) and the KV cache fitted to what is left."""

    device_bytes: int | None  # None: no device budget (the CPU)
    utilization: float | None
    parts: dict[str, int]
    kv_per_block: dict[str, int]  # "target" (the engine's cache), "proposer" (the method's own)
    num_blocks: int
    notes: list[str] = field(default_factory=list)

    @property
    def budget_bytes(self) -> int | None:
        if self.device_bytes is None or self.utilization is None:
            return None
        return int(self.utilization * self.device_bytes)

    @property
    def bytes_per_block(self) -> int:
        return sum(self.kv_per_block.values())

    @property
    def kv_bytes(self) -> int:
        return (self.num_blocks + 1) * self.bytes_per_block  # + each cache's trash block

    @property
    def fixed_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.kv_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "device_bytes": self.device_bytes, "utilization": self.utilization, "budget_bytes": self.budget_bytes,
            "parts": dict(self.parts), "kv_bytes_per_block": dict(self.kv_per_block),
            "num_blocks": self.num_blocks, "kv_bytes": self.kv_bytes, "total_bytes": self.total_bytes,
        }

    def line(self) -> str:
        """The start-up log line."""
        head = "memory"
        if self.budget_bytes is not None:
            head += f" {self.utilization} x {_gib(self.device_bytes)} = {_gib(self.budget_bytes)} GiB"
        parts = ", ".join(f"{name} {_gib(b)}" for name, b in self.parts.items() if b)
        kv = ", ".join(f"{name} {b / (1 << 20):.3f}" for name, b in self.kv_per_block.items() if b)
        return (f"{head}: {parts} -> KV cache {_gib(self.kv_bytes)} GiB ({self.num_blocks} blocks of "
                f"{self.bytes_per_block / (1 << 20):.3f} MiB: {kv}); total {_gib(self.total_bytes)} GiB")


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f}"


def plan_memory(cfg: Any, target: Any, *, num_spec_tokens: int, graphs: bool, static: bool, extra_layers: int = 0,
                needs: Any = None, device: DeviceFigures | None = None) -> MemoryBudget:
    """The budget of an engine serving ``target`` (a ``LoadedModel``: its model may be on
    the meta device) with ``cfg`` (a ``Config``).

    ``num_spec_tokens``: the engine's K (verification positions K+1 per request); ``graphs``: decode and
    verification steps are captured (CUDA graphs); ``static``: the persistent-buffer step
    runner runs the target (CUDA, one device); ``extra_layers``: the method's layers in the
    engine's KV cache (``MethodSpec.kv_layers``); ``needs``: the method's ``MemoryNeeds`` (None = no
    method, or a proposer built by the caller); ``device``: the device's figures (None =
    no device budget: the configured or CPU default KV size)."""
    e, a = cfg.engine, target.arch
    dt = target.dtype.itemsize
    B, K = e.max_num_seqs, num_spec_tokens
    rows = B * (K + 1)  # the largest captured step: every sequence verifying K drafts
    max_tokens = max(e.max_num_batched_tokens, rows)  # the largest eager step (the static runner's bound)
    n = needs
    held = device.held_bytes if device is not None and device.held_bytes is not None else None
    activations = device.activation_bytes if device is not None else None
    if device is not None and device.verify_bytes is not None:  # measured, plus the controls' copy of the logits
        verify = device.verify_bytes + rows * a.vocab_size * (VERIFY_BYTES_PER_LOGIT - VERIFY_STEP_BYTES_PER_LOGIT)
    else:
        verify = verify_bytes(B, K, a.vocab_size, cuda=device is not None)
    parts = {
        "weights": held if held is not None else module_bytes(target.model),
        "draft weights": n.weight_bytes if n is not None else 0,
        "activations": activations if activations is not None else step_activation_bytes(a, max_tokens, max_tokens, dt),
        # the engine's (B, K, V) copy of the drafts' q plus the proposer's own
        "verification": verify + (2 * n.draft_probs_bytes if n is not None else 0),
        "graph outputs": graph_output_bytes(rows, a, dt, n.aux_layers if n is not None else 0) if graphs else 0,
        "graph pools": graph_pool_bytes(rows, a, dt) if graphs else 0,
        "buffers": sampler_buffer_bytes(B, K) + (
            runner_buffer_bytes(B, max_tokens, target.max_model_len, e.block_size, a.num_heads, a.head_dim)
            if static else 0),
        "proposer graphs": n.graph_bytes if n is not None else 0,
        "proposer transient": n.transient_bytes if n is not None else 0,
    }
    kv_per_block = {
        "target": kv_bytes_per_block(a.num_layers + extra_layers, e.block_size, a.num_kv_heads, a.head_dim, dt),
        "proposer": (n.kv_bytes_per_block + n.scratch_bytes_per_block) if n is not None else 0,
    }
    mem = MemoryBudget(device.total_bytes if device is not None else None,
                       e.gpu_memory_utilization if device is not None else None, parts, kv_per_block, 0)
    min_blocks = -(-(target.max_model_len + K) // e.block_size)  # one longest request
    if e.num_kv_blocks is not None:
        mem.num_blocks = e.num_kv_blocks
        _check_given(mem, "engine.num_kv_blocks")
    elif e.kv_cache_memory_gib is not None or device is None:
        gib = e.kv_cache_memory_gib if e.kv_cache_memory_gib is not None else CPU_KV_CACHE_GIB
        # the size given is the engine's cache; a method's own caches come on top
        mem.num_blocks = max(1, int(gib * GIB) // kv_per_block["target"])
        _check_given(mem, "engine.kv_cache_memory_gib")
    else:
        mem.num_blocks = _fit(mem, min_blocks, B)
    return mem


def _check_given(mem: MemoryBudget, key: str) -> None:
    budget = mem.budget_bytes
    if budget is not None and mem.total_bytes > budget:
        note = (f"{key}: the KV cache given needs {_gib(mem.total_bytes)} GiB in all, over the budget of "
                f"{_gib(budget)} GiB ({mem.line()})")
        mem.notes.append(note)
        log.warning("%s", note)


def _fit(mem: MemoryBudget, min_blocks: int, max_num_seqs: int) -> int:
    """Blocks that fit what the fixed parts leave; ConfigError below one longest request."""
    budget = mem.budget_bytes
    assert budget is not None
    per_block = mem.bytes_per_block
    blocks = (budget - mem.fixed_bytes) // per_block - 1
    if blocks >= min_blocks:
        return blocks
    need = mem.fixed_bytes + (min_blocks + 1) * per_block
    short = need - budget
    scaled = sum(b for name, b in mem.parts.items() if name in SEQ_SCALED_PARTS)
    numbers = (f"{_gib(need)} GiB needed (fixed parts {_gib(mem.fixed_bytes)} GiB: "
               + ", ".join(f"{name} {_gib(b)}" for name, b in mem.parts.items() if b)
               + f"; a KV cache of one {min_blocks}-block request {_gib((min_blocks + 1) * per_block)}) but "
               f"{mem.utilization} x {_gib(mem.device_bytes)} GiB = {_gib(budget)} GiB")
    if max_num_seqs > 1 and scaled > short:
        fits = max(1, math.floor(max_num_seqs * (scaled - short) / scaled))
        raise ConfigError("engine.max_num_seqs", f"{max_num_seqs} does not fit: {numbers}; lower it to about "
                                                 f"{fits}, or raise engine.gpu_memory_utilization")
    raise ConfigError("engine.gpu_memory_utilization",
                      f"{mem.utilization} does not fit: {numbers}; raise it, use a device with more memory, or a "
                      "smaller model or max_model_len")

"""Which slice of a Llama-family model each tensor-parallel rank holds (pure Python).

Attention is split by KV group: a KV head and the query heads that read it stay
on one rank, so every rank runs ordinary grouped-query attention on its own
heads and the output projection sums the ranks' partial results (one
all-reduce).  Three layouts::

    num_kv_heads % tp == 0       every rank holds num_kv_heads / tp groups (even)
    num_kv_heads > tp otherwise  groups dealt as evenly as possible, lower ranks
                                 take the extra ones (SmolLM2: 3 groups of 3
                                 heads over 2 ranks = 6 + 3 query heads)
    num_kv_heads < tp            tp must be a multiple of num_kv_heads: each KV
                                 head is replicated on tp / num_kv_heads ranks,
                                 which split its query heads evenly

The MLP's intermediate dimension must divide by tp (one slice of gate/up rows
and the matching down columns per rank); the vocabulary is split into tp
equal slices of ceil(V / tp) rows, the last one padded with zero rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.errors import ConfigError
from specserve.methods import get_method

TP_KEY = "parallelism.tensor_parallel_size"


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    q_heads: tuple[int, int]  # [start, stop) of the attention heads this rank computes
    kv_heads: tuple[int, int]  # [start, stop) of the KV heads it holds (and caches)
    inter: tuple[int, int]  # [start, stop) of the MLP's intermediate dimension
    vocab: tuple[int, int]  # [start, stop) of the real vocabulary rows it holds
    vocab_shard: int  # rows of its embedding / LM-head slice (ceil(V / tp); padded with zeros)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.inter[1] - self.inter[0]


def _deal(n: int, parts: int, i: int) -> tuple[int, int]:
    """[start, stop) of part i when n items are dealt to `parts` parts, the first n % parts get one more."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def check_layout(num_heads: int, num_kv_heads: int, intermediate_size: int, tp: int, what: str = "model") -> None:
    """Raise one ConfigError line when the model cannot be split over tp ranks."""
    if num_heads % num_kv_heads:
        raise ConfigError(what, f"{num_heads} attention heads are not a multiple of its {num_kv_heads} KV heads")
    if num_kv_heads < tp:
        if tp % num_kv_heads or num_heads % tp:
            raise ConfigError(
                TP_KEY,
                f"{tp} does not fit {what}'s {num_heads} attention heads / {num_kv_heads} KV heads: with fewer KV "
                f"heads than ranks, the tensor-parallel size must be a multiple of the KV heads and divide the "
                f"attention heads (e.g. {_suggest(num_heads, num_kv_heads)})",
            )
    if intermediate_size % tp:
        raise ConfigError(
            TP_KEY, f"{tp} does not divide {what}'s MLP intermediate size {intermediate_size}",
        )


def _suggest(num_heads: int, num_kv_heads: int) -> str:
    ok = [t for t in (1, 2, 4, 8, 16) if t <= num_kv_heads or (t % num_kv_heads == 0 and num_heads % t == 0)]
    return "tensor_parallel_size in " + ", ".join(str(t) for t in ok)


def plan_shard(
    num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int, rank: int, tp: int,
    what: str = "model",
) -> ShardPlan:
    check_layout(num_heads, num_kv_heads, intermediate_size, tp, what)
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp:
        kv = _deal(num_kv_heads, tp, rank)
        q = (kv[0] * group, kv[1] * group)
    else:
        per_q = num_heads // tp
        q = (rank * per_q, (rank + 1) * per_q)
        head = q[0] // group  # every one of these query heads reads this KV head
        kv = (head, head + 1)
    inter = intermediate_size // tp
    vshard = -(-vocab_size // tp)
    v0 = min(rank * vshard, vocab_size)
    return ShardPlan(
        rank=rank, size=tp, q_heads=q, kv_heads=kv, inter=(rank * inter, (rank + 1) * inter),
        vocab=(v0, min(v0 + vshard, vocab_size)), vocab_shard=vshard,
    )


def describe(plans: list[ShardPlan]) -> str:
    """One line for the logs: who holds what."""
    return "; ".join(
        f"rank {p.rank}: heads {p.q_heads[0]}-{p.q_heads[1] - 1}, kv heads {p.kv_heads[0]}-{p.kv_heads[1] - 1}, "
        f"mlp {p.inter[0]}:{p.inter[1]}, vocab {p.vocab[0]}:{p.vocab[1]}"
        for p in plans
    )


def draft_tensor_parallel_size(method: Any, tp: int) -> int:
    """The draft's TP: ``method.draft_tensor_parallel_size``, by default the target's for
    a method whose draft shards (``MethodSpec.tensor_parallel``: a draft model, as vLLM)
    and 1 for everything else (heads and model-free methods draft on rank 0)."""
    if method is None:
        return 1
    if get_method(method.method).tensor_parallel:
        return method.draft_tensor_parallel_size or tp
    return 1

"""One rank's handle on one tensor-parallel model (``LoadedModel.tp``).

Rank 0 owns the engine: its runner of a sharded model is the tensor-parallel
backend (``executor.backends.tensor_parallel``), which registers with the workers
(``attach``) and, per step, sends them the ``StepBatch`` (``send_step``) before
running its own shard inside ``step()``; the workers receive the same batch and
run theirs (``specserve.parallel.worker``) on the torch backend.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import Tensor

from specserve.errors import ConfigError
from specserve.parallel.plan import TP_KEY, ShardPlan

if TYPE_CHECKING:
    from specserve.executor.batch import StepBatch
    from specserve.executor.runner import Runner
    from specserve.parallel.group import ControlLink


class Shard:
    """``link`` is rank 0's control link to the workers (None on a worker)."""

    def __init__(self, plan: ShardPlan, group: Any, model_id: int, link: "ControlLink | None" = None):
        self.plan = plan
        self.group = group  # the data-plane process group (NCCL on CUDA, gloo on the CPU)
        self.model_id = model_id
        self.link = link
        # True while every rank runs the same forward.  A worker is always inside
        # rank 0's step; rank 0 is inside one only while it runs its part of a step (``step``).
        self.in_step = link is None
        # Rank 0: the id each of this model's runners has on the workers (a model may have
        # several: a profiling runner, a proposer's own); freed there when dropped here.
        self._runner_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def size(self) -> int:
        return self.plan.size

    @property
    def leader(self) -> bool:
        """Rank 0, which sends the steps (a worker follows them)."""
        return self.link is not None

    def attach(self, runner: "Runner") -> None:
        """Rank 0 built a runner (and KV cache) for this model: workers build theirs with
        the same block count, so block tables and slots mean the same on every rank."""
        if getattr(runner.model, "shard", None) is not self:  # e.g. a view running some of its layers
            raise ConfigError(
                TP_KEY,
                f"a {type(runner.model).__name__} over the sharded model would run its layers on rank 0 alone: "
                "this method does not support tensor parallelism yet; use parallelism.tensor_parallel_size=1",
            )
        if self.link is not None:
            kv = runner.kv
            rid = self.link.new_runner_id()
            self._runner_ids[runner] = rid
            weakref.finalize(runner, self.link.release_runner, rid)
            self.link.send(("runner", self.model_id, rid, kv.num_blocks, kv.block_size, runner.min_causal_len))

    def send_step(self, runner: "Runner", batch: "StepBatch", aux_layer_ids: tuple[int, ...]) -> None:
        """Rank 0: the workers run ``batch`` on their twins of ``runner``."""
        assert self.link is not None
        self.link.send(("step", self._runner_ids[runner], batch, tuple(aux_layer_ids)))

    @contextmanager
    def step(self) -> Iterator[None]:
        """Rank 0 runs its part of a step every rank runs (vocabulary-parallel layers
        called inside need no ``join``)."""
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    def join(self, op: str, payload: Tensor) -> None:
        """Rank 0 calls a vocabulary-parallel layer outside a step (an EAGLE head reading the
        target's embedding or LM head): the workers must run their part of it too."""
        if self.link is not None and not self.in_step:
            self.link.send((op, self.model_id, payload.detach().cpu()))

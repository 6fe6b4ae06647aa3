"""The backend factory: which runner serves a model, decided in one place.

Device choices that need a GPU are checked on the plan (what will run, read from the
model's device and the engine's settings: no CUDA call); the tensor-parallel backend
is driven with a recording control link instead of worker processes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve.errors import ConfigError
from specserve.executor.backends.cuda_graphs import CudaGraphRunner
from specserve.executor.backends.factory import RunnerFactory
from specserve.executor.backends.fused_cpu import FusedCpuRunner
from specserve.executor.backends.tensor_parallel import TensorParallelRunner
from specserve.executor.backends.torch_backend import TorchRunner
from specserve.executor.batch import SeqInput, StepBatch
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import load_model
from specserve.executor.runner import ForwardOutput, Runner
from specserve.kernels.backends import BackendChoice
from specserve.parallel.plan import plan_shard
from specserve.parallel.shard import Shard

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def fp32(tiny_llama):
    return load_model(str(tiny_llama), "float32", CPU, max_model_len=128)


def make_kv(m, num_blocks: int = 32, block_size: int = 4) -> KVCache:
    a = m.arch
    return KVCache(a.num_layers, num_blocks, block_size, a.num_kv_heads, a.head_dim, m.dtype, m.device)


def on(device: str, tp=None) -> SimpleNamespace:
    """What the factory's plan reads of a model: its device and its shard."""
    return SimpleNamespace(device=torch.device(device), tp=tp)


# --------------------------------------------------------------------------- plans
@pytest.mark.parametrize("graphs", ["auto", "off"])
def test_on_cuda_the_target_and_drafts_run_the_persistent_buffer_runner(graphs):
    f = RunnerFactory(cuda_graphs=graphs)
    for target in (True, False):
        plan = f.plan(on("cuda"), target=target)
        assert plan.cuda and plan.static and not plan.tensor_parallel
        assert plan.graphs == (graphs == "auto")


def test_on_the_cpu_only_the_target_takes_the_step_runner_and_only_for_triton():
    assert not RunnerFactory().plan(on("cpu"), target=True).static
    triton = RunnerFactory(attention_backend="triton")
    target, draft = triton.plan(on("cpu"), target=True), triton.plan(on("cpu"))
    assert target.static and not target.graphs  # Triton's interpreter, eagerly
    assert not draft.static and not draft.cuda


def test_a_shard_runs_eagerly_on_every_rank_whatever_the_device():
    for device in ("cpu", "cuda"):
        plan = RunnerFactory(attention_backend="triton").plan(on(device, tp=object()), target=True)
        assert plan.tensor_parallel and not plan.static and not plan.graphs


def test_heads_draft_eagerly_where_their_target_replays_no_graphs():
    eager = [(RunnerFactory(), on("cpu")), (RunnerFactory(cuda_graphs="off"), on("cuda")),
             (RunnerFactory(), on("cuda", tp=object()))]
    for f, target in eager:  # None before anything of the head is touched
        assert f.head_graphs(None, None, target, block_size=4, trash_slot=0, num_spec_tokens=2, max_seq_len=16) is None


def test_heads_attend_through_the_kernel_their_target_uses_on_cuda():
    """An EAGLE head's and MTP's eager forwards: the paged kernel (as the target's check
    chose) on CUDA, so a prompt chunk beside decode rows pads nothing; the reference
    attention on the CPU, as the CPU target."""
    for backend in ("triton", "torch"):
        assert RunnerFactory(attention_backend=backend).head_attention(on("cuda")) == backend
        assert RunnerFactory(attention_backend=backend).head_attention(on("cpu")) is None


# --------------------------------------------------------------------------- runners
def test_float32_on_the_cpu_is_the_torch_backend_and_says_so(fp32):
    for mode in ("auto", "torch"):
        runner = RunnerFactory(cpu_kernel=mode).runner(fp32, make_kv(fp32))
        assert type(runner) is TorchRunner and runner.fused is None and runner.static is None
        assert runner.attention_backend == "torch" and runner.tensor_parallel_size == 1
    draft = RunnerFactory(cpu_kernel="auto").draft(fp32, make_kv(fp32), max_num_seqs=4, max_num_tokens=32)
    assert type(draft) is TorchRunner


def test_an_impossible_cpu_kernel_is_refused_in_one_line(fp32):
    with pytest.raises(ConfigError) as e:
        RunnerFactory(cpu_kernel="fused").runner(fp32, make_kv(fp32))
    assert str(e.value) == "engine.cpu_kernel: fused needs model.dtype=bfloat16 on the CPU"
    with pytest.raises(ConfigError) as e:
        RunnerFactory(cpu_kernel="avx").runner(fp32, make_kv(fp32))
    assert str(e.value) == "engine.cpu_kernel: 'avx' is not one of auto, fused, torch"


def test_backends_declare_what_they_run():
    bf16, f32 = torch.bfloat16, torch.float32
    assert FusedCpuRunner.supports.refusal(CPU, bf16) is None
    assert FusedCpuRunner.supports.refusal(CPU, f32) == "needs model.dtype=bfloat16, not float32"
    assert FusedCpuRunner.supports.refusal(torch.device("cuda"), bf16) == "runs on cpu, not cuda"
    assert TorchRunner.supports.refusal(torch.device("meta"), f32) is None
    assert CudaGraphRunner.supports.graphs and not CudaGraphRunner.supports.aux_per_step
    assert not TorchRunner.supports.graphs and TorchRunner.supports.aux_per_step


def test_the_target_on_triton_is_the_step_runner_with_its_aux_layers(fp32):
    twin = BackendChoice("engine.attention_backend", "triton", "torch", "the check chose the twin")
    runner = RunnerFactory(attention_backend="triton").target(fp32, make_kv(fp32), graph_query_lens=(1, 3),
                                                               aux_layer_ids=(1,), attention=twin)
    assert type(runner) is CudaGraphRunner and runner.static.aux_layer_ids == (1,)
    assert runner.static.graph_query_lens == (1, 3) and not runner.static.graphs
    ref = TorchRunner(fp32, make_kv(fp32)).forward([SeqInput([5, 6, 7], 0, [0], [2])], aux_layer_ids=(1,))
    out = runner.forward([SeqInput([5, 6, 7], 0, [0], [2])])
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.aux[1][:3], ref.aux[1], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- tensor parallelism
class RecordingLink:
    """Rank 0's control link, recording what would be sent to the workers."""

    def __init__(self):
        self.sent: list[tuple] = []
        self.released: list[int] = []
        self._ids = 0

    def new_runner_id(self) -> int:
        self._ids += 1
        return self._ids

    def release_runner(self, rid: int) -> None:
        self.released.append(rid)

    def send(self, msg: tuple) -> None:
        self.sent.append(msg)


class RankZeroShard(Runner):
    """The torch backend's place on rank 0: records what it runs and whether every
    rank was inside the step then."""

    def __init__(self, shard: Shard):
        self.loaded = SimpleNamespace(tp=shard)
        self.model = SimpleNamespace(shard=shard)
        self.kv = SimpleNamespace(num_blocks=12, block_size=4)
        self.device = CPU
        self.shard = shard
        self.ran: list[tuple] = []

    def execute(self, batch, aux_layer_ids=(), device_token_ids=None):
        self.ran.append((list(batch.token_ids), tuple(aux_layer_ids), self.shard.in_step, device_token_ids))
        return ForwardOutput(torch.zeros(0, 1), torch.zeros(0, 1), {}, batch.row_offsets)


def test_rank0_sends_each_step_before_running_its_own_shard_inside_it():
    link = RecordingLink()
    shard = Shard(plan_shard(4, 2, 128, 512, 0, 2), group=None, model_id=7, link=link)
    inner = RankZeroShard(shard)
    runner = TensorParallelRunner(inner)
    assert runner.tensor_parallel_size == 2 and runner.kv is inner.kv
    assert link.sent == [("runner", 7, 1, 12, 4, 2)]  # the workers build a twin with the same blocks
    batch = StepBatch.from_inputs([SeqInput([0, 0], 3, [0, 1], [0, 1])], 4)
    runner.execute(batch, (1,), device_token_ids=torch.tensor([11, 12]))
    assert link.sent[1] == ("step", 1, batch, (1,)) and batch.token_ids == [11, 12]  # the drafter's ids, as ids
    assert inner.ran == [([11, 12], (1,), True, None)]  # inside the step, on the host's ids
    assert shard.in_step is False  # outside a step again: vocabulary-parallel layers join the workers


def test_a_view_of_a_sharded_model_is_refused_before_the_workers_hear_of_it():
    link = RecordingLink()
    shard = Shard(plan_shard(4, 2, 128, 512, 0, 2), group=None, model_id=1, link=link)
    view = RankZeroShard(shard)
    view.model = torch.nn.Identity()  # e.g. layer skipping's SkipModel over the shard
    with pytest.raises(ConfigError) as e:
        TensorParallelRunner(view)
    assert str(e.value).startswith("parallelism.tensor_parallel_size: a Identity over the sharded model")
    assert link.sent == []

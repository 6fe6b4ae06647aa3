"""Kernels that degrade instead of dying, checked on the CPU: Triton's interpreter stands in
for the GPU (``engine.attention_backend=triton`` / ``engine.rejection_backend=triton`` run the
kernels there), and each failure a GPU can meet is injected -- a kernel entry point that
raises, a kernel whose output differs from its twin, a binary that does not compile at the
start-up warm-up, a graph capture that raises.  Every time the engine still serves, with
greedy output equal to plain decoding (seeded sampled output equal to the torch twin's),
reports the backend it uses (``ModelInfo``, ``/metrics``, ``/v1/models``, GetModelInfo) and
logs ONE warning line.  Also: no step compiles a binary the warm-up did not (the runtime
launches' specialization keys, computed with Triton's own binder), and the warm-up's
enumeration covers every step shape a runner accepts."""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest
import torch
from engine_utils import greedy, random_prompts, run, tiny_config

pytest.importorskip("triton")

import specserve.kernels.paged_attention as pa  # noqa: E402
import specserve.kernels.rejection_kernel as rk  # noqa: E402
from specserve.config import ServerConfig, validate_config  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.errors import ConfigError  # noqa: E402
from specserve.executor.backends.cuda_graphs import CudaGraphRunner  # noqa: E402
from specserve.executor.static_runner import StaticStepRunner  # noqa: E402
from specserve.kernels import backends, launches  # noqa: E402
from specserve.kernels.paged_attention import interpreter_active  # noqa: E402
from specserve.kernels.specializations import (  # noqa: E402
    AttentionGeometry,
    StepShape,
    _plan_key,
    rejection_launches,
    runner_step_shapes,
)
from specserve.request import SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not interpreter_active(), reason="triton was imported without TRITON_INTERPRET"),
    pytest.mark.timeout(600),
]

PROMPTS = random_prompts(3, seed=5, hi=12)
GREEDY = [greedy(10) for _ in PROMPTS]
SAMPLED = [SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=8, ignore_eos=True)
           for i in range(len(PROMPTS))]


def make_engine(model_dir, method: str | None = "ngram", **engine_keys) -> LLMEngine:
    cfg = tiny_config(model_dir, method, k=3)
    for key, value in engine_keys.items():
        setattr(cfg.engine, key, value)
    return LLMEngine(validate_config(cfg))


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return run(make_engine(tiny_llama, None), PROMPTS, GREEDY)


def backend_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == backends.__name__ and r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- attention


def test_triton_attention_serves_exactly_and_is_reported(tiny_llama, plain, caplog):
    eng = make_engine(tiny_llama, attention_backend="triton")
    assert eng.info.attention_backend == "triton" and eng.runner.static.impl == "triton"
    assert run(eng, PROMPTS, GREEDY) == plain
    assert backend_warnings(caplog) == []


def _raise(*args, **kwargs):
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


def _off_by_one(*args, **kwargs):
    return pa.paged_attention_reference(*args, **{k: v for k, v in kwargs.items() if k not in ("block_q", "block_n")}) + 1


ATTENTION_FAULTS = {
    "attention raises": ("paged_attention_triton", _raise, "its start-up check: RuntimeError: CUDA error"),
    "kv write raises": ("write_kv_triton", _raise, "its start-up check: RuntimeError: CUDA error"),
    "attention differs": ("paged_attention_triton", _off_by_one, "KernelCheckError: paged_attention: differs"),
}


@pytest.mark.parametrize("fault", list(ATTENTION_FAULTS))
def test_a_failing_attention_kernel_falls_back_to_the_twin(tiny_llama, plain, caplog, monkeypatch, fault):
    name, fake, why = ATTENTION_FAULTS[fault]
    monkeypatch.setattr(pa, name, fake)
    eng = make_engine(tiny_llama, attention_backend="triton")
    assert eng.info.attention_backend == "torch" and eng.runner.static.impl == "torch"
    warnings = backend_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("engine.attention_backend=triton: the Triton kernel failed ") and why in warnings[0]
    assert warnings[0].endswith("; using the torch twin") and "\n" not in warnings[0]
    assert run(eng, PROMPTS, GREEDY) == plain
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_a_binary_that_does_not_compile_at_warm_up_falls_back(tiny_llama, plain, caplog, monkeypatch):
    compiled = []

    def compile_only(launch):
        compiled.append(launch.kernel.name)
        if launch.kernel.name == "attn_kernel":
            raise RuntimeError("PTXASError: ptxas fatal: out of registers")

    monkeypatch.setattr(launches, "compile_only", compile_only)
    eng = make_engine(tiny_llama, attention_backend="triton")
    assert compiled[:1] == ["write_kv_kernel"] and compiled[-1] == "attn_kernel"  # warmed, then failed
    assert eng.info.attention_backend == "torch" and eng.runner.static.impl == "torch"
    warnings = backend_warnings(caplog)
    assert warnings == ["engine.attention_backend=triton: the Triton kernel failed to compile attn_kernel: "
                        "RuntimeError: PTXASError: ptxas fatal: out of registers; using the torch twin"]
    assert run(eng, PROMPTS, GREEDY) == plain


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graphs_off_does_not_choose_the_attention_backend(tiny_llama, backend):
    eng = make_engine(tiny_llama, attention_backend=backend, cuda_graphs="off")
    assert eng.info.attention_backend == backend
    model = eng.target
    for graphs in (False, None):  # None: the device's default (off on the CPU)
        runner = StaticStepRunner(model, eng.kv, max_num_seqs=2, max_num_tokens=16, attention_impl=backend,
                                  use_graphs=graphs)
        assert runner.impl == backend and not runner.use_graphs


def test_auto_on_the_cpu_is_the_twin_without_a_check_or_a_warning(caplog):
    def check():
        raise AssertionError("auto on the CPU must not run the Triton check")

    choice = backends.choose(backends.ATTENTION_KEY, "auto", torch.device("cpu"), check)
    assert (choice.used, choice.reason) == ("torch", "the Triton kernels run on CUDA, not cpu")
    assert backends.choose(backends.ATTENTION_KEY, "torch", "cpu", check).used == "torch"
    assert backend_warnings(caplog) == []


def test_backend_keys_are_validated(tiny_llama):
    for key in ("attention_backend", "rejection_backend"):
        cfg = tiny_config(tiny_llama)
        setattr(cfg.engine, key, "cuda")
        with pytest.raises(ConfigError, match=f"engine.{key}: must be one of auto, triton, torch; got 'cuda'"):
            validate_config(cfg)


# --------------------------------------------------------------------------- rejection


@pytest.fixture(scope="module")
def sampled_on_the_twin(tiny_llama):
    return run(make_engine(tiny_llama, rejection_backend="torch"), PROMPTS, SAMPLED)


def test_triton_verification_equals_the_twin(tiny_llama, sampled_on_the_twin, caplog, monkeypatch):
    seen = _triton_keys(monkeypatch)
    eng = make_engine(tiny_llama, rejection_backend="triton")
    assert eng.info.rejection_backend == "triton" and eng.sampler.use_kernel is True
    seen.clear()  # the start-up check's own launches
    assert run(eng, PROMPTS, SAMPLED) == sampled_on_the_twin
    assert backend_warnings(caplog) == []
    # every verification launched a binary the start-up compiled (any batch, any draft count)
    warmed = {(x.kernel.fn.__name__, *launches.specialization(x)[1:])
              for x in rejection_launches("strict", eng.target.arch.vocab_size, "cpu")}
    assert seen and {k for k in seen if k[0] == "_rejection_kernel"} == set(seen) <= warmed


def _wrong_tokens(*args, **kwargs):
    ids, acc = rk_original(*args, **kwargs)
    return torch.where(ids >= 0, (ids + 1) % args[0].shape[-1], ids), acc


rk_original = rk.rejection_sample_triton


@pytest.mark.parametrize("fake, why", [(_raise, "RuntimeError: CUDA error"),
                                       (_wrong_tokens, "KernelCheckError: rejection (strict): tokens differ")])
def test_a_failing_rejection_kernel_falls_back_to_the_twin(tiny_llama, sampled_on_the_twin, caplog, monkeypatch,
                                                           fake, why):
    monkeypatch.setattr(rk, "rejection_sample_triton", fake)
    eng = make_engine(tiny_llama, rejection_backend="triton")
    assert eng.info.rejection_backend == "torch" and eng.sampler.use_kernel is False
    warnings = backend_warnings(caplog)
    assert len(warnings) == 1 and warnings[0].startswith("engine.rejection_backend=triton: ") and why in warnings[0]
    assert run(eng, PROMPTS, SAMPLED) == sampled_on_the_twin


# --------------------------------------------------------------------------- graph capture


class EagerGraphs:
    """A CPU stand-in for CUDA graphs: capture runs the step once and keeps it; replay runs
    it again over the same static buffers (what a replay does)."""

    def __init__(self):
        self.replays = 0

    def __call__(self):
        return self

    def synchronize(self) -> None:
        pass

    def capture(self, fn):
        outer, out = self, fn()

        class Replay:
            def replay(self):
                outer.replays += 1
                fn()

        return Replay(), out


def test_a_failed_capture_leaves_that_key_eager(tiny_llama, caplog):
    params = [greedy(n) for n in (6, 12, 18)]  # the batch shrinks: buckets 4, 2 and 1 all run
    want = run(make_engine(tiny_llama, None), PROMPTS, params)
    eng = make_engine(tiny_llama)
    graphs = EagerGraphs()
    static = StaticStepRunner(eng.target, eng.kv, max_num_seqs=4, max_num_tokens=64, graph_query_lens=(1, 2, 3, 4),
                              attention_impl="torch", use_graphs=True, graphs_api=graphs)
    capture_one = static._capture_one

    def capture_or_fail(maker, bucket, q):
        if (bucket, q) == (4, 1):  # e.g. a stray synchronisation inside the step
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return capture_one(maker, bucket, q)

    static._capture_one = capture_or_fail
    with caplog.at_level(logging.WARNING):
        static.capture(progress=False)
    assert static.eager_keys == [(4, 1)]
    assert set(static.graphs) == {(b, q) for b in (1, 2, 4) for q in (1, 2, 3, 4)} - {(4, 1)}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["CUDA graph capture failed for 1 of 12 (batch, q) keys [(4, 1)] (first: RuntimeError: CUDA "
                        "error: operation not permitted when stream is capturing); those steps run eagerly"]
    eng.runner, eng.uniform_steps = CudaGraphRunner(static), True
    keys = []
    orig = static.run

    def spy(batch, device_token_ids=None):
        keys.append(static.graph_key(batch))
        return orig(batch, device_token_ids)

    static.run = spy
    assert run(eng, PROMPTS, params) == want
    assert (4, 1) in keys and graphs.replays == sum(k in static.graphs for k in keys) > 0
    assert eng.blocks.num_free == eng.blocks.num_blocks


# --------------------------------------------------------------------------- specializations


def _triton_keys(monkeypatch) -> list[tuple[str, tuple]]:
    """Record the specialization key of every kernel launch, computed by Triton's own
    binder from the arguments the interpreted kernel receives."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    seen: list[tuple[str, tuple]] = []
    orig = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        jit = JITFunction(self.fn, do_not_specialize=self.kwargs.get("do_not_specialize"),
                          do_not_specialize_on_alignment=self.kwargs.get("do_not_specialize_on_alignment"))
        binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        _, spec, options = binder(*args, **kwargs)
        seen.append((self.fn.__name__, launches._hashable(spec), tuple(sorted(options.items()))))
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    return seen


def test_every_step_uses_a_binary_the_warm_up_compiled(tiny_llama, plain, monkeypatch):
    """Decode at every batch size (eager, as with cuda_graphs=off), padded verification and
    ragged prefill steps launch only binaries the warm-up enumerated: nothing compiles while
    serving.  (Before, each batch size of a decode step was a binary of its own: the batch
    size equal to 1 became a constant and the binary search's step count a constexpr.)"""
    seen = _triton_keys(monkeypatch)
    eng = make_engine(tiny_llama, attention_backend="triton")
    static = eng.runner.static
    warmed = {(launch.kernel.fn.__name__, *launches.specialization(launch)[1:]) for launch in static.kernel_launches()}
    seen.clear()  # the start-up check's own launches
    prompts = random_prompts(5, seed=8, hi=20)
    assert run(eng, prompts, [greedy(6) for _ in prompts]) == run(make_engine(tiny_llama, None), prompts,
                                                                  [greedy(6) for _ in prompts])
    eng.uniform_steps = True  # padded verification, as CUDA graphs replay it
    run(eng, prompts[:3], [greedy(5) for _ in prompts[:3]])
    attention = {k for k in seen if k[0] == "_attn_kernel"}
    assert attention and {k for k in seen} <= warmed
    assert len(warmed) <= 12  # attention binaries of every step shape, plus the KV write


def test_decode_steps_of_every_batch_size_share_one_binary(tiny_llama, monkeypatch):
    seen = _triton_keys(monkeypatch)
    model = make_engine(tiny_llama, None)
    static = StaticStepRunner(model.target, model.kv, max_num_seqs=8, max_num_tokens=64, attention_impl="triton",
                              use_graphs=False)
    from specserve.executor.batch import SeqInput, StepBatch

    for B in range(1, 9):
        seen.clear()
        inputs = [SeqInput([5], 3, [b], [0]) for b in range(B)]
        static.run(StepBatch.from_inputs(inputs, model.kv.block_size))
        keys = {k for k in seen if k[0] == "_attn_kernel"}
        if B == 1:
            first = keys
        assert keys == first, f"a decode step of {B} sequences launches another binary"


def test_the_enumerated_step_shapes_cover_every_step_a_runner_accepts():
    """Brute force over every (sequences, tokens, longest query) a runner of this size can
    run, decode steps with and without split-KV: no tile plan outside the enumeration."""
    for dtype in (torch.bfloat16, torch.float32):
        g = AttentionGeometry(9, 3, 64, 16, None, dtype)
        kw = dict(max_num_seqs=8, max_tokens=96, graph_query_lens=(1, 2, 3, 4, 5, 6), max_seq_len=8192)
        shapes = runner_step_shapes(g, split_kv=True, num_sms=132, **kw)
        enumerated = {_plan_key(g, s) for s in shapes}
        assert len(enumerated) == len(shapes) <= 12
        from specserve.kernels.paged_attention import default_num_splits

        for B in range(1, 9):
            for q in range(1, 97):
                for T in range(q + B - 1, min(B * q, 96) + 1):
                    splits = default_num_splits(B, 9, 3, 64, 1, 8192, 132) if q == 1 else 1
                    assert _plan_key(g, StepShape(B, T, q, splits)) in enumerated, (B, T, q)


# --------------------------------------------------------------------------- reporting


def test_servers_report_the_backends_in_use(tiny_llama, monkeypatch):
    import grpc

    from specserve.engine.async_engine import AsyncEngine
    from specserve.server import start_servers
    from specserve.v1 import specserve_pb2 as pb
    from specserve.v1 import specserve_pb2_grpc as pb_grpc

    monkeypatch.setattr(pa, "paged_attention_triton", _raise)
    eng = make_engine(tiny_llama, attention_backend="triton", rejection_backend="triton")
    assert (eng.info.attention_backend, eng.info.rejection_backend) == ("torch", "triton")
    cfg = ServerConfig(host="127.0.0.1", grpc_port=0, http_port=0, api_key=None, api_key_env="",
                       metrics_key_env="")
    handle = start_servers(cfg, AsyncEngine(eng, max_queue=8))
    try:
        base = f"http://127.0.0.1:{handle.http_port}"
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            text = r.read().decode()
        assert ('specserve_backend_info{attention="torch",method="ngram",model_name="tiny",rejection="triton"} 1.0'
                in text), [line for line in text.splitlines() if "backend" in line]
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            card = json.loads(r.read())["data"][0]
        assert card["kernels"] == {"attention": "torch", "rejection": "triton"}
        with grpc.insecure_channel(f"127.0.0.1:{handle.grpc_port}") as ch:
            info = pb_grpc.SpecServeStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert (info.attention_backend, info.rejection_backend) == ("torch", "triton")
    finally:
        handle.stop()

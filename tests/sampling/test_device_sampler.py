"""The device sampler (specserve.sampling.sampler) against the reference path, and its step contract.

The reference path: ``logits_to_probs`` on the gathered rows, then ``verify_chain`` on the
probabilities (or on the argmax tokens when every request is greedy).
Fed the same keyed uniforms (``step_uniforms``), the device sampler must emit the same
tokens and accepted counts (rows without a draft distribution verified strictly, as the
engine verifies them); seeded requests must be unchanged by their batch neighbours; strict and
probabilistic must converge to the target; and the whole step must be capturable: no host
synchronisation, no data-dependent shapes, one graph under ``torch.compile(fullgraph=True)``.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specserve.sampling import (
    DeviceSampler,
    RejectionUniforms,
    RequestTensors,
    SamplerFlags,
    SamplingTensors,
    logits_to_probs,
    process_logits,
    sample_from_probs,
    seed_to_int64,
    step_uniforms,
    unpack,
    verify_chain,
    verify_step,
)

REPO = Path(__file__).resolve().parents[2]
METHODS = [("strict", False), ("probabilistic", False), ("probabilistic", True), ("synthetic", False)]


class Case:
    """One step of a batch: logits rows as the runner lays them out, drafts, per-request parameters."""

    def __init__(self, seed, B, K, V, greedy=0.3, min_p="mixed", all_greedy=False):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.rand(*s, generator=g)  # noqa: E731
        self.K, self.V = K, V
        self.n = torch.randint(0, K + 1, (B,), generator=g)  # (B,) drafts per request
        self.n[0] = 0
        if B > 1:
            self.n[1] = K
        first = torch.cat([torch.zeros(1, dtype=torch.int64), (self.n + 1).cumsum(0)[:-1]])  # (B,)
        self.rows = first.tolist()
        R = int((self.n + 1).sum())
        logits = torch.randn(R, V, generator=g) * 3  # peaked enough for drafts to be accepted
        logits[r(R, V) < 0.05] = float("-inf")  # masked vocabulary entries
        logits[::3] = (logits[::3] * 2).round() / 2  # ties (top-k keeps them)
        logits[:, 0] = logits[:, 0].clamp(min=-30.0)  # every row keeps a finite logit
        self.logits = logits
        j = torch.arange(K + 1)
        self.row_index = first[:, None] + torch.minimum(j[None, :], self.n[:, None])  # (B, K+1)
        is_greedy = (r(B) < greedy) | torch.tensor(all_greedy).expand(B)
        temps = torch.where(is_greedy, torch.zeros(B), 0.3 + 1.2 * r(B))
        if not all_greedy and B > 2:
            temps[2] = 0.9  # at least one sampled row
        if B > 3 and is_greedy[3]:
            temps[3] = 5e-6  # below GREEDY_EPS: greedy too
        self.temps = temps.tolist()
        self.top_ks = torch.where(r(B) < 0.4, torch.randint(1, V + 5, (B,), generator=g), 0).tolist()
        self.top_ps = torch.where(r(B) < 0.4, 0.3 + 0.65 * r(B), torch.ones(B)).tolist()
        mp = 0.01 + 0.3 * r(B)
        self.min_ps = {"mixed": torch.where(r(B) < 0.5, mp, 0.0), "all": mp, "none": torch.zeros(B)}[min_p].tolist()
        self.seeds = [int(s) for s in torch.randint(-(2**63), 2**63 - 1, (B,), generator=g)]
        self.seeds[0] = 2**64 - 5  # an unsigned seed, as the engine accepts them
        self.positions = torch.randint(0, 10**6, (B,), generator=g).tolist()
        # drafts: the argmax of the verified row (often accepted) or a random token
        argmax = logits.argmax(-1)[self.row_index[:, :K]]  # (B, K)
        drafts = torch.where(r(B, K) < 0.7, argmax, torch.randint(0, V, (B, K), generator=g))
        drafts[j[None, :K] >= self.n[:, None]] = -1
        self.drafts = drafts
        q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
        self.draft_probs = 0.5 * q + 0.5 * torch.nn.functional.one_hot(drafts.clamp(min=0), V).float()

    @property
    def B(self):
        return len(self.rows)

    def requests(self, flags=None, idx=None):
        idx = list(range(self.B)) if idx is None else idx
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        req = RequestTensors.build(pick(self.temps), pick(self.top_ks), pick(self.top_ps), pick(self.min_ps),
                                   pick(self.seeds), pick(self.positions))
        if flags is not None:
            req.flags = flags
        return req

    def draft_lists(self):
        return [d[:n].tolist() for d, n in zip(self.drafts, self.n)]


def device_result(case, method, with_q, flags=None, **kw):
    return verify_step(
        case.logits, case.row_index, case.drafts, case.n, case.requests(flags), method=method,
        synthetic_acceptance_rate=0.6 if method == "synthetic" else None,
        draft_probs=case.draft_probs if with_q else None, **kw,
    )


def todays_result(case, method, with_q, idx=None):
    """The reference path on requests ``idx`` (all by default), fed the same keyed uniforms:
    probabilities, then ``verify_chain``; probabilistic without q is strict verification."""
    idx = list(range(case.B)) if idx is None else idx
    K, V = case.K, case.V
    row_index, drafts, n = case.row_index[idx], case.drafts[idx], case.n[idx]
    B = len(idx)
    seeds = torch.tensor([seed_to_int64(case.seeds[i]) for i in idx])
    u = step_uniforms(seeds, torch.tensor([case.positions[i] for i in idx]), K)
    temps = [case.temps[i] for i in idx]
    if all(t < 1e-5 for t in temps) and method != "synthetic":
        out = verify_chain(None, drafts, n, target_tokens=case.logits.argmax(dim=-1)[row_index])
    else:
        st = SamplingTensors.build(temps, [case.top_ks[i] for i in idx], [case.top_ps[i] for i in idx],
                                   [case.min_ps[i] for i in idx]).repeat_interleave(K + 1)
        probs = logits_to_probs(case.logits[row_index].view(B * (K + 1), V), st).view(B, K + 1, V)
        out = verify_chain(
            probs, drafts, n, case.draft_probs[idx] if with_q else None, u,
            "strict" if method == "probabilistic" and not with_q else method,
            0.6 if method == "synthetic" else None, use_kernel=False,
        )
    return torch.cat([out.output_token_ids, out.num_accepted[:, None]], dim=1)


# --- the same results as today ---------------------------------------------------------------


@pytest.mark.parametrize("method, with_q", METHODS)
@pytest.mark.parametrize("K", [0, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_todays_path_request_by_request(method, with_q, K, seed):
    case = Case(seed * 10 + K, B=10, K=K, V=37)
    packed = device_result(case, method, with_q)
    assert packed.shape == (10, K + 2) and packed.dtype == torch.int64
    for b in range(case.B):  # today's path on the request alone
        assert packed[b].tolist() == todays_result(case, method, with_q, [b])[0].tolist(), b
    # and with the batch's own flags, where today's path is itself independent of neighbours (below)
    assert torch.equal(device_result(case, method, with_q, SamplerFlags.conservative()), packed)


@pytest.mark.parametrize("method, with_q", METHODS)
def test_the_cases_are_not_trivial(method, with_q):
    """Over the cases above: sampled rows accept and reject drafts; rows accept all K."""
    sampled_accepts = rejects = all_accepted = 0
    for seed in (0, 1, 2):
        for K in (2, 4):
            case = Case(seed * 10 + K, B=10, K=K, V=37)
            acc = device_result(case, method, with_q)[:, -1]
            sampled = torch.tensor(case.temps) >= 1e-5
            sampled_accepts += int((acc[sampled] > 0).sum())
            rejects += int((acc < case.n).sum())
            all_accepted += int(((acc == K) & (case.n == K)).sum())
    assert sampled_accepts >= 3 and rejects >= 3 and all_accepted >= 2, (sampled_accepts, rejects, all_accepted)


@pytest.mark.parametrize("method, with_q", METHODS)
@pytest.mark.parametrize("min_p", ["none", "all"])
def test_matches_todays_batched_path(method, with_q, min_p):
    # With every sampled row on min-p, or none, logits_to_probs does not couple rows.
    case = Case(7, B=12, K=3, V=29, min_p=min_p)
    assert torch.equal(device_result(case, method, with_q), todays_result(case, method, with_q))


@pytest.mark.parametrize("method, with_q", METHODS)
def test_all_greedy_batches_equal_greedy_verification(method, with_q):
    case = Case(3, B=9, K=3, V=41, all_greedy=True)
    assert case.requests().flags.all_greedy
    packed = device_result(case, method, with_q)
    assert torch.equal(packed, todays_result(case, method, with_q))
    # through the probabilities (flags that do not know the batch is greedy): the same tokens
    assert torch.equal(device_result(case, method, with_q, SamplerFlags.conservative()), packed)
    if method != "synthetic":
        t = case.logits.argmax(-1)[case.row_index]  # (B, K+1) greedy decoding of the target
        for b, (toks, a) in enumerate(unpack(packed)):
            assert toks == t[b, : a + 1].tolist()


def test_process_logits_is_logits_to_probs_row_by_row():
    g = torch.Generator().manual_seed(5)
    N, V = 24, 50
    logits = torch.randn(N, V, generator=g) * 2
    logits[::4] = logits[::4].round()  # ties
    temps = [0.0 if i % 5 == 0 else 0.4 + 0.05 * i for i in range(N)]
    ks = [0 if i % 3 else 1 + i % 11 for i in range(N)]
    ps = [1.0 if i % 2 else 0.5 + 0.02 * i for i in range(N)]
    mps = [0.0 if i % 4 < 2 else 0.02 * i for i in range(N)]
    req = RequestTensors.build(temps, ks, ps, mps, [0] * N, [0] * N)
    args = (logits, req.temperature, req.top_k, req.top_p, req.min_p)
    probs = process_logits(*args, req.flags)
    assert torch.equal(probs, process_logits(*args, SamplerFlags.conservative()))  # flags only skip work
    for i in range(N):
        alone = logits_to_probs(logits[i : i + 1], SamplingTensors.build([temps[i]], [ks[i]], [ps[i]], [mps[i]]))
        assert torch.equal(probs[i], alone[0]), i
        if mps[i] == 0.0 or temps[i] == 0.0:  # a neighbour's min-p does not touch this row
            others = RequestTensors.build([temps[i]], [ks[i]], [ps[i]], [0.0], [0], [0])
            assert torch.equal(process_logits(logits[i : i + 1], others.temperature, others.top_k, others.top_p,
                                              others.min_p, SamplerFlags.conservative())[0], probs[i])


# --- seeds and neighbours --------------------------------------------------------------------


def run_request_in_batches(sampler_args, x, neighbours, position, steps=4):
    """Request x (a dict) verified for ``steps`` steps at row ``position`` among ``neighbours``."""
    K, V = sampler_args["K"], sampler_args["V"]
    batch = neighbours[:position] + [x] + neighbours[position:]
    sampler = DeviceSampler(8, K, "cpu", method=sampler_args["method"], vocab_size=V,
                            synthetic_acceptance_rate=sampler_args.get("rate"))
    positions = [r["position"] for r in batch]
    outs = []
    for step in range(steps):
        logits = torch.cat([r["logits"][step] for r in batch])  # each request: K+1 rows per step
        rows = [i * (K + 1) for i in range(len(batch))]
        inputs = sampler.prepare(
            rows, [r["drafts"][step] for r in batch], [r["temp"] for r in batch], [r["top_k"] for r in batch],
            [r["top_p"] for r in batch], [r["min_p"] for r in batch], [r["seed"] for r in batch], positions,
            pad_to=8,
        )
        got = sampler.fetch(sampler.sample(logits, inputs), len(batch))
        outs.append(got[position])
        positions = [p + len(toks) for p, (toks, _) in zip(positions, got)]  # the tokens each emitted
    return outs


def random_request(g, K, V, steps=4, seed=None, temp=None, min_p=None):
    r = lambda: torch.rand((), generator=g).item()  # noqa: E731
    logits = [torch.randn(K + 1, V, generator=g) * 2 for _ in range(steps)]
    drafts = [[int(t) for t in lg[: int(torch.randint(0, K + 1, (), generator=g))].argmax(-1)] for lg in logits]
    return dict(
        logits=logits, drafts=drafts,
        temp=temp if temp is not None else (0.0 if r() < 0.3 else 0.5 + r()),
        top_k=int(torch.randint(0, V, (), generator=g)) if r() < 0.5 else 0,
        top_p=0.5 + 0.5 * r() if r() < 0.5 else 1.0,
        min_p=min_p if min_p is not None else (0.1 * r() if r() < 0.5 else 0.0),
        seed=seed if seed is not None else int(torch.randint(-(2**62), 2**62, (), generator=g)),
        position=int(torch.randint(0, 1000, (), generator=g)),
    )


@pytest.mark.parametrize("method", ["strict", "probabilistic", "synthetic"])
def test_seeded_stream_is_unchanged_by_neighbours(method):
    K, V = 3, 23
    args = dict(K=K, V=V, method=method, rate=0.5 if method == "synthetic" else None)
    g = torch.Generator().manual_seed(11)
    x = random_request(g, K, V, seed=2**64 - 99, temp=0.8, min_p=0.0)
    alone = run_request_in_batches(args, x, [], 0)
    crowd = [random_request(g, K, V) for _ in range(6)]
    crowd[0]["seed"], crowd[0]["position"] = x["seed"], x["position"] + 1  # same seed, shifted positions
    crowd[1]["min_p"], crowd[1]["temp"] = 0.2, 1.1  # a min-p neighbour
    assert run_request_in_batches(args, x, crowd, 3) == alone
    assert run_request_in_batches(args, x, crowd[::-1][:4], 0) == alone
    assert run_request_in_batches(args, x, crowd[2:], 4) == alone
    # the key matters: another seed, or another position, gives other tokens somewhere
    assert run_request_in_batches(args, dict(x, seed=12345), [], 0) != alone
    assert run_request_in_batches(args, dict(x, position=x["position"] + 7), [], 0) != alone


# --- convergence to the target ---------------------------------------------------------------


def assert_converges(tokens, p, reference, V):
    """vLLM's criterion (as in test_rejection): from 10 samples to N, the distance to p shrinks
    20x more than the distance to an unrelated distribution; the final distance to p is within
    3x the noise of an exact sampler."""
    N = tokens.numel()
    assert N >= 20_000, f"only {N} samples"
    chunks = torch.nn.functional.one_hot(tokens[: N // 10 * 10].view(-1, 10), V).float().mean(1)
    full = torch.bincount(tokens, minlength=V).float() / N
    l1 = lambda emp, dist: (emp - dist).abs().sum(-1).mean().item()  # noqa: E731
    assert l1(chunks, p) / l1(full, p) > 20 * l1(chunks, reference) / l1(full, reference)
    noise = (2 * p * (1 - p) / (math.pi * N)).sqrt().sum().item()
    assert l1(full, p) < 3 * noise, (l1(full, p), noise)


@pytest.mark.parametrize("method, with_q", [("strict", False), ("probabilistic", True), ("probabilistic", False)])
def test_emitted_tokens_follow_the_processed_target(method, with_q):
    K, V, N = 2, 10, 40_000
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(K + 1, V, generator=g) * 1.5  # (K+1, V) one context, N independent draws
    temp, top_k, top_p = 0.8, 8, 0.97
    p = logits_to_probs(logits, SamplingTensors.build([temp] * (K + 1), [top_k] * (K + 1), [top_p] * (K + 1),
                                                      [0.0] * (K + 1)))  # the processed target
    assert (p == 0).any()  # the filters removed something
    q = 0.5 * p[:K] + 0.5 * torch.softmax(torch.randn(K, V, generator=g), -1)
    drafts = sample_from_probs(q.repeat(N, 1), torch.rand(N * K, generator=g)).view(N, K)
    req = RequestTensors.build([temp] * N, [top_k] * N, [top_p] * N, [0.0] * N, [777] * N,
                               (torch.arange(N) * (K + 1)).tolist())  # one seed, disjoint positions
    packed = verify_step(
        logits.repeat(N, 1), torch.arange(N * (K + 1)).view(N, K + 1), drafts, torch.full((N,), K), req,
        method=method, draft_probs=q.expand(N, K, V).contiguous() if with_q else None,
    )
    reference = torch.softmax(torch.randn(V, generator=g), -1)
    tokens, acc = packed[:, : K + 1], packed[:, K + 1]
    assert_converges(tokens[:, 0], p[0], reference, V)
    for j in range(1, K + 1):  # the token at position j, given the request got there, ~ p_j
        at_j = tokens[acc >= j, j]
        if at_j.numel() >= 20_000:
            assert_converges(at_j, p[j], reference, V)
    if with_q:
        assert (acc >= K).sum() >= 20_000  # the bonus position was checked


# --- capturability: no host synchronisation, static shapes, one graph ------------------------


def meta(t):
    return t.to("meta")


@pytest.mark.parametrize("method, with_q", METHODS)
@pytest.mark.parametrize("K", [0, 3])
def test_runs_on_the_meta_device(method, with_q, K):
    """Meta tensors have shapes and no data: any host read (item, tolist, bool, nonzero,
    boolean masks, copies to the CPU) raises.  The whole step runs there."""
    case = Case(2, B=6, K=K, V=19)
    for flags in (case.requests().flags, SamplerFlags.conservative(), SamplerFlags(all_greedy=True)):
        req = case.requests(flags)
        req_meta = RequestTensors(*(meta(getattr(req, f)) for f in
                                    ("temperature", "top_k", "top_p", "min_p", "seed", "position")), flags=flags)
        out = verify_step(
            meta(case.logits), meta(case.row_index), meta(case.drafts), meta(case.n), req_meta, method=method,
            synthetic_acceptance_rate=0.5 if method == "synthetic" else None,
            draft_probs=meta(case.draft_probs) if with_q else None,
        )
        assert out.device.type == "meta" and out.shape == (6, K + 2) and out.dtype == torch.int64


SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "allclose", "unique",
            "_unique", "_unique2", "unique_consecutive", "unique_dim", "argwhere", "nonzero_static"}


class SyncAudit(TorchDispatchMode):
    """Fails on every aten op that needs device values on the host (a sync on CUDA) or makes a
    data-dependent shape: item/bool/int (_local_scalar_dense), nonzero, boolean-mask indexing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []) or []
        )
        if name in SYNC_OPS or bool_index or (name == "repeat_interleave" and isinstance(args[0], torch.Tensor)
                                              and len(args) > 1 and isinstance(args[1], torch.Tensor)):
            raise AssertionError(f"host synchronisation or data-dependent shape: aten.{name}")
        return func(*args, **kwargs)


@pytest.fixture
def no_host_reads(monkeypatch):
    """Python-level reads of device values raise too (tolist does not go through aten)."""

    def forbid(name):
        def raiser(self, *a, **k):
            raise AssertionError(f"Tensor.{name} called during the step")

        monkeypatch.setattr(torch.Tensor, name, raiser)

    def activate():
        for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            forbid(name)

    return activate


def test_the_sync_audit_catches_todays_cpu_checks(no_host_reads):
    case = Case(4, B=6, K=2, V=17)
    u = RejectionUniforms(torch.rand(6, 2), torch.rand(6, 3))
    probs = torch.softmax(case.logits[case.row_index], -1)
    with pytest.raises(AssertionError, match="host synchronisation|Tensor\\."):
        with SyncAudit():  # verify_chain validates draft ids on the CPU by reading them
            verify_chain(probs, case.drafts, case.n, None, u, "strict")
    with pytest.raises(AssertionError, match="Tensor.tolist"):
        no_host_reads()
        step_uniforms(torch.tensor([1]), torch.tensor([0]), 2).accept.tolist()


@pytest.mark.parametrize("method, with_q", METHODS)
def test_no_host_synchronisation_on_cpu(method, with_q, no_host_reads):
    case = Case(5, B=8, K=3, V=31)
    expected = device_result(case, method, with_q)
    reqs = [case.requests(), case.requests(SamplerFlags.conservative())]
    outs = []
    no_host_reads()
    with SyncAudit():
        for req in reqs:
            outs.append(verify_step(
                case.logits, case.row_index, case.drafts, case.n, req, method=method,
                synthetic_acceptance_rate=0.6 if method == "synthetic" else None,
                draft_probs=case.draft_probs if with_q else None,
            ))
    for out in outs:
        assert torch.equal(out, expected)


def audited_backend():
    """aot_eager, plus a look at the traced ATen graph: dynamo can trace ``int(tensor)`` or
    ``.item()`` into the graph (aten._local_scalar_dense, a sync at run time) without a graph
    break, so fullgraph alone would not prove the absence of host reads."""
    from torch._dynamo.backends.common import aot_autograd

    def inspect(gm, example_inputs):
        ops = {n.target.overloadpacket.__name__ for n in gm.graph.nodes
               if n.op == "call_function" and hasattr(n.target, "overloadpacket")}
        assert ops and not ops & SYNC_OPS, sorted(ops & SYNC_OPS)
        assert {"sort", "cumsum"} <= ops or "argmax" in ops  # the graph is the step, not a stub
        return gm.forward

    return aot_autograd(fw_compiler=inspect)


def compiled_step(method, with_q, backend):
    rate = 0.6 if method == "synthetic" else None

    def step(logits, row_index, drafts, n, req, q):
        return verify_step(logits, row_index, drafts, n, req, method=method, synthetic_acceptance_rate=rate,
                           draft_probs=q if with_q else None)

    return torch.compile(step, fullgraph=True, dynamic=False, backend=backend)


def check_compiled(backend, cases):
    import torch._dynamo

    torch._dynamo.reset()
    for method, with_q, all_greedy in cases:
        fn = compiled_step(method, with_q, backend)
        first = Case(6, B=6, K=2, V=13, all_greedy=all_greedy)
        second = Case(6, B=6, K=2, V=13, all_greedy=all_greedy)  # new values, same shapes and flags
        g = torch.Generator().manual_seed(1)
        second.logits = torch.randn(second.logits.shape, generator=g) * 3
        second.seeds = [s + 1 for s in second.seeds[1:]] + [7]
        second.positions = [o + 5 for o in second.positions]
        second.temps = [t * 1.1 for t in second.temps]
        valid = second.drafts >= 0
        second.drafts[valid] = (second.drafts[valid] + 1) % 13
        flags = first.requests().flags
        assert second.requests().flags == flags
        for case in (first, second):
            got = fn(case.logits, case.row_index, case.drafts, case.n, case.requests(flags), case.draft_probs)
            assert torch.equal(got, device_result(case, method, with_q, flags)), (method, with_q, all_greedy)
        torch._dynamo.reset()


@pytest.mark.parametrize("cases", [
    [("probabilistic", True, False), ("strict", False, True)],
    [("synthetic", False, False), ("strict", False, False)],
])
def test_compiles_to_one_graph(cases):
    """fullgraph=True: a graph break (data-dependent shape, untraceable call) is an error; the
    traced ATen graph holds no op that reads device values; the same values come out as in
    eager mode, and new values with the same shapes do not recompile."""
    import torch._dynamo

    with torch._dynamo.config.patch(error_on_recompile=True):
        check_compiled(audited_backend(), cases)


@pytest.mark.slow
def test_compiles_with_inductor():
    """Inductor's generated C++ gives the same tokens (Philox integer ops included); ~1 min on 2 cores."""
    check_compiled("inductor", [("probabilistic", True, False)])


# --- the persistent buffers and the one copy each way ---------------------------------------


@pytest.mark.parametrize("K", [0, 3])  # K = 0: the plain decoding step
def test_device_sampler_round_trip_equals_verify_step(K):
    case = Case(9, B=7, K=K, V=43)
    sampler = DeviceSampler(16, K, "cpu", method="probabilistic", vocab_size=43)
    inputs = sampler.prepare(case.rows, case.draft_lists(), case.temps, case.top_ks, case.top_ps, case.min_ps,
                             case.seeds, case.positions)
    assert torch.equal(inputs.row_index, case.row_index) and torch.equal(inputs.draft_ids, case.drafts)
    assert torch.equal(inputs.num_drafts, case.n)
    packed = sampler.sample(case.logits, inputs)
    assert torch.equal(packed, device_result(case, "probabilistic", False))
    out = sampler.fetch(packed)
    # the shape the engine's _verify_batch returns: (tokens emitted, drafts accepted)
    assert out == [(row[: row[-1] + 1], row[-1]) for row in packed.tolist()]
    assert all(len(toks) == a + 1 and a <= n for (toks, a), n in zip(out, case.n.tolist()))


def test_prepare_reuses_the_same_buffers_and_pads():
    case = Case(10, B=5, K=2, V=21)
    sampler = DeviceSampler(8, 2, "cpu", method="strict", vocab_size=21)
    args = (case.draft_lists(), case.temps, case.top_ks, case.top_ps, case.min_ps, case.seeds, case.positions)
    padded = sampler.prepare(case.rows, *args, pad_to=8)
    ptrs = [t.data_ptr() for t in (padded.row_index, padded.draft_ids, padded.num_drafts,
                                   padded.requests.temperature, padded.requests.seed, padded.requests.position)]
    result = sampler.sample(case.logits, padded)
    assert result.shape == (8, 4) and padded.num_real == 5
    assert padded.requests.temperature[5:].tolist() == [0.0] * 3 and padded.num_drafts[5:].tolist() == [0] * 3
    assert torch.equal(result[:5], device_result(case, "strict", False))
    smaller = sampler.prepare(case.rows[:3], *(a[:3] for a in args), pad_to=8)  # another batch, same graph
    assert [t.data_ptr() for t in (smaller.row_index, smaller.draft_ids, smaller.num_drafts,
                                   smaller.requests.temperature, smaller.requests.seed,
                                   smaller.requests.position)] == ptrs
    assert smaller.draft_ids[3:].eq(-1).all() and smaller.requests.flags.any_greedy
    assert len(sampler.fetch(sampler.sample(case.logits, smaller), 3)) == 3


def test_prepare_and_verify_errors_name_the_argument():
    sampler = DeviceSampler(4, 2, "cpu", vocab_size=10)
    good = dict(rows=[0, 3], drafts=[[1, 2], []], temperatures=[1.0, 0.0], top_ks=[0, 0], top_ps=[1.0, 1.0],
                min_ps=[0.0, 0.0], seeds=[1, 2], positions=[0, 0])
    for change, match in [
        (dict(drafts=[[1, 2, 3], []]), "drafts"),
        (dict(drafts=[[1, 10], []]), "drafts"),
        (dict(drafts=[[1]]), "drafts"),
        (dict(seeds=[1, 2**64]), "seed"),
        (dict(positions=[0, -1]), "positions"),
        (dict(top_ps=[0.0, 1.0]), "top_ps"),
        (dict(rows=[0, -1]), "rows"),
        (dict(rows=[0] * 5, drafts=[[]] * 5), "max_num_seqs"),
    ]:
        with pytest.raises(ValueError, match=match):
            sampler.prepare(**(good | change))
    with pytest.raises(ValueError, match="pad_to"):
        sampler.prepare(**good, pad_to=1)
    inputs = sampler.prepare(**good)
    logits = torch.zeros(4, 10)
    args = (logits, inputs.row_index, inputs.draft_ids, inputs.num_drafts, inputs.requests)
    with pytest.raises(ValueError, match="method"):
        verify_step(*args, method="lossy")
    with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
        verify_step(*args, method="synthetic")
    with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
        verify_step(*args, method="strict", synthetic_acceptance_rate=0.5)
    with pytest.raises(ValueError, match="row_index"):
        verify_step(logits, inputs.row_index[:, :2], inputs.draft_ids, inputs.num_drafts, inputs.requests)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_step(*args, draft_probs=torch.zeros(2, 2, 9))
    with pytest.raises(ValueError, match="use_kernel"):
        verify_step(*args, method="synthetic", synthetic_acceptance_rate=0.5, use_kernel=True)


# --- the Triton kernel path (compiled on a GPU, interpreted on the CPU) ----------------------


def _kernel_device():
    pytest.importorskip("triton")
    from specserve.kernels.rejection_kernel import interpreter_active

    if interpreter_active():
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


@pytest.mark.parametrize("method, with_q", METHODS[:3])
def test_kernel_path_matches_the_torch_path(method, with_q):
    device = _kernel_device()
    if device is None:
        pytest.skip("triton was imported without TRITON_INTERPRET; see test_kernel_path_in_a_fresh_process")
    case = Case(13, B=6, K=2, V=24)
    expected = device_result(case, method, with_q, use_kernel=False)
    req = case.requests()
    req_dev = RequestTensors(*(getattr(req, f).to(device) for f in
                               ("temperature", "top_k", "top_p", "min_p", "seed", "position")), flags=req.flags)
    got = verify_step(case.logits.to(device), case.row_index.to(device), case.drafts.to(device),
                      case.n.to(device), req_dev, method=method,
                      draft_probs=case.draft_probs.to(device) if with_q else None, use_kernel=True)
    assert torch.equal(got.cpu(), expected)


def test_kernel_path_in_a_fresh_process():
    if _kernel_device() is not None:
        pytest.skip("test_kernel_path_matches_the_torch_path runs in-process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "-k", "test_kernel_path_matches_the_torch_path"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "3 passed" in res.stdout, res.stdout[-4000:] + res.stderr[-2000:]

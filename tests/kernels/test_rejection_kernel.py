"""The Triton rejection kernel against its torch reference (specserve.sampling.rejection).

Same inputs and uniforms must give exactly the same tokens.  Without a GPU the kernel runs
under Triton's interpreter on CPU tensors (see conftest.py); a separate test compiles it for
sm_90 so that compile errors show up on machines without a GPU too.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from specserve.kernels.rejection_kernel import interpreter_active, rejection_sample_triton  # noqa: E402
from specserve.sampling import RejectionUniforms, sample_from_probs, step_uniforms, verify_chain  # noqa: E402

INTERPRETED = interpreter_active()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
IN_PROCESS = DEVICE == "cuda" or INTERPRETED
in_process = pytest.mark.skipif(
    not IN_PROCESS, reason="triton was imported without TRITON_INTERPRET; see test_in_a_fresh_process"
)
REPO = Path(__file__).resolve().parents[2]


def normalize(x):
    return x / x.sum(-1, keepdim=True)


def make_case(seed, B, K, V):
    """Random verification inputs with the awkward parts: zero-probability tokens, one-hot
    (greedy) rows, 0..K drafts, drafts the drafter gives zero mass, uniforms at the edges and a
    row whose residual max(p - q, 0) is empty."""
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 5, -1)  # [B, K+1, V]
    target[torch.rand(B, K + 1, V, generator=g) < 0.3] = 0.0
    target[..., 0] += 1e-3  # every row keeps some mass
    target = normalize(target)
    greedy = torch.arange(B) % 5 == 4
    target[greedy] = torch.nn.functional.one_hot(target[greedy].argmax(-1), V).float()
    draft_probs = normalize(0.8 * target[:, :K] + 0.2 * torch.softmax(torch.randn(B, K, V, generator=g), -1))
    draft_probs[1, 0] = target[1, 0]  # p == q at (1, 0) ...
    drafts = sample_from_probs(draft_probs.reshape(-1, V), torch.rand(B * K, generator=g)).view(B, K)
    drafts[2] = torch.randint(0, V, (K,), generator=g)  # arbitrary drafts, q(d) may be 0
    if K:
        zero = torch.nonzero(target[1, 0] == 0)
        drafts[1, 0] = zero[0, 0] if len(zero) else 0  # ... and a draft both give zero mass
    drafts[greedy] = target[greedy, :K].argmax(-1)  # a perfect drafter on the greedy rows
    n = torch.randint(0, K + 1, (B,), generator=g)
    n[0], n[1], n[4] = 0, K, K  # row 4 is greedy: all accepted, then the bonus
    drafts[torch.arange(K)[None, :] >= n[:, None]] = -1
    u = RejectionUniforms(accept=torch.rand(B, K, generator=g), sample=torch.rand(B, K + 1, generator=g))
    u.sample[3] = 0.0
    u.sample[5] = 1.0 - 2**-24  # largest float32 below 1
    u.sample[6] = 1.0  # outside [0, 1), but guarded: the last token with mass
    # row 7 drafted exactly what strict will sample from the target: accepted on a sampled row
    drafts[7] = sample_from_probs(target[7, :K], u.sample[7, :K])
    n[7] = K
    if K:
        u.accept[4, 0] = 0.0
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(target), to(drafts), to(n), to(draft_probs), RejectionUniforms(to(u.accept), to(u.sample))


CASES = [  # (seed, B, K, V, block_v): V not a multiple of BLOCK_V, one block, exact multiples
    (0, 16, 3, 37, 16),
    (1, 10, 4, 100, 32),
    (2, 12, 2, 50, 64),
    (3, 12, 3, 64, 32),
]


@in_process
@pytest.mark.parametrize("seed, B, K, V, block_v", CASES)
@pytest.mark.parametrize("method", ["strict", "probabilistic"])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_kernel_matches_the_torch_reference(seed, B, K, V, block_v, method, with_draft_probs):
    target, drafts, n, q, u = make_case(seed, B, K, V)
    q = q if with_draft_probs else None
    ref = verify_chain(target, drafts, n, q, u, method, use_kernel=False)
    ids, num_accepted = rejection_sample_triton(target, drafts, n, q, u.accept, u.sample, method, block_v=block_v)
    assert ids.tolist() == ref.output_token_ids.tolist()
    assert num_accepted.tolist() == ref.num_accepted.tolist()
    # the case is not trivial: all accepted somewhere, sampled rows accepting and rejecting
    sampled = torch.arange(B, device=DEVICE) % 5 != 4
    assert (ref.num_accepted == K).any() and (ref.num_accepted[sampled] >= 1).any()
    assert (ref.num_accepted < n).any()


@in_process
@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_dispatch_with_use_kernel_and_no_drafts(method):
    target, _, _, _, _ = make_case(4, 8, 2, 40)
    target = target[:, :1].contiguous()  # K = 0: every row samples the bonus
    drafts = torch.empty(8, 0, dtype=torch.int64, device=DEVICE)
    n = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    u = step_uniforms(torch.arange(8, device=DEVICE), torch.zeros(8, dtype=torch.int64, device=DEVICE), 0)
    ref = verify_chain(target, drafts, n, None, u, method, use_kernel=False)
    out = verify_chain(target, drafts, n, None, u, method, use_kernel=True)
    assert out.output_token_ids.tolist() == ref.output_token_ids.tolist()
    assert out.num_accepted.tolist() == [0] * 8


def test_use_kernel_routes_to_the_kernel(monkeypatch):
    import specserve.kernels.rejection_kernel as rk

    calls = []

    def spy(*args, **kwargs):
        calls.append(args[-1])
        return torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)

    monkeypatch.setattr(rk, "rejection_sample_triton", spy)
    args = (torch.full((1, 2, 4), 0.25), torch.tensor([[1]]), torch.tensor([1]), None,
            RejectionUniforms(torch.zeros(1, 1), torch.zeros(1, 2)))
    verify_chain(*args, "probabilistic", use_kernel=True)
    verify_chain(*args, "strict")  # CPU tensors: the torch path by default
    assert calls == ["probabilistic"]
    with pytest.raises(ValueError, match="use_kernel"):
        verify_chain(*args, "synthetic", 0.5, use_kernel=True)


def test_wrapper_errors_name_the_argument(monkeypatch):
    target, drafts, n, q, u = make_case(0, 8, 2, 20)
    good = dict(target_probs=target, draft_token_ids=drafts, num_draft_tokens=n, draft_probs=q,
                u_accept=u.accept, u_sample=u.sample, method="strict")
    for change, match in [
        (dict(target_probs=target.double()), "target_probs"),
        (dict(draft_token_ids=drafts.int()), "draft_token_ids"),
        (dict(num_draft_tokens=n[:3]), "num_draft_tokens"),
        (dict(draft_probs=q[:, :1]), "draft_probs"),
        (dict(u_accept=u.sample), "u_accept"),
        (dict(u_sample=u.accept), "u_sample"),
        (dict(method="synthetic"), "method"),
        (dict(block_v=48), "block_v"),
    ]:
        with pytest.raises(ValueError, match=match):
            rejection_sample_triton(**(good | change))
    if DEVICE == "cpu":
        import specserve.kernels.rejection_kernel as rk

        monkeypatch.setattr(rk, "interpreter_active", lambda: False)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            rejection_sample_triton(**good)


@pytest.mark.skipif(IN_PROCESS, reason="runs the kernel tests in-process")
def test_in_a_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


COMPILE_SCRIPT = textwrap.dedent(
    """
    import sys
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from specserve.kernels.rejection_kernel import _rejection_kernel
        fn = triton.jit(_rejection_kernel)
        sig = {name: "*fp32" for name in ("target_probs_ptr", "draft_probs_ptr", "u_accept_ptr", "u_sample_ptr")}
        sig |= {name: "*i64" for name in ("draft_ids_ptr", "num_draft_ptr", "out_ids_ptr", "num_accepted_ptr")}
        sig |= {"K": "i32", "V": "i32", "STRICT": "constexpr", "HAS_DRAFT_PROBS": "constexpr", "BLOCK_V": "constexpr"}
        sources = [
            ASTSource(fn=fn, signature=sig, constexprs={"STRICT": s, "HAS_DRAFT_PROBS": h, "BLOCK_V": 1024})
            for s, h in ((True, False), (False, True))
        ]
        target = GPUTarget("cuda", 90, 32)
    except Exception as e:  # this triton's compile API differs: nothing to check here
        print("skip:", repr(e))
        sys.exit(77)
    for src in sources:
        assert "cubin" in triton.compile(src, target=target).asm
    print("ok")
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel is compiled and run on the GPU above")
def test_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    if res.returncode == 77:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]

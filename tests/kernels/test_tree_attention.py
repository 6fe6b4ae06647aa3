"""Draft-tree attention on the paged kernel: the Triton ``_attn_kernel`` (TREE) and its
torch twin against the dense oracle (``tests/tree_reference.py``).

Steps are ragged: tree sequences (one continuing earlier keys of its tree range) beside
a decode row, a verification chain and a prompt chunk over cached context, on shuffled
block tables whose unused slots hold NaN (a stray read shows).  GQA, a sliding window
shorter than the contexts, both query-tile numberings, split-KV, fp32 tight and bf16
loose.  Without a GPU the kernel runs under Triton's interpreter (tests/kernels/conftest.py),
so shapes stay small.

The fused CPU decoder (bf16): a tree node's logits are bit-identical to its token's decoded
plainly, one token per step, across tree steps whose accepted paths are moved into place.
"""

from __future__ import annotations

import random

import pytest
import torch
from tree_reference import mixed_seqs, oracle, random_parents, step_tensors

from specserve.executor.batch import SeqInput, StepBatch
from specserve.kernels.paged_attention import interpreter_active, paged_attention_reference, step_launches

pytest.importorskip("triton")

from specserve.kernels.paged_attention import paged_attention_triton  # noqa: E402

INTERPRETED = interpreter_active()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
in_process = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED,
                                reason="triton was imported without TRITON_INTERPRET")
BS, NB = 4, 64


def kernel_inputs(seed: int, dtype: torch.dtype, nh: int = 4, nkv: int = 2, hd: int = 16, max_ctx: int = 20):
    rng = random.Random(seed)
    batch = StepBatch.from_inputs(mixed_seqs(rng, BS, NB, max_ctx), block_size=BS)
    q, k, v, kc, vc, k_all, v_all = step_tensors(batch, NB, BS, nh, nkv, hd, dtype, seed, poison=True)
    slots = torch.tensor(batch.slot_mapping)
    kc.index_copy_(0, slots, k)  # the kernel reads the new tokens' K/V from the cache
    vc.index_copy_(0, slots, v)
    width = max(len(t) for t in batch.block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in batch.block_tables], dtype=torch.int32)
    qs = batch.query_start

    def dev(t):
        return t.to(DEVICE)

    args = dict(q=dev(q), k_cache=dev(kc), v_cache=dev(vc), block_tables=dev(tables),
                query_start_loc=dev(torch.tensor(qs, dtype=torch.int32)),
                seq_lens=dev(torch.tensor(batch.seq_lens, dtype=torch.int32)),
                tree_base=dev(torch.tensor(batch.tree_base, dtype=torch.int32)),
                tree_masks=dev(torch.tensor(batch.tree_masks, dtype=torch.int64)),
                positions=dev(torch.tensor(batch.positions, dtype=torch.int64)))
    kw = dict(block_size=BS, scale=hd ** -0.5, max_query_len=batch.max_query_len)
    return batch, args, kw, oracle(batch, q, k_all, v_all, None), (q, k_all, v_all)


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("window", [None, 5])
def test_twin_equals_dense_oracle(seed, window):
    for dtype in (torch.float32, torch.bfloat16):
        batch, args, kw, _, (q, k_all, v_all) = kernel_inputs(seed, dtype, max_ctx=40)
        want = oracle(batch, q, k_all, v_all, window)
        got = paged_attention_reference(**args, **kw, sliding_window=window)
        torch.testing.assert_close(got.float().cpu(), want, **tol(dtype))


# (seed, dtype, window, num_splits, block_q, block_n): seq-major and flat tiles, split-KV
KERNEL_CASES = [
    (0, torch.float32, None, 1, None, None),
    (1, torch.float32, 5, 1, 4, 16),
    (2, torch.float32, None, 2, 2, 16),
    (3, torch.bfloat16, 6, 1, None, 16),
    (4, torch.bfloat16, None, 3, 4, 16),
]


@in_process
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"seed{c[0]}-{str(c[1])[6:]}-w{c[2]}-s{c[3]}")
def test_triton_tree_kernel_equals_dense_oracle(case):
    seed, dtype, window, splits, block_q, block_n = case
    batch, args, kw, _, (q, k_all, v_all) = kernel_inputs(seed, dtype)
    want = oracle(batch, q, k_all, v_all, window)
    got = paged_attention_triton(**args, **kw, sliding_window=window, num_splits=splits, block_q=block_q,
                                 block_n=block_n)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float().cpu(), want, **tol(dtype))


@in_process
def test_a_step_without_trees_launches_the_unchanged_binary():
    """No tree tensors: the TREE constexpr is off and the result is the causal one."""
    launches = step_launches(2, 5, 4, 1, num_heads=4, num_kv_heads=2, head_dim=16, block_size=BS,
                             sliding_window=None, dtype=torch.float32, device="cpu")
    tree = step_launches(2, 5, 4, 1, num_heads=4, num_kv_heads=2, head_dim=16, block_size=BS,
                         sliding_window=None, dtype=torch.float32, device="cpu", tree=True)
    assert launches[1].constexprs["TREE"] is False and tree[1].constexprs["TREE"] is True
    rng = random.Random(0)
    seqs = [SeqInput([1, 2, 3], 6, [3, 5, 7], [0, 1, 2]), SeqInput([4], 9, [1, 2, 4], [0])]
    batch = StepBatch.from_inputs(seqs, block_size=BS)
    q, k, v, kc, vc, k_all, v_all = step_tensors(batch, NB, BS, 4, 2, 16, torch.float32, rng.randrange(99))
    slots = torch.tensor(batch.slot_mapping)
    kc.index_copy_(0, slots, k)
    vc.index_copy_(0, slots, v)
    tables = torch.tensor(batch.block_tables, dtype=torch.int32)
    got = paged_attention_triton(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), tables.to(DEVICE),
                                 torch.tensor(batch.query_start, dtype=torch.int32, device=DEVICE),
                                 torch.tensor(batch.seq_lens, dtype=torch.int32, device=DEVICE), block_size=BS,
                                 scale=0.25, max_query_len=3)
    torch.testing.assert_close(got.cpu(), oracle(batch, q, k_all, v_all), rtol=1e-5, atol=1e-5)


def test_tree_arguments_are_checked_by_name():
    batch, args, kw, _, _ = kernel_inputs(0, torch.float32)
    with pytest.raises(ValueError, match="^tree_base: .*go together"):
        paged_attention_reference(**{**args, "positions": None}, **kw)
    with pytest.raises(ValueError, match="^tree_masks: expected"):
        paged_attention_reference(**{**args, "tree_masks": args["tree_masks"].int()}, **kw)


@in_process
@pytest.mark.parametrize("impl", ["twin", "triton"])
def test_deep_tree_keys_are_seen_by_bit_past_a_short_window(impl):
    """A tree deeper than the window: its nodes see every ancestor whose bit is set, even
    one a whole key tile below where the window alone would start the tile's range."""
    from specserve.executor.batch import tree_depths, tree_masks

    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 4]
    ctx = 30
    seq = SeqInput(list(range(len(parents))), ctx, list(range(1, 12)), list(range(len(parents))),
                   positions=[ctx + d for d in tree_depths(parents)], tree_base=ctx, tree_masks=tree_masks(parents))
    batch = StepBatch.from_inputs([seq, SeqInput([5], 12, [20, 21, 22, 23], [0])], block_size=BS)
    q, k, v, kc, vc, k_all, v_all = step_tensors(batch, NB, BS, 2, 1, 16, torch.float32, 11, poison=True)
    slots = torch.tensor(batch.slot_mapping)
    kc.index_copy_(0, slots, k)
    vc.index_copy_(0, slots, v)
    width = max(len(t) for t in batch.block_tables)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    args = dict(q=q.to(DEVICE), k_cache=kc.to(DEVICE), v_cache=vc.to(DEVICE),
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in batch.block_tables], **i32),
                query_start_loc=torch.tensor(batch.query_start, **i32), seq_lens=torch.tensor(batch.seq_lens, **i32),
                tree_base=torch.tensor(batch.tree_base, **i32),
                tree_masks=torch.tensor(batch.tree_masks, dtype=torch.int64, device=DEVICE),
                positions=torch.tensor(batch.positions, dtype=torch.int64, device=DEVICE))
    kw = dict(block_size=BS, scale=0.25, max_query_len=len(parents), sliding_window=3)
    if impl == "twin":
        got = paged_attention_reference(**args, **kw)
    else:
        got = paged_attention_triton(**args, **kw, block_q=2, block_n=16)
    torch.testing.assert_close(got.cpu(), oracle(batch, q, k_all, v_all, 3, 0.25), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the fused CPU decoder

# head_dim 16 runs the decoder's per-(token, head) attention, 64 its grouped AVX kernels
FUSED_MODELS = {
    "llama-hd16": ("llama", {}),
    "llama-hd64": ("llama", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)),
    "mistral-hd16-window": ("mistral", dict(sliding_window=6)),
    "mistral-hd64-window": ("mistral", dict(sliding_window=6, hidden_size=128, num_attention_heads=2,
                                            num_key_value_heads=1)),
}
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7, 3, 10, 9, 12]  # depth 6 > the window


@pytest.fixture(scope="module")
def fused_lib(tmp_path_factory):
    from specserve.kernels.cpu_decoder import KernelUnavailable, load_library

    cache = tmp_path_factory.mktemp("kernel-cache")
    try:
        load_library(cache)
    except KernelUnavailable as e:
        pytest.skip(f"fused CPU decoder unavailable here: {e}")
    return cache


@pytest.mark.parametrize("name", list(FUSED_MODELS))
def test_fused_tree_step_equals_the_torch_path_and_its_own_chains(tmp_path, fused_lib, name):
    """A tree step after a prompt on the fused decoder: each node's logits equal (bit for
    bit) those of its root..node chain run plainly on the fused decoder, and agree with the
    torch path's tree step within bf16 tolerance.  Ragged: a decode row of another
    sequence rides along in the tree step."""
    from tiny_models import make_tiny_model

    from specserve.executor.backends.factory import RunnerFactory
    from specserve.executor.batch import tree_depths, tree_masks
    from specserve.executor.kv_cache import KVCache
    from specserve.executor.loader import load_model

    arch, kw = FUSED_MODELS[name]
    path = make_tiny_model(tmp_path / name, arch, **kw)
    # one load per path: the torch runner lays the weights out for oneDNN, the decoder reads them as saved
    models = {k: load_model(str(path), "bfloat16", torch.device("cpu")) for k in ("fused", "torch")}

    def make(kernel):
        lm = models[kernel]
        a = lm.arch
        kv = KVCache(a.num_layers, 32, BS, a.num_kv_heads, a.head_dim, torch.bfloat16, torch.device("cpu"))
        return RunnerFactory(cpu_kernel=kernel, cache_dir=fused_lib).runner(lm, kv)

    rng = random.Random(4)
    prompt, other = [rng.randrange(5, 500) for _ in range(13)], [rng.randrange(5, 500) for _ in range(7)]
    tokens = [rng.randrange(5, 500) for _ in PARENTS]
    P, n = len(prompt), len(PARENTS)
    blocks, oblocks = list(range(1, 9)), [20, 21, 22]
    window = kw.get("sliding_window")  # masks as plain decoding windows a chain
    tree = SeqInput(tokens, P, blocks, list(range(n)), positions=[P + d for d in tree_depths(PARENTS)],
                    tree_base=P, tree_masks=tree_masks(PARENTS, window=window))
    outs = {}
    for kernel in ("fused", "torch"):
        r = make(kernel)
        assert (r.fused is not None) == (kernel == "fused")
        r.forward([SeqInput(prompt, 0, blocks, [P - 1]), SeqInput(other, 0, oblocks, [6])])
        outs[kernel] = r.forward([SeqInput([9], 7, oblocks, [0]), tree]).logits
    rel = float((outs["fused"] - outs["torch"]).abs().max() / outs["torch"].abs().max())
    assert rel < 0.03, rel
    for node in (0, 4, 9, 12, 13):
        path = [node]
        while PARENTS[path[-1]] >= 0:
            path.append(PARENTS[path[-1]])
        path.reverse()
        r = make("fused")
        r.forward([SeqInput(prompt, 0, blocks, [P - 1])])
        chain = r.forward([SeqInput([tokens[i] for i in path], P, blocks, [len(path) - 1])]).logits[0]
        assert torch.equal(outs["fused"][1 + node], chain), node


# --------------------------------------------------------------------------- the step runner on the kernel


@in_process
@pytest.mark.timeout(600)
def test_step_runner_on_the_triton_kernel_runs_trees_losslessly(tiny_llama):
    """The persistent-buffer runner with the Triton kernel (interpreted on the CPU): a tree
    step's node logits equal those of each node's ancestor chain, which run the non-TREE
    binary; the tree step staged its masks in the runner's one staging buffer."""
    from tree_reference import tree_and_chain_logits

    from specserve.executor.backends.cuda_graphs import CudaGraphRunner
    from specserve.executor.kv_cache import KVCache
    from specserve.executor.loader import load_model
    from specserve.executor.static_runner import StaticStepRunner

    model = load_model(str(tiny_llama), "float32", torch.device("cpu"), max_model_len=64)
    a = model.arch
    runners = []

    def make_runner():
        kv = KVCache(a.num_layers, 16, BS, a.num_kv_heads, a.head_dim, model.dtype, model.device)
        static = StaticStepRunner(model, kv, max_num_seqs=2, max_num_tokens=32, attention_impl="triton",
                                  trees=True, use_graphs=False)
        runners.append(static)
        return CudaGraphRunner(static)

    rng = random.Random(8)
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]
    prompt = [rng.randrange(5, 500) for _ in range(9)]
    tokens = [rng.randrange(5, 500) for _ in parents]
    got, chains = tree_and_chain_logits(make_runner, prompt, parents, tokens, BS, nodes=[0, 4, 5, 7])
    assert runners[0].impl == "triton" and runners[0].trees
    for node, want in zip([0, 4, 5, 7], chains):
        torch.testing.assert_close(got[node], want, rtol=1e-4, atol=1e-4)



# The embedded SmolLM2-135M's attention shapes (head_dim 64, 9 query heads on 3 KV heads)
# on a small random stack; and with a sliding window shorter than the trees and the chain.
SMOL_SHAPES = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=256,
                   num_hidden_layers=8)
STEP_MODELS = {
    "smollm2-shapes": ("llama", SMOL_SHAPES),
    "smollm2-shapes-window": ("mistral", dict(SMOL_SHAPES, sliding_window=7)),
}


def _path(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def fused_steps_against_plain(model, cache_dir, rng: random.Random, steps, prompt_len: int = 37,
                              window: int | None = None) -> tuple[list[tuple[int, int]], int]:
    """Run ``steps`` on the fused decoder as the engine does and decode the same tokens
    plainly (one per step) beside it; returns the (step, node) whose logits differ and how
    many were compared.  A step is a parent list (a tree at the root's slot: node i's K/V at
    the root + i, then the accepted path, root to the deepest node, moved to the slots after
    the root) or an int (a verification chain of that many tokens, all accepted).  Every
    tree node is compared: the plain side decodes each root..leaf path from a copy of its
    cache, the accepted path last."""
    from specserve.executor.backends.factory import RunnerFactory
    from specserve.executor.batch import tree_depths, tree_masks
    from specserve.executor.kv_cache import KVCache

    a = model.arch

    def make():
        kv = KVCache(a.num_layers, 64, BS, a.num_kv_heads, a.head_dim, torch.bfloat16, torch.device("cpu"))
        r = RunnerFactory(cpu_kernel="fused", cache_dir=cache_dir).runner(model, kv)
        assert r.fused is not None
        return r, kv

    prompt = [rng.randrange(5, 500) for _ in range(prompt_len)]
    blocks = rng.sample(range(1, 64), 60)  # shuffled: a path's slots are not consecutive

    def slot(j: int) -> int:
        return blocks[j // BS] * BS + j % BS

    (spec, kv), (plain, plain_kv) = make(), make()
    for r in (spec, plain):
        r.forward([SeqInput(prompt, 0, blocks, [prompt_len - 1])])

    def decode(tokens: list[int], at: int) -> list[torch.Tensor]:
        return [plain.forward([SeqInput([t], at + k, blocks, [0])]).logits[0] for k, t in enumerate(tokens)]

    start, differ, compared = prompt_len, [], 0
    for step, parents in enumerate(steps):
        if isinstance(parents, int):
            toks = [rng.randrange(5, 500) for _ in range(parents)]
            got = spec.forward([SeqInput(toks, start, blocks, list(range(parents)))]).logits
            differ += [(step, i) for i, want in enumerate(decode(toks, start)) if not torch.equal(got[i], want)]
            compared += parents
            start += parents
            continue
        toks = [rng.randrange(5, 500) for _ in parents]
        tree = SeqInput(toks, start, blocks, list(range(len(parents))),
                        positions=[start + d for d in tree_depths(parents)], tree_base=start,
                        tree_masks=tree_masks(parents, window=window))
        got = spec.forward([tree]).logits
        depths = tree_depths(parents)
        accepted = max(range(len(parents)), key=lambda i: (depths[i], i))
        leaves = [i for i in range(len(parents)) if i not in parents and i != accepted] + [accepted]
        saved, seen = plain_kv.data.clone(), set()
        for leaf in leaves:
            path = _path(parents, leaf)
            for i, want in zip(path, decode([toks[i] for i in path], start)):
                if i not in seen:
                    seen.add(i)
                    differ += [] if torch.equal(got[i], want) else [(step, i)]
            if leaf != accepted:
                plain_kv.data.copy_(saved)
        compared += len(seen)
        path = _path(parents, accepted)
        src, dst = [slot(start + i) for i in path], [slot(start + k) for k in range(len(path))]
        kv.move(torch.tensor(src), torch.tensor(dst))
        start += len(path)
    return differ, compared


@pytest.mark.parametrize("name", list(STEP_MODELS))
def test_fused_tree_steps_after_compaction_equal_plain_decoding(tmp_path, fused_lib, name):
    """Tree steps on the fused decoder as the engine runs them, with compaction and a chain
    between: every node's logits equal, bit for bit, those of its token decoded plainly
    (one token per step) on the fused decoder.  The first tree has 64 nodes (its last
    node's mask has bit 63 set).  A node's softmax denominator must sum its visible keys as
    plain decoding does; summed in step order, the other branches' keys between its
    ancestors changed its rounding, and a bf16 output now and then."""
    from tiny_models import make_tiny_model

    from specserve.executor.batch import MAX_TREE_SPAN
    from specserve.executor.loader import load_model

    arch, kw = STEP_MODELS[name]
    model = load_model(str(make_tiny_model(tmp_path / name, arch, **kw)), "bfloat16", torch.device("cpu"))
    rng = random.Random(5)
    steps = [random_parents(rng, MAX_TREE_SPAN), 6, PARENTS, random_parents(rng, 40)]
    differ, compared = fused_steps_against_plain(model, fused_lib, rng, steps, window=kw.get("sliding_window"))
    assert compared == 64 + 6 + len(PARENTS) + 40
    assert not differ, f"(step, node) {differ} of {compared} differ from plain decoding"

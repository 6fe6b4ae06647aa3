"""Draft-tree steps: the contract (``executor.batch``) and the reference attention.

The reference path (``attention.batch_metadata`` + ``write_and_attend``, what the CPU
torch runner runs) must equal the dense oracle (``tests/tree_reference.py``) on ragged
steps mixing tree sequences with decode rows, chains and prompt chunks, with GQA and a
sliding window; a node of a tree must see exactly what a chain of its ancestors sees.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from specserve.executor.attention import batch_metadata, kernel_metadata, write_and_attend
from specserve.executor.batch import MAX_TREE_SPAN, SeqInput, StepBatch, int64_masks, tree_depths, tree_masks
from tree_reference import (dense_tree_attention, mixed_seqs, oracle, plain_seq, random_parents, step_tensors,
                            tree_and_chain_logits, tree_seq)

BS = 4  # block size
NB = 64  # blocks


def test_tree_helpers_give_depths_and_ancestor_bits():
    parents = [-1, 0, 0, 1, 3, 2]
    assert tree_depths(parents) == [0, 1, 1, 2, 3, 2]
    assert tree_masks(parents) == [0b1, 0b11, 0b101, 0b1011, 0b11011, 0b100101]
    assert tree_masks(parents, offset=2)[4] == 0b11011 << 2
    # under a window of 2, a node sees itself and its parent only (as a windowed chain does)
    assert tree_masks(parents, window=2) == [0b1, 0b11, 0b101, 0b1010, 0b11000, 0b100100]
    assert tree_masks(parents, window=4) == tree_masks(parents)
    with pytest.raises(ValueError, match="parents"):
        tree_masks([0, 0])
    with pytest.raises(ValueError, match="parents"):
        tree_depths([-1, 1])


def _seq(**kw) -> SeqInput:
    base = dict(token_ids=[1, 2, 3], start_pos=5, block_table=[0, 1, 2], positions=[5, 6, 6],
                tree_base=5, tree_masks=[0b1, 0b11, 0b101])
    base.update(kw)
    return SeqInput(**base)


@pytest.mark.parametrize("kw, field", [
    (dict(positions=[5, 6]), "positions"),
    (dict(tree_masks=None), "tree_masks"),
    (dict(tree_masks=[0b1, 0b11]), "tree_masks"),
    (dict(tree_base=6), "tree_base"),
    (dict(tree_masks=[0b1, 0b01, 0b101]), "tree_masks"),  # token 1 lacks its own bit
    (dict(tree_masks=[0b11, 0b11, 0b101]), "tree_masks"),  # token 0 sees a later token
    (dict(start_pos=70, block_table=list(range(19)), tree_base=5, positions=None,
          tree_masks=[1 << 65, 1 << 66, 1 << 67]), "tree_base"),  # span 68 > 64
])
def test_from_inputs_rejects_bad_tree_fields_by_name(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        StepBatch.from_inputs([_seq(**kw)], block_size=BS)


def test_steps_without_trees_are_unchanged():
    plain = SeqInput(token_ids=[7, 8], start_pos=3, block_table=[0, 1], logits_offsets=[0, 1])
    b = StepBatch.from_inputs([plain, plain], block_size=BS)
    assert b.tree_base is None and b.tree_masks is None
    assert b.positions == [3, 4, 3, 4] and b.uniform_query_len() == 2
    tree = _seq(logits_offsets=[0, 1, 2])
    b = StepBatch.from_inputs([tree, plain], block_size=BS, pad_to=3, trash_slot=99)
    assert b.positions == [5, 6, 6, 3, 4, 5]
    assert b.tree_base == [5, 6] and b.tree_masks == [0b1, 0b11, 0b101, 0, 0, 0]
    assert b.seq_lens == [8, 6] and b.slot_mapping[-1] == 99
    assert MAX_TREE_SPAN == 64


def _reference(batch, q, k, v, k_cache, v_cache, window):
    meta, _ = batch_metadata(batch, BS, torch.device("cpu"), window)
    return write_and_attend(q, k, v, k_cache.clone(), v_cache.clone(), meta)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, 7])
def test_reference_attention_equals_dense_oracle(seed, window):
    rng = random.Random(seed)
    batch = StepBatch.from_inputs(mixed_seqs(rng, BS, NB), block_size=BS)
    assert batch.tree_masks is not None
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        q, k, v, kc, vc, k_all, v_all = step_tensors(batch, NB, BS, nh=4, nkv=2, hd=8, dtype=dtype, seed=seed)
        got = _reference(batch, q, k, v, kc, vc, window).float()
        want = oracle(batch, q, k_all, v_all, window)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 5])
def test_eager_kernel_metadata_carries_the_trees(window):
    """``attention.kernel_metadata`` (an eager forward on the paged kernel, here its twin)
    hands the step's tree bases, masks and positions to the kernel: the dense oracle's result;
    a step without trees hands none."""
    rng = random.Random(9)
    batch = StepBatch.from_inputs(mixed_seqs(rng, BS, NB), block_size=BS)
    q, k, v, kc, vc, k_all, v_all = step_tensors(batch, NB, BS, nh=4, nkv=2, hd=8, dtype=torch.float32, seed=9)
    meta, pos = kernel_metadata(batch, BS, torch.device("cpu"), "torch", window)
    assert meta.kernel.tree_masks is not None and meta.kernel.tree_positions is pos
    got = write_and_attend(q, k, v, kc, vc, meta)
    torch.testing.assert_close(got, oracle(batch, q, k_all, v_all, window), atol=1e-5, rtol=1e-5)
    plain = StepBatch.from_inputs([SeqInput([1, 2], 3, [0, 1], [1])], block_size=BS)
    k = kernel_metadata(plain, BS, torch.device("cpu"), "torch")[0].kernel
    assert k.tree_base is None and k.tree_masks is None and k.tree_positions is None


def test_a_tree_node_sees_what_its_ancestor_chain_sees():
    """Node i of a tree attends exactly like the last token of the chain root..i run as a
    plain (tree-less) verification at the same positions: the oracle is not needed."""
    rng = random.Random(3)
    parents = [-1, 0, 0, 1, 2, 3, 3, 5]
    ctx, n = 9, len(parents)
    depths = tree_depths(parents)
    tree = SeqInput(token_ids=[0] * n, start_pos=ctx, block_table=list(range(1, 6)),
                    logits_offsets=list(range(n)), positions=[ctx + d for d in depths],
                    tree_base=ctx, tree_masks=tree_masks(parents))
    batch = StepBatch.from_inputs([tree], block_size=BS)
    q, k, v, kc, vc, k_all, v_all = step_tensors(batch, NB, BS, nh=4, nkv=1, hd=8, dtype=torch.float32, seed=1)
    got = _reference(batch, q, k, v, kc, vc, window=None)
    for node in rng.sample(range(n), 4):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        chain = SeqInput(token_ids=[0] * len(path), start_pos=ctx, block_table=list(range(10, 15)),
                         logits_offsets=[len(path) - 1])
        cb = StepBatch.from_inputs([chain], block_size=BS)
        ckc, cvc = kc.clone(), vc.clone()
        for j in range(ctx):  # the same cached context in the chain's blocks
            ckc[cb.block_tables[0][j // BS] * BS + j % BS] = kc[j // BS * BS + BS + j % BS]
            cvc[cb.block_tables[0][j // BS] * BS + j % BS] = vc[j // BS * BS + BS + j % BS]
        out = _reference(cb, q[path], k[path], v[path], ckc, cvc, window=None)
        torch.testing.assert_close(out[-1], got[node], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch, window", [("llama", None), ("mistral", 6)])
def test_torch_runner_tree_step_equals_each_ancestor_chain(tmp_path, arch, window):
    """The CPU torch runner on a tiny model: each node's logits in one tree step equal the
    logits of its root..node chain run plainly; with a sliding window shorter than the
    prompt and the tree, context keys are windowed by the node's depth position, not its
    context index, and the masks leave out ancestors outside the window."""
    from tiny_models import make_tiny_model

    from specserve.executor.backends.torch_backend import TorchRunner
    from specserve.executor.kv_cache import KVCache
    from specserve.executor.loader import load_model

    kw = {"sliding_window": window} if window else {}
    model = load_model(str(make_tiny_model(tmp_path / arch, arch, **kw)), "float32", torch.device("cpu"),
                       max_model_len=128)
    assert model.arch.sliding_window == window
    a = model.arch

    def make_runner():
        return TorchRunner(model, KVCache(a.num_layers, 16, BS, a.num_kv_heads, a.head_dim, model.dtype,
                                          model.device))

    rng = random.Random(5)
    parents = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7, 3, 10, 9, 12]  # depth 6: deeper than the window
    prompt = [rng.randrange(5, 500) for _ in range(13)]
    tokens = [rng.randrange(5, 500) for _ in parents]
    got, chains = tree_and_chain_logits(make_runner, prompt, parents, tokens, BS, window=window)
    for node, want in enumerate(chains):
        torch.testing.assert_close(got[node], want, rtol=1e-4, atol=1e-4)


class _ReplayGraphs:
    """A CPU stand-in for CUDA graphs (``StaticStepRunner.graphs_api``): capture runs the
    step once and keeps it; replay reruns it over the same static buffers."""

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


def _tree_steps() -> list[tuple[list[SeqInput], int | None]]:
    """(inputs, pad_to) per step of three sequences: prefills, a ragged step with two trees
    beside a decode row (eager), then a uniform step of trees padded to 6 (a tree graph)."""
    rng = random.Random(2)
    tables = [[7, 2, 11, 5, 9, 15], [3, 14, 1, 8, 12, 16], [6, 0, 13, 4, 10, 17]]
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (9, 5, 14)]
    steps = [([SeqInput(p, 0, t, [len(p) - 1]) for p, t in zip(prompts, tables)], None)]

    def tree(ctx: int, parents: list[int], table: list[int], offset: int = 0) -> SeqInput:
        depths = tree_depths(parents)
        chain = (1 << offset) - 1
        return SeqInput([rng.randrange(5, 500) for _ in parents], ctx, table, list(range(len(parents))),
                        positions=[ctx - offset + offset + d for d in depths], tree_base=ctx - offset,
                        tree_masks=[m | chain for m in tree_masks(parents, offset)])

    steps.append(([tree(9, [-1, 0, 0, 1, 1, 2], tables[0]), SeqInput([17], 5, tables[1], [0]),
                   tree(14, [-1, 0, 1, 0], tables[2])], None))
    steps.append(([tree(15, [-1, 0, 0, 2, 2, 1], tables[0]), tree(6, [-1, 0, 0], tables[1], offset=1),
                   SeqInput([23], 18, tables[2], [0])], 6))
    return steps


@pytest.mark.parametrize("late_device", [False, True])
def test_static_runner_tree_steps_equal_the_torch_runner(tiny_llama, late_device):
    """The persistent-buffer runner (kernel twin) on tree steps: an eager ragged tree step and
    a uniform tree step replaying its own graph (keyed apart from chains) give the eager torch
    runner's logits; with a device that runs copies as late as a GPU may, the two tree steps
    are issued back to back before any result is read, so a staging race would show."""
    from deferred_device import DeferredDevice

    from specserve.executor.backends.torch_backend import TorchRunner
    from specserve.executor.kv_cache import KVCache
    from specserve.executor.loader import load_model
    from specserve.executor.static_runner import StaticStepRunner

    model = load_model(str(tiny_llama), "float32", torch.device("cpu"), max_model_len=128)
    a = model.arch

    def kv():
        return KVCache(a.num_layers, 24, BS, a.num_kv_heads, a.head_dim, model.dtype, model.device)

    eager, graphs = TorchRunner(model, kv()), _ReplayGraphs()
    dev = DeferredDevice() if late_device else None
    static = StaticStepRunner(model, kv(), max_num_seqs=4, max_num_tokens=64, graph_query_lens=(1, 4),
                              tree_query_lens=(6,), attention_impl="torch", use_graphs=True, graphs_api=graphs,
                              transfer=dev)
    static.capture(progress=False)
    assert set(static.tree_graphs) == {(b, 6) for b in (1, 2, 4)} and (4, 6) not in static.graphs
    want, got, keys = [], [], []
    ctx = dev if dev is not None else contextlib.nullcontext()
    with ctx:
        for inputs, pad in _tree_steps():
            want.append(eager.forward(inputs).logits)
            batch = StepBatch.from_inputs(inputs, BS, pad_to=pad, trash_slot=static.kv.trash_slot, max_position=127)
            keys.append((static.graph_key(batch), batch.tree_masks is not None))
            out = static.run(batch).logits
            if pad is not None:  # every row's logits: keep the real ones
                out = torch.cat([out[b * pad + torch.tensor(s.logits_offsets)] for b, s in enumerate(inputs)])
            got.append(out)
        got = [g.clone() for g in got]  # reads: a late device runs its queue now
    assert keys == [(None, False), (None, True), ((4, 6), True)]
    assert graphs.replays == 1
    if dev is not None:
        assert dev.copies >= 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_step_runner_without_trees_refuses_a_tree_step_by_name(tiny_llama):
    from specserve.executor.kv_cache import KVCache
    from specserve.executor.loader import load_model
    from specserve.executor.static_runner import StaticStepRunner

    model = load_model(str(tiny_llama), "float32", torch.device("cpu"), max_model_len=128)
    a = model.arch
    kv = KVCache(a.num_layers, 24, BS, a.num_kv_heads, a.head_dim, model.dtype, model.device)
    static = StaticStepRunner(model, kv, max_num_seqs=2, max_num_tokens=32, attention_impl="torch", use_graphs=False)
    assert static.trees is False and "tmask" not in static.d
    tree = _tree_steps()[1][0][0]
    with pytest.raises(ValueError, match="^tree_masks: .*trees=True"):
        static.run(StepBatch.from_inputs([tree], BS))


def test_int64_masks_keep_every_bit():
    masks = [0b101, 1 << 62, (1 << 63) | 1, (1 << 64) - 1]
    got = int64_masks(masks)
    assert got == [0b101, 1 << 62, -(1 << 63) + 1, -1]
    t = torch.tensor(got, dtype=torch.int64)
    for bit in range(64):
        assert [(m >> bit) & 1 for m in masks] == ((t >> bit) & 1).tolist(), bit


def _span64_step() -> StepBatch:
    """A tree whose range spans 64 keys (10 earlier tree keys, then 54 nodes: the last
    nodes own bits 60..63) beside a decode row and a chain."""
    rng = random.Random(12)
    blocks = list(range(1, NB))
    rng.shuffle(blocks)
    seqs = [tree_seq(rng, 30, 54, blocks[:21], offset=10), plain_seq(rng, 9, 1, blocks[21:24]),
            plain_seq(rng, 6, 4, blocks[24:27])]
    batch = StepBatch.from_inputs(seqs, block_size=BS)
    assert batch.seq_lens[0] - batch.tree_base[0] == MAX_TREE_SPAN
    assert batch.tree_masks[53] >> 63 == 1
    return batch


@pytest.mark.parametrize("window", [None, 9])
def test_a_tree_spanning_64_keys_on_the_reference_path_and_the_twin(window):
    """Bit 63 set (a 64-key tree): the reference path (``batch_metadata``) and the eager kernel
    metadata on the twin (``kernel_metadata``) build their int64 tensors and equal the dense
    oracle, which reads the bits from the same two's complement values."""
    batch = _span64_step()
    q, k, v, kc, vc, k_all, v_all = step_tensors(batch, NB, BS, nh=4, nkv=2, hd=8, dtype=torch.float32, seed=3)
    want = dense_tree_attention(q, k_all, v_all, batch.query_start, batch.positions, batch.tree_base,
                                int64_masks(batch.tree_masks), window)
    torch.testing.assert_close(_reference(batch, q, k, v, kc, vc, window), want, atol=1e-5, rtol=1e-5)
    meta, _ = kernel_metadata(batch, BS, torch.device("cpu"), "torch", window)
    assert int(meta.kernel.tree_masks[53]) < 0
    torch.testing.assert_close(write_and_attend(q, k, v, kc.clone(), vc.clone(), meta), want, atol=1e-5, rtol=1e-5)


def test_a_64_node_tree_on_the_torch_and_static_runners(tiny_llama):
    """A 64-node tree step (the last node owns bit 63) on a tiny model: on the torch runner
    each checked node's logits equal its root..node chain's, and the persistent-buffer runner
    (its staging buffer, the twin) gives the torch runner's logits."""
    from specserve.executor.backends.torch_backend import TorchRunner
    from specserve.executor.kv_cache import KVCache
    from specserve.executor.loader import load_model
    from specserve.executor.static_runner import StaticStepRunner

    model = load_model(str(tiny_llama), "float32", torch.device("cpu"), max_model_len=128)
    a = model.arch

    def kv():
        return KVCache(a.num_layers, 24, BS, a.num_kv_heads, a.head_dim, model.dtype, model.device)

    rng = random.Random(6)
    parents = random_parents(rng, MAX_TREE_SPAN)
    prompt = [rng.randrange(5, 500) for _ in range(11)]
    tokens = [rng.randrange(5, 500) for _ in parents]
    nodes = [0, 17, 40, 62, 63]
    got, chains = tree_and_chain_logits(lambda: TorchRunner(model, kv()), prompt, parents, tokens, BS, nodes=nodes)
    for node, want in zip(nodes, chains):
        torch.testing.assert_close(got[node], want, rtol=1e-4, atol=1e-4)
    static = StaticStepRunner(model, kv(), max_num_seqs=2, max_num_tokens=80, attention_impl="torch", trees=True,
                              use_graphs=False)
    blocks = list(range(1, 1 + -(-(len(prompt) + len(parents)) // BS)))
    static.run(StepBatch.from_inputs([SeqInput(prompt, 0, blocks, [len(prompt) - 1])], BS))
    P = len(prompt)
    tree = SeqInput(tokens, P, blocks, list(range(len(parents))), positions=[P + d for d in tree_depths(parents)],
                    tree_base=P, tree_masks=tree_masks(parents))
    torch.testing.assert_close(static.run(StepBatch.from_inputs([tree], BS)).logits, got, rtol=1e-4, atol=1e-4)

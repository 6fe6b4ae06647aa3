"""Who holds what under tensor parallelism, the loader's slices, the launch topology and
the one-line errors for layouts that cannot run (no processes started here)."""

from __future__ import annotations

import pytest
import torch

from specserve.cli import UsageError, compose_config
from specserve.config import ParallelismConfig
from specserve.errors import ConfigError
from specserve.executor.loader import ArchConfig, fuse_llama_weights, read_state_dict
from specserve.parallel.launch import resolve_tp_device, topology
from specserve.parallel.loading import SliceReader, shard_weights
from specserve.parallel.plan import check_layout, draft_tensor_parallel_size, plan_shard


def _plans(h, kv, inter, vocab, tp):
    return [plan_shard(h, kv, inter, vocab, r, tp) for r in range(tp)]


@pytest.mark.parametrize("h, kv, tp, heads, kv_heads", [
    (32, 8, 2, [(0, 16), (16, 32)], [(0, 4), (4, 8)]),             # even
    (9, 3, 2, [(0, 6), (6, 9)], [(0, 2), (2, 3)]),                # SmolLM2: 3 KV groups dealt 2 + 1
    (4, 2, 4, [(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 1), (0, 1), (1, 2), (1, 2)]),  # KV replicated
    (32, 8, 8, [(4 * i, 4 * i + 4) for i in range(8)], [(i, i + 1) for i in range(8)]),
    (16, 1, 4, [(4 * i, 4 * i + 4) for i in range(4)], [(0, 1)] * 4),  # multi-query attention
])  # fmt: skip
def test_heads_are_split_by_kv_group(h, kv, tp, heads, kv_heads):
    plans = _plans(h, kv, 64, 100, tp)
    assert [p.q_heads for p in plans] == heads and [p.kv_heads for p in plans] == kv_heads
    group = h // kv
    for p in plans:  # every query head on a rank reads a KV head that rank holds
        assert all(p.kv_heads[0] <= q // group < p.kv_heads[1] for q in range(*p.q_heads))
        assert p.num_heads % p.num_kv_heads == 0  # plain grouped attention on each rank
    assert sum(p.num_heads for p in plans) == h


def test_vocab_and_mlp_slices_cover_everything_once():
    plans = _plans(8, 4, 96, 101, 4)  # 101 rows: slices of 26, the last has 23 real rows
    assert [p.vocab for p in plans] == [(0, 26), (26, 52), (52, 78), (78, 101)]
    assert all(p.vocab_shard == 26 for p in plans)
    assert [p.inter for p in plans] == [(0, 24), (24, 48), (48, 72), (72, 96)]


@pytest.mark.parametrize("h, kv, inter, tp, expect", [
    (4, 2, 128, 3, "parallelism.tensor_parallel_size: 3 does not fit model's 4 attention heads / 2 KV heads"),
    (6, 2, 120, 4, "parallelism.tensor_parallel_size: 4 does not fit model's 6 attention heads / 2 KV heads"),
    (8, 8, 100, 3, "parallelism.tensor_parallel_size: 3 does not divide model's MLP intermediate size 100"),
])  # fmt: skip
def test_layouts_that_cannot_split_are_one_line(h, kv, inter, tp, expect):
    with pytest.raises(ConfigError) as e:
        check_layout(h, kv, inter, tp)
    assert str(e.value).startswith(expect) and "\n" not in str(e.value)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [2, 4])
def test_slices_reassemble_the_full_checkpoint(tiny_model_dirs, arch, tp):
    """Each rank's sliced tensors, put back together, are exactly the one-device weights."""
    from transformers import AutoConfig

    d = tiny_model_dirs[arch]
    a = ArchConfig.from_hf(AutoConfig.from_pretrained(str(d)))
    full = fuse_llama_weights(read_state_dict(d), a)
    reader = SliceReader(d)
    parts = [shard_weights(reader, a, plan_shard(a.num_heads, a.num_kv_heads, a.intermediate_size, a.vocab_size, r,
                                                 tp)) for r in range(tp)]  # fmt: skip
    hd, V = a.head_dim, a.vocab_size
    assert torch.equal(torch.cat([p["embed_tokens.weight"] for p in parts])[:V], full["embed_tokens.weight"])
    assert torch.equal(torch.cat([p["lm_head.weight"] for p in parts])[:V], full["lm_head.weight"])
    for i in range(a.num_layers):
        n = f"layers.{i}."
        q, kv = a.num_heads * hd, a.num_kv_heads * hd
        fq, fk, fv = full[n + "qkv_proj.weight"].split([q, kv, kv])
        for r, p in enumerate(parts):
            plan = plan_shard(a.num_heads, a.num_kv_heads, a.intermediate_size, a.vocab_size, r, tp)
            lkv = plan.num_kv_heads * hd
            lq, lk, lv = p[n + "qkv_proj.weight"].split([plan.num_heads * hd, lkv, lkv])
            assert torch.equal(lq, fq[plan.q_heads[0] * hd : plan.q_heads[1] * hd])
            assert torch.equal(lk, fk[plan.kv_heads[0] * hd : plan.kv_heads[1] * hd])
            assert torch.equal(lv, fv[plan.kv_heads[0] * hd : plan.kv_heads[1] * hd])
            if a.attention_bias:
                assert p[n + "qkv_proj.bias"].shape[0] == (plan.num_heads + 2 * plan.num_kv_heads) * hd
        if tp <= a.num_kv_heads:  # no replication: the slices add up exactly
            assert torch.equal(torch.cat([p[n + "o_proj.weight"] for p in parts], 1), full[n + "o_proj.weight"])
        assert torch.equal(torch.cat([p[n + "down_proj.weight"] for p in parts], 1), full[n + "down_proj.weight"])
        gates = [p[n + "gate_up_proj.weight"].chunk(2)[0] for p in parts]
        assert torch.equal(torch.cat(gates), full[n + "gate_up_proj.weight"].chunk(2)[0])


def test_topology_from_the_environment():
    p = ParallelismConfig(tensor_parallel_size=4, master_port=29555)
    one = topology(p, {})
    assert (one.rank, one.spawn, one.master_port, one.launcher) == (0, [1, 2, 3], 0, "specserve")
    run = topology(p, {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"})  # fmt: skip
    assert (run.rank, run.local_rank, run.spawn, run.launcher, run.master_port) == (2, 0, [], "torchrun", 29400)
    lws = {"LWS_LEADER_ADDRESS": "specserve-0.specserve.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    pod = topology(p, lws)
    assert (pod.rank, pod.local_world_size, pod.spawn, pod.master_addr, pod.master_port) == (
        2, 2, [3], "specserve-0.specserve.ns", 29555)
    leader = topology(p, {**lws, "LWS_WORKER_INDEX": "0"})
    assert leader.is_rank0 and leader.spawn == [1]
    with pytest.raises(ConfigError, match=r"^parallelism.tensor_parallel_size: 4 is not a multiple of the "):
        topology(p, {**lws, "LWS_GROUP_SIZE": "3"})
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=2 processes"):
        topology(p, {"RANK": "0", "WORLD_SIZE": "2"})


def test_tp_larger_than_the_visible_gpus_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError) as e:
        resolve_tp_device("cuda", 0, 2)
    assert str(e.value) == ("parallelism.tensor_parallel_size: needs 2 GPUs on this node but 1 are visible "
                            "(CUDA_VISIBLE_DEVICES=0)")


@pytest.mark.parametrize("overrides, expect", [
    (["+method=ngram", "parallelism.pipeline_parallel_size=2"],
     "parallelism.pipeline_parallel_size: pipeline parallelism with speculative decoding (+method=ngram) is not"),
    (["parallelism=tp2", "+method=draft_model", "draft=smollm2-135m", "method.draft_tensor_parallel_size=4"],
     "method.draft_tensor_parallel_size: must be 1 or equal to the target's tensor_parallel_size (2); got 4"),
    (["parallelism=tp4", "+method=ngram", "method.draft_tensor_parallel_size=4"],
     "method.draft_tensor_parallel_size: ngram drafts on rank 0 in this build: use 1"),
    (["parallelism=tp2", "engine.cpu_kernel=fused"], "engine.cpu_kernel: fused runs the whole model on one device"),
])  # fmt: skip
def test_bad_parallel_configs_are_one_line(overrides, expect):
    with pytest.raises((ConfigError, UsageError)) as e:
        compose_config(overrides)
    assert str(e.value).startswith(expect) and "\n" not in str(e.value), str(e.value)


def test_tp_presets_compose():
    for n in (2, 4, 8):
        cfg = compose_config([f"parallelism=tp{n}", "+method=draft_model", "draft=smollm2-135m"])
        assert cfg.parallelism.tensor_parallel_size == n
        assert draft_tensor_parallel_size(cfg.method, n) == n  # a draft model is sharded like the target by default
        assert draft_tensor_parallel_size(compose_config([f"parallelism=tp{n}", "+method=ngram"]).method, n) == 1


def test_the_cli_refuses_an_unsplittable_model_in_one_line(tiny_llama, capsys):
    """`specserve parallelism.tensor_parallel_size=3` on 4 heads / 2 KV heads: exit 2, one
    line, before any worker process is started."""
    from specserve.cli import serve_main
    from specserve.parallel.launch import current_group

    rc = serve_main([f"model.path={tiny_llama}", "parallelism.tensor_parallel_size=3", "server.grpc_port=0",
                     "server.http_port=0"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("specserve: error: parallelism.tensor_parallel_size: 3 does not fit model's "
                                          "4 attention heads / 2 KV heads")  # fmt: skip
    assert current_group() is None


def test_a_runner_over_a_view_of_the_sharded_model_is_refused():
    """A proposer that wraps the target (layer skipping) would run its layers on rank 0 alone
    and the workers would never join: refused in one line instead of hanging."""
    from types import SimpleNamespace

    from specserve.parallel.shard import Shard

    plan = plan_shard(4, 2, 128, 512, 0, 2)
    shard = Shard(plan, group=None, model_id=1)
    own = SimpleNamespace(model=SimpleNamespace(shard=shard), kv=None, min_causal_len=2)
    shard.attach(own)  # the model's own runner: fine (a worker: nothing to send)
    with pytest.raises(ConfigError) as e:
        shard.attach(SimpleNamespace(model=torch.nn.Identity(), kv=None, min_causal_len=2))
    assert str(e.value).startswith("parallelism.tensor_parallel_size: a Identity over the sharded model would run "
                                   "its layers on rank 0 alone")  # fmt: skip

"""Rank 0 of a 2-rank gloo group for the tensor-parallel tests, run as its own process
(torch.distributed is per process, so pytest's process never joins a group).

    python tp_driver.py SPEC.json OUT.json

SPEC: {"models": {arch: dir}, "draft": dir, "eagle": {"target": dir, "head": dir} | null}.
It starts its worker itself (as `specserve parallelism=tp2` does), runs every case
on one device and on two ranks in this process, and writes what the tests assert.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: engine_utils

from engine_utils import greedy, random_prompts, run, tiny_config  # noqa: E402

from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.executor.batch import SeqInput  # noqa: E402
from specserve.executor.kv_cache import KVCache  # noqa: E402
from specserve.executor.loader import load_model  # noqa: E402
from specserve.executor.backends.factory import RunnerFactory  # noqa: E402


def tp_config(model_dir, tp: int, **kw):
    cfg = tiny_config(Path(model_dir), **kw)
    cfg.parallelism.tensor_parallel_size = tp
    cfg.parallelism.timeout_s = 60.0
    cfg.engine.num_threads = 1
    cfg.engine.num_prediction_tokens = 0  # Predicted Outputs off: only the method drafts
    return cfg


def logits_case(model_dir: str) -> dict:
    """One prefill of three sequences, then a decode step that reads the cache: tp1 vs tp2 logits."""
    from specserve.parallel.launch import load_target

    cfg = tp_config(model_dir, 2)
    one = load_model(model_dir, "float32", torch.device("cpu"))
    two = load_target(cfg)
    bs, nb = 4, 64
    runners = []
    for m in (one, two):
        a = m.arch
        kv = KVCache(a.num_layers, nb, bs, a.num_kv_heads, a.head_dim, m.dtype, m.device)
        runners.append(RunnerFactory(cpu_kernel="torch").runner(m, kv))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 12, 3)]
    tables = [[0, 1, 2, 3], [8, 9, 10, 11, 12], [20, 21]]
    pre = [SeqInput(p, 0, t, list(range(len(p)))) for p, t in zip(prompts, tables)]
    dec = [SeqInput([5 + i], len(p), t, [0]) for i, (p, t) in enumerate(zip(prompts, tables))]
    out = {}
    for name, seqs in (("prefill", pre), ("decode", dec)):
        a, b = (r.forward(seqs, aux_layer_ids=(1,)) for r in runners)
        rel = ((a.logits - b.logits).abs().max() / a.logits.abs().max()).item()
        hid = ((a.hidden - b.hidden).abs().max() / a.hidden.abs().max()).item()
        out[name] = {"max_rel": rel, "hidden_max_rel": hid, "shape": list(b.logits.shape),
                     "argmax_equal": bool((a.logits.argmax(-1) == b.logits.argmax(-1)).all())}
    out["rank0_heads"] = [two.arch.num_heads, two.arch.num_kv_heads, one.arch.num_heads, one.arch.num_kv_heads]
    return out


def greedy_case(model_dir: str, method: str | None, **kw) -> dict:
    prompts = random_prompts(6, seed=3)
    params = [greedy(24) for _ in prompts]
    outs, infos = [], []
    for tp in (1, 2):
        t0 = time.perf_counter()
        eng = LLMEngine(tp_config(model_dir, tp, method=method, **kw))
        res = eng.generate(prompts, params)
        outs.append([o.token_ids for o in res])
        infos.append({"seconds": time.perf_counter() - t0, "tp": eng.info.tensor_parallel_size,
                      "draft_tp": eng.info.draft_tensor_parallel_size,
                      "accepted": sum(o.spec.num_accepted_tokens for o in res),
                      "drafts": sum(o.spec.num_draft_tokens for o in res)})
    return {"equal": outs[0] == outs[1], "tp1": outs[0], "tp2": outs[1], "info": infos}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    res: dict = {"logits": {}, "greedy": {}}
    t0 = time.perf_counter()
    for arch, d in spec["models"].items():
        res["logits"][arch] = logits_case(d)
    for arch, d in spec["models"].items():
        res["greedy"][f"{arch}/vanilla"] = greedy_case(d, None)
        res["greedy"][f"{arch}/ngram"] = greedy_case(d, "ngram")
    llama = spec["models"]["llama"]
    res["greedy"]["llama/draft_model-dtp1"] = greedy_case(llama, "draft_model", draft_dir=Path(spec["draft"]),
                                                          draft_tensor_parallel_size=1)
    # The target as its own draft, sharded like it (draft TP 2 is the default): every draft is accepted.
    res["greedy"]["llama/draft_model-dtp2"] = greedy_case(llama, "draft_model", draft_dir=Path(llama))
    res["greedy"]["llama/suffix"] = greedy_case(llama, "suffix")
    if spec.get("eagle"):
        e = spec["eagle"]
        res["greedy"]["bigram/eagle3"] = greedy_case(e["target"], "eagle3", draft_dir=Path(e["head"]))
    res["seconds"] = time.perf_counter() - t0
    Path(sys.argv[2]).write_text(json.dumps(res))


if __name__ == "__main__":
    main()

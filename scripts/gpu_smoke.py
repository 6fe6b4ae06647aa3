"""Five minutes on one GPU that settle what the CPU tests cannot (``scripts/gpu_smoke.sh``).

Checks, each in its own process (a fresh CUDA context, its own memory peak, and a crash
that spares the others), all written to ONE JSON file with a summary table beside it:

* ``long_prefill``: a long prompt (8000 tokens of ShareGPT first turns, raw text) prefilled
  in several chunks with nothing else running, greedy in float32 on CUDA, against the same
  request on the CPU in float32 in the same process; on a difference, the CPU reference's
  top-2 logit gap at the first differing position (a near-tie or a bug).
* ``draft_graphs``: ``draft_model`` with the model drafting for itself, K fixed, each prompt
  alone: ``engine.cuda_graphs=auto`` against ``off``: output tokens and acceptance counts
  must be equal.
* ``startup``: start-up at ``engine.max_num_seqs=256`` with K=16 (``draft_model``, fixed K,
  so every step verifies 256 x 17 rows), then one full batch; the engine's memory budget
  (``engine.memory_budget``) against ``torch.cuda.max_memory_allocated``.
* ``kernel_self_check``: what the Triton kernels' start-up self-check chose in every engine
  above (``kernels.backends``): on CUDA each kernel must run as Triton, and no graph key may
  have fallen back to eager.

``--dry-run`` (or ``GPU_SMOKE_DRY=1``) runs every check on the CPU with tiny sizes: the
"device" engine is the CPU engine driven by the CUDA path's persistent-buffer step runner
with the kernels' torch twins (``attention_impl="torch"``), its "graphs" replayed eagerly
(``ReplayGraphs``) with padded uniform steps, so the script runs end to end without a GPU.

    python scripts/gpu_smoke.py --out results/gpu/smoke.json
    python scripts/gpu_smoke.py --dry-run --out /tmp/smoke-dry.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

EMBEDDED = "embedded:smollm2-135m-instruct"
CHECKS = ("long_prefill", "draft_graphs", "startup")
# Sizes of a real run and of the dry run (the CPU, tiny).
SIZES = {
    "prompt_tokens": (8000, 160), "max_tokens": (64, 6), "chunk": (2048, 48), "max_model_len": (8192, 256),
    "draft_prompts": (4, 1), "draft_max_tokens": (64, 6), "draft_k": (4, 3),
    "startup_seqs": (256, 4), "startup_k": (16, 3), "startup_max_tokens": (34, 5),
}


# ---------------------------------------------------------------- helpers
def log(msg: str) -> None:
    print(f"[gpu_smoke {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def jsonable(x: Any) -> Any:
    """A JSON-friendly copy of a report object (dataclasses, ``as_dict``, tensors)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [jsonable(v) for v in x]
    if hasattr(x, "as_dict"):
        return jsonable(x.as_dict())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return jsonable(dataclasses.asdict(x))
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return repr(x)


def engine(args: argparse.Namespace, overrides: list[str], device: str, target: Any = None) -> Any:
    from specserve.cli import compose_config
    from specserve.engine.engine import LLMEngine

    # The dry run: one torch thread (a forward with two stalls whenever another process holds a
    # core) and a short max_model_len (the step runner's shapes are padded to it).
    dry = ["engine.num_threads=1", f"model.max_model_len={args.max_model_len}"] if args.dry_run else []
    cfg = compose_config([f"model.path={args.model}", f"engine.device={device}", *dry, *overrides])
    return LLMEngine(cfg, target=target)


class _Replay:
    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class ReplayGraphs:
    """Dry run: the step runner's graph maker on the CPU.  A "graph" is its step function,
    replayed eagerly into the same output buffers from the same staging buffers (what a
    CUDA graph's replay reads and writes), so graph keys, bucket padding and the shared
    outputs run as on CUDA."""

    def synchronize(self) -> None:
        pass

    def capture(self, fn: Callable[[], Any]) -> tuple[_Replay, Any]:
        return _Replay(fn), fn()


def twin_runner(runner: Any, max_num_seqs: int, max_tokens: int, query_lens: tuple[int, ...],
                graphs: bool = False) -> Any:
    """Dry run: the runner to use in place of ``runner`` (the engine's or its drafter's):
    the CUDA path's step runner on the CPU over the same model and cache, attention by
    the kernels' torch twin; ``graphs``: captured by ``ReplayGraphs`` where the step
    runner takes a graph maker."""
    import inspect

    from specserve.executor.backends.cuda_graphs import CudaGraphRunner
    from specserve.executor.static_runner import StaticStepRunner

    kw: dict[str, Any] = {}
    graphs = graphs and "graphs_api" in inspect.signature(StaticStepRunner).parameters
    if graphs:
        kw["graphs_api"] = ReplayGraphs
    static = StaticStepRunner(runner.loaded, runner.kv, max_num_seqs=max_num_seqs, max_num_tokens=max_tokens,
                              graph_query_lens=query_lens, attention_impl="torch", use_graphs=graphs, **kw)
    if graphs:
        static.capture(progress=False)
    return CudaGraphRunner(static)


def greedy(max_tokens: int) -> Any:
    from specserve.request import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def free() -> None:
    """Collect dropped engines before the next one sizes its KV cache from what is free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def self_check(eng: Any) -> dict[str, Any]:
    """What the kernels' start-up self-check chose, where the engine exposes it: the backend
    of attention and verification (``engine.info``), the attention check of the engine's
    and the drafter's step runners (``kernels.backends.BackendChoice``: used, reason),
    their Triton warm-up time and any graph keys that run eagerly."""
    out: dict[str, Any] = {}
    info = getattr(eng, "info", None)
    for key in ("attention_backend", "rejection_backend"):
        if hasattr(info, key):
            out[key] = getattr(info, key)
    proposer = getattr(eng, "proposer", None)
    runners = {"target": getattr(eng, "runner", None), "drafter": getattr(proposer, "runner", None)}
    for name, runner in runners.items():
        static = getattr(runner, "static", None)
        if static is None or not hasattr(static, "attention"):
            continue
        out[f"{name}_attention"] = jsonable(static.attention)
        out[f"{name}_warm_up_seconds"] = getattr(static, "warm_up_s", None)
        out[f"{name}_eager_graph_keys"] = jsonable(getattr(static, "eager_keys", []))
    out["available"] = bool(out)
    return out


def kernel_verdict(checks: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """The self-check over every engine the checks built: on CUDA each kernel must run as
    Triton (a twin there means its check, compile or launch failed: the reason is kept)."""
    seen = {}
    for name, r in checks.items():
        modes = [("", r.get("self_check"))] + [(m, x.get("self_check")) for m, x in r.get("runs", {}).items()]
        for mode, sc in modes:
            if sc and sc.get("available"):
                seen[f"{name}{'/' + mode if mode else ''}"] = sc
    if not seen:
        return {"ok": None, "detail": "not exposed by this engine"}
    used = [v for sc in seen.values() for k, v in sc.items() if k in ("attention_backend", "rejection_backend")]
    used += [sc[k]["used"] for sc in seen.values() for k in sc if k.endswith("_attention") and isinstance(sc[k], dict)]
    eager = [k for sc in seen.values() for key, k in sc.items() if key.endswith("_eager_graph_keys") and k]
    ok = all(u == "triton" for u in used) and not eager if cuda else True
    return {"ok": ok, "engines": seen}


def memory_report(eng: Any, cuda: bool) -> dict[str, Any]:
    budget = getattr(eng, "memory_budget", None)
    out: dict[str, Any] = {"budget": jsonable(budget) if budget is not None else None}
    if budget is not None and hasattr(budget, "line"):
        out["budget_line"] = budget.line()
    out.update(max_memory_allocated=None, max_memory_reserved=None, device_free_bytes=None, device_total_bytes=None)
    if cuda:
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        out["max_memory_reserved"] = torch.cuda.max_memory_reserved()
        out["device_free_bytes"], out["device_total_bytes"] = torch.cuda.mem_get_info()
    return out


def sharegpt_text(min_tokens: int, tok: Any) -> tuple[str, str]:
    """(text, source): ShareGPT first turns joined until ``min_tokens`` tokens, else a
    repeated numbered paragraph (no ShareGPT on this machine)."""
    try:
        from specserve.data import bench_prompts
        from specserve.executor.loader import default_cache_dir

        turns = bench_prompts(2000, seed=0, cache_dir=default_cache_dir())
        source = "sharegpt"
    except Exception as e:  # no package and no cached turns
        log(f"ShareGPT unavailable ({e}); using a repeated paragraph")
        turns = [f"Paragraph {i}: the quick brown fox jumps over the lazy dog while the scheduler counts "
                 f"blocks, pages and tokens, and the verifier compares {i} drafts." for i in range(4000)]
        source = "repeated"
    parts, n = [], 0
    for t in turns:
        parts.append(t)
        n += len(tok.encode_plain(t)) + 2
        if n >= min_tokens + 64:
            break
    return "\n\n".join(parts), source


# ---------------------------------------------------------------- the checks
def check_long_prefill(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    from specserve.executor.batch import SeqInput

    # No Predicted Outputs room (K=0): one request, plain decoding, decode graphs only.
    common = ["model.dtype=float32", f"engine.max_num_batched_tokens={args.chunk}", "engine.max_num_seqs=4",
              "engine.num_prediction_tokens=0"]
    if cuda:  # a fixed KV cache: the CPU reference's budget is no concern of the device's
        common += [f"model.max_model_len={args.max_model_len}", "engine.kv_cache_memory_gib=2"]
    ref = engine(args, common, "cpu")
    text, source = sharegpt_text(args.prompt_tokens, ref.tokenizer)
    prompt = ref.tokenizer.encode_plain(text)[: args.prompt_tokens]
    assert len(prompt) == args.prompt_tokens, f"only {len(prompt)} prompt tokens"
    t0 = time.perf_counter()
    want = ref.generate([prompt], [greedy(args.max_tokens)])[0].token_ids
    cpu_s = time.perf_counter() - t0
    if cuda:
        dev = engine(args, common, "cuda")
    else:  # dry: the same target on the CUDA path's step runner, torch twins
        dev = engine(args, common, "cpu", target=ref.target)
        dev.runner = twin_runner(dev.runner, dev.cfg.engine.max_num_seqs, args.chunk, (1,))
    chunks: list[int] = []

    class Listener:
        def on_step(self, s: Any) -> None:
            if s.num_prompt_tokens:
                chunks.append(s.num_prompt_tokens)

        def on_request_finished(self, s: Any) -> None:
            pass

    dev.listeners.append(Listener())
    t0 = time.perf_counter()
    got = dev.generate([prompt], [greedy(args.max_tokens)])[0].token_ids
    dev_s = time.perf_counter() - t0
    res: dict[str, Any] = {
        "prompt_source": source, "prompt_tokens": len(prompt), "max_tokens": args.max_tokens,
        "prefill_chunks": chunks, "identical": got == want, "cpu_seconds": cpu_s, "device_seconds": dev_s,
        "kv_blocks_free_after": dev.blocks.num_free == dev.blocks.num_blocks, "self_check": self_check(dev),
    }
    if got != want:
        m = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        seq = prompt + want[:m]
        blocks = list(range(-(-len(seq) // ref.kv.block_size)))
        logits = ref.runner.forward([SeqInput(seq, 0, blocks, [len(seq) - 1])]).logits[0].float()
        top = logits.topk(2)
        res["first_difference"] = {"position": m, "device_token": got[m] if m < len(got) else None,
                                   "cpu_token": want[m] if m < len(want) else None,
                                   "cpu_top2": top.indices.tolist(),
                                   "cpu_top2_gap": float(top.values[0] - top.values[1])}
    res["ok"] = res["identical"] and len(chunks) >= 2 and res["kv_blocks_free_after"]
    return res


def check_draft_graphs(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    k, B = args.draft_k, 2 if args.dry_run else 8
    common = ["+method=draft_model", "draft=smollm2-135m", f"draft.path={args.model}",
              f"method.num_speculative_tokens={k}", "engine.speculation=fixed", "model.dtype=float32",
              "draft.dtype=float32", f"engine.max_num_seqs={B}"]
    if cuda:
        common.append("engine.kv_cache_memory_gib=1")
    runs: dict[str, Any] = {}
    target = None
    for mode in ("off", "auto"):
        if cuda:
            eng = engine(args, [*common, f"engine.cuda_graphs={mode}"], "cuda")
        else:  # dry: "auto" = the step runners with replayed graphs and padded uniform steps
            eng = engine(args, common, "cpu", target=target)
            target = eng.target
            if mode == "auto":
                eng.runner = twin_runner(eng.runner, B, eng.cfg.engine.max_num_batched_tokens, (1, k + 1),
                                         graphs=True)
                eng.proposer.runner = twin_runner(eng.proposer.runner, B, eng.proposer.max_step_tokens, (1,),
                                                  graphs=True)
                eng.uniform_steps = True
        if mode == "off":
            text, _ = sharegpt_text(64 * args.draft_prompts, eng.tokenizer)
            chunks = [t for t in text.split("\n\n") if t.strip()]
            prompts = [eng.tokenizer.apply_chat_template([{"role": "user", "content": c[:400]}])
                       for c in chunks[: args.draft_prompts]]
        t0 = time.perf_counter()
        outs = [eng.generate([p], [greedy(args.draft_max_tokens)])[0] for p in prompts]  # each alone
        static = getattr(eng.runner, "static", None)
        runs[mode] = {
            "seconds": time.perf_counter() - t0,
            "graphs_captured": len(getattr(static, "graphs", {}) or {}),
            "draft_graphs_captured": len(getattr(getattr(eng.proposer.runner, "static", None), "graphs", {}) or {}),
            "tokens": [o.token_ids for o in outs],
            "rounds": [o.spec.num_drafts for o in outs],
            "drafted": [o.spec.num_draft_tokens for o in outs],
            "accepted": [o.spec.num_accepted_tokens for o in outs],
            "self_check": self_check(eng),
        }
        if cuda:  # the next engine sizes its KV cache from what this one leaves
            del eng, static
            free()
    off, auto = runs["off"], runs["auto"]
    res = {
        "k": k, "prompts": len(prompts), "max_tokens": args.draft_max_tokens,
        "outputs_equal": off["tokens"] == auto["tokens"],
        "acceptance_equal": [off[x] for x in ("rounds", "drafted", "accepted")] ==
                            [auto[x] for x in ("rounds", "drafted", "accepted")],
        "acceptance_length": {m: 1 + sum(r["accepted"]) / max(1, sum(r["rounds"])) for m, r in runs.items()},
        "runs": runs,
    }
    res["ok"] = res["outputs_equal"] and res["acceptance_equal"] and (not cuda or auto["graphs_captured"] > 0)
    return res


def check_startup(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    B, k = args.startup_seqs, args.startup_k
    overrides = ["+method=draft_model", "draft=smollm2-135m", f"draft.path={args.model}",
                 f"method.num_speculative_tokens={k}", "engine.speculation=fixed", f"engine.max_num_seqs={B}",
                 "model.dtype=bfloat16" if cuda else "model.dtype=float32",
                 "draft.dtype=bfloat16" if cuda else "draft.dtype=float32"]
    if cuda and torch.cuda.is_initialized():  # --in-process: earlier checks' peaks
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    eng = engine(args, overrides, "cuda" if cuda else "cpu")
    if not cuda:
        eng.runner = twin_runner(eng.runner, B, eng.cfg.engine.max_num_batched_tokens, (1, k + 1))
        eng.uniform_steps = True
    startup_s = time.perf_counter() - t0
    res: dict[str, Any] = {"max_num_seqs": B, "k": k, "startup_seconds": startup_s,
                           "graph_capture_seconds": getattr(getattr(eng.runner, "static", None), "capture_s", None),
                           "after_startup": memory_report(eng, cuda), "self_check": self_check(eng)}
    # One full batch: every sequence verifying K drafts (the self-draft accepts them all).
    text, _ = sharegpt_text(40 * B, eng.tokenizer)
    turns = [t for t in text.split("\n\n") if t.strip()] or ["Hello"]
    prompts = [eng.tokenizer.apply_chat_template([{"role": "user", "content": turns[i % len(turns)][:200]}])
               for i in range(B)]
    t0 = time.perf_counter()
    outs = eng.generate(prompts, [greedy(args.startup_max_tokens)] * B)
    res["batch_seconds"] = time.perf_counter() - t0
    res["batch_tokens"] = sum(len(o.token_ids) for o in outs)
    res["after_batch"] = memory_report(eng, cuda)
    total = (res["after_batch"]["budget"] or {}).get("total_bytes")
    peak = res["after_batch"].get("max_memory_allocated")
    res["peak_over_budget_total"] = None if total is None or peak is None else peak / total
    res["ok"] = res["after_batch"]["budget"] is not None and (not cuda or (total is not None and peak <= total))
    return res


RUNNERS: dict[str, Callable[[argparse.Namespace, bool], dict[str, Any]]] = {
    "long_prefill": check_long_prefill, "draft_graphs": check_draft_graphs, "startup": check_startup,
}


# ---------------------------------------------------------------- driver
def environment() -> dict[str, Any]:
    """What Triton's launcher build needs (a C compiler, Python.h) and where it caches."""
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "triton": triton_version, "cc": os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang"),
           "python_h": (Path(include) / "Python.h").is_file(), "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
           "device": platform.processor() or "cpu"}  # the GPU's name comes from the checks (no context here)
    return out


def run_child(args: argparse.Namespace, name: str, argv: list[str]) -> dict[str, Any]:
    """One check in a fresh process; its output echoed live, its tail kept on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "part.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--check", name, "--part", str(part)]
        tail: collections.deque[str] = collections.deque(maxlen=30)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip("\n"))
        rc = proc.wait()
        if part.is_file():
            return json.loads(part.read_text())
        return {"ok": False, "error": f"exit status {rc}, no result", "log_tail": list(tail),
                "seconds": time.perf_counter() - t0}


def run_check(args: argparse.Namespace, name: str, cuda: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        res = RUNNERS[name](args, cuda)
    except Exception as e:  # reported, and the other checks still run
        import traceback

        traceback.print_exc()
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    res["seconds"] = time.perf_counter() - t0
    if cuda and torch.cuda.is_initialized():
        res["device"] = torch.cuda.get_device_name()
    return res


def summary(report: dict[str, Any]) -> str:
    c = report["checks"]
    rows = []

    def add(name: str, what: str, detail: Callable[[dict[str, Any]], str]) -> None:
        r = c.get(name)
        if r is None:
            return
        shown = r["error"] if "error" in r else detail(r)
        passed = {True: "yes", None: "n/a"}.get(r.get("ok"), "NO")
        rows.append(f"| {what} | {passed} | {shown} | {r.get('seconds', 0):.0f} |")

    add("long_prefill", "long prompt, chunked prefill: device greedy == CPU fp32",
        lambda r: f"{r['prompt_tokens']} tokens ({r['prompt_source']}) in {len(r['prefill_chunks'])} chunks, "
                  f"{r['max_tokens']} out, identical {r['identical']}"
                  + (f"; first difference at {r['first_difference']['position']}, CPU top-2 gap "
                     f"{r['first_difference']['cpu_top2_gap']:.4g}" if "first_difference" in r else ""))
    add("draft_graphs", "draft_model (self), CUDA graphs == eager",
        lambda r: f"K={r['k']}, {r['prompts']} prompts: outputs equal {r['outputs_equal']}, acceptance equal "
                  f"{r['acceptance_equal']} (AL " + ", ".join(f"{m} {v:.2f}" for m, v in r["acceptance_length"].items())
                  + f"), graphs {r['runs']['auto']['graphs_captured']} + draft "
                    f"{r['runs']['auto']['draft_graphs_captured']}")

    def startup(r: dict[str, Any]) -> str:
        b = r["after_batch"]
        total = (b["budget"] or {}).get("total_bytes")
        gib = lambda x: "n/a" if x is None else f"{x / (1 << 30):.2f} GiB"  # noqa: E731
        return (f"max_num_seqs {r['max_num_seqs']}, K={r['k']}: start-up {r['startup_seconds']:.1f} s; budget total "
                f"{gib(total)}, max_memory_allocated {gib(b.get('max_memory_allocated'))}, reserved "
                f"{gib(b.get('max_memory_reserved'))}")

    if "startup" in c and "error" not in c["startup"]:
        add("startup", f"start-up at {c['startup']['max_num_seqs']} seqs, K={c['startup']['k']}: memory budget vs peak",
            startup)
    else:
        add("startup", "start-up: memory budget vs peak", startup)
    def kernels(r: dict[str, Any]) -> str:
        if "engines" not in r:
            return r.get("detail", "")
        parts = []
        for where, sc in r["engines"].items():
            used = [f"{k.removesuffix('_backend')} {v}" for k, v in sc.items() if k.endswith("_backend")]
            used += [f"{k.removesuffix('_attention')} attention {v.get('used')}"
                     + (f" ({v['reason']})" if v.get("reason") else "")
                     for k, v in sc.items() if k.endswith("_attention") and isinstance(v, dict)]
            eager = [f"{k}: {v}" for k, v in sc.items() if k.endswith("_eager_graph_keys") and v]
            parts.append(f"{where}: " + ", ".join(used + eager))
        return "; ".join(parts)

    add("kernel_self_check", "Triton kernels' start-up self-check (Triton on CUDA, no eager graph keys)", kernels)
    for name in c:
        if name not in RUNNERS and name != "kernel_self_check":
            add(name, name, lambda r: "")
    lines = [f"GPU smoke ({'dry run on the CPU' if report['dry_run'] else report['environment']['device']}): "
             f"{'all passed' if report['ok'] else 'FAILED'}", "",
             "| check | passed | detail | s |", "|---|---|---|---|", *rows, "",
             f"Triton launcher prerequisites: cc {report['environment']['cc']}, Python.h "
             f"{report['environment']['python_h']}, TRITON_CACHE_DIR {report['environment']['triton_cache_dir']}"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_SMOKE_DRY") == "1",
                    help="every check on the CPU, tiny sizes, the kernels' torch twins (also GPU_SMOKE_DRY=1)")
    ap.add_argument("--out", default=None, help="the JSON report (default results/gpu/smoke.json, smoke-dry.json)")
    ap.add_argument("--model", default=os.environ.get("SMOL") or EMBEDDED)
    ap.add_argument("--checks", default=",".join(CHECKS))
    ap.add_argument("--in-process", action="store_true", help="run the checks in this process")
    for key in SIZES:
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    ap.add_argument("--check", help=argparse.SUPPRESS)  # a child: run this check only
    ap.add_argument("--part", help=argparse.SUPPRESS)  # ... and write its result here
    args = ap.parse_args(argv)
    for key, (real, dry) in SIZES.items():
        if getattr(args, key) is None:
            setattr(args, key, dry if args.dry_run else real)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        log("no CUDA device: run with --dry-run (GPU_SMOKE_DRY=1) to exercise the script on the CPU")
        return 2
    if args.check:  # a child process
        res = run_check(args, args.check, cuda)
        Path(args.part).write_text(json.dumps(res))
        return 0
    out = Path(args.out or ("results/gpu/smoke-dry.json" if args.dry_run else "results/gpu/smoke.json"))
    report: dict[str, Any] = {"script": "gpu_smoke", "dry_run": args.dry_run, "model": args.model,
                              "sizes": {k: getattr(args, k) for k in SIZES}, "environment": environment(), "checks": {}}
    t0 = time.perf_counter()
    for name in args.checks.split(","):
        log(f"{name} ...")
        child_argv = [a for a in argv if a not in ("--in-process",)]
        res = run_check(args, name, cuda) if args.in_process else run_child(args, name, child_argv)
        report["checks"][name] = res
        log(f"{name}: {'ok' if res.get('ok') else 'FAILED'} ({res.get('seconds', 0):.1f} s)")
    report["environment"]["device"] = next((r["device"] for r in report["checks"].values() if "device" in r),
                                           report["environment"]["device"])
    report["checks"]["kernel_self_check"] = kernel_verdict(report["checks"], cuda)
    report["seconds"] = time.perf_counter() - t0
    # a self-check the engine does not expose (ok None) fails nothing
    report["ok"] = all(r.get("ok") is not False for r in report["checks"].values()) and \
        all(r.get("ok") for n, r in report["checks"].items() if n != "kernel_self_check")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    text = summary(report)
    out.with_suffix(".md").write_text(text)
    print(text, end="")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

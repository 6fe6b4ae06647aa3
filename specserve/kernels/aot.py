"""Ahead-of-time compilation of every Triton binary the engine launches, for GPUs this
machine need not have.

For each preset (a model's attention geometry and vocabulary, the engine's defaults
and a method) and dtype, :func:`preset_jobs` lists the binaries an engine can launch:
its static runner's (``kernels.specializations.runner_step_shapes``, draft-tree steps
included: the TREE binaries of every plan and of uniform tree steps), an EAGLE head's
draft graphs (decode per batch bucket, the head's context bound) and the rejection
kernel's.  :func:`compile_job` compiles one for one GPU with ``triton.compile`` and
the ``ASTSource`` of that exact launch (``kernels.launches.ast_source``); Triton's
bundled ptxas assembles it, with its log (registers, spill stores and loads), and the
compiled metadata gives the shared memory.  ``scripts/triton_aot_report.py`` writes
the table to ``docs/benchmarks/triton-aot/``; ``tests/kernels/test_triton_aot.py`` runs
the same in a subprocess and checks the limits (:func:`violations`).

Run it in a process without ``TRITON_INTERPRET`` and with a fresh ``TRITON_CACHE_DIR``
(a cached binary skips ptxas, so its log would be missing).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
from dataclasses import asdict, dataclass

import torch

# Shared memory a block may use (the opt-in maximum): A100 163 KB, H100 227 KB.
ARCHS = {"sm_80": (80, 163 * 1024), "sm_90": (90, 227 * 1024)}
MAX_ATTENTION_BINARIES = 40  # per (preset, dtype): attention, KV write and reduce of the runner and head
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Preset:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    dtypes: tuple[str, ...]
    k: int  # drafts per step: verification graphs for q = 2..k+1
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    eagle_head: bool = True  # an EAGLE head drafting with the target's attention geometry
    rejection: tuple[str, ...] = ("strict", "probabilistic")
    tree_nodes: tuple[int, ...] = (8, 16)  # nodes per sequence of the uniform draft-tree steps captured


PRESETS = (
    # the embedded default (conf/model/smollm2-135m.yaml) with +method=ngram (K=5)
    Preset("smollm2-135m", 9, 3, 64, 49152, 8192, ("bfloat16", "float32"), k=5),
    # helm/specserve/ci/gpu-eagle3-values.yaml: Llama-3.1-8B, EAGLE-3 K=3, max_num_seqs 64
    Preset("llama-3.1-8b", 32, 8, 128, 128256, 8192, ("bfloat16", "float16", "float32"), k=3, max_num_seqs=64),
)


@dataclass
class Job:
    preset: str
    dtype: str
    group: str  # runner | head | rejection
    kernel: str
    detail: str  # the constexprs that tell binaries apart
    launch: object  # kernels.launches.Launch
    key: tuple  # its specialization: jobs with equal keys share one binary


def preset_jobs(p: Preset, dtype: str, num_sms: int = 132) -> list[Job]:
    """One job per distinct binary of preset ``p`` in ``dtype`` (CPU stand-in tensors)."""
    from specserve.executor.batch import draft_sizes
    from specserve.kernels.specializations import (AttentionGeometry, StepShape, batch_buckets, rejection_launches,
                                                   runner_launches, runner_step_shapes)

    from specserve.kernels.paged_attention import default_num_splits
    from specserve.kernels.rejection_kernel import default_block_v

    g = AttentionGeometry(p.num_heads, p.num_kv_heads, p.head_dim, p.block_size, None, DTYPES[dtype])
    graph_q = (1, *(n + 1 for n in draft_sizes(p.k)))
    max_tokens = max(p.max_num_batched_tokens, p.max_num_seqs * max(graph_q))
    shapes = runner_step_shapes(g, max_num_seqs=p.max_num_seqs, max_tokens=max_tokens, graph_query_lens=graph_q,
                                max_seq_len=p.max_model_len, split_kv=True, num_sms=num_sms, trees=True,
                                tree_query_lens=p.tree_nodes)
    groups = [("runner", runner_launches(g, shapes, "cpu"))]
    if p.eagle_head:  # head_graphs: one decode step per bucket over contexts up to max_model_len + K + 1
        bound = p.max_model_len + p.k + 1
        head = [StepShape(b, b, 1, default_num_splits(b, p.num_heads, p.num_kv_heads, p.head_dim, 1, bound, num_sms))
                for b in batch_buckets(p.max_num_seqs)]
        groups.append(("head", runner_launches(g, head, "cpu")))
    jobs = _jobs(p.name, dtype, groups)
    if dtype == p.dtypes[0]:  # verification reads float32 probabilities whatever the model's dtype
        block_v = default_block_v(p.vocab_size, "cuda")
        launches = [x for m in p.rejection for x in rejection_launches(m, p.vocab_size, "cpu", block_v)]
        jobs += _jobs(p.name, "float32", [("rejection", launches)])
    return jobs


def _jobs(preset: str, dtype: str, groups: list[tuple[str, list]]) -> list[Job]:
    """Jobs of distinct binaries within each group; a group may share binaries with
    another (an EAGLE head of the target's geometry launches the runner's decode binaries)."""
    from specserve.kernels.launches import specialization

    jobs = []
    for group, launches in groups:
        seen = set()
        for launch in launches:
            key = specialization(launch)
            if key in seen:
                continue
            seen.add(key)
            detail = " ".join(f"{k}={v}" for k, v in launch.constexprs.items()
                              if k in ("BLOCK_Q", "BLOCK_M", "BLOCK_N", "FLAT", "SPLIT", "TREE", "STRICT",
                                       "HAS_DRAFT_PROBS", "BLOCK_V"))
            detail += f" warps={launch.options.get('num_warps', 4)}"
            jobs.append(Job(preset, dtype, group, launch.kernel.name, detail, launch, key))
    return jobs


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass
class Compiled:
    preset: str
    dtype: str
    group: str
    kernel: str
    detail: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    shared_limit: int
    error: str = ""


def compile_job(job: Job, arch: str) -> Compiled:
    """Compile ``job`` for ``arch`` (sm_80 / sm_90) with Triton's bundled ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget

    from specserve.kernels.launches import ast_source

    cc, limit = ARCHS[arch]
    out = Compiled(job.preset, job.dtype, job.group, job.kernel, job.detail, arch, 0, 0, 0, 0, limit)
    src, options = ast_source(job.launch)
    options = {k: v for k, v in options.items() if k in ("num_warps", "num_stages", "num_ctas")}
    log = io.StringIO()
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints ptxas -v's report
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
    except Exception as exc:  # reported, and failed by the test
        out.error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
        return out
    text = log.getvalue()
    regs = [int(r) for r in _PTXAS_REGS.findall(text)]
    spills = [(int(a), int(b)) for a, b in _PTXAS_SPILLS.findall(text)]
    if not regs:
        out.error = "no ptxas report (a cached binary? use a fresh TRITON_CACHE_DIR)"
        return out
    out.registers = max(regs)
    out.spill_stores = max((a for a, _ in spills), default=0)
    out.spill_loads = max((b for _, b in spills), default=0)
    out.shared_bytes = int(kernel.metadata.shared)
    return out


def _compile_star(args: tuple[Job, str]) -> dict:
    return asdict(compile_job(*args))


def compile_all(jobs: list[Job], archs: tuple[str, ...] = tuple(ARCHS), workers: int = 2) -> list[dict]:
    """Every job for every arch, each distinct binary compiled once (presets share the
    rejection kernel's), in a pool of ``workers`` spawned processes; rows in job order."""
    import concurrent.futures
    import multiprocessing

    first: dict[tuple, Job] = {}
    for j in jobs:
        first.setdefault(j.key, j)
    work = [(j, a) for j in first.values() for a in archs]
    if workers <= 1:
        done = [_compile_star(w) for w in work]
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            done = list(pool.map(_compile_star, work))
    by_key = {(j.key, a): r for (j, a), r in zip(work, done)}
    rows = []
    for j in jobs:
        for a in archs:
            binary = hashlib.sha256(repr(j.key).encode()).hexdigest()[:12]
            rows.append(dict(by_key[(j.key, a)], preset=j.preset, dtype=j.dtype, group=j.group, binary=binary))
    return rows


def violations(rows: list[dict]) -> list[str]:
    """What the engine must not ship: a binary that does not compile, an attention binary
    (attention, KV write, reduce; any dtype) that spills, one that needs more shared memory
    than its GPU's blocks have, or more attention binaries per (preset, dtype) than
    ``MAX_ATTENTION_BINARIES``.  The rejection kernel's few bytes of spill (its float64
    sums; 0-8 B, with 32-70 registers) are reported, not failed."""
    bad = []
    for r in rows:
        where = f"{r['preset']} {r['dtype']} {r['arch']} {r['kernel']} [{r['detail']}]"
        if r["error"]:
            bad.append(f"{where}: does not compile: {r['error']}")
            continue
        if r["group"] != "rejection" and (r["spill_stores"] or r["spill_loads"]):
            bad.append(f"{where}: spills {r['spill_stores']} B stores / {r['spill_loads']} B loads")
        if r["shared_bytes"] > r["shared_limit"]:
            bad.append(f"{where}: {r['shared_bytes']} B of shared memory > {r['shared_limit']} B")
    for (preset, dtype, arch), n in count_attention(rows).items():
        if n > MAX_ATTENTION_BINARIES:
            bad.append(f"{preset} {dtype} {arch}: {n} attention binaries > {MAX_ATTENTION_BINARIES}")
    return bad


def count_attention(rows: list[dict]) -> dict[tuple[str, str, str], int]:
    """Distinct attention binaries (attention, KV write, reduce) per (preset, dtype, arch)."""
    binaries: dict[tuple[str, str, str], set[str]] = {}
    for r in rows:
        if r["group"] != "rejection":
            binaries.setdefault((r["preset"], r["dtype"], r["arch"]), set()).add(r["binary"])
    return {k: len(v) for k, v in binaries.items()}


def markdown(rows: list[dict], triton_version: str) -> str:
    """The report as a markdown table: a summary per (preset, dtype, arch, kernel), then every binary."""
    lines = [
        "# Triton binaries compiled ahead of time",
        "",
        f"Written by `scripts/triton_aot_report.py` (triton {triton_version}, its bundled ptxas; no GPU).",
        "Every binary the engine can launch for each preset, compiled for sm_80 (A100) and sm_90 (H100);",
        "`tests/kernels/test_triton_aot.py` recompiles the bf16/fp16 ones and fails on an error, a spill in",
        "an attention binary (attention, KV write, reduce), shared memory over the block limit, or more",
        f"than {MAX_ATTENTION_BINARIES} attention binaries per (preset, dtype).  Groups: `runner` = the",
        "target's static runner (with the TREE binaries of draft-tree steps: `TREE=True`, uniform tree",
        "steps of 8 and 16 nodes per sequence and every mixed plan), `head` = an EAGLE head's draft graphs",
        "(the runner's decode binaries",
        "when its attention shape is the target's), `rejection` = draft verification (float32",
        "probabilities whatever the model's dtype; its few bytes of spill are float64 sums, reported).",
        "",
        "| preset | dtype | arch | kernel | groups | binaries | max registers | max spill stores (B) | "
        "max shared (KB) |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    summary: dict[tuple, list[dict]] = {}
    for r in rows:
        summary.setdefault((r["preset"], r["dtype"], r["arch"], r["kernel"]), []).append(r)
    for (preset, dtype, arch, kernel), rs in summary.items():
        groups = ", ".join(dict.fromkeys(r["group"] for r in rs))
        lines.append(f"| {preset} | {dtype} | {arch} | {kernel} | {groups} | {len({r['binary'] for r in rs})} | "
                     f"{max(r['registers'] for r in rs)} | "
                     f"{max(r['spill_stores'] for r in rs)} | {max(r['shared_bytes'] for r in rs) / 1024:.1f} |")
    lines += ["", "Every binary:", "",
              "| preset | dtype | arch | group | kernel | constexprs | registers | spill stores / loads (B) | "
              "shared (KB) |",
              "|---|---|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['dtype']} | {r['arch']} | {r['group']} | {r['kernel']} | {r['detail']} | "
                     f"{r['registers']} | {r['spill_stores']} / {r['spill_loads']} | {r['shared_bytes'] / 1024:.1f} |")
    return "\n".join(lines) + "\n"

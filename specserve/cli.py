"""Thin entry points: compose the Hydra config -> validate -> build -> run.

``specserve [--config-dir DIR] [--config-name NAME] [--cfg] [override ...]``
serves; ``specserve-generate`` and ``specserve-bench`` take the same config.
``specserve serve MODEL --flags`` is vLLM's form (translated by ``specserve.serve_compat``)
and ``specserve-bench -m`` a sweep (``specserve.sweep``).  The command line becomes a
validated config in ``specserve.compose``; a user mistake (unknown key, bad value,
missing model) prints ONE line, ``specserve: error: <key>: <what is allowed>``, and
exits 2: no traceback.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

from specserve.compose import UsageError, _cap_onednn_isa, check_device, compose_config, run_entry_point
from specserve.config import Config


def _run(argv: list[str] | None, body: Callable[[Config], int], prog: str = "specserve") -> int:
    argv = sys.argv[1:] if argv is None else argv

    def run() -> int:
        cfg = compose_config(argv, prog)
        if cfg is None:
            return 0
        _cap_onednn_isa(cfg)
        check_device(cfg)  # after the oneDNN cap: it may import torch
        if cfg.parallelism.tensor_parallel_size > 1:
            from specserve.parallel.launch import is_worker_process

            if is_worker_process(cfg):  # a rank > 0 under torchrun or a LeaderWorkerSet
                from specserve.parallel.worker import run_worker

                return run_worker(cfg)
        return body(cfg)

    return run_entry_point(prog, run)


def _serve(cfg: Config) -> int:
    from specserve.server import check_ports, run_server

    logging.getLogger().setLevel(cfg.server.log_level)
    check_ports(cfg.server)  # a port in use fails now, not after minutes of model loading
    from specserve.engine.async_engine import build_async_engine

    engine = build_async_engine(cfg)
    if cfg.parallelism.tensor_parallel_size == 1:
        from specserve.server.lifecycle import exit_process

        exit_process(run_server(cfg, engine))  # drained and stopped: skip the interpreter's teardown
    from specserve.parallel import launch

    launch.attach_engine(engine)  # a dead rank: health NOT_SERVING, then exit non-zero
    code = run_server(cfg, engine)
    return launch.shutdown(failed=code != 0) or code  # every rank exits; 0 only if all did cleanly


def _generate(cfg: Config) -> int:
    from specserve.engine.engine import LLMEngine
    from specserve.request import SamplingParams

    g = cfg.generate
    if not g.prompts and not g.messages:
        raise UsageError(
            "generate.prompts: give prompts ('generate.prompts=[\"Hello\"]') or a conversation "
            "('generate.messages=[{role:user,content:Hello}]')"
        )
    engine = LLMEngine(cfg)
    tok = engine.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) if g.chat else tok.encode(p) for p in g.prompts]
    labels = list(g.prompts)
    if g.messages:
        ids.append(tok.apply_chat_template([dict(m) for m in g.messages]))
        labels.append(" | ".join(f"{m['role']}: {m['content']}" for m in g.messages))
    params = [
        SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_tokens=g.max_tokens, seed=g.seed)
        for _ in ids
    ]
    for prompt, out in zip(labels, engine.generate(ids, params)):
        print(f"### prompt: {prompt}\n{out.text}\n[finish_reason={out.finish_reason.value} tokens={len(out.token_ids)} "
              f"mean_acceptance_length={out.spec.mean_acceptance_length:.2f}]")
    return 0


def _bench(cfg: Config) -> int:
    from specserve.bench import run_bench

    return run_bench(cfg)


def serve_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # `specserve serve MODEL --flags`: the vLLM-compatible form
        from specserve.serve_compat import serve_main as vllm_style_serve

        return vllm_style_serve(argv[1:], run=lambda overrides: _run(overrides, _serve))
    return _run(argv, _serve)


def generate_main(argv: list[str] | None = None) -> int:
    return _run(argv, _generate, "specserve-generate")


def bench_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-m" in argv or "--multirun" in argv:  # Hydra-style sweep, run in this process
        from specserve.sweep import main as sweep_main

        return sweep_main([a for a in argv if a not in ("-m", "--multirun")])
    return _run(argv, _bench, "specserve-bench")


def main() -> None:  # python -m specserve.cli
    sys.exit(serve_main())


if __name__ == "__main__":
    main()

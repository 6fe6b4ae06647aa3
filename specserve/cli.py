"""Thin entry points: compose the Hydra config -> validate -> build -> run.

``specserve [--config-dir DIR] [--config-name NAME] [--cfg] [override ...]``
serves; ``specserve-generate`` and ``specserve-bench`` take the same config.
User mistakes (unknown keys, bad values, missing models) print ONE line,
``specserve: error: <key>: <what is allowed>``, and exit 2: no traceback.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from specserve.config import MISPLACED_KEY_HINTS, Config, register_configs, validate_config
from specserve.errors import SpecServeError

USAGE = """usage: {prog} [--config-dir DIR] [--config-name NAME] [--cfg] [-h] [OVERRIDE ...]

Overrides are Hydra overrides, for example:
  model=smollm2-135m  +method=ngram  method.num_speculative_tokens=4
  +method=draft_model draft=smollm2-135m  model.dtype=float32  server.grpc_port=50051
Groups: model, method (absent = plain decoding), draft, parallelism.
--config-dir DIR  extra presets (same group layout), searched before the built-in ones
--cfg             print the composed config and exit
vLLM-style: `specserve serve MODEL --port 8000 --speculative-config JSON ...` (see `specserve serve --help`)
"""


class UsageError(Exception):
    pass


def conf_dir() -> Path:
    env = os.environ.get("SPECSERVE_CONF_DIR")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    candidates += [here.parent / "conf", here / "conf"]
    for c in candidates:
        if (c / "config.yaml").is_file():
            return c
    raise UsageError("cannot find the built-in conf/ directory; set SPECSERVE_CONF_DIR")


def _parse_argv(argv: list[str]) -> tuple[str | None, str, bool, bool, list[str]]:
    extra_dir, name, show, help_ = None, "config", False, False
    overrides: list[str] = []
    it = iter(argv)
    for a in it:
        if a in ("-h", "--help"):
            help_ = True
        elif a == "--cfg" or a == "--cfg=job":
            show = True
        elif a.startswith("--config-dir") or a.startswith("-cd"):
            extra_dir = a.split("=", 1)[1] if "=" in a else next(it, None)
            if not extra_dir:
                raise UsageError("--config-dir needs a directory")
        elif a.startswith("--config-name") or a.startswith("-cn"):
            value = a.split("=", 1)[1] if "=" in a else next(it, None)
            if not value:
                raise UsageError("--config-name needs a name")
            name = value
        elif a.startswith("-"):
            raise UsageError(f"unknown option {a!r} (overrides look like key=value)")
        else:
            overrides.append(a)
    return extra_dir, name, show, help_, overrides


def _presets(group: str, dirs: list[Path]) -> list[str]:
    return sorted({f.stem for d in dirs for f in (d / group).glob("*.yaml")})


def _first_line_of(e: BaseException, dirs: list[Path]) -> str:
    """A one-line message for a Hydra/OmegaConf composition error."""
    cause = e
    while cause.__cause__ is not None and not getattr(cause, "full_key", None):
        cause = cause.__cause__
    full_key = getattr(cause, "full_key", None) or getattr(e, "full_key", None)
    text = str(cause).strip()
    msg = text.splitlines()[0] if text else type(cause).__name__
    missing = re.search(r"Could not find '([\w-]+)/([^']+)'", text)
    if missing:
        group, name = missing.groups()
        return f"{group}: unknown preset {name!r}; available: {', '.join(_presets(group, dirs)) or '(none)'}"
    if full_key:
        hint = MISPLACED_KEY_HINTS.get(str(full_key))
        if hint:
            return f"{full_key}: is not a valid key here; {hint}"
        return f"{full_key}: {msg}"
    return msg


def compose_config(argv: list[str]) -> Config | None:
    """Compose and validate; None when only --cfg/--help output was requested."""
    extra_dir, name, show, help_, overrides = _parse_argv(argv)
    if help_:
        print(USAGE.format(prog=Path(sys.argv[0]).name))
        return None
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in MISPLACED_KEY_HINTS:
            raise UsageError(f"{key}: is not a valid key here; {MISPLACED_KEY_HINTS[key]}")
    obj = compose_object(name, overrides, extra_dir, show, register_configs)
    if obj is None:
        return None
    assert isinstance(obj, Config)
    return validate_config(obj)


def compose_object(name: str, overrides: list[str], extra_dir: str | None, show: bool,
                   register: Callable[[Any], None]) -> Any:
    """The object of preset ``name`` composed with ``overrides`` (the presets of
    ``--config-dir`` searched before the built-in ones) once ``register`` has filled the
    config store; None when ``show`` printed the composed YAML instead.  A bad override
    or preset is a one-line ``UsageError``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    dirs = [conf_dir()]
    if extra_dir is not None:
        d = Path(extra_dir).resolve()
        if not d.is_dir():
            raise UsageError(f"--config-dir: {extra_dir} is not a directory")
        overrides = [f"hydra.searchpath=[file://{d}]"] + overrides
        dirs.append(d)
    register(ConfigStore.instance())
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(dirs[0]), version_base="1.3"):
            cfg = compose(config_name=name, overrides=overrides)
        if show:
            print(OmegaConf.to_yaml(cfg, resolve=True))
            return None
        return OmegaConf.to_object(cfg)
    except SpecServeError:
        raise
    except Exception as e:  # Hydra and OmegaConf raise many types for a bad override
        raise UsageError(_first_line_of(e, dirs)) from None
    finally:
        GlobalHydra.instance().clear()


def _run(argv: list[str] | None, body: Callable[[Config], int]) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prog = Path(sys.argv[0]).name
    if not prog.startswith("specserve"):
        prog = "specserve"  # python -m specserve.cli
    logging.basicConfig(
        level=os.environ.get("SPECSERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = compose_config(argv)
        if cfg is None:
            return 0
        _cap_onednn_isa(cfg)
        if cfg.parallelism.tensor_parallel_size > 1:
            from specserve.parallel.launch import is_worker_process

            if is_worker_process(cfg):  # a rank > 0 under torchrun or a LeaderWorkerSet
                from specserve.parallel.worker import run_worker

                return run_worker(cfg)
        return body(cfg)
    except (UsageError, SpecServeError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _cap_onednn_isa(cfg: Config) -> None:
    """oneDNN reads ONEDNN_MAX_CPU_ISA once, when torch loads: set it before that."""
    isa = cfg.engine.onednn_max_cpu_isa
    if isa == "auto":  # cap only where bf16 runs on torch's kernels
        from specserve.kernels.cpu_features import fused_kernel_expected

        isa = None if fused_kernel_expected(cfg.engine.cpu_kernel) else "AVX512_CORE_BF16"
    if isa and cfg.engine.device != "cuda" and "torch" not in sys.modules:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", isa)



def _serve(cfg: Config) -> int:
    from specserve.engine.async_engine import build_async_engine
    from specserve.server import run_server

    logging.getLogger().setLevel(cfg.server.log_level)
    engine = build_async_engine(cfg)
    if cfg.parallelism.tensor_parallel_size == 1:
        return run_server(cfg, engine)
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

        return vllm_style_serve(argv[1:])
    return _run(argv, _serve)


def generate_main(argv: list[str] | None = None) -> int:
    return _run(argv, _generate)


def bench_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-m" in argv or "--multirun" in argv:  # Hydra-style sweep, run in this process
        from specserve.sweep import main as sweep_main

        return sweep_main([a for a in argv if a not in ("-m", "--multirun")])
    return _run(argv, _bench)


def main() -> None:  # python -m specserve.cli
    sys.exit(serve_main())


if __name__ == "__main__":
    main()

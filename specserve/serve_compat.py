"""``specserve serve MODEL [vLLM flags]``: the vLLM-compatible way to start the server.

A thin translation into Hydra overrides (``--dry-run`` prints them and the
composed config once it has passed start-up's checks); the server then starts
exactly as ``specserve <overrides>`` would.  ``--port`` without ``--grpc-port``
puts gRPC on a free port, so two servers with different ``--port`` never collide.  Hydra stays the primary interface: ``specserve +method=ngram`` is
unchanged, and ``key=value`` arguments here are passed through as overrides.

    specserve serve embedded:smollm2-135m-instruct --port 8000 --seed 42 -tp 1 \\
        --max-model-len 2048 --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from typing import Any

from specserve.compat import (
    ENGINE_KEYS,
    IGNORED_ENGINE_ARGS,
    REMOVED_SPEC_KNOBS,
    UnsupportedArgumentError,
    hydra_value,
    override,
    engine_overrides,
)
from specserve.errors import SpecServeError
from specserve.vllm_flags import VLLM_SWITCHES, VLLM_VALUED, flags_help, vllm_flag

PROG = "specserve serve"

# flag (vLLM spelling, underscores as dashes) -> where its value goes
_ENGINE_FLAGS = {
    "model": "model",
    "speculative-config": "speculative_config",
    "tensor-parallel-size": "tensor_parallel_size",
    "dtype": "dtype",
    "max-model-len": "max_model_len",
    "seed": "seed",
    "served-model-name": "served_model_name",
    "kv-cache-memory-bytes": "kv_cache_memory_bytes",
    **{k.replace("_", "-"): k for k in ENGINE_KEYS},
}
_SERVER_FLAGS = {
    "host": "server.host",
    "port": "server.http_port",
    "grpc-port": "server.grpc_port",
    "api-key": "server.api_key",
    "ssl-certfile": "server.tls_cert_file",
    "ssl-keyfile": "server.tls_key_file",
    "pipeline-parallel-size": "parallelism.pipeline_parallel_size",
    # tools and reasoning (docs/server.md "Tools and reasoning")
    "tool-call-parser": "model.tool_call_format",
    "reasoning-parser": "model.reasoning_format",
    "chat-template": "model.chat_template",
    "default-chat-template-kwargs": "server.default_chat_template_kwargs",
}
_SHORT = {"-tp": "tensor-parallel-size", "-pp": "pipeline-parallel-size", "-h": "help"}
_SWITCHES = {"dry-run", "help", "enforce-eager", "enable-auto-tool-choice"} | {
    k.replace("_", "-") for k in IGNORED_ENGINE_ARGS}

# vLLM's everyday flags (specserve.vllm_flags): switches, valued flags, and what each becomes.
_VLLM_SWITCHES = set(VLLM_SWITCHES)
_VLLM_VALUED = set(VLLM_VALUED)
_INT_FLAGS = {"tensor-parallel-size", "max-model-len", "seed", "port", "grpc-port", "pipeline-parallel-size"}
_TEXT_FLAGS = {"model", "served-model-name", "host", "api-key", "ssl-certfile", "ssl-keyfile", "speculative-config",
               "dtype", "device", "cpu-kernel", "onednn-max-cpu-isa", "tool-call-parser", "reasoning-parser",
               "chat-template"}

USAGE = f"""usage: {PROG} [MODEL] [options] [key=value ...]

The vLLM-compatible form of `specserve`: options become Hydra overrides
(--dry-run prints them and the config, checked as start-up checks it, then exits).
  MODEL / --model M            model preset, embedded:<name>, a .gguf file or an HF directory
  --host H                     listen address (server.host)
  --port P                     HTTP port, the OpenAI API (server.http_port; 0 = any free port)
  --grpc-port P                gRPC port (server.grpc_port; default 50051, or a free port
                               when --port is given: the log says which)
  --seed N                     engine.seed
  -tp, --tensor-parallel-size  parallelism.tensor_parallel_size
  --max-model-len N            model.max_model_len
  --dtype D                    model.dtype: auto, float32, bfloat16, float16 (half, float)
  --speculative-config JSON    e.g. '{{"method": "draft_model", "model": "<draft>", "num_speculative_tokens": 5}}'
  --served-model-name NAME ... the model ids clients send (model.name, then
                               server.served_model_aliases); MODEL as given answers too
  --api-key KEY                server.api_key;  --ssl-certfile/--ssl-keyfile: TLS
  --{' / --'.join(k.replace('_', '-') for k in ENGINE_KEYS)}
                               engine.* keys
  --enforce-eager              engine.cuda_graphs=off
  --tool-call-parser NAME      model.tool_call_format (hermes, llama3_json, qwen3_coder, pythonic, or
                               package.module:Class); unset: detected from the chat template
  --reasoning-parser NAME      model.reasoning_format (deepseek_r1, qwen3, granite, or package.module:Class)
  --enable-auto-tool-choice    server.enable_auto_tool_choice=true (already on wherever a format is known)
  --chat-template FILE         model.chat_template (a file, or the template's text)
  --default-chat-template-kwargs JSON  server.default_chat_template_kwargs, e.g. '{{"enable_thinking": false}}'
  --trust-remote-code          accepted, no effect
  --dry-run                    print the translation and the composed config, then exit
  key=value                    any Hydra override, applied last
Underscore spellings (--max_model_len) work too; so does --flag=value.
vLLM's everyday flags:
""" + flags_help() + "\n"


def _split(arg: str) -> tuple[str, str | None]:
    """'--max_model_len=2048' -> ('max-model-len', '2048'); '-tp' -> ('tensor-parallel-size', None)."""
    name, eq, value = arg.partition("=")
    if name in _SHORT:
        return _SHORT[name], (value if eq else None)
    return name.lstrip("-").replace("_", "-"), (value if eq else None)


def translate(argv: list[str]) -> tuple[list[str], list[str], bool]:
    """Parse ``serve`` arguments -> (Hydra overrides, notes, dry_run).  Raises
    UnsupportedArgumentError / ConfigError with one line."""
    engine: dict[str, Any] = {}
    server: list[str] = []
    notes: list[str] = []
    passthrough: list[str] = []
    config_dir: list[str] = []
    dry_run = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("-") or arg == "-":
            if "=" in arg:
                passthrough.append(arg)
            elif "model" not in engine:
                engine["model"] = arg
            else:
                raise UnsupportedArgumentError("model", f"one model only; got {engine['model']!r} and {arg!r}")
            continue
        name, value = _split(arg)
        key = name.replace("-", "_")
        if key in REMOVED_SPEC_KNOBS:
            raise UnsupportedArgumentError(key, _removed(key))
        if name in _VLLM_SWITCHES or name in _VLLM_VALUED:  # vLLM's everyday flags: specserve.vllm_flags
            if name in _VLLM_VALUED and value is None:
                if i >= len(argv) or argv[i].startswith("--"):
                    raise UnsupportedArgumentError(key, f"--{name} needs a value")
                value = argv[i]
                i += 1
            elif name in ("enable-prefix-caching", "enable-chunked-prefill") and value is None and i < len(argv) \
                    and argv[i].lower() in ("true", "false"):  # --enable-prefix-caching true
                value = argv[i]
                i += 1
            flag_overrides, note, revision = vllm_flag(name, value)
            server += flag_overrides
            notes += [note] if note else []
            if revision is not None:
                engine["revision"] = revision
            continue
        if name in _SWITCHES:
            if value is not None:
                raise UnsupportedArgumentError(key, f"--{name} takes no value")
            if name == "help":
                raise _Help()
            if name == "dry-run":
                dry_run = True
            elif name == "enable-auto-tool-choice":
                server.append("server.enable_auto_tool_choice=true")
            else:
                engine[key] = True
            continue
        if name not in _ENGINE_FLAGS and name not in _SERVER_FLAGS and name != "config-dir":
            raise UnsupportedArgumentError(
                key,
                f"unknown option {arg.partition('=')[0]!r} (see `{PROG} --help`; "
                "other settings: key=value Hydra overrides)",
            )
        if value is None:
            if i >= len(argv) or argv[i].startswith("--"):
                raise UnsupportedArgumentError(key, f"--{name} needs a value")
            value = argv[i]
            i += 1
            if name == "served-model-name":  # several names, as vLLM's nargs="+": up to the next option
                names = [value]
                while i < len(argv) and not argv[i].startswith("-") and "=" not in argv[i]:
                    names.append(argv[i])
                    i += 1
                engine["served_model_name"] = names
                continue
        if name == "config-dir":
            config_dir = ["--config-dir", value]
        elif name == "default-chat-template-kwargs":
            server.append(_kwargs_override(value))
        elif name in _SERVER_FLAGS:
            server.append(override(_SERVER_FLAGS[name], _typed(name, value)))
        else:
            engine[_ENGINE_FLAGS[name]] = _typed(name, value)
    spec = engine.pop("speculative_config", None)
    if spec is not None:
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise UnsupportedArgumentError(
                "speculative_config", f"--speculative-config: not valid JSON ({e})"
            ) from None
    revision = engine.pop("revision", None)
    if revision is not None:  # --revision R: the model id pinned, org/name@R
        model = engine.get("model")
        from specserve.hub import parse_id

        if not isinstance(model, str) or parse_id(model) is None or "@" in model:
            raise UnsupportedArgumentError("revision", "--revision pins a Hugging Face id given as MODEL (org/name); "
                                                       f"got {model!r}")
        engine["model"] = f"{model}@{revision}"
    overrides, engine_notes = engine_overrides(speculative_config=spec, where="serve", **engine)
    notes = engine_notes + notes
    given = {o.partition("=")[0].lstrip("+") for o in server + passthrough}
    if "server.http_port" in given and "server.grpc_port" not in given:
        # vLLM has only the HTTP port: a second server started with another --port must not
        # collide with the first on gRPC's fixed default.
        server.append("server.grpc_port=0")
        notes.append("--port without --grpc-port: gRPC listens on a free port, logged at start-up "
                     "(\"gRPC on HOST:PORT\"); --grpc-port P fixes it")
    return config_dir + overrides + server + passthrough, notes, dry_run


class _Help(Exception):
    pass


def _kwargs_override(text: str) -> str:
    """``--default-chat-template-kwargs JSON`` -> the Hydra override of that object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise UnsupportedArgumentError("default_chat_template_kwargs",
                                       f"--default-chat-template-kwargs: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise UnsupportedArgumentError("default_chat_template_kwargs",
                                       "--default-chat-template-kwargs must be a JSON object")

    def hydra(v) -> str:
        if isinstance(v, dict):
            return "{" + ",".join(f"{hydra_value(str(k))}:{hydra(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ",".join(hydra(x) for x in v) + "]"
        return hydra_value(v)

    return f"server.default_chat_template_kwargs={hydra(value)}"


def _removed(key: str) -> str:
    from specserve.compat import removed_knob_message

    return removed_knob_message(key, "serve")


def _typed(name: str, value: str) -> Any:
    """Integers where vLLM's flag is an integer (so a typo fails naming the flag);
    numbers as numbers, names and paths as text; the schema types the rest."""
    if name in _INT_FLAGS:
        try:
            return int(value)
        except ValueError:
            raise UnsupportedArgumentError(
                name.replace("-", "_"), f"--{name} must be an integer, got {value!r}"
            ) from None
    if name not in _TEXT_FLAGS:
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def serve_main(argv: list[str], run: Callable[[list[str]], int]) -> int:
    """``specserve serve ...``: translate, then ``run(overrides)``, the normal server path
    that ``specserve.cli`` passes in (or print, with --dry-run)."""
    try:
        overrides, notes, dry_run = translate(argv)
    except _Help:
        print(USAGE)
        return 0
    except SpecServeError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"{PROG}: note: {note}", file=sys.stderr)
    hydra_form = "specserve " + shlex.join(overrides)
    if dry_run:
        return _dry_run(overrides, hydra_form)
    print(f"{PROG}: running as: {hydra_form}", file=sys.stderr, flush=True)
    return run(overrides)


def _dry_run(overrides: list[str], hydra_form: str) -> int:
    from specserve.compose import UsageError, check_device, check_model_paths, compose_config, config_yaml

    print("# the Hydra command line this translates to:")
    print(hydra_form)
    try:
        cfg = compose_config(overrides)
        check_device(cfg)  # start-up's device and dtype checks (float16 on the CPU, ...)
        check_model_paths(cfg)  # the model files exist (nothing is loaded)
    except (UsageError, SpecServeError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print("# the composed, validated config:")
    print(config_yaml(cfg), end="")
    return 0

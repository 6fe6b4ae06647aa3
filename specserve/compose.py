"""From a command line to a validated ``Config``: what every entry point shares.

``compose_config(argv, prog)`` parses ``[--config-dir DIR] [--config-name NAME] [--cfg]
[-h] [override ...]``, composes the Hydra presets (those of ``--config-dir`` searched
before the built-in ``conf/``), converts the result to the schema's dataclasses and
validates it; ``compose_object`` does the composition for any schema (``specserve-train``
uses it with its own).  User mistakes (unknown keys, bad values, missing presets) are
ONE-line ``UsageError``s, ``<key>: <what is allowed>``.  An unknown key
(``+engine.max_num_seq=64`` as well as ``engine.max_num_seq=64``) names the closest key
of the schema, and Hydra's wording for the common slips (``method.*`` without
``+method=``, ``method=`` without ``+``, two ``+method=``) becomes what to type instead.
``--cfg`` prints a config only once it passes the checks start-up makes before loading
the model (``check_device`` included).  Also here: each command's ``--help`` text
(``help_text``, ``keys_help``) and ``_cap_onednn_isa``, which must run before torch loads.

Imports only the config schema and the errors at module level: the entry points
(``specserve.cli``, ``specserve.sweep``, ``specserve.serve_compat``, ``specserve.train.cli``)
and the vLLM-shaped API (``specserve.compat``, ``specserve.llm``) all stand on it.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from specserve.config import (
    MISPLACED_KEY_HINTS,
    Config,
    register_configs,
    schema_keys,
    unknown_key_message,
    unknown_keys,
    validate_config,
)
from specserve.errors import SpecServeError


USAGE = """usage: {prog} [--config-dir DIR] [--config-name NAME] [--cfg] [-h] [OVERRIDE ...]

Overrides are Hydra overrides, for example:
  model=smollm2-135m  +method=ngram  method.num_speculative_tokens=4
  +method=draft_model draft=smollm2-135m  model.dtype=float32  server.grpc_port=50051
Groups: model, method (absent = plain decoding), draft, parallelism.
--config-dir DIR  extra presets (same group layout), searched before the built-in ones
--cfg             print the composed config and exit, once it passes start-up's checks
vLLM-style: `specserve serve MODEL --port 8000 --speculative-config JSON ...` (see `specserve serve --help`)
"""


GENERATE_USAGE = """usage: specserve-generate [--config-dir DIR] [--config-name NAME] [--cfg] [-h] [OVERRIDE ...]

Generates a completion for each prompt with the configured model and method and prints
it with its finish reason and mean acceptance length.  For example:
  specserve-generate +method=ngram "generate.prompts=['The future of AI is']"
  specserve-generate "generate.messages=[{role:user,content:Hello}]" generate.max_tokens=64

{keys}
The model, method and engine are chosen as for `specserve` (model=..., +method=...,
engine.*; see `specserve --help`).  --cfg prints the composed config and exits.
"""


BENCH_USAGE = """usage: specserve-bench [-m] [--config-dir DIR] [--config-name NAME] [--cfg] [-h] [OVERRIDE ...]

Measures the configured method against plain decoding (specserve_vanilla) and
transformers generate (hf) on the same prompts, greedy, in one process; writes a
JSON report to bench.output and prints the speed ratios and a greedy-match line.
  specserve-bench +method=ngram bench.num_prompts=32 bench.max_tokens=128
  specserve-bench -m +method=ngram,suffix method.num_speculative_tokens=2,4,8

{keys}
-m, --multirun  sweep: one run per combination of comma-separated values, each beside a
                plain-decoding run made right before it; a summary table and plot
                in bench.output's directory (bench.output without its suffix)
The model, method and engine are chosen as for `specserve` (model=..., +method=...,
engine.*; see `specserve --help`).  --cfg prints the composed config and exits.
"""


def _override_value(v: Any) -> str:
    """``v`` as a Hydra override writes it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_override_value(x) for x in v) + "]"
    return str(v)


def keys_help(prefix: str, cls: type, skip: tuple[str, ...] = ()) -> list[str]:
    """``prefix.key=default`` for each field of the dataclass ``cls`` (nested dataclasses
    listed key by key), each with its comment in the source when it has one."""
    import dataclasses
    import inspect
    import textwrap

    comments: dict[str, str] = {}
    above: list[str] = []
    try:
        source = inspect.getsource(cls).splitlines()[1:]
    except (OSError, TypeError):
        source = []
    for line in source:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("#").strip())
            continue
        m = re.match(r"(\w+)\s*:", text)
        if m and m.group(1) not in comments:
            after = text.split("  # ", 1)[1] if "  # " in text else ""
            comments[m.group(1)] = " ".join(above) or after
        above = []
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "???"
        if dataclasses.is_dataclass(default):
            out += keys_help(f"{prefix}{f.name}.", type(default))
            continue
        out.append(f"  {prefix}{f.name}={_override_value(default)}")
        if comments.get(f.name):
            text = comments[f.name][0].upper() + comments[f.name][1:]
            out += textwrap.wrap(text, 88, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return out


def help_text(prog: str) -> str:
    """What ``prog --help`` prints: its own usage and the keys it reads."""
    from specserve.config import BenchConfig, GenerateConfig

    if prog == "specserve-generate":
        keys = "Keys (defaults shown):\n" + "\n".join(keys_help("generate.", GenerateConfig))
        return GENERATE_USAGE.replace("{keys}", keys)
    if prog == "specserve-bench":
        keys = "Keys (defaults shown):\n" + "\n".join(keys_help("bench.", BenchConfig))
        return BENCH_USAGE.replace("{keys}", keys)
    return USAGE.format(prog=prog)


class UsageError(Exception):
    pass


def run_entry_point(prog: str, body: Callable[[], int]) -> int:
    """What every entry point does around its work: logging at ``$SPECSERVE_LOG_LEVEL``
    (INFO), a user mistake printed as ONE line ``<prog>: error: ...`` with exit code 2,
    and exit code 130 on Ctrl-C."""
    import logging

    logging.basicConfig(level=os.environ.get("SPECSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return body()
    except (UsageError, SpecServeError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


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


# Groups that are absent unless added with +group=<preset> (speculation is off by default).
ADDED_GROUPS = ("method",)


def _group_choices(overrides: list[str]) -> dict[str, list[str]]:
    """``group -> [the overrides selecting it]`` for ``[+]group=value`` overrides (no dot in the key)."""
    out: dict[str, list[str]] = {}
    for o in overrides:
        key, eq, _ = o.partition("=")
        name = key.lstrip("+~")
        if eq and name and "." not in name and not name.startswith("hydra"):
            out.setdefault(name, []).append(o)
    return out


def _slip(text: str, dirs: list[Path], overrides: list[str]) -> str | None:
    """Hydra's wording for the common slips, said as what to type instead; None if not one."""
    choices = _group_choices(overrides)
    if "Unexpected type for root: NoneType" in text:  # group.key=... while the group is absent
        for o in overrides:
            key = o.partition("=")[0].lstrip("+~")
            group = key.partition(".")[0]
            if "." in key and group in ("method", "draft") and group not in choices:
                names = ", ".join(_presets(group, dirs))
                if group == "method":
                    return (f"{key}: no speculative method is selected; add one first: "
                            f"+method=<name> {o} (methods: {names})")
                return f"{key}: no draft is selected; add draft=<preset> first ({names}), or set method.model=<path>"
    m = re.search(r"Could not override '([\w-]+)'\. No match in the defaults list", text)
    if m:
        group = m.group(1)
        value = next((o.partition("=")[2] for o in choices.get(group, [])), "<name>")
        return f"{group}: not in the defaults, so it is added with +: write +{group}={value}"
    m = re.search(r"Multiple values for ([\w-]+)|([\w-]+) appears more than once in the final defaults list", text)
    if m:
        group = m.group(1) or m.group(2)
        added = [o for o in choices.get(group, []) if o.startswith("+")]
        if group in ADDED_GROUPS and len(added) > 1:
            return f"{group}: selected twice ({' and '.join(added)}); give +{group}=<name> once"
        value = next((o.partition("=")[2] for o in added), "<name>")
        return f"{group}: is in the defaults already, so it is selected without +: write {group}={value}"
    m = re.search(r"force-add of config groups is not supported: '\+\+([\w-]+)=([^']*)'", text)
    if m:
        return f"{m.group(1)}: a group is added with one +: write +{m.group(1)}={m.group(2)}"
    m = re.search(r"Could not append to config\. An item is already at '([^']+)'", text)
    if m:
        key = m.group(1)
        value = next((o.partition("=")[2] for o in overrides if o.lstrip("+").partition("=")[0] == key), "<value>")
        return f"{key}: is set already (by its preset or the schema), so it is changed without +: write {key}={value}"
    m = re.search(r"Could not delete from config\. '([^']+)' does not exist", text)
    if m:
        key = m.group(1)
        return unknown_key_message(key) if key not in schema_keys() else f"{key}: is not set; nothing to delete"
    m = re.search(r"Error parsing override '([^'=]+)'$", text.splitlines()[0] if text else "")
    if m:
        return f"{m.group(1)}: an override needs a value: {m.group(1)}=<value>"
    return None


def _first_line_of(e: BaseException, dirs: list[Path], overrides: Sequence[str] = ()) -> str:
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
    slip = _slip(str(e).strip() or text, dirs, list(overrides))
    if slip is not None:
        return slip
    unparsed = _unparsed_override(text, overrides)
    if unparsed is not None:
        return unparsed
    if full_key:
        hint = MISPLACED_KEY_HINTS.get(str(full_key))
        if hint:
            return f"{full_key}: is not a valid key here; {hint}"
        if re.search(r"Key '[^']*' not in '", text):
            chosen = _group_choices(list(overrides)).get("method", [])  # the method selected names the keys
            return unknown_key_message(str(full_key), chosen[-1].partition("=")[2] if chosen else None)
        return f"{full_key}: {msg}"
    return msg


# String keys whose value is a comma-separated list of their own (several API keys): a comma
# there is no Hydra sweep, so an unquoted value is quoted for Hydra.
COMMA_LIST_KEYS = ("server.api_key", "server.metrics_key")


def _quote_comma_lists(overrides: list[str]) -> list[str]:
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        if eq and key.lstrip("+") in COMMA_LIST_KEYS and "," in value and value[:1] not in ("'", '"'):
            o = f"{key}='{value}'" if "'" not in value else f'{key}="{value}"'
        out.append(o)
    return out


def _unparsed_override(text: str, overrides: Sequence[str]) -> str | None:
    """One line for an override Hydra's grammar cannot read: which key, and how to quote it."""
    ambiguous = re.match(r"Ambiguous value for argument '([^=']+)=(.*)'", text)
    if ambiguous:
        key, value = ambiguous.groups()
        return (f"{key.lstrip('+~')}: Hydra reads the commas in {value!r} as a sweep over several runs; "
                f"quote the value: {key}='{value}'")  # fmt: skip
    if not re.search(r"LexerNoViableAlt|mismatched input|extraneous input|token recognition error|no viable alt", text):
        return None
    for o in overrides:
        key, eq, value = o.partition("=")
        if eq and o in text:
            if value.startswith("[") and value.endswith("]"):
                items = ", ".join(f"'{v.strip()}'" for v in value[1:-1].split(",") if v.strip())
                suggestion = f"{key}=[{items}]"
            else:
                suggestion = f"{key}='{value}'"
            return (f"{key.lstrip('+~')}: Hydra cannot read {value!r} unquoted (non-ASCII letters, spaces and "
                    f"some symbols need quotes); write {suggestion}")  # fmt: skip
    return None


def compose_config(argv: list[str], prog: str = "specserve") -> Config | None:
    """Compose and validate; None when only --cfg/--help output was requested.

    ``--cfg`` prints the config only once it has passed every check start-up makes
    before loading the model (``validate_config`` and ``check_device``)."""
    extra_dir, name, show, help_, overrides = _parse_argv(argv)
    if help_:
        print(help_text(prog))
        return None
    overrides = _quote_comma_lists(overrides)
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in MISPLACED_KEY_HINTS:
            raise UsageError(f"{key}: is not a valid key here; {MISPLACED_KEY_HINTS[key]}")
    obj = compose_object(name, overrides, extra_dir, False, register_configs, schema=Config)
    assert isinstance(obj, Config)
    cfg = validate_config(obj)
    if show:
        check_device(cfg)
        print(config_yaml(cfg), end="")
        return None
    return cfg


def config_yaml(cfg: Config) -> str:
    """The validated config as YAML (what ``--cfg`` and ``serve --dry-run`` print)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def check_device(cfg: Config) -> None:
    """The device and dtype checks start-up makes when it loads the model (the loader's own
    ``resolve_device`` / ``resolve_dtype``), without loading it: ``engine.device=cuda``
    without CUDA, ``float16`` on the CPU.  torch is imported only where one could fail."""
    models = [("model", cfg.model)] + ([("draft", cfg.draft)] if cfg.draft is not None else [])
    if cfg.engine.device != "cuda" and all(m.dtype != "float16" for _, m in models):
        return  # auto/cpu with auto/float32/bfloat16: nothing here can fail
    from specserve.errors import ModelLoadError
    from specserve.executor.loader import resolve_device, resolve_dtype

    try:
        device = resolve_device(cfg.engine.device)
        for _, m in models:
            resolve_dtype(m.dtype, device, cfg.engine.cpu_kernel)
    except ModelLoadError as e:
        raise UsageError(str(e)) from None


def check_model_paths(cfg: Config) -> None:
    """The target's and any draft's files exist (``loader.check_model_path``), checked
    before anything loads; a missing one is a one-line UsageError naming its key."""
    from specserve.errors import ModelLoadError
    from specserve.executor.loader import check_model_path

    paths = [("model.path", cfg.model.path)]
    if cfg.draft is not None and getattr(cfg.draft, "path", None):
        paths.append(("draft.path", cfg.draft.path))
    for key, path in paths:
        try:
            check_model_path(str(path))
        except ModelLoadError as e:
            raise UsageError(f"{key}: {e}") from None


def compose_object(name: str, overrides: list[str], extra_dir: str | None, show: bool,
                   register: Callable[[Any], None], schema: type | None = None) -> Any:
    """The object of preset ``name`` composed with ``overrides`` (the presets of
    ``--config-dir`` searched before the built-in ones) once ``register`` has filled the
    config store; None when ``show`` printed the composed YAML instead.  A bad override
    or preset is a one-line ``UsageError``; so is a key that ``schema`` (when given) lacks,
    which Hydra lets ``+key=value`` add: the line names the closest real key."""
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
        if schema is not None:
            tree = OmegaConf.to_container(cfg, resolve=False)
            unknown = unknown_keys(tree, schema)
            if unknown:
                section = tree.get("method")  # the method selected names the keys to suggest
                method = section.get("method") if isinstance(section, dict) else None
                raise UsageError(unknown_key_message(unknown[0], method))
        if show:
            print(OmegaConf.to_yaml(cfg, resolve=True))
            return None
        return OmegaConf.to_object(cfg)
    except (SpecServeError, UsageError):
        raise
    except Exception as e:  # Hydra and OmegaConf raise many types for a bad override
        raise UsageError(_first_line_of(e, dirs, overrides)) from None
    finally:
        GlobalHydra.instance().clear()


def _cap_onednn_isa(cfg: Config) -> None:
    """oneDNN reads ONEDNN_MAX_CPU_ISA once, when torch loads: set it before that."""
    isa = cfg.engine.onednn_max_cpu_isa
    if isa == "auto":  # cap only where bf16 runs on torch's kernels
        from specserve.kernels.cpu_features import fused_kernel_expected

        isa = None if fused_kernel_expected(cfg.engine.cpu_kernel) else "AVX512_CORE_BF16"
    if isa and cfg.engine.device != "cuda" and "torch" not in sys.modules:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", isa)

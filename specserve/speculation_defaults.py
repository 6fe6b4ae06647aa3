"""The speculation a model implies, filled into a config before validation (pure
Python: json, no torch).

Two steps (``config.validate_config`` calls ``compose_speculation``; this module
reads the method registry, not the config):

1. A speculators checkpoint (vllm-project/speculators: ``config.json`` with
   ``speculators_config``) served as the model enables speculation by itself,
   as vLLM does: ``model.path=<dir>`` with no method becomes
   ``+method=<algorithm> method.model=<dir>`` with K from its default proposal
   method and ``model.path`` = its verifier.  The verifier must be local:
   ``verifier.name_or_path`` is used when it is ``embedded:<name>``, an
   existing directory (absolute, or relative to the checkpoint or the working
   directory) or a Hugging Face id in the Hugging Face cache (``specserve.hub``);
   otherwise it fails with one line saying how to pass the verifier.
2. ``+method=eagle3`` with no head on a target that ships one (the embedded
   SmolLM2) selects that head (``DEFAULT_HEADS``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specserve.errors import ConfigError
from specserve.methods import method_options

# (method, target model.path) -> the head used when none is given
DEFAULT_HEADS = {
    ("eagle3", "embedded:smollm2-135m-instruct"): "embedded:smollm2-135m-instruct-eagle3",
}
SPECULATORS_ALGORITHMS = {"eagle3": "eagle3", "eagle": "eagle"}


def read_speculators_config(path: str | None) -> dict[str, Any] | None:
    """The config.json of a speculators checkpoint directory, else None."""
    if not path or path.startswith("embedded:"):
        return None
    f = Path(path).expanduser() / "config.json"
    if not f.is_file():
        return None
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) and isinstance(cfg.get("speculators_config"), dict) else None


def speculative_tokens(cfg: dict[str, Any]) -> int | None:
    sc = cfg["speculators_config"]
    methods = sc.get("proposal_methods") or []
    default = sc.get("default_proposal_method")
    chosen = next((m for m in methods if m.get("proposal_type") == default), methods[0] if methods else None)
    k = chosen.get("speculative_tokens") if isinstance(chosen, dict) else None
    return int(k) if isinstance(k, int) and not isinstance(k, bool) else None


def _verifier_path(cfg: dict[str, Any], head_dir: str) -> str:
    name = (cfg["speculators_config"].get("verifier") or {}).get("name_or_path")
    if not isinstance(name, str) or not name:
        raise ConfigError("model.path", f"{head_dir} is a speculators checkpoint without a verifier name_or_path; "
                                        "give the target with model.path=<dir> and the head with method.model")
    if name.startswith("embedded:"):
        return name
    for cand in (Path(name).expanduser(), Path(head_dir).expanduser() / name):
        if cand.is_dir():
            return str(cand.resolve())
    from specserve.hub import cached_snapshot, parse_id

    hub_id = parse_id(name)
    if hub_id is not None and (snapshot := cached_snapshot(*hub_id)) is not None:  # in the Hugging Face cache
        return str(snapshot)
    raise ConfigError(
        "model.path",
        f"{head_dir} is a speculators checkpoint whose verifier {name!r} is not a local model (nor in the "
        f"Hugging Face cache; nothing is downloaded); serve it as model.path=<the verifier's local directory> +method="
        f"{cfg['speculators_config'].get('algorithm', 'eagle3')} method.model={head_dir}",
    )


def compose_speculation(cfg: Any) -> None:
    """Apply both composition steps to a ``config.Config`` in place."""
    spec_cfg = read_speculators_config(cfg.model.path)
    if spec_cfg is not None:
        head_dir = cfg.model.path
        algo = spec_cfg["speculators_config"].get("algorithm") or spec_cfg.get("speculators_model_type")
        method = SPECULATORS_ALGORITHMS.get(algo)
        if method is None:
            raise ConfigError("model.path", f"{head_dir} is a speculators checkpoint for {algo!r}; this build "
                                            f"serves {', '.join(SPECULATORS_ALGORITHMS)} speculators")
        if cfg.method is None:
            cfg.method = method_options(method, num_speculative_tokens=speculative_tokens(spec_cfg))
        if cfg.method.model is None and cfg.draft is None:
            cfg.method.model = head_dir
        cfg.model.path = _verifier_path(spec_cfg, head_dir)
    s = cfg.method
    if s is None:
        return
    if not s.model and cfg.draft is None:
        default = DEFAULT_HEADS.get((s.method, cfg.model.path))
        if default is not None:
            s.model = default
    if s.num_speculative_tokens is None and s.model:
        head_cfg = read_speculators_config(s.model)
        if head_cfg is not None:
            s.num_speculative_tokens = speculative_tokens(head_cfg)

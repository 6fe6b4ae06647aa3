"""Models named by Hugging Face id, found in the standard Hugging Face cache (pure Python).

A model, draft, head or tokenizer may be given as ``org/name`` or ``org/name@revision``
(a branch, tag or commit) wherever a local directory is accepted, as vLLM takes them.
The id is looked up in the hub cache that ``huggingface_hub`` and transformers fill
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; the
``models--org--name/snapshots/<commit>`` layout) through ``huggingface_hub``'s own
offline resolution, and becomes that snapshot directory.  A path that exists on disk
always wins over an id of the same spelling.

Nothing is downloaded unless asked: ``model.download=true`` (or ``draft.download``)
fetches a missing snapshot with ``huggingface_hub.snapshot_download`` (token from
``$HF_TOKEN``) when the model is loaded; ``HF_HUB_OFFLINE=1`` forbids it.  Without
either, a missing id is one line naming the key, the cache searched and how to fill it.

``python -m specserve.hub fetch org/name[@revision] ...`` fetches snapshots into the cache
and prints their directories: the chart's init container runs it (docs/deploy.md).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from specserve.errors import ConfigError

# A repository id as the Hub spells it (namespace/name), with an optional @revision.
_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<rev>[A-Za-z0-9_./-]+))?")
# What a snapshot must hold to be served: the config, weights and tokenizer files.
SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
_TRUE = {"1", "true", "yes", "on"}


def parse_id(text: Any) -> tuple[str, str | None] | None:
    """``org/name[@revision]`` -> (repo id, revision or None); None when ``text`` is not an
    id (another shape, ``embedded:``, a ``.gguf`` file, or a path that exists on disk)."""
    if not isinstance(text, str) or text.endswith(".gguf") or text.startswith(("embedded:", "/", ".", "~")):
        return None
    m = _ID.fullmatch(text)
    if m is None or Path(text).exists() or ".." in text:
        return None
    return m.group("repo"), m.group("rev")


def cache_dir() -> Path:
    """The hub cache, as ``huggingface_hub`` chooses it, read from the environment now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = Path(os.environ["XDG_CACHE_HOME"]).expanduser() if os.environ.get("XDG_CACHE_HOME") else (
        Path.home() / ".cache")
    return base / "huggingface" / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cached_snapshot(repo: str, revision: str | None) -> Path | None:
    """The snapshot directory of ``repo`` at ``revision`` (default: main) in the cache, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo, revision=revision, cache_dir=str(cache_dir()), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    snapshot = Path(path)
    return snapshot if snapshot.is_dir() and any(snapshot.iterdir()) else None  # an empty one holds nothing


def _spelled(repo: str, revision: str | None) -> str:
    return f"{repo}@{revision}" if revision else repo


def missing_message(repo: str, revision: str | None, download_key: str) -> str:
    where = cache_dir()
    fill = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    hint = os.environ.get("SPECSERVE_MODEL_FETCH_HINT")  # set by the Helm chart: its own key
    if hint:
        how = f"{hint} ({fill})"
    elif offline():
        how = f"HF_HUB_OFFLINE=1 forbids downloads: fill the cache first ({fill})"
    else:
        how = f"fetch it with `{fill}` or set {download_key}=true to download it at start-up"
    return (f"{_spelled(repo, revision)} is neither a local directory nor in the Hugging Face cache ({where}; "
            f"set by HF_HUB_CACHE or HF_HOME), and nothing is downloaded unless asked: {how}")


def resolve(text: Any, key: str, download: bool = False, download_key: str = "model.download") -> Any:
    """``text`` with a Hugging Face id replaced by its cached snapshot directory; anything
    else unchanged.  An id missing from the cache stays as it is when ``download`` (the
    loader fetches it: ``local_dir``), else ConfigError naming ``key``."""
    parsed = parse_id(text)
    if parsed is None:
        return text
    found = cached_snapshot(*parsed)
    if found is not None:
        return str(found)
    if download and not offline():
        return text
    raise ConfigError(key, missing_message(*parsed, download_key))


def resolve_config(cfg: Any) -> None:
    """Every model id of a ``config.Config`` (target, tokenizer, draft, method.model) made a
    snapshot directory, in place; ids left to fetch stay ids (``model.download=true``)."""
    m = cfg.model
    m.path = resolve(m.path, "model.path", m.download)
    if getattr(m, "tokenizer", None):
        m.tokenizer = resolve(m.tokenizer, "model.tokenizer", m.download)
    if cfg.draft is not None:
        cfg.draft.path = resolve(cfg.draft.path, "draft.path", cfg.draft.download, "draft.download")
    if cfg.method is not None and cfg.method.model:
        cfg.method.model = resolve(cfg.method.model, "method.model", m.download)


def local_dir(text: str, key: str) -> Path | None:
    """For the loaders: the directory of an id (cached, or fetched now: only ids that
    validation let through with download on reach here); None when ``text`` is no id."""
    parsed = parse_id(text)
    if parsed is None:
        return None
    found = cached_snapshot(*parsed)
    if found is not None:
        return found
    if offline():
        raise ConfigError(key, missing_message(*parsed, "model.download"))
    return fetch(*parsed)


def fetch(repo: str, revision: str | None = None, token: str | None = None) -> Path:
    """Download one snapshot (config, weights, tokenizer) into the cache; its directory."""
    import logging

    from huggingface_hub import snapshot_download

    logging.getLogger(__name__).info("downloading %s into %s", _spelled(repo, revision), cache_dir())
    try:
        path = snapshot_download(repo, revision=revision, cache_dir=str(cache_dir()),
                                 token=token or os.environ.get("HF_TOKEN") or None,
                                 allow_patterns=SNAPSHOT_PATTERNS)  # fmt: skip
    except Exception as e:  # the hub client raises many types (auth, not found, network)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("model.path", f"cannot download {_spelled(repo, revision)}: {first}") from None
    return Path(path)


USAGE = """usage: python -m specserve.hub fetch ORG/NAME[@REVISION] [ORG/NAME[@REVISION] ...]
       python -m specserve.hub check ORG/NAME[@REVISION] [...]

fetch: download each snapshot (config, weights, tokenizer) into the Hugging Face cache
($HF_HUB_CACHE or $HF_HOME/hub) unless it is there already; token from $HF_TOKEN.
check: exit 0 when every one is cached, else 1 with one line.  Both print each snapshot's
directory, one per line.
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] not in ("fetch", "check") or any(a.startswith("-") for a in argv[1:]):
        print(USAGE, file=sys.stderr)
        return 2
    command, specs = argv[0], argv[1:]
    parsed = [_ID.fullmatch(spec) for spec in specs]
    for spec, m in zip(specs, parsed):
        if m is None:
            print(f"specserve.hub: error: {spec!r} is not a Hugging Face id (org/name[@revision])", file=sys.stderr)
            return 2
    for m in parsed:
        repo, revision = m.group("repo"), m.group("rev")
        found = cached_snapshot(repo, revision)
        if found is None and (command == "check" or offline()):
            print(f"specserve.hub: error: {missing_message(repo, revision, 'model.download')}", file=sys.stderr)
            return 1
        if found is None:
            try:
                found = fetch(repo, revision)
            except ConfigError as e:
                print(f"specserve.hub: error: {e}", file=sys.stderr)
                return 1
        print(found, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

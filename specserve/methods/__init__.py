"""The method registry: the one list of speculative methods (no torch here).

Each module of this package declares one method (eagle.py declares two) with
``register(MethodSpec(...))``: its name, its options (a subclass of
``SpeculativeConfig`` holding the ``method.*`` keys only it reads, and their checks),
what it can do (capabilities), and where its proposer and its memory declaration
live (``"module:function"``, imported on first use: they import torch).  The
modules are found by listing this package, the first time the registry is asked;
nothing else lists methods.  What reads the registry:

* ``specserve.config``: one Hydra schema per method (``method/<name>_schema`` in the
  ConfigStore, selected by ``conf/method/<name>.yaml``) and the checks of
  ``method.*``;
* ``specserve.proposers.base``: ``build_proposer`` and ``memory_needs``;
* ``scripts/gen_methods.py``: the Helm values schema's method enum and the README's
  method table (tests check both are current).

Adding a method: ``specserve/methods/<name>.py`` (this declaration),
``specserve/proposers/<name>.py`` (the proposer and its memory declaration),
``conf/method/<name>.yaml`` (the preset), its tests, then ``python scripts/gen_methods.py``.
The declaration is kept apart from the proposer so that composing and validating a
config never imports torch (``specserve.cli`` sets oneDNN's ISA cap before torch loads).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from specserve.errors import ConfigError

__all__ = [
    "MethodSpec",
    "Q_VERIFICATION_METHODS",
    "REJECTION_METHODS",
    "SpeculativeConfig",
    "TreeConfig",
    "as_method_options",
    "get_method",
    "load",
    "method_names",
    "method_options",
    "methods",
    "option_keys",
    "owners_of",
    "register",
]

# The values of method.rejection_sample_method: how drafts are verified (specserve.sampling.rejection).
REJECTION_METHODS = ("strict", "probabilistic", "block", "synthetic")
# The verification methods that read the drafts' distributions q: a proposer that can
# sample its drafts from q does so (and hands q over) only under these.
Q_VERIFICATION_METHODS = ("probabilistic", "block")


@dataclass
class TreeConfig:
    """``method.tree``: each step drafts a tree of candidates instead of a chain, all of it
    verified in one target forward (EAGLE-2's dynamic trees; SGLang's ``topk``,
    ``num_draft_tokens``, ``num_steps``).  Every key None: chains.  Only methods whose
    ``MethodSpec.tree`` is true accept it; checked by ``specserve.config``."""

    topk: Optional[int] = None  # children of each expanded node: the drafter's k best tokens
    # Tokens verified per tree INCLUDING its root (the request's pending token): a chain of
    # K drafts verifies K + 1.  With a tree the engine's K is num_draft_tokens - 1.
    num_draft_tokens: Optional[int] = None
    depth: Optional[int] = None  # expansion steps: the deepest draft is this many tokens ahead
    # A fixed tree instead of topk/depth (vLLM's speculative_token_tree): its nodes as paths of
    # child ranks, e.g. "[(0,), (1,), (0, 0), (0, 1)]" ((0, 1): the second-best child of the
    # best first token), a string or a list of lists; num_draft_tokens is its nodes + 1.
    static: Any = None

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.topk, self.num_draft_tokens, self.depth, self.static))

    def static_paths(self) -> tuple[tuple[int, ...], ...]:
        """``static`` as a tuple of paths, in the order given (unchecked beyond their form:
        ``specserve.config.validate_tree`` checks the tree); ``ConfigError`` naming
        ``method.tree.static`` when it is not a list of integer tuples."""
        value = self.static
        if isinstance(value, str):
            try:
                value = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                raise ConfigError("method.tree.static", f"must be a list of paths like \"[(0,), (1,), (0, 0)]\"; "
                                                        f"got {self.static!r:.80}") from None
        paths = list(value) if not isinstance(value, (str, bytes, dict)) and hasattr(value, "__iter__") else None
        if paths is not None:
            paths = [tuple(p) if not isinstance(p, (str, bytes, dict)) and hasattr(p, "__iter__") else None
                     for p in paths]
        if not paths or any(p is None or not p or any(isinstance(r, bool) or not isinstance(r, int) for r in p)
                            for p in paths):
            raise ConfigError("method.tree.static", "must be a non-empty list of paths, each a non-empty tuple of "
                                                    f"child ranks (integers), like \"[(0,), (1,), (0, 0)]\"; got "
                                                    f"{self.static!r:.80}")
        return tuple(paths)

    def expanded(self) -> "TreeConfig":
        """The shape tree drafters follow: this config, or for a static tree a copy with
        ``num_draft_tokens`` its nodes + 1, ``depth`` its longest path and ``topk`` the width
        of its expansions (the most child ranks under a node, or expanded nodes of a level:
        every drafting step runs that many nodes, ``proposers.heads.StaticLevels``)."""
        if self.static is None:
            return self
        paths = self.static_paths()
        expanded = Counter(len(p) - 1 for p in {p[:-1] for p in paths if len(p) > 1})  # nodes with children, by level
        width = max(max(r + 1 for p in paths for r in p), max(expanded.values(), default=0))
        return dataclasses.replace(self, topk=width, depth=max(len(p) for p in paths),
                                   num_draft_tokens=len(set(paths)) + 1)


@dataclass
class SpeculativeConfig:
    """The ``method.*`` keys every method shares (vLLM's ``speculative_config`` keys).

    A method's own keys live in its options class, a subclass of this one; a method
    without keys of its own uses this class as its options.  ``specserve.config`` checks
    these shared keys; ``validate`` checks a method's own."""

    method: str = ""
    model: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    draft_tensor_parallel_size: Optional[int] = None
    max_model_len: Optional[int] = None
    # All K drafts in one draft forward (PARD draft models); only methods whose
    # MethodSpec.parallel_drafting is true accept it.
    parallel_drafting: bool = False
    rejection_sample_method: str = "strict"
    synthetic_acceptance_rate: Optional[float] = None
    # Draft trees instead of chains (methods whose MethodSpec.tree is true): TreeConfig.
    tree: TreeConfig = dataclasses.field(default_factory=TreeConfig)

    @property
    def lossless(self) -> bool:
        """Outputs follow the target exactly (greedy) or in distribution (sampled); False
        for synthetic acceptance, and for a method's lossy mode (its options say so)."""
        return self.rejection_sample_method != "synthetic"

    @property
    def samples_drafts(self) -> bool:
        """Drafts are sampled from the drafter's q and verified against it (else argmax
        drafts, verified strictly)."""
        return self.rejection_sample_method in Q_VERIFICATION_METHODS

    def validate(self) -> None:
        """Check this method's own keys (a subclass's); raise ``ConfigError("method.<key>", ...)``.
        May fill defaults that depend on other keys.  The shared keys have none here."""


@dataclass(frozen=True)
class MethodSpec:
    """One speculative method, as registered by its declaration module."""

    name: str  # +method=<name>, method.method
    summary: str  # one line: what it drafts from (the README's method table)
    proposer: str  # "module:function": (options, ProposerContext) -> Proposer
    memory: Optional[str] = None  # "module:function": (options, TargetShape, EngineConfig, draft) -> MemoryNeeds
    options: type = SpeculativeConfig  # its method.* keys: SpeculativeConfig or a subclass
    needs_model: bool = True  # drafts with weights given by method.model or draft=<preset>
    draft_probs: bool = False  # with probabilistic verification it samples drafts and hands over q
    parallel_drafting: bool = False  # accepts method.parallel_drafting=true (all K drafts in one forward)
    tensor_parallel: bool = False  # its draft shards like the target (draft_tensor_parallel_size > 1); else rank 0
    tree: bool = False  # accepts method.tree: drafts a tree of candidates, verified in one forward
    kv_layers: int = 0  # layers it keeps in the engine's KV cache after the target's (an EAGLE head's one)

    def own_keys(self) -> list[str]:
        """The keys of its options beyond the shared ones."""
        shared = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        return [f.name for f in dataclasses.fields(self.options) if f.name not in shared]


_REGISTRY: dict[str, MethodSpec] = {}
_discovered = False


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` (called by its declaration module when imported)."""
    if not (isinstance(spec.options, type) and issubclass(spec.options, SpeculativeConfig)):
        raise TypeError(f"{spec.name}: options must be SpeculativeConfig or a subclass, got {spec.options!r}")
    old = _REGISTRY.get(spec.name)
    if old is not None and old != spec:
        raise ValueError(f"method {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def _discover() -> None:
    """Import every declaration module of this package once (each registers itself)."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


def methods() -> tuple[MethodSpec, ...]:
    """Every registered method, by name."""
    _discover()
    return tuple(_REGISTRY[name] for name in sorted(_REGISTRY))


def method_names() -> tuple[str, ...]:
    return tuple(spec.name for spec in methods())


def get_method(name: Any) -> MethodSpec:
    """The method called ``name``; ``ConfigError`` on ``method.method`` for any other value."""
    _discover()
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ConfigError("method.method", f"must be one of {', '.join(method_names())}; got {name!r}")
    return spec


def option_keys() -> list[str]:
    """Every ``method.*`` key of any method: the shared ones first, then each method's own."""
    keys = [f.name for f in dataclasses.fields(SpeculativeConfig)]
    for spec in methods():
        keys += [k for k in spec.own_keys() if k not in keys]
    return keys


def owners_of(key: str) -> tuple[str, ...]:
    """The methods whose own keys include ``key``."""
    return tuple(spec.name for spec in methods() if key in spec.own_keys())


def _foreign_key(key: str, method: str) -> ConfigError:
    owners = owners_of(key)
    if owners:
        return ConfigError(f"method.{key}", f"is not a key of method {method}; only "
                                            f"{', '.join(f'+method={o}' for o in owners)} reads it")
    spec = get_method(method)
    keys = [f.name for f in dataclasses.fields(spec.options)]
    return ConfigError(f"method.{key}", f"no such key; method {method} has: {', '.join(keys)}")


def method_options(method: str, **values: Any) -> SpeculativeConfig:
    """The options of ``method`` from keyword values (vLLM's ``speculative_config`` keys);
    ``ConfigError`` naming ``method.<key>`` for a key that ``method`` does not read.
    Not validated: ``specserve.config.validate_config`` does that."""
    spec = get_method(method)
    names = {f.name for f in dataclasses.fields(spec.options)}
    for key in values:
        if key not in names:
            raise _foreign_key(key, method)
    return spec.options(method=method, **values)


def as_method_options(s: SpeculativeConfig) -> SpeculativeConfig:
    """``s`` as an instance of its method's options class: ``s`` itself when it is one,
    else a copy with the shared keys (and any key both classes have) and the class's
    defaults for the rest.  A key of ``s``'s class that the method does not read is a
    ``ConfigError`` when it differs from its default (``+method=ngram method.method=suffix``)."""
    spec = get_method(s.method)
    if type(s) is spec.options:
        return s
    names = {f.name for f in dataclasses.fields(spec.options)}
    values: dict[str, Any] = {}
    for f in dataclasses.fields(s):
        value = getattr(s, f.name)
        if f.name in names:
            values[f.name] = value
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value != default:
            raise _foreign_key(f.name, spec.name)
    return spec.options(**values)


def load(ref: str) -> Any:
    """The object a ``"module:attribute"`` reference names (importing the module)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)

"""The method registry (specserve/methods) is the one list of speculative methods.

* Every registered method has a preset that selects its schema, and every preset a method.
* Composing selects the method's options class; a key of another method fails in one line
  naming the method that reads it; the shared checks follow each method's registration
  (``parallel_drafting``, a sharded draft, draft weights).
* Composing and validating a config imports no torch.
* The generated files (the Helm values schema's enum, the README's table) are current.
* A new method needs only its declaration, its preset and its proposer: one registered
  here, in the test, composes, validates with its own checks and builds.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from specserve import methods as registry
from specserve.cli import UsageError, compose_config
from specserve.config import Config, SpeculativeConfig, validate_config
from specserve.errors import ConfigError
from specserve.methods import MethodSpec, get_method, method_names, method_options, methods

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "conf" / "method"


def selected(spec: MethodSpec) -> list[str]:
    """Overrides selecting ``spec`` with what it needs to validate (draft weights)."""
    return [f"+method={spec.name}"] + (["draft=smollm2-135m"] if spec.needs_model else [])


def test_presets_and_registrations_name_the_same_methods():
    assert sorted(p.stem for p in PRESETS.glob("*.yaml")) == list(method_names())
    for name in method_names():
        preset = yaml.safe_load((PRESETS / f"{name}.yaml").read_text())
        assert preset["defaults"][0] == f"{name}_schema" and preset["method"] == name, name


@pytest.mark.parametrize("name", method_names())
def test_each_preset_composes_to_its_method_options(name):
    spec = get_method(name)
    cfg = compose_config(selected(spec))
    assert type(cfg.method) is spec.options and cfg.method.method == name


@pytest.mark.parametrize("owner", [m.name for m in methods() if m.own_keys()])
def test_another_methods_key_is_one_line_naming_the_method_that_reads_it(owner):
    key = get_method(owner).own_keys()[0]
    for other in methods():
        if key in other.own_keys():
            continue
        for plus in ("", "+"):
            with pytest.raises(UsageError) as e:
                compose_config(selected(other) + [f"{plus}method.{key}=1"])
            assert str(e.value) == f"method.{key}: is not a key of method {other.name}; only +method={owner} reads it"


def test_the_own_keys_compose_and_are_checked_by_their_method():
    cfg = compose_config(["+method=suffix", "method.suffix_decoding_max_tree_depth=8"])
    assert cfg.method.suffix_decoding_max_tree_depth == 8
    with pytest.raises(ConfigError, match=r"^method\.suffix_decoding_max_tree_depth: must be >= 1, got 0$"):
        compose_config(["+method=suffix", "method.suffix_decoding_max_tree_depth=0"])
    with pytest.raises(ConfigError, match=r"^method\.skip_ratio: must be in \(0, 1\)"):
        compose_config(["+method=layer_skip", "method.skip_ratio=1.5"])


@pytest.mark.parametrize("name", method_names())
def test_parallel_drafting_follows_the_registration(name):
    spec = get_method(name)
    overrides = selected(spec) + ["method.parallel_drafting=true"]
    if spec.parallel_drafting:
        assert compose_config(overrides).method.parallel_drafting is True
    else:
        with pytest.raises(ConfigError, match=rf"^method\.parallel_drafting: is only supported by .*, not {name}$"):
            compose_config(overrides)


@pytest.mark.parametrize("name", method_names())
def test_a_sharded_draft_follows_the_registration(name):
    spec = get_method(name)
    overrides = selected(spec) + ["parallelism=tp2", "method.draft_tensor_parallel_size=2"]
    if spec.tensor_parallel:
        assert compose_config(overrides).method.draft_tensor_parallel_size == 2
    else:
        with pytest.raises(ConfigError, match=rf"^method\.draft_tensor_parallel_size: {name} drafts on rank 0"):
            compose_config(overrides)


@pytest.mark.parametrize("name", method_names())
def test_draft_weights_are_required_where_the_registration_says(name):
    spec = get_method(name)
    cfg = Config(method=SpeculativeConfig(method=name, num_speculative_tokens=2))
    cfg.model.path = "/nonexistent-target"  # no shipped head is chosen for it
    if spec.needs_model:
        with pytest.raises(ConfigError, match=r"^method\.model: method .* needs a draft model"):
            validate_config(cfg)
    else:
        assert type(validate_config(cfg).method) is spec.options


def test_options_from_python_name_the_key_a_method_does_not_read():
    assert method_options("ngram", num_speculative_tokens=3, prompt_lookup_max=4).prompt_lookup_max == 4
    with pytest.raises(ConfigError) as e:
        method_options("ngram", num_speculative_tokens=3, skip_ratio=0.3)
    assert str(e.value) == "method.skip_ratio: is not a key of method ngram; only +method=layer_skip reads it"
    with pytest.raises(ConfigError, match=r"^method\.bogus: no such key; method ngram has: method, model, "):
        method_options("ngram", bogus=1)
    with pytest.raises(ConfigError, match=r"^method\.method: must be one of ctc, dflash, .*; got 'lookahead'$"):
        method_options("lookahead")


def test_the_shared_keys_alone_validate_into_the_method_options():
    cfg = validate_config(Config(method=SpeculativeConfig(method="ngram", num_speculative_tokens=3)))
    assert type(cfg.method) is get_method("ngram").options
    assert (cfg.method.prompt_lookup_min, cfg.method.prompt_lookup_max) == (5, 5)


def test_composing_and_validating_imports_no_torch():
    code = (
        "import sys\n"
        "from specserve.cli import compose_config\n"
        "from specserve.methods import methods\n"
        "for m in methods():\n"
        "    compose_config([f'+method={m.name}'] + (['draft=smollm2-135m'] if m.needs_model else []))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


def test_the_speculators_composition_does_not_import_the_config():
    code = ("import sys, specserve.speculation_defaults\n"
            "assert 'specserve.config' not in sys.modules, sorted(m for m in sys.modules if 'specserve' in m)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


def test_the_generated_files_are_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_methods.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------- a new method


@dataclass
class ToyOptions(SpeculativeConfig):
    toy_width: int = 2

    def validate(self) -> None:
        if self.toy_width < 1:
            raise ConfigError("method.toy_width", f"must be >= 1, got {self.toy_width}")


class ToyProposer:
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, options: ToyOptions):
        self.options = options


def build_toy(options: ToyOptions, ctx) -> ToyProposer:
    return ToyProposer(options)


@pytest.fixture
def toy(monkeypatch, tmp_path) -> Path:
    """A method registered as its declaration module would, and its preset in a --config-dir."""
    methods()  # the built-in methods first, as a running process has them
    spec = MethodSpec(name="toy", summary="a test's method", proposer=f"{__name__}:build_toy", options=ToyOptions,
                      needs_model=False)
    monkeypatch.setitem(registry._REGISTRY, "toy", spec)
    (tmp_path / "method").mkdir()
    (tmp_path / "method" / "toy.yaml").write_text("defaults:\n  - toy_schema\n  - _self_\nmethod: toy\n"
                                                  "num_speculative_tokens: 3\n")
    return tmp_path


def test_a_new_method_needs_only_its_declaration_preset_and_proposer(toy):
    from specserve.proposers.base import MemoryNeeds, ProposerContext, TargetShape, build_proposer, memory_needs

    cfg = compose_config(["--config-dir", str(toy), "+method=toy", "method.toy_width=5"])
    assert type(cfg.method) is ToyOptions and cfg.method.toy_width == 5
    with pytest.raises(ConfigError, match=r"^method\.toy_width: must be >= 1, got 0$"):
        compose_config(["--config-dir", str(toy), "+method=toy", "method.toy_width=0"])
    with pytest.raises(UsageError, match=r"^method\.toy_width: is not a key of method ngram; only \+method=toy"):
        compose_config(["--config-dir", str(toy), "+method=ngram", "method.toy_width=5"])
    proposer = build_proposer(cfg.method, ProposerContext(target=None, draft_model=None, engine=None, num_kv_blocks=1))
    assert isinstance(proposer, ToyProposer) and proposer.options.toy_width == 5
    assert memory_needs(cfg.method, TargetShape(arch=None, dtype_bytes=2, max_model_len=8), None) == MemoryNeeds()
    assert dataclasses.fields(ToyOptions)[-1].name in get_method("toy").own_keys()

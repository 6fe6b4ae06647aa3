"""Models named by Hugging Face id (``org/name[@revision]``), found in a hub-layout cache
built here (``models--org--name/refs`` + ``snapshots/<commit>``): nothing is downloaded.

* the id resolves through ``HF_HUB_CACHE``, ``HF_HOME`` and ``~/.cache/huggingface/hub``,
  by branch and by commit, to the snapshot directory;
* a missing id, or one with ``HF_HUB_OFFLINE=1``, is one line naming the key, the cache and
  how to fill it (``model.download=true``); a preset's missing directory names
  ``SPECSERVE_MODELS_DIR``;
* the model served by id answers the official openai client (``/v1/models`` lists the id)
  with the same greedy tokens as the same model served from its directory, through the
  Hydra form and through the vLLM form ``specserve serve org/name``;
* ``python -m specserve.hub check`` (the chart's offline path) and ``fetch`` in offline mode.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from specserve.cli import serve_main
from specserve.compose import UsageError, compose_config
from specserve.errors import ConfigError, ModelLoadError
from specserve.hub import cache_dir, parse_id

pytestmark = pytest.mark.timeout(180)

REPO = "testorg/tiny-llama"
COMMIT = "c0ffee" + "0" * 34
OLD = "0ddba11" + "0" * 33  # an older commit, reachable by its hash only


def build_hub_cache(root: Path, repo: str, model_dir: Path, commit: str = COMMIT, branch: str | None = "main",
                    extra: dict | None = None) -> Path:
    """A Hugging Face hub cache under ``root`` holding ``model_dir`` as ``repo`` at ``commit``
    (the head of ``branch``), laid out as huggingface_hub writes it: blobs, snapshot symlinks, refs."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    blobs = repo_dir / "blobs"
    blobs.mkdir(exist_ok=True)
    for f in sorted(model_dir.iterdir()):
        blob = blobs / f"{commit[:8]}-{f.name}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(blob)
    (repo_dir / "refs").mkdir(exist_ok=True)
    if branch is not None:
        (repo_dir / "refs" / branch).write_text(commit)
    for name, text in (extra or {}).items():
        (snap / name).write_text(text)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("hf") / "hub"
    snap = build_hub_cache(root, REPO, tiny_llama)
    old = build_hub_cache(root, REPO, tiny_llama, OLD, branch=None)
    return root, snap, old


@pytest.fixture
def hub_env(hub, monkeypatch):
    root, _, _ = hub
    for var in ("HF_HOME", "HF_HUB_OFFLINE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return hub


def test_ids_are_told_from_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_id("meta-llama/Llama-3.1-8B-Instruct") == ("meta-llama/Llama-3.1-8B-Instruct", None)
    assert parse_id("Qwen/Qwen3-0.6B@v1.0") == ("Qwen/Qwen3-0.6B", "v1.0")
    for not_an_id in ("embedded:smollm2-135m-instruct", "/abs/dir", "./rel/dir", "~/m", "a/b/c", "x.gguf",
                      "org/m.gguf", "single", "../up/x"):
        assert parse_id(not_an_id) is None, not_an_id
    (tmp_path / "local" / "dir").mkdir(parents=True)
    assert parse_id("local/dir") is None  # a path that exists wins


def test_cache_location_follows_huggingface_hub(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert cache_dir() == tmp_path / "hfhome" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"


@pytest.mark.parametrize("how", ["HF_HUB_CACHE", "HF_HOME", "HOME"])
def test_an_id_resolves_to_its_snapshot_wherever_the_cache_is(hub, monkeypatch, tmp_path, how):
    root, snap, _ = hub
    for var in ("HF_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    if how == "HF_HUB_CACHE":
        monkeypatch.setenv("HF_HUB_CACHE", str(root))
    else:
        base = tmp_path / ("hfhome" if how == "HF_HOME" else ".cache/huggingface")
        base.mkdir(parents=True)
        (base / "hub").symlink_to(root)
        if how == "HF_HOME":
            monkeypatch.setenv("HF_HOME", str(base))
        else:
            monkeypatch.setenv("HOME", str(tmp_path))
    cfg = compose_config([f"model.path={REPO}", "model.name=tiny"])
    assert Path(cfg.model.path) == snap and (Path(cfg.model.path) / "config.json").is_file()
    assert REPO in cfg.server.served_model_aliases  # the id as given answers too


def test_a_revision_selects_the_commit(hub_env):
    _, snap, old = hub_env
    assert Path(compose_config([f"model.path='{REPO}@main'"]).model.path) == snap
    assert Path(compose_config([f"model.path='{REPO}@{OLD}'"]).model.path) == old


def one_line(overrides: list[str]) -> str:
    with pytest.raises((ConfigError, UsageError)) as e:
        compose_config(overrides)
    text = str(e.value)
    assert "\n" not in text
    return text


def test_a_missing_id_is_one_line_naming_the_key_the_cache_and_the_fix(hub_env):
    root, _, _ = hub_env
    text = one_line(["model.path=testorg/absent"])
    assert text.startswith("model.path: testorg/absent is neither a local directory nor in the Hugging Face cache")
    assert str(root) in text and "model.download=true" in text and "hf download testorg/absent" in text
    text = one_line([f"model.path='{REPO}@v9'"])
    assert f"{REPO}@v9" in text and "--revision v9" in text
    # a draft: its own key
    text = one_line(["+method=draft_model", "draft=smollm2-135m", "draft.path=testorg/absent-draft"])
    assert text.startswith("draft.path: testorg/absent-draft") and "draft.download=true" in text


def test_offline_mode_forbids_the_download_in_one_line(hub_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = one_line(["model.path=testorg/absent", "model.download=true"])
    assert text.startswith("model.path: testorg/absent") and "HF_HUB_OFFLINE=1 forbids downloads" in text


def test_download_opt_in_leaves_the_id_for_the_loader_and_never_fetches_in_validation(hub_env, monkeypatch):
    import specserve.hub as hub_mod

    calls = []
    monkeypatch.setattr(hub_mod, "fetch", lambda *a, **k: calls.append(a) or Path("/nowhere"))
    cfg = compose_config(["model.path=testorg/absent", "model.download=true"])
    assert cfg.model.path == "testorg/absent" and calls == []  # --cfg / --dry-run download nothing
    assert hub_mod.local_dir("testorg/absent", "model.path") == Path("/nowhere") and calls == [("testorg/absent", None)]


def test_a_preset_without_its_directory_names_specserve_models_dir(monkeypatch, tmp_path):
    from specserve.executor.loader import resolve_hf_dir

    monkeypatch.delenv("SPECSERVE_MODELS_DIR", raising=False)
    with pytest.raises(ModelLoadError) as e:
        resolve_hf_dir(compose_config(["model=qwen3-0.6b"]).model.path, None)
    assert "SPECSERVE_MODELS_DIR is unset" in str(e.value) and "/models/Qwen3-0.6B" in str(e.value)
    monkeypatch.setenv("SPECSERVE_MODELS_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError) as e:
        resolve_hf_dir(compose_config(["model=qwen3-0.6b"]).model.path, None)
    assert f"SPECSERVE_MODELS_DIR={tmp_path}" in str(e.value) and "org/name" in str(e.value)


def test_hub_module_check_and_offline_fetch(hub_env, monkeypatch):
    from specserve.hub import main

    _, snap, _ = hub_env
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["check", REPO]) == 0
        assert main(["fetch", REPO]) == 0  # cached: nothing to fetch
    assert out.getvalue().split() == [str(snap), str(snap)]
    err = io.StringIO()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with contextlib.redirect_stderr(err):
        assert main(["check", "testorg/absent"]) == 1
        assert main(["fetch", REPO, "testorg/absent@abc"]) == 1
        assert main(["fetch", "not an id"]) == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 3 and all(line.startswith("specserve.hub: error: ") for line in lines)
    assert "testorg/absent@abc" in lines[1] and "HF_HUB_OFFLINE=1" in lines[1]
    # the chart's hint (modelCache.offline) replaces the generic advice
    monkeypatch.setenv("SPECSERVE_MODEL_FETCH_HINT", "modelCache.offline=true: the chart fetches nothing")
    text = one_line(["model.path=testorg/absent"])
    assert "modelCache.offline=true: the chart fetches nothing (hf download testorg/absent)" in text


# --------------------------------------------------------------------------- served by id


GREEDY = dict(temperature=0, max_tokens=8)
SERVE = ["--dtype", "float32", "--max-model-len", "256", "--grpc-port", "0", "--port", "0", "--host", "127.0.0.1",
         "engine.num_kv_blocks=64", "engine.block_size=4"]  # fmt: skip


def serve_in_process(argv: list[str]):
    """``specserve serve ARGV`` translated and composed as the command does, served on loopback."""
    from specserve.engine.async_engine import build_async_engine
    from specserve.serve_compat import translate
    from specserve.server import start_servers

    overrides, _, _ = translate(argv)
    cfg = compose_config(overrides)
    return cfg, start_servers(cfg, build_async_engine(cfg))


def ask(handle, model: str) -> tuple[list[str], str]:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{handle.http_port}/v1", api_key="x", max_retries=0) as client:
        ids = [m.id for m in client.models.list().data]
        r = client.completions.create(model=model, prompt="w10 w11 w12 w10 w11", **GREEDY)
    return ids, r.choices[0].text


def test_vllm_form_serves_an_id_from_the_cache_like_its_directory(hub_env, tiny_llama):
    _, snap, _ = hub_env
    cfg, by_id = serve_in_process([REPO, *SERVE])
    try:
        assert Path(cfg.model.path) == snap and cfg.model.name == REPO
        ids, text_by_id = ask(by_id, REPO)
    finally:
        by_id.stop()
    assert ids == [REPO]
    _, by_dir = serve_in_process([str(tiny_llama), *SERVE])
    try:
        _, text_by_dir = ask(by_dir, str(tiny_llama))
    finally:
        by_dir.stop()
    assert text_by_id == text_by_dir and text_by_id.strip()


def test_hydra_form_and_llm_load_an_id(hub_env, tiny_llama):
    from specserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6)
    small = dict(dtype="float32", num_kv_blocks=64, block_size=4)
    by_id = LLM(model=REPO, **small).generate(["w3 w4 w5"], params, use_tqdm=False)
    by_dir = LLM(model=str(tiny_llama), **small).generate(["w3 w4 w5"], params, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == by_dir[0].outputs[0].token_ids


def test_serve_an_absent_id_exits_2_with_one_line(hub_env):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = serve_main(["serve", "testorg/absent", "--port", "0"])
    lines = [line for line in err.getvalue().splitlines() if "error" in line]
    assert rc == 2 and len(lines) == 1 and "model.path: testorg/absent is neither a local directory" in lines[0]


def test_the_cli_names_the_id_in_a_subprocess(hub_env, tmp_path):
    """The real console entry, dry run: the id becomes the snapshot in the composed config."""
    _, snap, _ = hub_env
    proc = subprocess.run([sys.executable, "-m", "specserve", "serve", REPO, "--dry-run"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"path: {snap}" in proc.stdout and f"name: {REPO}" in proc.stdout


def test_a_speculators_head_names_its_verifier_by_id(hub_env, tmp_path):
    """vLLM serves a speculators checkpoint alone; its verifier is a Hub id, found in the cache."""
    import json

    from specserve.config import Config, ModelConfig, validate_config

    _, snap, _ = hub_env
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "speculators_config": {
        "algorithm": "eagle3", "verifier": {"name_or_path": REPO},
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]}}))  # fmt: skip
    cfg = validate_config(Config(model=ModelConfig(name="x", path=str(head))))
    assert Path(cfg.model.path) == snap and cfg.method.method == "eagle3" and cfg.method.model == str(head)

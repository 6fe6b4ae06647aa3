"""specserve-train end to end on a tiny target: capture through the engine, reduced
vocabulary, training-time-test training (agreement rises), resumable checkpoints,
exports in the EAGLE-3 and speculators layouts that the eagle3 proposer serves
losslessly, and evaluation through the real engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "proposers"))

from eagle_heads import make_bigram_target  # noqa: E402
from engine_utils import greedy, random_prompts, run, tiny_config  # noqa: E402
from specserve.cli import UsageError  # noqa: E402
from specserve.config import Config, ModelConfig, validate_config  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.errors import ConfigError  # noqa: E402
from specserve.train.cli import compose_train_config, main  # noqa: E402
from specserve.train.trainer import train  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_bigram_target(root / "target", leak=0.05)
    texts = [" ".join(f"w{t}" for t in p) for p in random_prompts(40, seed=5, lo=4, hi=16, vocab=200)]
    (root / "prompts.json").write_text(json.dumps(texts))
    return root, target


def _cfg(root, target, *extra):
    return compose_train_config([
        f"model.path={target}", "model.name=tiny", f"data.prompts_file={root / 'prompts.json'}",
        "data.num_conversations=40", "data.max_new_tokens=24", "data.batch_size=16", "data.shard_size=16",
        "head.draft_vocab_size=96", "head.aux_layer_ids=[0,1,1]", "optim.batch_tokens=256", "optim.lr=3e-3",
        "optim.warmup_steps=5", "optim.ttt_steps=3", "eval.num_prompts=3", "eval.max_tokens=16",
        "eval.num_speculative_tokens=3", f"output_dir={root / 'out'}", "progress=false",
        "engine.num_kv_blocks=512", "engine.block_size=4", "checkpoint_every=10", *extra,
    ])


def test_train_export_serve_and_resume(setup):
    root, target = setup
    out = root / "out"
    first = train(_cfg(root, target, "optim.epochs=20", "optim.max_steps=60"))
    assert first["steps"] == 60 and len(list((out / "data").glob("shard-*.pt"))) == 3
    hist = torch.load(out / "checkpoint.pt", weights_only=True)["history"]
    assert hist[0]["top1"][0] < 0.2 and first["final_top1_per_step"][0] > 0.5  # the head learned the target
    assert first["draft_vocab_size"] == 96 and 0 < first["draft_vocab_coverage"] <= 1
    assert first["eval"]["num_drafts"] > 0 and len(first["eval"]["acceptance_rate_per_position"]) == 3

    # resume: shards and checkpoint are reused, training continues at step 60
    second = train(_cfg(root, target, "optim.epochs=20", "optim.max_steps=70"))
    hist = torch.load(out / "checkpoint.pt", weights_only=True)["history"]
    assert second["steps"] == 70 and len(hist) == 70 and second["timings"]["capture_s"] < 5

    # the EAGLE-3 export serves losslessly; the speculators export alone enables speculation
    eagle3 = json.loads((out / "eagle3" / "config.json").read_text())
    assert eagle3["architectures"] == ["LlamaForCausalLMEagle3"] and eagle3["draft_vocab_size"] == 96
    from safetensors.torch import load_file

    keys = set(load_file(str(out / "eagle3" / "model.safetensors")))
    assert {"d2t", "t2d", "fc.weight", "midlayer.hidden_norm.weight", "lm_head.weight"} <= keys
    assert "embed_tokens.weight" not in keys  # shared with the target
    prompts = random_prompts(4, seed=8)
    plain = run(LLMEngine(tiny_config(target)), prompts, [greedy(16) for _ in prompts])
    eng = LLMEngine(tiny_config(target, "eagle3", k=3, draft_dir=out / "eagle3"))
    assert run(eng, prompts, [greedy(16) for _ in prompts]) == plain
    spec = json.loads((out / "speculators" / "config.json").read_text())
    spec["speculators_config"]["verifier"]["name_or_path"] = str(target)
    (out / "speculators" / "config.json").write_text(json.dumps(spec))
    cfg = Config(model=ModelConfig(name="tiny", path=str(out / "speculators"), dtype="float32"))
    cfg.engine.num_kv_blocks, cfg.engine.block_size = 256, 4
    outs = LLMEngine(validate_config(cfg)).generate(prompts, [greedy(16) for _ in prompts])
    assert [o.token_ids for o in outs] == plain and sum(o.spec.num_accepted_tokens for o in outs) > 0


def test_frozen_lm_head_keeps_the_target_rows(setup, tmp_path):
    """head.train_lm_head=false: the exported LM head is still the target's rows of the
    draft vocabulary, while the rest of the head learned."""
    root, target = setup
    from safetensors.torch import load_file

    from specserve.executor.loader import load_model
    from specserve.train.trainer import target_lm_rows

    rep = train(_cfg(root, target, "optim.max_steps=4", "eval.enabled=false", "head.train_lm_head=false",
                     "model.dtype=float32", "export_dtype=float32", f"output_dir={tmp_path}"))
    assert rep["steps"] == 4
    w = load_file(str(tmp_path / "eagle3" / "model.safetensors"))
    t = load_model(str(target), "float32", torch.device("cpu"), None, None, cpu_kernel="torch")
    rows = target_lm_rows(t, torch.load(tmp_path / "vocab.pt")["ids"])
    assert torch.equal(w["lm_head.weight"], rows)
    fc = w["fc.weight"]
    H = fc.shape[0]
    assert not torch.equal(fc[:, 2 * H :], torch.diag(torch.diagonal(fc[:, 2 * H :])))  # fc learned off its init


def test_bad_training_config_is_one_line(setup, capsys):
    root, target = setup
    with pytest.raises(ConfigError, match="head.train_lm_head"):
        _cfg(root, target, "head.train_lm_head=false", "head.init=random")
    with pytest.raises(ConfigError, match="optim.ttt_steps"):
        _cfg(root, target, "optim.ttt_steps=0")
    with pytest.raises(UsageError, match="optim.nope"):
        _cfg(root, target, "optim.nope=1")
    assert main(["head.init=zeros"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specserve-train: error: head.init") and "\n" not in err

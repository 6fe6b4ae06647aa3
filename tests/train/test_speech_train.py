"""The speech trainer's stages on a tiny text model and synthetic clips (no synthesizer):
ctc, ctc2, targets, filler, embed and align each run, checkpoint and skip when rerun
(resumable), and the export loads through the executor's loader as a speech model whose
engine transcribes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.train import speech as S
from specserve.train.speech_config import SpeechTrainConfig, validate_speech_config
from tests.engine_utils import one_thread  # noqa: F401
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    text = make_tiny_model(tmp_path_factory.mktemp("text"))
    out = tmp_path_factory.mktemp("speech-train")
    cfg = SpeechTrainConfig(model={"name": "tiny", "path": str(text)}, output_dir=str(out), audio_token_index=495)
    cfg.encoder.num_layers, cfg.encoder.hidden_dim, cfg.encoder.num_heads = 2, 32, 2
    cfg.projector.hidden_size, cfg.projector.num_attention_heads, cfg.projector.intermediate_size = 16, 2, 32
    cfg.prompt_system, cfg.prompt_instruction = None, "w7"
    for stage in (cfg.ctc, cfg.ctc2, cfg.filler, cfg.embed, cfg.align):
        stage.max_steps, stage.checkpoint_every, stage.batch_size, stage.warmup_steps = 2, 1, 2, 1
    validate_speech_config(cfg)
    rng = np.random.default_rng(0)
    clips = [(0.3 * rng.standard_normal(int(s * 16000))).astype(np.float32) for s in (0.6, 0.9, 0.7, 1.1, 0.5, 0.8)]
    offsets = np.cumsum([0] + [len(c) for c in clips])
    data = {"samples": (np.concatenate(clips) * 32767).astype(np.int16), "offsets": offsets,
            "texts": ["w10 w11", "w12 w13 w14", "w15", "w16 w17", "w18", "w19 w20"], "num_train": 4}
    return cfg, data, out


def test_every_stage_runs_resumes_and_exports_a_loadable_model(setup):
    cfg, data, out = setup
    torch.manual_seed(0)
    enc, proj = S.model_configs(cfg, 64)
    model = S.SpeechModel(enc, proj)
    S.train_ctc(cfg, model, data, out)
    S.train_ctc(cfg, model, data, out, "ctc2")
    llm, tok, _ = S._text_model(cfg)
    targets = S.build_targets(cfg, model, data, out, tok)
    assert targets["hidden"].shape[0] == targets["offsets"][-1] and len(targets["ids"]) == len(data["texts"])
    aligned = [i for i, ids in enumerate(targets["ids"]) if ids is not None]
    assert aligned and all(len(targets["ids"][i]) == len(targets["slots"][i]) == len(data["texts"][i].split())
                           for i in aligned)
    filler = S.train_filler(cfg, data, targets, out, llm, tok, model.projector.p)
    assert filler.shape == (model.projector.p.num_queries, 64)
    S.train_embed(cfg, model, data, targets, out, llm.get_input_embeddings().weight, filler)
    S.train_align(cfg, model, data, targets, out, llm, tok)
    for name in ("ctc.pt", "ctc2.pt", "filler.pt", "embed.pt", "align.pt"):
        state = torch.load(out / name, weights_only=False)
        assert state["done"] and state["step"] == 2, name
    before = (out / "align.pt").stat().st_mtime_ns
    S.train_align(cfg, model, data, targets, out, llm, tok)  # a finished stage is skipped
    assert (out / "align.pt").stat().st_mtime_ns == before
    assert S.build_targets(cfg, model, data, out, tok)["offsets"] == targets["offsets"]  # cached

    from transformers import AutoConfig

    S.export(cfg, model, out / "model", AutoConfig.from_pretrained(cfg.model["path"]))
    from specserve.audio.decode import encode_wav
    from specserve.llm import LLM

    llm = LLM(str(out / "model"), dtype="float32", num_kv_blocks=128, block_size=4)
    assert llm.engine.target.speech.instruction == "w7"
    [t] = llm.transcribe(encode_wav(data["samples"][: data["offsets"][1]].astype(np.float32) / 32767))
    assert t.segments and t.duration_s == pytest.approx(0.6)
    assert llm.engine.blocks.usage == 0


def _init_from_run(cfg, data, tmp_path, src, modules):
    """A run directory holding ``data`` as its data.npz and a copy of ``cfg`` that starts from
    ``src`` (init_from) with a rank-2 adapter on ``modules``."""
    import copy

    run = tmp_path / "run"
    run.mkdir()
    np.savez(run / "data.npz", samples=data["samples"], offsets=data["offsets"], texts=np.asarray(data["texts"]),
             num_train=data["num_train"])
    cfg2 = copy.deepcopy(cfg)
    cfg2.output_dir, cfg2.init_from, cfg2.export_dir = str(run), str(src), None
    cfg2.data.generated_sentences = 0
    cfg2.adapter.rank, cfg2.adapter.modules = 2, modules
    return run, cfg2


def test_adapt_from_an_exported_model_trains_the_text_adapter_and_ships_it(setup, tmp_path):
    """init_from: the encoder and projector come from an exported model (stages ctc .. align
    skipped), stage adapt trains the projector with a low-rank adapter on the text model,
    resumes when rerun, and the export carries the adapter that the loader merges."""
    import json

    from transformers import AutoConfig

    from specserve.llm import LLM

    cfg, data, _ = setup
    src = tmp_path / "src"
    torch.manual_seed(1)
    enc, proj = S.model_configs(cfg, 64)
    S.export(cfg, S.SpeechModel(enc, proj), src, AutoConfig.from_pretrained(cfg.model["path"]))
    (src / "training_report.json").write_text(json.dumps({"stages": {"ctc": {"steps": 7, "minutes": 1.0}}}))
    run, cfg2 = _init_from_run(cfg, data, tmp_path, src, ["q_proj", "down_proj"])
    cfg2.adapt.max_steps, cfg2.adapt.checkpoint_every, cfg2.adapt.batch_size, cfg2.adapt.warmup_steps = 2, 1, 2, 1
    validate_speech_config(cfg2)
    report = S.train_speech(cfg2)
    assert report["init_from"] == str(src)
    assert report["stages"]["ctc"] == {"steps": 7, "minutes": 1.0} and report["stages"]["adapt"]["steps"] == 2
    assert not (run / "ctc.pt").exists() and not (run / "align.pt").exists()  # those stages came from src
    state = torch.load(run / "adapt.pt", weights_only=False)
    assert state["done"] and any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in state["adapter"].items())
    cfg_json = json.loads((run / "model" / "config.json").read_text())
    assert cfg_json["specserve"]["text_adapter"] == {"file": "text_adapter.safetensors", "scale": 16.0}
    before = (run / "adapt.pt").stat().st_mtime_ns
    S.train_speech(cfg2)  # rerun: the finished stage is skipped
    assert (run / "adapt.pt").stat().st_mtime_ns == before
    llm = LLM(str(run / "model"), dtype="float32", num_kv_blocks=128, block_size=4)
    base = LLM(str(src), dtype="float32", num_kv_blocks=128, block_size=4)
    merged = dict(llm.engine.target.model.named_parameters())
    plain = dict(base.engine.target.model.named_parameters())
    changed = {k for k in merged if not torch.equal(merged[k], plain[k])}
    assert changed and all("qkv" in k or "down" in k for k in changed), changed
    from specserve.audio.decode import encode_wav

    [t] = llm.transcribe(encode_wav(data["samples"][: data["offsets"][1]].astype(np.float32) / 32767))
    assert t.segments and llm.engine.blocks.usage == 0
    # a later run from this export starts stage adapt from its adapter (same rank and alpha)
    from safetensors.torch import load_file

    from specserve.errors import ConfigError
    from specserve.train.lora import add_lora, lora_state_dict

    shipped = load_file(str(run / "model" / "text_adapter.safetensors"))
    llm2, _, _ = S._text_model(cfg2)
    add_lora(llm2, 2, cfg2.adapter.alpha, ["q_proj", "down_proj"])
    assert S.init_adapter_from_export(llm2, run / "model", 2, cfg2.adapter.alpha)
    assert all(torch.equal(v, shipped[k].float()) for k, v in lora_state_dict(llm2).items())
    assert not S.init_adapter_from_export(llm2, src, 2, cfg2.adapter.alpha)  # src has no adapter
    with pytest.raises(ConfigError, match="adapter.alpha"):
        S.init_adapter_from_export(llm2, run / "model", 2, cfg2.adapter.alpha * 2)
    llm3, _, _ = S._text_model(cfg2)
    add_lora(llm3, 4, cfg2.adapter.alpha * 2, ["q_proj", "down_proj"])
    with pytest.raises(ConfigError, match="init_from"):
        S.init_adapter_from_export(llm3, run / "model", 4, cfg2.adapter.alpha * 2)


def test_generated_sentences_come_from_the_engine_seeded_and_cached(tmp_path, monkeypatch):
    """The text model's everyday sentences (data.generated_sentences): written by specserve's
    engine with a seed per prompt (a fresh cache gives the same sentences), normalised, 3 to
    14 words, never a held-out sentence; a rerun reads the cache and generates nothing."""
    from specserve.executor.loader import resolve_hf_dir
    from specserve.train import speech_text

    hf = resolve_hf_dir("embedded:smollm2-135m-instruct", None)
    a = speech_text.generated_sentences(hf, 6, [], 3, tmp_path / "a.jsonl", batch_size=2, max_new_tokens=48)
    assert len(a) == 6 and len(set(a)) == 6
    assert all(3 <= len(s.split()) <= 14 and s == speech_text.normalize_transcript(s) for s in a)
    held = [a[0]]
    b = speech_text.generated_sentences(hf, 5, held, 3, tmp_path / "b.jsonl", batch_size=2, max_new_tokens=48)
    assert b == [s for s in a if s != a[0]][:5]  # the same draws; the held-out sentence left out

    def no_engine(*args, **kwargs):
        raise AssertionError("the cache holds enough sentences: nothing to generate")

    monkeypatch.setattr("specserve.llm.LLM", no_engine)
    assert speech_text.generated_sentences(hf, 6, [], 3, tmp_path / "a.jsonl", batch_size=2) == a


@pytest.mark.parametrize("bf16", [False, True])
def test_the_lm_loss_uses_bfloat16_only_where_the_cpu_has_it(setup, monkeypatch, bf16):
    """Without AVX512-BF16 or AMX, torch's bfloat16 matmuls take a scalar path (about 100 s
    a step of stage adapt on an AVX2 machine instead of about 5): the loss runs in float32
    there, in bfloat16 autocast where the CPU has the instructions."""
    cfg, _, _ = setup
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert S._bf16_autocast() is bf16
    llm, tok, _ = S._text_model(cfg)
    seen = []
    llm.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    emb = llm.get_input_embeddings()
    audio = [torch.randn(3, llm.config.hidden_size)]
    loss = S._lm_loss(llm, *S._lm_batch(cfg, tok, emb, audio, ["w3 w4"], S._end_token(tok)))
    assert seen == [torch.bfloat16 if bf16 else torch.float32] and torch.isfinite(loss)


def test_joint_encode_equals_the_encoder_and_trains_only_its_top_blocks(setup):
    """joint_encode gives the encoder's own states (recording by recording), and only the
    top ``k`` blocks (with the CTC head) receive gradients."""
    cfg, data, _ = setup
    torch.manual_seed(2)
    enc, proj = S.model_configs(cfg, 64)
    model = S.SpeechModel(enc, proj).eval()
    feats = [S.input_features(S.recording(data, i)) for i in (0, 3)]
    for k in (0, 1, 2):
        hidden, mids = S.joint_encode(model, feats, k)
        for h, f in zip(hidden, feats):
            torch.testing.assert_close(h, model.encoder(f[None])[0][0], rtol=0, atol=0)
        assert all(m is None for m in mids) if k < 2 else all(m is not None for m in mids)
        trained = {id(p) for p in S.joint_parameters(model, k)}
        model.zero_grad()
        sum(h.square().sum() for h in hidden).backward() if k else None
        for name, p in model.encoder.named_parameters():
            got = p.grad is not None and bool(p.grad.abs().sum() > 0)
            assert got <= (id(p) in trained), (k, name)  # a gradient only where the stage trains
            if name.startswith(f"layers.{2 - k}.") and k:
                assert id(p) in trained, name


def test_joint_from_an_exported_model_trains_encoder_projector_and_adapter(setup, tmp_path):
    """Stage joint (init_from an exported model with an adapter): the encoder's top block,
    the projector and the adapter change, the lower block and the batch-norm statistics do
    not; no targets are built; a rerun skips the finished stage; the export loads and
    transcribes."""
    import copy
    import json

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from specserve.errors import ConfigError
    from specserve.llm import LLM
    from specserve.train.lora import add_lora, lora_state_dict

    cfg, data, _ = setup
    src = tmp_path / "src"
    torch.manual_seed(3)
    enc, proj = S.model_configs(cfg, 64)
    model = S.SpeechModel(enc, proj)
    llm0, _, _ = S._text_model(cfg)
    add_lora(llm0, 2, cfg.adapter.alpha, ["q_proj"])
    for name, p in llm0.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)
    run, cfg2 = _init_from_run(cfg, data, tmp_path, src, ["q_proj"])
    S.export(cfg2, model, src, AutoConfig.from_pretrained(cfg.model["path"]), lora_state_dict(llm0))
    cfg2.joint.max_steps, cfg2.joint.checkpoint_every, cfg2.joint.batch_size, cfg2.joint.warmup_steps = 2, 1, 2, 1
    cfg2.joint.encoder_layers, cfg2.joint.lr = 1, 1e-2
    validate_speech_config(cfg2)
    report = S.train_speech(cfg2)
    assert report["stages"]["joint"]["steps"] == 2 and "adapt" not in report["stages"]
    assert not (run / "targets.pt").exists()
    before, after = load_file(str(src / "model.safetensors")), load_file(str(run / "model" / "model.safetensors"))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(k.startswith("model.encoder.layers.1.") for k in changed)
    assert any(k.startswith("model.projector.") for k in changed)
    assert not any(k.startswith(("model.encoder.layers.0.", "model.encoder.input_linear")) for k in changed), changed
    assert not any("running_" in k for k in changed), changed
    a0, a1 = load_file(str(src / "text_adapter.safetensors")), load_file(str(run / "model" / "text_adapter.safetensors"))
    assert any(not torch.equal(a0[k], a1[k]) for k in a0)
    assert json.loads((run / "model" / "config.json").read_text())["specserve"]["text_adapter"]["scale"] == 16.0
    mtime = (run / "joint.pt").stat().st_mtime_ns
    S.train_speech(cfg2)  # rerun: the finished stage is skipped
    assert (run / "joint.pt").stat().st_mtime_ns == mtime
    llm = LLM(str(run / "model"), dtype="float32", num_kv_blocks=128, block_size=4)
    from specserve.audio.decode import encode_wav

    [t] = llm.transcribe(encode_wav(data["samples"][: data["offsets"][1]].astype(np.float32) / 32767))
    assert t.segments and llm.engine.blocks.usage == 0
    for key, value in (("joint.encoder_layers", 3), ("joint.ctc_weight", -1.0)):
        bad = copy.deepcopy(cfg2)
        setattr(bad.joint, key.split(".")[1], value)
        with pytest.raises(ConfigError, match=key):
            validate_speech_config(bad)
    bad = copy.deepcopy(cfg2)
    bad.adapter.rank = 0
    with pytest.raises(ConfigError, match="joint.max_steps"):
        validate_speech_config(bad)

"""Train a speech model in the Granite Speech layout for a frozen text model.

Stages (each resumable from ``output_dir``; a finished stage is skipped on a rerun):

1. ``data``: training sentences (``speech_data.training_sentences``) spoken by espeak-ng
   with a words-per-minute and pitch drawn per sentence, kept as 16 kHz int16 in
   ``data.npz``.
2. ``ctc``: the conformer encoder with a character CTC head (labels are Unicode code
   points, blank 0), the loss on the final states plus half the loss of the middle
   block's self-conditioning head.  Batches add gain and, half the time, white noise.
3. ``embed``: the encoder frozen, the projector's outputs aligned with the text model's
   token embeddings by a CTC over its vocabulary (cosine similarity to the embeddings of
   the training transcripts' tokens, blank = the audio token; no LLM forward), their norms
   held at the embeddings' mean norm: a start for the LM loss.
4. ``align``: the encoder frozen, the Q-Former projector trained so that the frozen text
   model, prompted with ``audio.prompt.transcription_prompt`` whose audio positions hold
   the projector's outputs, writes the normalised transcript and then its end-of-turn
   token (cross-entropy on those tokens only; the text model's weights never change).
5. ``export``: ``config.json`` (``model_type: granite_speech``, the text model's config,
   ``specserve.text_model`` naming where its weights come from) and ``model.safetensors``
   holding the encoder and projector under transformers' names.

Learning rates warm up, then follow a cosine to 10% over the stage's steps or minutes,
whichever runs out first (the machine may be shared, so both bound a stage).
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specserve.audio.features import input_features
from specserve.audio.prompt import transcription_prompt
from specserve.executor.models.granite_speech import (
    EncoderConfig, ProjectorConfig, SpeechModel, checkpoint_state_dict, ctc_greedy_labels, ctc_text,
)
from specserve.train.speech_config import SpeechTrainConfig
from specserve.train.speech_data import espeak_ng, training_sentences

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- data
def build_data(cfg: SpeechTrainConfig, out: Path) -> dict[str, Any]:
    path = out / "data.npz"
    if path.is_file():
        z = np.load(path, allow_pickle=False)
        return {"samples": z["samples"], "offsets": z["offsets"], "texts": [str(t) for t in z["texts"]],
                "num_train": int(z["num_train"])}
    d = cfg.data
    exclude = Path(d.exclude_file)
    held = [s for s in exclude.read_text().splitlines() if s.strip()] if exclude.is_file() else []
    if not held:
        log.warning("data.exclude_file=%s holds no sentences: nothing is held out", d.exclude_file)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else None
    sentences = training_sentences(d.num_sentences + d.num_valid, held, seed=d.seed, cache_dir=cache)
    rng = random.Random(d.seed)
    chunks, offsets, t0 = [], [0], time.time()
    for i, s in enumerate(sentences):
        x = espeak_ng(s, d.voice, rng.randint(*d.wpm), rng.randint(*d.pitch))
        chunks.append((np.clip(x, -1, 1) * 32767).astype(np.int16))
        offsets.append(offsets[-1] + len(x))
        if i % 1000 == 0:
            log.info("synthesized %d/%d sentences (%.0f s)", i, len(sentences), time.time() - t0)
    num_train = len(sentences) - d.num_valid
    tmp = out / "data.tmp.npz"
    np.savez(tmp, samples=np.concatenate(chunks), offsets=np.asarray(offsets, dtype=np.int64),
             texts=np.asarray(sentences), num_train=num_train)
    tmp.rename(path)
    hours = offsets[-1] / 16000 / 3600
    log.info("data: %d sentences, %.2f hours of speech", len(sentences), hours)
    return build_data(cfg, out)


def _clip(data: dict[str, Any], i: int) -> np.ndarray:
    a, b = data["offsets"][i], data["offsets"][i + 1]
    return data["samples"][a:b].astype(np.float32) / 32767.0


def _batch_features(clips: list[np.ndarray], rng: np.random.Generator, cfg: SpeechTrainConfig | None) -> tuple[torch.Tensor, list[int]]:
    """Pad with silence to the longest, augment (gain, noise) when ``cfg``, -> (B, frames, 160)."""
    n = max(len(c) for c in clips)
    feats, lens = [], []
    for c in clips:
        x = np.zeros(n, dtype=np.float32)
        x[: len(c)] = c
        if cfg is not None:
            d = cfg.data
            x *= 10 ** (rng.uniform(*d.gain_db) / 20)
            if rng.random() < d.noise_prob:
                power = float(np.mean(c ** 2)) + 1e-12
                snr = rng.uniform(*d.noise_snr_db)
                x += rng.normal(0, math.sqrt(power / 10 ** (snr / 10)), n).astype(np.float32)
        f = input_features(x)
        feats.append(f)
        lens.append(min(f.shape[0], (len(c) // 160 + 1) // 2 + 2))
    return torch.stack(feats), lens


def _lr(stage: Any, step: int, elapsed_s: float) -> float:
    if step < stage.warmup_steps:
        return stage.lr * (step + 1) / stage.warmup_steps
    progress = min(1.0, max(step / stage.max_steps, elapsed_s / (stage.max_minutes * 60)))
    return stage.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _done(stage: Any, step: int, elapsed_s: float) -> bool:
    return step >= stage.max_steps or elapsed_s >= stage.max_minutes * 60


def _save(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


# ----------------------------------------------------------------------------- model
def model_configs(cfg: SpeechTrainConfig, text_hidden: int) -> tuple[EncoderConfig, ProjectorConfig]:
    e, p = cfg.encoder, cfg.projector
    enc = EncoderConfig(input_dim=160, num_layers=e.num_layers, hidden_dim=e.hidden_dim, feedforward_mult=e.feedforward_mult,
                        num_heads=e.num_heads, dim_head=e.hidden_dim // e.num_heads, output_dim=e.output_dim,
                        context_size=e.context_size, max_pos_emb=e.max_pos_emb, conv_kernel_size=e.conv_kernel_size,
                        conv_expansion_factor=e.conv_expansion_factor)
    proj = ProjectorConfig(hidden_size=p.hidden_size, num_hidden_layers=p.num_hidden_layers,
                           num_attention_heads=p.num_attention_heads, intermediate_size=p.intermediate_size,
                           encoder_hidden_size=e.hidden_dim, cross_attention_frequency=1, window_size=p.window_size,
                           downsample_rate=p.downsample_rate, text_hidden_size=text_hidden)
    return enc, proj


def _targets(texts: list[str], output_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    labels = [[ord(ch) for ch in t if 0 < ord(ch) < output_dim] for t in texts]
    return torch.tensor([x for lab in labels for x in lab], dtype=torch.long), torch.tensor([len(x) for x in labels])


def _cer(hyp: str, ref: str) -> tuple[int, int]:
    prev = list(range(len(ref) + 1))
    for i, h in enumerate(hyp, 1):
        cur = [i]
        for j, r in enumerate(ref, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (h != r)))
        prev = cur
    return prev[-1], len(ref)


def train_ctc(cfg: SpeechTrainConfig, model: SpeechModel, data: dict[str, Any], out: Path) -> None:
    stage, ckpt = cfg.ctc, out / "ctc.pt"
    opt = torch.optim.AdamW(model.encoder.parameters(), lr=stage.lr, weight_decay=0.01)
    step, elapsed = 0, 0.0
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.encoder.load_state_dict(state["encoder"])
        opt.load_state_dict(state["opt"])
        step, elapsed = state["step"], state["elapsed"]
        if state.get("done"):
            log.info("ctc: done (step %d)", step)
            return
    rng = np.random.default_rng(cfg.data.seed + step)
    n_train = data["num_train"]
    lens = np.diff(data["offsets"])[:n_train]
    order = np.argsort(lens)
    model.encoder.train()
    t_last, losses = time.time(), []
    while not _done(stage, step, elapsed):
        # a random window of similar lengths (less padding)
        start = int(rng.integers(0, max(1, n_train - stage.batch_size * 4)))
        idx = rng.choice(order[start : start + stage.batch_size * 4], stage.batch_size, replace=False)
        feats, flens = _batch_features([_clip(data, int(i)) for i in idx], rng, cfg)
        tg, tlens = _targets([data["texts"][int(i)] for i in idx], cfg.encoder.output_dim)
        for g in opt.param_groups:
            g["lr"] = _lr(stage, step, elapsed)
        hidden, mid = model.encoder(feats)
        logp = model.encoder.ctc_logits(hidden).log_softmax(-1).transpose(0, 1)
        il = torch.tensor(flens)
        loss = F.ctc_loss(logp, tg, il, tlens, zero_infinity=True)
        loss = loss + 0.5 * F.ctc_loss(mid.log_softmax(-1).transpose(0, 1), tg, il, tlens, zero_infinity=True)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.encoder.parameters(), 5.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % stage.checkpoint_every == 0 or _done(stage, step, elapsed):
            cer = ctc_eval(model, data, 16)
            model.encoder.train()
            log.info("ctc step %d  %.1f min  loss %.3f  lr %.2e  valid CER %.3f", step, elapsed / 60,
                     sum(losses) / len(losses), opt.param_groups[0]["lr"], cer)
            losses = []
            _save(ckpt, {"encoder": model.encoder.state_dict(), "opt": opt.state_dict(), "step": step,
                         "elapsed": elapsed, "done": _done(stage, step, elapsed), "valid_cer": cer})
            t_last = time.time()


@torch.no_grad()
def ctc_eval(model: SpeechModel, data: dict[str, Any], num: int) -> float:
    model.encoder.eval()
    errs = total = 0
    for i in range(data["num_train"], min(len(data["texts"]), data["num_train"] + num)):
        hidden, _ = model.encoder(input_features(_clip(data, i))[None])
        hyp = ctc_text(ctc_greedy_labels(model.encoder.ctc_logits(hidden[0])))
        e, n = _cer(hyp, data["texts"][i])
        errs, total = errs + e, total + n
    return errs / max(total, 1)


def _text_model(cfg: SpeechTrainConfig):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.executor.loader import resolve_hf_dir

    hf_dir = resolve_hf_dir(cfg.model["path"], cfg.cache_dir)
    llm = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    return llm, tok, hf_dir


def _end_token(tok: Any) -> int:
    ids = tok.convert_tokens_to_ids(["<|im_end|>"])
    return ids[0] if ids and ids[0] is not None and ids[0] != tok.unk_token_id else tok.eos_token_id


def train_embed(cfg: SpeechTrainConfig, model: SpeechModel, data: dict[str, Any], out: Path) -> None:
    """Stage 2a, no LLM forward: the projector's outputs read as a CTC over the text model's
    vocabulary (cosine similarity with its token embeddings; blank = the audio token) with
    the transcript's tokens as targets, their norms held at the embeddings' mean norm.  The
    outputs then lie near the embeddings of the tokens being spoken, in order: a start from
    which the LM loss (``train_align``) has the text model read them."""
    stage, ckpt = cfg.embed, out / "embed.pt"
    if stage.max_steps <= 0:
        return
    from transformers import AutoTokenizer

    from specserve.executor.loader import resolve_hf_dir
    from safetensors.torch import load_file

    hf_dir = resolve_hf_dir(cfg.model["path"], cfg.cache_dir)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    emb = load_file(str(hf_dir / "model.safetensors"))["model.embed_tokens.weight"].float()
    norm = float(emb.norm(dim=-1).mean())
    # the classifier covers the tokens of the training transcripts (and the blank) only
    vocab = sorted({t for s in data["texts"][: data["num_train"]] for t in tok(s, add_special_tokens=False).input_ids}
                   | {cfg.audio_token_index})
    index = {t: i for i, t in enumerate(vocab)}
    unit = F.normalize(emb[torch.tensor(vocab)], dim=-1)
    blank = index[cfg.audio_token_index]
    opt = torch.optim.AdamW(model.projector.parameters(), lr=stage.lr, weight_decay=0.01)
    step, elapsed = 0, 0.0
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.projector.load_state_dict(state["projector"])
        opt.load_state_dict(state["opt"])
        step, elapsed = state["step"], state["elapsed"]
        if state.get("done"):
            log.info("embed: done (step %d)", step)
            return
    model.encoder.eval()
    model.projector.train()
    rng = np.random.default_rng(cfg.data.seed + 104729 + step)
    t_last, losses = time.time(), []
    while not _done(stage, step, elapsed):
        idx = rng.choice(data["num_train"], stage.batch_size, replace=False)
        outs, targets = [], []
        with torch.no_grad():
            hid = [model.encoder(input_features(_clip(data, int(i)))[None])[0][0] for i in idx]
        for h, i in zip(hid, idx):
            outs.append(model.projector(h[None])[0])
            targets.append([index[t] for t in tok(data["texts"][int(i)], add_special_tokens=False).input_ids])
        T = max(o.shape[0] for o in outs)
        x = torch.stack([F.pad(o, (0, 0, 0, T - o.shape[0])) for o in outs])  # (B, T, H)
        logits = 30.0 * F.normalize(x, dim=-1) @ unit.T  # (B, T, V)
        logp = logits.log_softmax(-1).transpose(0, 1)
        tg = torch.tensor([t for ts in targets for t in ts])
        loss = F.ctc_loss(logp, tg, torch.tensor([o.shape[0] for o in outs]), torch.tensor([len(t) for t in targets]),
                          blank=blank, zero_infinity=True)
        loss = loss + ((torch.cat(outs).norm(dim=-1) - norm) ** 2).mean()
        for g in opt.param_groups:
            g["lr"] = _lr(stage, step, elapsed)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.projector.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % stage.checkpoint_every == 0 or _done(stage, step, elapsed):
            best = logits[0, : outs[0].shape[0]].argmax(-1).tolist()
            path = [vocab[t] for j, t in enumerate(best) if t != blank and (j == 0 or t != best[j - 1])]
            log.info("embed step %d  %.1f min  loss %.3f  [%r vs %r]", step, elapsed / 60, sum(losses) / len(losses),
                     tok.decode(path), data["texts"][int(idx[0])])
            losses = []
            _save(ckpt, {"projector": model.projector.state_dict(), "opt": opt.state_dict(), "step": step,
                         "elapsed": elapsed, "done": _done(stage, step, elapsed)})
            t_last = time.time()


def train_align(cfg: SpeechTrainConfig, model: SpeechModel, data: dict[str, Any], out: Path) -> None:
    stage, ckpt = cfg.align, out / "align.pt"
    llm, tok, _ = _text_model(cfg)
    emb = llm.get_input_embeddings()
    end = _end_token(tok)
    opt = torch.optim.AdamW(model.projector.parameters(), lr=stage.lr, weight_decay=0.01)
    step, elapsed = 0, 0.0
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.projector.load_state_dict(state["projector"])
        opt.load_state_dict(state["opt"])
        step, elapsed = state["step"], state["elapsed"]
        if state.get("done"):
            log.info("align: done (step %d)", step)
            return
    elif (out / "embed.pt").is_file():  # from the embedding-aligned projector (train_embed)
        model.projector.load_state_dict(torch.load(out / "embed.pt", weights_only=False)["projector"])
    else:  # start the projector's outputs at the scale of the text model's token embeddings
        with torch.no_grad():
            model.projector.linear.weight.mul_(float(emb.weight.std()) / 0.05)
            model.projector.linear.bias.zero_()
    model.encoder.eval()
    model.projector.train()
    rng = np.random.default_rng(cfg.data.seed + 7919 + step)
    n_train = data["num_train"]
    t_last, losses = time.time(), []
    while not _done(stage, step, elapsed):
        idx = rng.choice(n_train, stage.batch_size, replace=False)
        clips = [_clip(data, int(i)) for i in idx]
        with torch.no_grad():
            hid = []
            for c in clips:  # one recording at a time, as served (no padding in the encoder)
                h, _ = model.encoder(input_features(c)[None])
                hid.append(h[0])
        seqs, labels = [], []
        for h, i in zip(hid, idx):
            a = model.projector(h[None])[0]  # (n_audio, H)
            prompt = transcription_prompt(tok, cfg.audio_token_index, a.shape[0], cfg.prompt_instruction,
                                          system=cfg.prompt_system)
            target = tok(data["texts"][int(i)], add_special_tokens=False).input_ids + [end]
            ids = torch.tensor(prompt + target)
            x = emb(ids).clone()
            pos = (ids == cfg.audio_token_index).nonzero().flatten()
            x[pos] = a
            seqs.append(x)
            labels.append(torch.tensor([-100] * len(prompt) + target))
        L = max(s.shape[0] for s in seqs)
        x = torch.stack([F.pad(s, (0, 0, 0, L - s.shape[0])) for s in seqs])
        mask = torch.stack([torch.arange(L) < s.shape[0] for s in seqs]).long()
        y = torch.stack([F.pad(lab, (0, L - lab.shape[0]), value=-100) for lab in labels])
        for g in opt.param_groups:
            g["lr"] = _lr(stage, step, elapsed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = llm(inputs_embeds=x, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1),
                               ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.projector.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % stage.checkpoint_every == 0 or _done(stage, step, elapsed):
            sample = align_sample(model, llm, tok, data, cfg, end, 2)
            model.projector.train()
            log.info("align step %d  %.1f min  loss %.3f  lr %.2e  %s", step, elapsed / 60, sum(losses) / len(losses),
                     opt.param_groups[0]["lr"], sample)
            losses = []
            _save(ckpt, {"projector": model.projector.state_dict(), "opt": opt.state_dict(), "step": step,
                         "elapsed": elapsed, "done": _done(stage, step, elapsed)})
            export(cfg, model, out / "model", llm.config)
            t_last = time.time()


@torch.no_grad()
def align_sample(model: SpeechModel, llm: Any, tok: Any, data: dict[str, Any], cfg: SpeechTrainConfig, end: int,
                 num: int) -> str:
    """Greedy transcripts of ``num`` validation recordings (the progress line)."""
    model.projector.eval()
    emb = llm.get_input_embeddings()
    lines = []
    for i in range(data["num_train"], data["num_train"] + num):
        h, _ = model.encoder(input_features(_clip(data, i))[None])
        a = model.projector(h)[0]
        ids = torch.tensor(transcription_prompt(tok, cfg.audio_token_index, a.shape[0], cfg.prompt_instruction,
                                                system=cfg.prompt_system))
        x = emb(ids).clone()
        x[(ids == cfg.audio_token_index).nonzero().flatten()] = a
        out = []
        cache = None
        cur = x[None]
        for _ in range(40):
            o = llm(inputs_embeds=cur, past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            t = int(o.logits[0, -1].argmax())
            if t == end:
                break
            out.append(t)
            cur = emb(torch.tensor([[t]]))
        lines.append(f"[{tok.decode(out)!r} vs {data['texts'][i]!r}]")
    return " ".join(lines)


def export(cfg: SpeechTrainConfig, model: SpeechModel, out: Path, text_config: Any) -> None:
    """The model directory: config.json + model.safetensors (encoder and projector only)."""
    from safetensors.torch import save_file

    e, p = model.encoder.c, model.projector.p
    text = text_config.to_dict() if hasattr(text_config, "to_dict") else dict(text_config)
    config = {
        "model_type": "granite_speech",
        "architectures": ["GraniteSpeechForConditionalGeneration"],
        "audio_token_index": cfg.audio_token_index,
        "downsample_rate": p.downsample_rate,
        "window_size": p.window_size,
        "has_lora_adapter": False,
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", True)),
        "encoder_config": {"model_type": "granite_speech_encoder", "input_dim": e.input_dim, "num_layers": e.num_layers,
                           "hidden_dim": e.hidden_dim, "feedforward_mult": e.feedforward_mult,
                           "num_heads": e.num_heads, "dim_head": e.dim_head, "output_dim": e.output_dim,
                           "context_size": e.context_size, "max_pos_emb": e.max_pos_emb, "dropout": 0.0,
                           "conv_kernel_size": e.conv_kernel_size, "conv_expansion_factor": e.conv_expansion_factor},
        "projector_config": {"model_type": "blip_2_qformer", "hidden_size": p.hidden_size,
                             "num_hidden_layers": p.num_hidden_layers, "num_attention_heads": p.num_attention_heads,
                             "intermediate_size": p.intermediate_size, "encoder_hidden_size": p.encoder_hidden_size,
                             "cross_attention_frequency": p.cross_attention_frequency,
                             "layer_norm_eps": p.layer_norm_eps, "hidden_act": p.hidden_act,
                             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        "text_config": text,
        # specserve's own keys: where the text model's weights and tokenizer come from, and
        # what the CTC labels mean.
        "specserve": {"text_model": cfg.model["path"], "ctc_labels": "unicode", "transcript": "normalized",
                      "languages": ["en"],
                      "prompt": {"system": cfg.prompt_system, "instruction": cfg.prompt_instruction},
                      "trained_on": "English sentences spoken by espeak-ng (voice %s)" % cfg.data.voice},
    }
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(checkpoint_state_dict(model, "model."), str(tmp / "model.safetensors"))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def train_speech(cfg: SpeechTrainConfig) -> dict[str, Any]:
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.data.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = build_data(cfg, out)
    from transformers import AutoConfig

    from specserve.executor.loader import resolve_hf_dir

    text_config = AutoConfig.from_pretrained(str(resolve_hf_dir(cfg.model["path"], cfg.cache_dir)))
    enc, proj = model_configs(cfg, text_config.hidden_size)
    model = SpeechModel(enc, proj, dropout=cfg.encoder.dropout)
    train_ctc(cfg, model, data, out)
    state = torch.load(out / "ctc.pt", weights_only=False)
    model.encoder.load_state_dict(state["encoder"])
    train_embed(cfg, model, data, out)
    train_align(cfg, model, data, out)
    model.projector.load_state_dict(torch.load(out / "align.pt", weights_only=False)["projector"])
    export(cfg, model, out / "model", text_config)
    report = {"ctc_steps": state["step"], "ctc_minutes": state["elapsed"] / 60, "valid_cer": ctc_eval(model, data, 64),
              "num_sentences": data["num_train"], "hours_of_speech": float(data["offsets"][data["num_train"]]) / 16000 / 3600}
    a = torch.load(out / "align.pt", weights_only=False)
    report.update(align_steps=a["step"], align_minutes=a["elapsed"] / 60)
    (out / "model" / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    if cfg.export_dir:
        dst = Path(cfg.export_dir)
        dst.mkdir(parents=True, exist_ok=True)
        for f in (out / "model").iterdir():
            shutil.copy2(f, dst / f.name)
    return report

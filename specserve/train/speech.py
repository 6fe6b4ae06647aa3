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
5. ``adapt`` (with ``adapter.rank`` > 0): the projector and a low-rank adapter on the text
   model's linear layers (``train.lora``) trained together with the same LM loss; the base
   weights stay frozen.
6. ``joint`` (with ``adapter.rank`` > 0, off by default): the encoder's top blocks and CTC
   head trained beside the projector and the adapter, on the LM loss plus the CTC loss; the
   encoder runs every step (its lower blocks and batch-norm statistics frozen).
7. ``export``: ``config.json`` (``model_type: granite_speech``, the text model's config,
   ``specserve.text_model`` naming where its weights come from) and ``model.safetensors``
   holding the encoder and projector under transformers' names; with an adapter,
   ``text_adapter.safetensors`` and ``specserve.text_adapter`` (merged at load time).

With ``init_from`` (an exported model directory) the encoder and projector are loaded from
it and stages 2-4 are not run: the run builds its data (and, for stage adapt, its targets)
and goes on from there; an exported text adapter is where stages ``adapt`` and ``joint``
start (its rank and alpha must match).

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
from specserve.errors import ConfigError
from specserve.executor.models.granite_speech import (
    EncoderConfig, ProjectorConfig, SpeechModel, checkpoint_state_dict, ctc_greedy_labels, ctc_text,
)
from specserve.train.speech_config import SpeechTrainConfig
from specserve.train.speech_data import espeak_ng, training_sentences

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- data
def _synthesize(sentences: list[str], cfg: SpeechTrainConfig, seed: int, path: Path, num_train: int) -> None:
    d = cfg.data
    rng = random.Random(seed)
    chunks, offsets, t0 = [], [0], time.time()
    for i, s in enumerate(sentences):
        x = espeak_ng(s, d.voice, rng.randint(*d.wpm), rng.randint(*d.pitch))
        chunks.append((np.clip(x, -1, 1) * 32767).astype(np.int16))
        offsets.append(offsets[-1] + len(x))
        if i % 1000 == 0:
            log.info("synthesized %d/%d sentences (%.0f s)", i, len(sentences), time.time() - t0)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, samples=np.concatenate(chunks), offsets=np.asarray(offsets, dtype=np.int64),
             texts=np.asarray(sentences), num_train=num_train)
    tmp.rename(path)
    log.info("%s: %d sentences, %.2f hours of speech", path.name, len(sentences), offsets[-1] / 16000 / 3600)


def load_recordings(path: Path) -> dict[str, Any]:
    """A ``data.npz`` / ``data_gen.npz`` of this trainer: int16 ``samples`` of every recording
    end to end, their ``offsets``, ``texts``, and ``num_train`` (the rest are validation)."""
    z = np.load(path, allow_pickle=False)
    return {"samples": z["samples"], "offsets": z["offsets"], "texts": [str(t) for t in z["texts"]],
            "num_train": int(z["num_train"])}


def build_data(cfg: SpeechTrainConfig, out: Path) -> dict[str, Any]:
    """The training and validation recordings: ``data.npz`` (ShareGPT sentences) and, with
    ``data.generated_sentences``, ``data_gen.npz`` (the text model's everyday sentences),
    merged as [ShareGPT train, generated train, ShareGPT valid, generated valid];
    ``num_primary`` counts the ShareGPT training recordings (stages with ``generated:
    false`` sample those only)."""
    d = cfg.data
    exclude = Path(d.exclude_file)
    held = [s for s in exclude.read_text().splitlines() if s.strip()] if exclude.is_file() else []
    cache = Path(cfg.cache_dir) if cfg.cache_dir else None
    path = out / "data.npz"
    if not path.is_file():
        if not held:
            log.warning("data.exclude_file=%s holds no sentences: nothing is held out", d.exclude_file)
        sentences = training_sentences(d.num_sentences + d.num_valid, held, seed=d.seed, cache_dir=cache)
        _synthesize(sentences, cfg, d.seed, path, len(sentences) - d.num_valid)
    data = load_recordings(path)
    data["num_primary"] = data["num_train"]
    if d.generated_sentences <= 0:
        return data
    gpath = out / "data_gen.npz"
    if not gpath.is_file():
        from specserve.executor.loader import resolve_hf_dir
        from specserve.train.speech_text import generated_sentences

        known = set(data["texts"])
        gen = generated_sentences(resolve_hf_dir(cfg.model["path"], cache), d.generated_sentences + d.generated_valid + 100,
                                  held, d.seed, out / "generated.jsonl")
        gen = [s for s in gen if s not in known][: d.generated_sentences + d.generated_valid]
        _synthesize(gen, cfg, d.seed + 1, gpath, len(gen) - d.generated_valid)
    g = load_recordings(gpath)
    return merge_data(data, g)


def merge_data(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """[a train, b train, a valid, b valid] in one sample array."""
    na, nb = a["num_train"], b["num_train"]
    parts = [(a, 0, na), (b, 0, nb), (a, na, len(a["texts"])), (b, nb, len(b["texts"]))]
    samples, offsets, texts = [], [0], []
    for src, i, j in parts:
        lo, hi = src["offsets"][i], src["offsets"][j]
        samples.append(src["samples"][lo:hi])
        offsets.extend((src["offsets"][i + 1 : j + 1] - lo + offsets[-1]).tolist())
        texts.extend(src["texts"][i:j])
    return {"samples": np.concatenate(samples), "offsets": np.asarray(offsets, dtype=np.int64), "texts": texts,
            "num_train": na + nb, "num_primary": na}


def recording(data: dict[str, Any], i: int) -> np.ndarray:
    """Recording ``i`` of ``load_recordings``'s ``data`` as float32 samples at 16 kHz."""
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


def spec_augment(feats: torch.Tensor, lens: list[int], cfg: SpeechTrainConfig, rng: np.random.Generator) -> torch.Tensor:
    """SpecAugment on (B, frames, 160) stacked-pair features: ``data.freq_masks`` mel bands
    (the same bins in both frames of a pair) and ``data.time_masks`` frame runs set to the
    recording's mean feature value."""
    d = cfg.data
    x = feats.clone()
    for b, n in enumerate(lens):
        fill = float(x[b, :n].mean())
        for _ in range(d.freq_masks):
            w = int(rng.integers(0, d.freq_mask_bins + 1))
            f0 = int(rng.integers(0, 80 - w + 1))
            x[b, :n, f0 : f0 + w] = fill
            x[b, :n, 80 + f0 : 80 + f0 + w] = fill
        for _ in range(d.time_masks):
            w = int(rng.integers(0, min(d.time_mask_frames, max(1, n // 10)) + 1))
            t0 = int(rng.integers(0, max(1, n - w)))
            x[b, t0 : t0 + w] = fill
    return x


def _lr(stage: Any, step: int, elapsed_s: float) -> float:
    if step < stage.warmup_steps:
        return stage.lr * (step + 1) / stage.warmup_steps
    progress = min(1.0, max(step / stage.max_steps, elapsed_s / (stage.max_minutes * 60)))
    return stage.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _done(stage: Any, step: int, elapsed_s: float) -> bool:
    return step >= stage.max_steps or elapsed_s >= stage.max_minutes * 60


def _update(opt: Any, loss: torch.Tensor, lr: float, clip: tuple[Any, float] | None = None) -> float:
    """One optimizer step at ``lr`` (times a parameter group's ``mult`` where it has one;
    gradients clipped to ``clip`` = (parameters, max norm) if given); returns the loss as a
    float."""
    for g in opt.param_groups:
        g["lr"] = lr * g.get("mult", 1.0)
    opt.zero_grad()
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(*clip)
    opt.step()
    return float(loss.detach())


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


def _ctc_loss(final: torch.Tensor, mid: torch.Tensor | None, lengths: list[int], texts: list[str],
              output_dim: int) -> torch.Tensor:
    """The encoder's character CTC loss: the final head's plus half the middle head's (when
    given), both (B, frames, labels) logits whose frames past ``lengths`` are padding."""
    tg, tlens = _targets(texts, output_dim)
    il = torch.tensor(lengths)

    def one(logits: torch.Tensor) -> torch.Tensor:
        return F.ctc_loss(logits.log_softmax(-1).transpose(0, 1), tg, il, tlens, zero_infinity=True)

    return one(final) if mid is None else one(final) + 0.5 * one(mid)


def _cer(hyp: str, ref: str) -> tuple[int, int]:
    prev = list(range(len(ref) + 1))
    for i, h in enumerate(hyp, 1):
        cur = [i]
        for j, r in enumerate(ref, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (h != r)))
        prev = cur
    return prev[-1], len(ref)


def train_ctc(cfg: SpeechTrainConfig, model: SpeechModel, data: dict[str, Any], out: Path, name: str = "ctc") -> None:
    """The encoder's CTC stage ``name`` (``ctc``, or ``ctc2``: on from the weights in
    ``model``, a new learning-rate cycle)."""
    stage, ckpt = getattr(cfg, name), out / f"{name}.pt"
    if stage.max_steps <= 0:
        return
    opt = torch.optim.AdamW(model.encoder.parameters(), lr=stage.lr, weight_decay=0.01)
    step, elapsed = 0, 0.0
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.encoder.load_state_dict(state["encoder"])
        opt.load_state_dict(state["opt"])
        step, elapsed = state["step"], state["elapsed"]
        if state.get("done"):
            log.info("%s: done (step %d)", name, step)
            return
    rng = np.random.default_rng(cfg.data.seed + step + (7 if name != "ctc" else 0))
    n_train = data["num_train"] if stage.generated else data.get("num_primary", data["num_train"])
    lens = np.diff(data["offsets"])[:n_train]
    order = np.argsort(lens)
    model.encoder.train()
    t_last, losses = time.time(), []
    while not _done(stage, step, elapsed):
        # a random window of similar lengths (less padding)
        start = int(rng.integers(0, max(1, n_train - stage.batch_size * 4)))
        idx = rng.choice(order[start : start + stage.batch_size * 4], stage.batch_size, replace=False)
        feats, flens = _batch_features([recording(data, int(i)) for i in idx], rng, cfg)
        if stage.spec_augment:
            feats = spec_augment(feats, flens, cfg, rng)
        hidden, mid = model.encoder(feats)
        loss = _ctc_loss(model.encoder.ctc_logits(hidden), mid, flens, [data["texts"][int(i)] for i in idx],
                         cfg.encoder.output_dim)
        losses.append(_update(opt, loss, _lr(stage, step, elapsed), (model.encoder.parameters(), 5.0)))
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % stage.checkpoint_every == 0 or _done(stage, step, elapsed):
            cer = ctc_eval(model, data, 16)
            model.encoder.train()
            log.info("%s step %d  %.1f min  loss %.3f  lr %.2e  valid CER %.3f", name, step, elapsed / 60,
                     sum(losses) / len(losses), opt.param_groups[0]["lr"], cer)
            losses = []
            _save(ckpt, {"encoder": model.encoder.state_dict(), "opt": opt.state_dict(), "step": step,
                         "elapsed": elapsed, "done": _done(stage, step, elapsed), "valid_cer": cer})
            t_last = time.time()


@torch.no_grad()
def ctc_eval(model: SpeechModel, data: dict[str, Any], num: int) -> float:
    model.encoder.eval()
    errs = total = 0
    valid = range(data["num_train"], len(data["texts"]))
    step = max(1, len(valid) // max(num, 1))
    for i in list(valid)[::step][:num]:  # spread over the validation sentences of every source
        hidden, _ = model.encoder(input_features(recording(data, i))[None])
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


# ----------------------------------------------------------------------------- projector
def build_targets(cfg: SpeechTrainConfig, model: SpeechModel, data: dict[str, Any], out: Path, tok: Any) -> dict[str, Any]:
    """Stage ``targets`` (once, cached in ``targets.pt``): the final encoder's states of
    every recording (float16, concatenated; the later stages never run the encoder again)
    and where each transcript token sits among its audio positions
    (``speech_targets.transcript_targets``: CTC forced alignment of the transcript's
    characters).  A recording whose alignment fails or crowds tokens into one position
    gets no targets (None) and is not trained on."""
    path = out / "targets.pt"
    if path.is_file():
        return torch.load(path, weights_only=False)
    from specserve.train.speech_targets import transcript_targets

    model.encoder.eval()
    p = model.projector.p
    hidden, offsets, ids, slots, t0 = [], [0], [], [], time.time()
    with torch.no_grad():
        for i in range(len(data["texts"])):
            h, _ = model.encoder(input_features(recording(data, i))[None])
            logp = model.encoder.ctc_logits(h[0]).float().log_softmax(-1).numpy()
            hidden.append(h[0].to(torch.float16))
            offsets.append(offsets[-1] + h.shape[1])
            try:
                tid, pos = transcript_targets(tok, data["texts"][i], logp, p.window_size, p.num_queries)
                ok = all(b > a for a, b in zip(pos, pos[1:]))
            except ValueError:
                ok = False
            ids.append(tid if ok else None)
            slots.append(pos if ok else None)
            if i % 2000 == 0:
                log.info("targets: %d/%d recordings (%.0f s)", i, len(data["texts"]), time.time() - t0)
    targets = {"hidden": torch.cat(hidden), "offsets": offsets, "ids": ids, "slots": slots}
    log.info("targets: %d of %d recordings aligned", sum(x is not None for x in ids), len(ids))
    _save(path, targets)
    return targets


def _usable(targets: dict[str, Any], lo: int, hi: int) -> np.ndarray:
    return np.asarray([i for i in range(lo, hi) if targets["ids"][i] is not None])


def _hidden(targets: dict[str, Any], i: int) -> torch.Tensor:
    a, b = targets["offsets"][i], targets["offsets"][i + 1]
    return targets["hidden"][a:b].float()


def _num_slots(targets: dict[str, Any], i: int, p: Any) -> int:
    n = targets["offsets"][i + 1] - targets["offsets"][i]
    return p.num_queries * -(-n // p.window_size)


def slot_targets(targets: dict[str, Any], i: int, p: Any, emb: torch.Tensor, filler: torch.Tensor) -> torch.Tensor:
    """(audio positions, text hidden): the token embeddings at their positions, the
    filler (one vector per query of a window) elsewhere."""
    n = _num_slots(targets, i, p)
    x = filler.repeat(n // p.num_queries, 1).clone()
    x[torch.tensor(targets["slots"][i])] = emb[torch.tensor(targets["ids"][i])]
    return x


def _project_many(model: SpeechModel, hiddens: list[torch.Tensor]) -> list[torch.Tensor]:
    """The projector over several recordings in one call: each padded to whole windows
    and laid end to end (windows are independent, so this equals one call each)."""
    W, Q = model.projector.p.window_size, model.projector.p.num_queries
    padded = [F.pad(h, (0, 0, 0, -h.shape[0] % W)) for h in hiddens]
    y = model.projector(torch.cat(padded)[None])[0]
    out, k = [], 0
    for h in padded:
        n = h.shape[0] // W * Q
        out.append(y[k : k + n])
        k += n
    return out


def _audio_prompt(cfg: SpeechTrainConfig, tok: Any, n: int) -> list[int]:
    return transcription_prompt(tok, cfg.audio_token_index, n, cfg.prompt_instruction, system=cfg.prompt_system)


def _lm_batch(cfg: SpeechTrainConfig, tok: Any, emb: Any, audio: list[torch.Tensor], texts: list[str], end: int):
    """Inputs embeddings (B, L, H), attention mask and the (row, position, label) of every
    target token: the prompt around each recording's audio rows, then its transcript and
    the end-of-turn token (the only positions with a loss)."""
    seqs, where, labels = [], [], []
    for b, (a, text) in enumerate(zip(audio, texts)):
        prompt = _audio_prompt(cfg, tok, a.shape[0])
        target = tok(text, add_special_tokens=False).input_ids + [end]
        ids = torch.tensor(prompt + target)
        x = emb(ids)
        pos = (ids == cfg.audio_token_index).nonzero().flatten()
        x = torch.cat([x[: pos[0]], a, x[pos[-1] + 1 :]])
        seqs.append(x)
        for j, t in enumerate(target):
            where.append((b, len(prompt) + j - 1))
            labels.append(t)
    L = max(s.shape[0] for s in seqs)
    x = torch.stack([F.pad(s, (0, 0, 0, L - s.shape[0])) for s in seqs])
    mask = torch.stack([torch.arange(L) < s.shape[0] for s in seqs]).long()
    rows, cols = torch.tensor([w[0] for w in where]), torch.tensor([w[1] for w in where])
    return x, mask, rows, cols, torch.tensor(labels)


def _bf16_autocast() -> bool:
    """Whether bfloat16 autocast pays on this CPU (AVX512-BF16 or AMX: the shipped model
    trained so); without them torch's bfloat16 matmuls take a scalar path (measured on an
    AVX2 machine: about 100 s a step of stage adapt, about 5 s in float32)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _lm_loss(llm: Any, x: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
             labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the frozen text model at the target positions only (the head runs
    on those rows alone); in bfloat16 autocast where the CPU has bfloat16 arithmetic
    (``_bf16_autocast``), else in float32."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_bf16_autocast()):
        h = llm.model(inputs_embeds=x, attention_mask=mask).last_hidden_state
        logits = llm.lm_head(h[rows, cols])
    return F.cross_entropy(logits.float(), labels)


def _stage_state(path: Path, opt: Any, params: dict[str, Any]) -> tuple[int, float, bool]:
    if not path.is_file():
        return 0, 0.0, False
    state = torch.load(path, weights_only=False)
    for k, load in params.items():
        load(state[k])
    opt.load_state_dict(state["opt"])
    return state["step"], state["elapsed"], bool(state.get("done"))


def train_filler(cfg: SpeechTrainConfig, data: dict[str, Any], targets: dict[str, Any], out: Path, llm: Any, tok: Any,
                 p: Any) -> torch.Tensor:
    """Stage ``filler``: the vectors the projector writes at audio positions holding no
    token (one per query of a window), learned so that the frozen text model, given the
    transcript's own token embeddings at their positions and these elsewhere, writes
    the transcript (LM loss; no projector yet).  Returns (queries, text hidden)."""
    stage, ckpt = cfg.filler, out / "filler.pt"
    emb = llm.get_input_embeddings()
    space = tok(" ", add_special_tokens=False).input_ids  # a start the text model nearly skips
    start = emb.weight[space[-1]] if space else emb.weight.mean(0)
    filler = torch.nn.Parameter(start.detach().clone().repeat(p.num_queries, 1))
    opt = torch.optim.Adam([filler], lr=stage.lr)
    step, elapsed, done = _stage_state(ckpt, opt, {"filler": lambda v: filler.data.copy_(v)})
    if done or stage.max_steps <= 0:
        return filler.detach()
    end = _end_token(tok)
    usable = _usable(targets, 0, data["num_train"])
    rng = np.random.default_rng(cfg.data.seed + 31 + step)
    t_last, losses = time.time(), []
    while not _done(stage, step, elapsed):
        idx = rng.choice(usable, stage.batch_size, replace=False)
        audio = [slot_targets(targets, int(i), p, emb.weight, filler) for i in idx]
        loss = _lm_loss(llm, *_lm_batch(cfg, tok, emb, audio, [data["texts"][int(i)] for i in idx], end))
        losses.append(_update(opt, loss, _lr(stage, step, elapsed)))
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % stage.checkpoint_every == 0 or _done(stage, step, elapsed):
            log.info("filler step %d  %.1f min  loss %.3f", step, elapsed / 60, sum(losses) / len(losses))
            losses = []
            _save(ckpt, {"filler": filler.detach(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                         "done": _done(stage, step, elapsed)})
            t_last = time.time()
    return filler.detach()


def _regression_loss(out: torch.Tensor, tgt: torch.Tensor, classes: torch.Tensor, protos: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared error to the targets (relative to the embeddings' mean square) plus a
    cross-entropy of cosine similarities against the class prototypes; and the argmax
    classes (for the accuracy lines)."""
    mse = ((out - tgt) ** 2).sum(-1).mean() / scale
    logits = 20.0 * F.normalize(out, dim=-1) @ protos.T
    return mse + F.cross_entropy(logits, classes), logits.argmax(-1)


def train_embed(cfg: SpeechTrainConfig, model: SpeechModel, data: dict[str, Any], targets: dict[str, Any], out: Path,
                emb: torch.Tensor, filler: torch.Tensor) -> None:
    """Stage ``embed`` (no text-model forward): the projector regressed onto
    ``slot_targets``: at each audio position the embedding of the token spoken there
    (``build_targets``) or the filler; squared error plus a cross-entropy over the
    transcripts' tokens and the fillers (cosine similarity), on the cached encoder
    states."""
    stage, ckpt = cfg.embed, out / "embed.pt"
    if stage.max_steps <= 0:
        return
    p = model.projector.p
    opt = torch.optim.AdamW(model.projector.parameters(), lr=stage.lr, weight_decay=0.01)
    step, elapsed, done = _stage_state(ckpt, opt, {"projector": model.projector.load_state_dict})
    if done:
        log.info("embed: done (step %d)", step)
        return
    vocab = sorted({t for ids in targets["ids"] if ids is not None for t in ids})
    index = {t: k for k, t in enumerate(vocab)}
    protos = F.normalize(torch.cat([emb[torch.tensor(vocab)], filler]), dim=-1)
    scale = float((emb[torch.tensor(vocab)] ** 2).sum(-1).mean())
    usable = _usable(targets, 0, data["num_train"])
    valid = _usable(targets, data["num_train"], len(data["texts"]))

    def batch(idx):
        tg, cl = [], []
        for i in idx:
            i = int(i)
            tg.append(slot_targets(targets, i, p, emb, filler))
            c = torch.arange(tg[-1].shape[0]) % p.num_queries + len(vocab)
            c[torch.tensor(targets["slots"][i])] = torch.tensor([index[t] for t in targets["ids"][i]])
            cl.append(c)
        return torch.cat(tg), torch.cat(cl)

    model.projector.train()
    rng = np.random.default_rng(cfg.data.seed + 104729 + step)
    t_last, losses = time.time(), []
    while not _done(stage, step, elapsed):
        idx = rng.choice(usable, stage.batch_size, replace=False)
        y = torch.cat(_project_many(model, [_hidden(targets, int(i)) for i in idx]))
        tg, cl = batch(idx)
        loss, _ = _regression_loss(y, tg, cl, protos, scale)
        losses.append(_update(opt, loss, _lr(stage, step, elapsed), (model.projector.parameters(), 1.0)))
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % stage.checkpoint_every == 0 or _done(stage, step, elapsed):
            model.projector.eval()
            with torch.no_grad():
                vi = valid[:64]
                y = torch.cat(_project_many(model, [_hidden(targets, int(i)) for i in vi]))
                tg, cl = batch(vi)
                vloss, pred = _regression_loss(y, tg, cl, protos, scale)
                tok_pos = cl < len(vocab)
                acc = float((pred[tok_pos] == cl[tok_pos]).float().mean())
                fill = float((pred[~tok_pos] >= len(vocab)).float().mean())
            model.projector.train()
            log.info("embed step %d  %.1f min  loss %.3f  valid loss %.3f  tokens right %.3f  fillers right %.3f",
                     step, elapsed / 60, sum(losses) / len(losses), float(vloss), acc, fill)
            losses = []
            _save(ckpt, {"projector": model.projector.state_dict(), "opt": opt.state_dict(), "step": step,
                         "elapsed": elapsed, "done": _done(stage, step, elapsed)})
            t_last = time.time()


def train_align(cfg: SpeechTrainConfig, model: SpeechModel, data: dict[str, Any], targets: dict[str, Any], out: Path,
                llm: Any, tok: Any) -> None:
    """Stage ``align``: the projector (from ``embed``) trained so that the frozen text
    model, prompted with ``audio.prompt.transcription_prompt`` whose audio positions hold
    the projector's outputs, writes the normalised transcript and then its end-of-turn
    token (cross-entropy on those tokens only; the text model's weights never change)."""
    _train_lm(cfg, model, data, targets, out, llm, tok, "align", cfg.align, 7919,
              [(list(model.projector.parameters()), 1.0)], {})


def train_adapt(cfg: SpeechTrainConfig, model: SpeechModel, data: dict[str, Any], targets: dict[str, Any], out: Path,
                llm: Any, tok: Any, lora: list[Any]) -> None:
    """Stage ``adapt``: the projector and the text model's low-rank adapter (``lora``: the
    factors ``train.lora.add_lora`` wrapped into ``llm``) trained together with align's LM
    loss.  The adapter's learning rate is the stage's times ``adapter.lr_mult``."""
    from specserve.train.lora import load_lora_state_dict, lora_state_dict

    _train_lm(cfg, model, data, targets, out, llm, tok, "adapt", cfg.adapt, 104729,
              [(list(model.projector.parameters()), 1.0), (lora, cfg.adapter.lr_mult)],
              {"adapter": (lambda sd: load_lora_state_dict(llm, sd), lambda: lora_state_dict(llm))})


def _train_lm(cfg: SpeechTrainConfig, model: SpeechModel, data: dict[str, Any], targets: dict[str, Any], out: Path,
              llm: Any, tok: Any, name: str, stage: Any, seed_offset: int, groups: list[tuple[list[Any], float]],
              extra: dict[str, tuple[Any, Any]]) -> None:
    """Stages align and adapt: the projector (and ``groups``' other parameters) on the LM
    loss, the encoder's states read from ``targets``."""
    emb, end = llm.get_input_embeddings(), _end_token(tok)

    def loss_of(idx: list[int], rng: np.random.Generator) -> torch.Tensor:
        audio = _project_many(model, [_hidden(targets, i) for i in idx])
        return _lm_loss(llm, *_lm_batch(cfg, tok, emb, audio, [data["texts"][i] for i in idx], end))

    _train_loop(cfg, out, name, stage, seed_offset, groups,
                {"projector": (model.projector.load_state_dict, model.projector.state_dict), **extra},
                _usable(targets, 0, data["num_train"]), loss_of, model.projector.train,
                lambda: align_sample(model, llm, tok, data, lambda i: _hidden(targets, i), cfg, end, 2))


def _train_loop(cfg: SpeechTrainConfig, out: Path, name: str, stage: Any, seed_offset: int,
                groups: list[tuple[list[Any], float]], state: dict[str, tuple[Any, Any]], pool: np.ndarray,
                loss_of: Any, train_mode: Any, progress: Any) -> None:
    """The loop of the LM-loss stages (checkpoint ``<name>.pt``, resumable): batches of
    ``stage.batch_size`` recordings drawn from ``pool``, ``loss_of(indices, rng)`` minimised over
    ``groups`` = (parameters, learning-rate multiplier); ``state`` = checkpoint key ->
    (load, save); ``train_mode()`` puts the modules back in training mode after
    ``progress()`` (the progress line's text) ran."""
    ckpt = out / f"{name}.pt"
    opt = torch.optim.AdamW([{"params": ps, "mult": m} for ps, m in groups], lr=stage.lr, weight_decay=0.01)
    step, elapsed, done = _stage_state(ckpt, opt, {k: load for k, (load, _) in state.items()})
    if done or stage.max_steps <= 0:
        log.info("%s: done (step %d)", name, step)
        return
    train_mode()
    rng = np.random.default_rng(cfg.data.seed + seed_offset + step)
    params = [p for ps, _ in groups for p in ps]
    t_last, losses = time.time(), []
    while not _done(stage, step, elapsed):
        idx = [int(i) for i in rng.choice(pool, stage.batch_size, replace=False)]
        lr = _lr(stage, step, elapsed)
        losses.append(_update(opt, loss_of(idx, rng), lr, (params, 1.0)))
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % stage.checkpoint_every == 0 or _done(stage, step, elapsed):
            sample = progress()
            train_mode()
            log.info("%s step %d  %.1f min  loss %.3f  lr %.2e  %s", name, step, elapsed / 60,
                     sum(losses) / len(losses), lr, sample)
            losses = []
            _save(ckpt, {**{k: save() for k, (_, save) in state.items()}, "opt": opt.state_dict(), "step": step,
                         "elapsed": elapsed, "done": _done(stage, step, elapsed)})
            t_last = time.time()


# ----------------------------------------------------------------------------- joint
def _joint_train_mode(model: SpeechModel, k: int) -> None:
    """Training mode for the projector and the encoder's top ``k`` blocks; the lower blocks
    and every batch norm (its statistics) stay in inference mode."""
    model.projector.train()
    enc = model.encoder
    enc.eval()
    for layer in enc.layers[len(enc.layers) - k :]:
        layer.train()
    for m in enc.modules():
        if isinstance(m, torch.nn.BatchNorm1d):
            m.eval()


def joint_parameters(model: SpeechModel, k: int) -> list[Any]:
    """The encoder's parameters stage joint trains: the top ``k`` blocks and the CTC head
    (and the input layer and self-conditioning projection where they fall among them)."""
    enc = model.encoder
    n = len(enc.layers)
    mods = [*enc.layers[n - k :], enc.out] if k else []
    if k > n - n // 2:  # the middle block (n // 2, counting from 1) trains: its self-conditioning too
        mods.append(enc.out_mid)
    if k == n:
        mods.append(enc.input_linear)
    return [p for m in mods for p in m.parameters()]


def joint_encode(model: SpeechModel, feats: list[torch.Tensor], k: int) -> tuple[list[torch.Tensor], list[Any]]:
    """Each recording's final encoder states and middle-block CTC logits (None where that
    block is frozen), one recording at a time (no padding: what serving computes), the
    blocks below the top ``k`` without gradients."""
    enc = model.encoder
    n = len(enc.layers)
    hidden, mids = [], []
    for f in feats:
        with torch.set_grad_enabled(k == n and torch.is_grad_enabled()):
            x = enc.input_linear(f[None])
        with torch.no_grad():
            x, _ = enc.blocks(x, 0, n - k)
        x, mid = enc.blocks(x, n - k, n)
        hidden.append(x[0])
        mids.append(mid if mid is not None and mid.requires_grad else None)
    return hidden, mids


def train_joint(cfg: SpeechTrainConfig, model: SpeechModel, data: dict[str, Any], out: Path, llm: Any, tok: Any,
                lora: list[Any]) -> None:
    """Stage ``joint``: the encoder's top ``joint.encoder_layers`` blocks and CTC head, the
    projector and the text model's adapter, on the LM loss of stage adapt plus
    ``joint.ctc_weight`` times the CTC loss (final head, and half the middle one's where its
    block trains); the encoder runs each step on the augmented audio (gain, noise; SpecAugment
    with ``joint.spec_augment``), so the projector sees the states the encoder now gives."""
    from specserve.train.lora import load_lora_state_dict, lora_state_dict

    stage, k = cfg.joint, cfg.joint.encoder_layers
    emb, end = llm.get_input_embeddings(), _end_token(tok)

    def loss_of(idx: list[int], rng: np.random.Generator) -> torch.Tensor:
        feats = []
        for i in idx:
            f, lens = _batch_features([recording(data, i)], rng, cfg)
            feats.append((spec_augment(f, lens, cfg, rng) if stage.spec_augment else f)[0])
        hidden, mids = joint_encode(model, feats, k)
        texts = [data["texts"][i] for i in idx]
        loss = _lm_loss(llm, *_lm_batch(cfg, tok, emb, _project_many(model, hidden), texts, end))
        if stage.ctc_weight and k:
            pad = torch.nn.utils.rnn.pad_sequence
            mid = pad([m[0] for m in mids], batch_first=True) if all(m is not None for m in mids) else None
            final = pad([model.encoder.ctc_logits(h) for h in hidden], batch_first=True)
            loss = loss + stage.ctc_weight * _ctc_loss(final, mid, [h.shape[0] for h in hidden], texts,
                                                       cfg.encoder.output_dim)
        return loss

    def hidden_of(i: int) -> torch.Tensor:
        return model.encoder(input_features(recording(data, i))[None])[0][0]

    def progress() -> str:  # ctc_eval leaves the encoder in inference mode for the samples
        return f"valid CER {ctc_eval(model, data, 16):.3f} " + align_sample(model, llm, tok, data, hidden_of, cfg, end, 2)

    enc = model.encoder
    _train_loop(cfg, out, "joint", stage, 32452843,
                [(joint_parameters(model, k), stage.encoder_lr_mult), (list(model.projector.parameters()), 1.0),
                 (lora, cfg.adapter.lr_mult)],
                {"encoder": (enc.load_state_dict, enc.state_dict),
                 "projector": (model.projector.load_state_dict, model.projector.state_dict),
                 "adapter": (lambda sd: load_lora_state_dict(llm, sd), lambda: lora_state_dict(llm))},
                np.arange(data["num_train"]), loss_of, lambda: _joint_train_mode(model, k), progress)


@torch.no_grad()
def align_sample(model: SpeechModel, llm: Any, tok: Any, data: dict[str, Any], hidden_of: Any,
                 cfg: SpeechTrainConfig, end: int, num: int) -> str:
    """Greedy transcripts of ``num`` validation recordings (the progress line);
    ``hidden_of(i)``: recording i's encoder states."""
    model.projector.eval()
    emb = llm.get_input_embeddings()
    lines = []
    for i in range(data["num_train"], data["num_train"] + num):
        a = model.projector(hidden_of(i)[None])[0]
        ids = torch.tensor(_audio_prompt(cfg, tok, a.shape[0]))
        x = emb(ids).clone()
        x[(ids == cfg.audio_token_index).nonzero().flatten()] = a
        out, cache, cur = [], None, x[None]
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


def export(cfg: SpeechTrainConfig, model: SpeechModel, out: Path, text_config: Any,
           adapter: dict[str, torch.Tensor] | None = None) -> None:
    """The model directory: config.json + model.safetensors (encoder and projector), and
    with ``adapter`` (``train.lora.lora_state_dict``) text_adapter.safetensors (float16
    factors; ``executor.text_adapter`` merges them at load time)."""
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
    if adapter:
        config["specserve"]["text_adapter"] = {"file": "text_adapter.safetensors",
                                               "scale": cfg.adapter.alpha / cfg.adapter.rank}
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(checkpoint_state_dict(model, "model."), str(tmp / "model.safetensors"))
    if adapter:
        save_file({k: v.to(torch.float16).contiguous() for k, v in adapter.items()}, str(tmp / "text_adapter.safetensors"))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def init_from_export(model: SpeechModel, d: Path) -> dict[str, Any]:
    """Load an exported model's encoder and projector into ``model`` (their configs must
    match this run's); returns its training report's stages (for the new report)."""
    from safetensors.torch import load_file

    from specserve.executor.models.granite_speech import state_dict_from_checkpoint

    try:
        model.load_state_dict(state_dict_from_checkpoint(load_file(str(d / "model.safetensors"))), strict=True)
    except RuntimeError as e:
        raise ConfigError("init_from", f"{d}: its encoder/projector do not match this run's encoder and projector "
                                       f"configs: {str(e).splitlines()[0]}") from e
    report = d / "training_report.json"
    return json.loads(report.read_text()).get("stages", {}) if report.is_file() else {}


def init_adapter_from_export(llm: Any, d: Path, rank: int, alpha: float) -> bool:
    """Load an exported model's text adapter (``specserve.text_adapter``, read as the loader
    reads it) into ``llm``'s low-rank layers (``train.lora.add_lora`` done); False when it
    has none."""
    from specserve.executor.text_adapter import read_text_adapter
    from specserve.train.lora import load_lora_state_dict

    spec = json.loads((d / "config.json").read_text()).get("specserve", {}).get("text_adapter")
    if not spec:
        return False
    factors, scale, _ = read_text_adapter(d, spec, "init_from")
    if abs(scale - alpha / rank) > 1e-6:
        raise ConfigError("adapter.alpha", f"{d}: its adapter's scale is {scale}, this run's alpha / rank "
                                           f"is {alpha / rank}")
    try:
        load_lora_state_dict(llm, {k: v.float() for k, v in factors.items()})
    except (KeyError, RuntimeError) as e:
        raise ConfigError("init_from", f"{d}: its text adapter does not fit this run's adapter "
                                       f"(rank {rank}, modules): {str(e).splitlines()[0]}") from e
    return True


def _stage_summary(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    st = torch.load(path, weights_only=False)
    return {"steps": st["step"], "minutes": round(st["elapsed"] / 60, 1)}


def train_speech(cfg: SpeechTrainConfig) -> dict[str, Any]:
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.data.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = build_data(cfg, out)
    llm, tok, _ = _text_model(cfg)
    enc, proj = model_configs(cfg, llm.config.hidden_size)
    model = SpeechModel(enc, proj, dropout=cfg.encoder.dropout)
    stages = ("ctc", "ctc2", "filler", "embed", "align")
    earlier: dict[str, Any] = {}
    if cfg.init_from:  # stages ctc .. align come from an exported model
        earlier = init_from_export(model, Path(cfg.init_from))
    else:
        for name in ("ctc", "ctc2"):
            train_ctc(cfg, model, data, out, name)
            if (out / f"{name}.pt").is_file():
                model.encoder.load_state_dict(torch.load(out / f"{name}.pt", weights_only=False)["encoder"])
    model.encoder.eval()
    adapting = cfg.adapter.rank > 0 and cfg.adapt.max_steps > 0
    joint = cfg.adapter.rank > 0 and cfg.joint.max_steps > 0
    if not cfg.init_from or adapting:  # the stages reading the encoder's states from targets.pt
        targets = build_targets(cfg, model, data, out, tok)
    if not cfg.init_from:
        filler = train_filler(cfg, data, targets, out, llm, tok, model.projector.p)
        train_embed(cfg, model, data, targets, out, llm.get_input_embeddings().weight, filler)
        for name in ("embed", "align"):
            if name == "align":
                train_align(cfg, model, data, targets, out, llm, tok)
            if (out / f"{name}.pt").is_file():
                model.projector.load_state_dict(torch.load(out / f"{name}.pt", weights_only=False)["projector"])
    adapter = None
    if adapting or joint:
        from specserve.train.lora import add_lora, lora_state_dict

        lora = add_lora(llm, cfg.adapter.rank, cfg.adapter.alpha, list(cfg.adapter.modules))
        # a checkpoint of adapt or joint holds the adapter already
        resuming = any((out / f"{n}.pt").is_file() for n in ("adapt", "joint"))
        if cfg.init_from and not resuming and init_adapter_from_export(llm, Path(cfg.init_from), cfg.adapter.rank,
                                                                       cfg.adapter.alpha):
            log.info("adapter: starts from %s's text adapter", cfg.init_from)
        if adapting:
            train_adapt(cfg, model, data, targets, out, llm, tok, lora)  # leaves the checkpoint's state in place
            stages += ("adapt",)
        if joint:
            train_joint(cfg, model, data, out, llm, tok, lora)
            stages += ("joint",)
        adapter = lora_state_dict(llm)
    export(cfg, model, out / "model", llm.config, adapter)
    summary = {name: _stage_summary(out / f"{name}.pt") for name in stages}
    report = {"sentences": data["num_train"], "primary_sentences": data.get("num_primary", data["num_train"]),
              "hours_of_speech": round(float(data["offsets"][data["num_train"]]) / 16000 / 3600, 2),
              "valid_cer": round(ctc_eval(model, data, 128), 4),
              "stages": {k: earlier.get(k) if summary.get(k) is None else summary[k] for k in stages}}
    if cfg.init_from:
        report["init_from"] = str(cfg.init_from)
    (out / "model" / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    if cfg.export_dir:
        dst = Path(cfg.export_dir)
        dst.mkdir(parents=True, exist_ok=True)
        for f in (out / "model").iterdir():
            shutil.copy2(f, dst / f.name)
    return report

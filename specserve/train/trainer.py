"""``specserve-train``: train an EAGLE-3 head for a target specserve serves.

Phases, each resumable from ``output_dir``:

1. data (``capture``): the target regenerates responses to ShareGPT training
   prompts through specserve's engine, batched, greedy; its features are
   captured from the same forwards (shards under ``data/``);
2. vocabulary: the ``head.draft_vocab_size`` most frequent tokens the head must
   predict (plus EOS) -> d2t/t2d (``vocab.pt``);
3. training with the training-time test (``ttt``), a progress bar with the loss,
   top-1 agreement per unrolled step, tokens/s and the ETA; checkpoints every
   ``checkpoint_every`` steps (``checkpoint.pt``, resumed automatically);
4. export in the EAGLE-3 layout (``eagle3/``) and the speculators layout
   (``speculators/``);
5. evaluation: acceptance on held-out ShareGPT benchmark prompts through the real
   engine with ``+method=eagle3`` (``eval.json``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specserve.executor.eagle_loader import default_eagle3_layers, save_eagle3, save_speculators
from specserve.executor.loader import LoadedModel, default_cache_dir, load_model, resolve_device
from specserve.executor.models.eagle import EagleHead, HeadConfig, num_parameters
from specserve.train.capture import capture, load_shards
from specserve.train.config import TrainConfig
from specserve.train.ttt import collate, ttt_loss

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


# ---------------------------------------------------------------- vocabulary

def draft_vocabulary(convs: list[tuple[Tensor, int, Tensor]], vocab_size: int, size: int,
                     always: tuple[int, ...], loss_on_prompt: bool) -> tuple[Tensor | None, float]:
    """Sorted target ids of the draft vocabulary (None = the full vocabulary) and the
    fraction of the head's training targets it covers."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for toks, plen, feats in convs:
        n = feats.shape[0]
        first = 2 if loss_on_prompt else max(2, plen)
        tgt = toks[first : n + 1].long()  # tokens the head predicts (row t -> token t + 2)
        counts += torch.bincount(tgt, minlength=vocab_size).double()
    if size <= 0 or size >= vocab_size:
        return None, 1.0
    score = counts.clone()
    score[list(always)] = float("inf")
    ids = torch.sort(torch.topk(score, size).indices).values
    covered = float(counts[ids].sum() / counts.sum().clamp(min=1))
    return ids, covered


# ---------------------------------------------------------------- head

def feature_rms(convs, hidden: int, sample: int = 64) -> float:
    """Median RMS of the high layer's features (position 0, the attention sink with its
    huge activations, left out)."""
    rms = [c[2][1:, 2 * hidden : 3 * hidden].float().pow(2).mean(-1).sqrt() for c in convs[:sample]]
    return float(torch.cat(rms).median()) if rms else 1.0


def new_head(target: LoadedModel, cfg: TrainConfig, layer_ids: tuple[int, ...], vocab: Tensor | None,
             device: torch.device, feat_rms: float = 1.0) -> EagleHead:
    a = target.arch
    c = HeadConfig(
        kind="eagle3", hidden_size=a.hidden_size, intermediate_size=cfg.head.intermediate_size or a.intermediate_size,
        num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
        vocab_size=a.vocab_size, draft_vocab_size=a.vocab_size if vocab is None else vocab.numel(),
        target_hidden_size=a.hidden_size, aux_layer_ids=layer_ids, rope_config=target.hf_config,
    )
    torch.manual_seed(cfg.seed)
    head = EagleHead(c, target.max_model_len + cfg.optim.ttt_steps + 8)
    head.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
    with torch.no_grad():
        for lin in (head.fc, head.layer.qkv_proj, head.layer.o_proj, head.layer.gate_up_proj, head.layer.down_proj):
            nn.init.normal_(lin.weight, std=0.02)
        if cfg.head.init == "target":
            # Start as "the target's own prediction at this position": fc passes the high
            # layer's stream through, scaled down to unit RMS where it is larger (SmolLM2: 23;
            # the final norm ignores the scale,
            # and the layer's own contributions are not drowned by the raw stream's
            # magnitude), and the final norm and LM head are the target's.
            H = c.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, 2 * H :] = torch.eye(H) / max(feat_rms, 1.0)  # large streams only
            head.lm_head.weight.copy_(target_lm_rows(target, vocab))
            head.norm.weight.copy_(target.model.norm.weight.float())
    head.lm_head.weight.requires_grad_(cfg.head.train_lm_head)
    head = head.to(device)
    if vocab is not None:
        head.draft_to_target = vocab.to(device)
    head.attach_target(target.model)
    return head


def target_lm_rows(target: LoadedModel, vocab: Tensor | None) -> Tensor:
    """(Vd, H) float32: the target's LM head rows of the draft vocabulary."""
    m = target.model
    lm = getattr(m.lm_head, "weight", None)
    w = m.embed_tokens.weight if lm is None else lm
    w = w.detach().float()
    return w if vocab is None else w[vocab.to(w.device)]


# ---------------------------------------------------------------- batches

def batches(convs, batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices of conversations per batch: similar lengths together, padded size
    (count x longest) within batch_tokens; batch order shuffled per epoch."""
    order = sorted(range(len(convs)), key=lambda i: convs[i][2].shape[0])
    out, cur, longest = [], [], 0
    for i in order:
        n = convs[i][2].shape[0]
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    random.Random(seed * 1000 + epoch).shuffle(out)
    return out


def _lr(step: int, total: int, o) -> float:
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    frac = (step - o.warmup_steps) / max(total - o.warmup_steps, 1)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _save_checkpoint(path: Path, head: EagleHead, opt, step: int, history: list) -> None:
    state = {"step": step, "head": {k: v.detach().cpu() for k, v in head.state_dict().items()},
             "optim": opt.state_dict(), "history": history}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------- main

def train(cfg: TrainConfig) -> dict[str, Any]:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    if cfg.engine.num_threads is not None:
        torch.set_num_threads(cfg.engine.num_threads)
    device = resolve_device(cfg.engine.device)
    m = cfg.model
    cache = Path(m.cache_dir) if m.cache_dir else default_cache_dir()
    t_start = time.perf_counter()
    target = load_model(m.path, m.dtype, device, m.max_model_len, m.cache_dir, cpu_kernel=cfg.engine.cpu_kernel)
    L = target.arch.num_layers
    layer_ids = tuple(cfg.head.aux_layer_ids or default_eagle3_layers(L))
    if len(layer_ids) != 3 or any(not 0 <= i < L for i in layer_ids):
        from specserve.errors import ConfigError

        raise ConfigError("head.aux_layer_ids", f"need 3 layer ids in [0, {L}), got {list(layer_ids)}")
    timings: dict[str, float] = {}

    # 1. data
    t0 = time.perf_counter()
    shards = capture(cfg, target, layer_ids, out, cache, progress=cfg.progress)
    timings["capture_s"] = time.perf_counter() - t0
    convs = [c for c in load_shards(shards) if c[2].shape[0] >= 3]
    if not convs:
        raise RuntimeError("no training conversations were captured")

    # 2. vocabulary
    vocab_file = out / "vocab.pt"
    if vocab_file.is_file():
        saved = torch.load(vocab_file, weights_only=True)
        vocab, coverage = saved["ids"], float(saved["coverage"])
        vocab = None if vocab.numel() == 0 else vocab
    else:
        vocab, coverage = draft_vocabulary(convs, target.arch.vocab_size, cfg.head.draft_vocab_size,
                                           target.eos_token_ids, cfg.data.loss_on_prompt)
        torch.save({"ids": vocab if vocab is not None else torch.zeros(0, dtype=torch.int64),
                    "coverage": coverage}, vocab_file)
    log.info("draft vocabulary: %s tokens covering %.2f%% of the head's targets",
             "all" if vocab is None else vocab.numel(), 100 * coverage)

    # 3. training
    head = new_head(target, cfg, layer_ids, vocab, device, feature_rms(convs, target.arch.hidden_size))
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, betas=(0.9, 0.95))
    target_lm = target_lm_rows(target, vocab).to(device)
    o = cfg.optim
    epochs = [batches(convs, o.batch_tokens, cfg.seed, e) for e in range(o.epochs)]
    total = sum(len(e) for e in epochs)
    if o.max_steps is not None:
        total = min(total, o.max_steps)
    ckpt = out / "checkpoint.pt"
    step, history = 0, []
    if cfg.resume and ckpt.is_file():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optim"])
        step, history = int(state["step"]), list(state["history"])
        log.info("resumed from %s at step %d of %d", ckpt, step, total)
    flat = [b for e in epochs for b in e][:total]
    from tqdm import tqdm

    bar = tqdm(total=total, initial=step, desc="train eagle3", unit="step", disable=not cfg.progress,
               dynamic_ncols=True)
    t0 = time.perf_counter()
    seen = 0
    window: list[tuple[float, list[float]]] = []
    while step < total:
        items = [convs[i] for i in flat[step]]
        batch = collate(items, target.arch.hidden_size, device)
        for g in opt.param_groups:
            g["lr"] = _lr(step, total, o)
        loss, losses, agree = ttt_loss(head, batch, target_lm, o.ttt_steps, o.step_weight, cfg.data.loss_on_prompt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        step += 1
        seen += batch.num_positions
        window = (window + [(float(loss.detach()), agree)])[-20:]
        mean_agree = [sum(a[i] for _, a in window) / len(window) for i in range(o.ttt_steps)]
        rate = seen / (time.perf_counter() - t0)
        bar.update(1)
        bar.set_postfix(loss=f"{sum(x for x, _ in window) / len(window):.3f}",
                        top1="/".join(f"{a:.2f}" for a in mean_agree), tok_s=f"{rate:.0f}")
        history.append({"step": step, "loss": float(loss.detach()), "losses": losses, "top1": agree,
                        "lr": opt.param_groups[0]["lr"]})
        if step % cfg.checkpoint_every == 0 or step == total:
            _save_checkpoint(ckpt, head, opt, step, history)
    bar.close()
    timings["train_s"] = time.perf_counter() - t0
    head.eval()

    # 4. export
    dtype = DTYPES[cfg.export_dtype]
    head_dir = save_eagle3(head, target.hf_config, out / "eagle3", dtype,
                           extra={"specserve_training": {"conversations": len(convs), "steps": total,
                                                         "draft_vocab_coverage": coverage}})
    save_speculators(head, target.hf_config, out / "speculators", cfg.speculators_verifier or m.path,
                     cfg.eval.num_speculative_tokens, dtype)
    size = sum(f.stat().st_size for f in head_dir.iterdir())
    report: dict[str, Any] = {
        "model": m.path, "layer_ids": list(layer_ids), "conversations": len(convs),
        "positions": sum(c[2].shape[0] for c in convs), "draft_vocab_size": head.c.draft_vocab_size,
        "draft_vocab_coverage": coverage, "parameters": num_parameters(head), "eagle3_dir_bytes": size,
        "steps": total, "final_top1_per_step": history[-1]["top1"] if history else None,
        "device": str(device), "threads": torch.get_num_threads(),
    }

    # 5. evaluation through the real engine
    if cfg.eval.enabled:
        t0 = time.perf_counter()
        report["eval"] = evaluate(cfg, target, head_dir)
        timings["eval_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    report["timings"] = timings
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def evaluate(cfg: TrainConfig, target: LoadedModel, head_dir: Path) -> dict[str, Any]:
    """Mean acceptance length (and per position) of the exported head on held-out
    ShareGPT benchmark prompts, greedy, through the real engine."""
    import dataclasses

    from specserve.bench import AcceptanceCounter, run_engine
    from specserve.config import Config, SpeculativeConfig, validate_config
    from specserve.data import bench_prompts
    from specserve.engine.engine import LLMEngine

    e = cfg.eval
    spec = SpeculativeConfig(method="eagle3", model=str(head_dir), num_speculative_tokens=e.num_speculative_tokens)
    ecfg = dataclasses.replace(cfg.engine, max_num_seqs=max(cfg.engine.max_num_seqs, e.concurrency))
    run_cfg = validate_config(Config(model=cfg.model, method=spec, engine=ecfg))
    engine = LLMEngine(run_cfg, target=target)
    cache = Path(cfg.model.cache_dir) if cfg.model.cache_dir else default_cache_dir()
    prompts = []
    for t in bench_prompts(e.num_prompts, e.seed, cache):
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": t}])
        if len(ids) <= 512 and len(ids) + e.max_tokens < engine.max_model_len:
            prompts.append(ids)
        if len(prompts) == e.num_prompts:
            break
    counter = AcceptanceCounter(e.num_speculative_tokens)
    engine.listeners.append(counter)
    res = run_engine(engine, prompts, e.max_tokens, e.concurrency)
    summary = counter.summary()
    summary.update({"num_prompts": len(prompts), "max_tokens": e.max_tokens, "k": e.num_speculative_tokens,
                    "tokens_per_second": res.tokens_per_second, "concurrency": e.concurrency})
    log.info("eval: mean acceptance length %.3f (K=%d) on %d held-out prompts", summary["mean_acceptance_length"],
             e.num_speculative_tokens, len(prompts))
    return summary

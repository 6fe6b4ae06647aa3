"""Tiny random HF-format models for unit tests, built from configs and saved
through the same files users load (config.json + safetensors + tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 512


def _tokenizer(out: Path) -> None:
    """A small word-level tokenizer over a fixed vocabulary (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    words = [f"w{i}" for i in range(TINY_VOCAB - len(specials))]
    vocab = {t: i for i, t in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    fast.save_pretrained(out)


def make_tiny_model(out: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of `arch` (llama, mistral, qwen2, qwen3) to `out`."""
    import transformers as tf

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[arch]
    if arch == "mistral":
        common.setdefault("sliding_window", None)
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    config = cls[0](**common)
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    with torch.no_grad():  # widen the logit spread so greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer(out)
    return out

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


SPEECH_AUDIO_TOKEN = TINY_VOCAB - 12  # "w495": the tiny speech models' audio placeholder


def make_tiny_speech_model(out: Path, text: str = "llama", seed: int = 0, output_dim: int = 128,
                           tie: bool = False) -> Path:
    """Save a tiny random Granite Speech model (transformers' GraniteSpeechForConditionalGeneration)
    with a ``text`` (llama or granite, Granite's multipliers away from 1) text model to ``out``;
    the encoder's batch-norm statistics are drawn too, so eval mode is not the identity."""
    import transformers as tf

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    if text == "granite":
        text_cfg = tf.GraniteConfig(embedding_multiplier=2.5, attention_multiplier=0.2, residual_multiplier=0.6,
                                    logits_scaling=3.0, **common)
    else:
        text_cfg = tf.LlamaConfig(**common)
    cfg = tf.GraniteSpeechConfig(
        text_config=text_cfg.to_dict(),
        encoder_config=dict(input_dim=160, num_layers=4, hidden_dim=48, num_heads=4, output_dim=output_dim,
                            context_size=40, max_pos_emb=64, conv_kernel_size=5, dropout=0.0),
        projector_config=dict(model_type="blip_2_qformer", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, encoder_hidden_size=48, cross_attention_frequency=1,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        audio_token_index=SPEECH_AUDIO_TOKEN, window_size=15, downsample_rate=5, has_lora_adapter=False,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = tf.GraniteSpeechForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "language_model" in name:
                p.mul_(3.0)  # widen the logit spread so greedy choices are not near-ties
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.normal_(0, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer(out)
    return out

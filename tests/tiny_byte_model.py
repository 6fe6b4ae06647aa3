"""A tiny random llama with a byte-level BPE tokenizer (256 byte tokens, no merges):
any text, JSON included, is expressible, which structured-output tests need (the
word-level tokenizer of tiny_models.py cannot spell a brace)."""

from __future__ import annotations

from pathlib import Path

from tiny_models import make_tiny_model


def _byte_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out)


def make_byte_model(out: Path, seed: int = 0, **overrides) -> Path:
    """make_tiny_model (vocabulary 512, of which 261 are tokenizer entries) + the byte tokenizer."""
    make_tiny_model(out, "llama", seed=seed, **overrides)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (out / f).unlink(missing_ok=True)
    _byte_tokenizer(out)
    return out

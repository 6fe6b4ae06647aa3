"""Property test: streamed text equals one decode of all ids, for any split of the stream.

Speculation delivers several tokens per step, so a multi-byte character can be split
across step boundaries in any way.  For random token sequences (text of emoji, ZWJ
sequences, flags, CJK, combining marks, real U+FFFD characters, byte-fallback tokens,
special tokens, arbitrary ids, and characters left unfinished: the first bytes of a
multi-byte character as byte tokens) cut into random chunks, the concatenated deltas
must equal one decode of all ids with the same special-token handling, streamed and
not, with and without stop strings.  Two real tokenizer families: the embedded SmolLM2's
byte-level BPE and a SentencePiece-style tokenizer with byte fallback (Llama 2's
decoder), built here (for it, arbitrary ids exclude lone byte tokens: see the fixture).

The seed differs per run (printed on failure; set DETOK_SEED to replay one).
"""

from __future__ import annotations

import os
import random

import pytest

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.tokenizer import Tokenizer

CASES_PER_TOKENIZER = 1200  # two tokenizers: 2,400 cases per run
SEED = int(os.environ.get("DETOK_SEED", random.SystemRandom().randrange(1 << 30)))

PIECES = [
    "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "🏳️‍🌈", "中文", "漢字", "日本語", "한국어", "é", "e\u0301", "n\u0303",
    "a\u0308\u0304", "ß", "Ω", "∑", "€", "𝔘𝔫𝔦", " ", "  ", "\n", "\t", "hello", " world", ",", ".", "!", "'s",
    "123", "<", "{", "\\", "\"", "ü", "ø", "ł", "🤖🤖", "‼️", "\u200b", "ﬁ",
    "\ufffd", "\ufffd\ufffd\ufffd", "a\ufffd",  # a real U+FFFD is text like any other
]
MULTI_BYTE = ["é", "€", "中", "😀", "𝔘", "\ufffd"]  # characters of 2, 3 and 4 bytes


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))


def chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 6)
        out.append(ids[i : i + n])
        i += n
    return out


def unfinished_char(tok: "PlainTokenizer", rng: random.Random) -> list[int]:
    """Byte tokens of the first bytes (not all) of a multi-byte character."""
    data = rng.choice(MULTI_BYTE).encode()
    return [tok.byte_ids[b] for b in data[: rng.randint(1, len(data) - 1)]]


def random_ids(tok: "PlainTokenizer", rng: random.Random) -> list[int]:
    kind = rng.random()
    if kind < 0.45:
        return tok.encode_plain(random_text(rng))
    if kind < 0.55:  # text ending in an unfinished character (then flushed by the final append)
        ids = tok.encode_plain(random_text(rng))
        if tok.spliceable is None:  # byte-level: unfinished characters may sit anywhere
            ids.insert(rng.randint(0, len(ids)), unfinished_char(tok, rng)[0])
        else:  # byte fallback: after a word token, so the bytes are a run of their own (see the fixture)
            ids.append(tok.word_id)
        return ids + unfinished_char(tok, rng)
    if kind < 0.8:  # arbitrary ids: lone byte tokens, broken sequences, special tokens
        return [tok.random_id(rng) for _ in range(rng.randint(1, 16))]
    if tok.spliceable is None:  # text with arbitrary ids spliced in anywhere
        ids = tok.encode_plain(random_text(rng))
        for _ in range(rng.randint(1, 3)):
            ids.insert(rng.randint(0, len(ids)), tok.random_id(rng))
        return ids
    ids = []  # byte fallback: splice between characters only (see the fixture)
    for _ in range(rng.randint(1, 8)):
        ids += tok.encode_plain(rng.choice(PIECES))
        if rng.random() < 0.3:
            ids.append(tok.random_id(rng))
    return ids


class PlainTokenizer(Tokenizer):
    """The engine's Tokenizer plus what the test needs: encode without BOS, vocab size."""

    def encode_plain(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def __init__(self, hf, eos, byte_ids: dict[int, int], spliceable: list[int] | None = None):
        super().__init__(hf, eos)
        self.byte_ids = byte_ids  # byte value -> the token that is that one byte
        self.spliceable = spliceable  # None: any id
        self.word_id = hf.convert_tokens_to_ids("▁hello") if spliceable is not None else None

    def random_id(self, rng: random.Random) -> int:
        return rng.choice(self.spliceable) if self.spliceable is not None else rng.randrange(len(self.hf))


@pytest.fixture(scope="module")
def smollm2() -> PlainTokenizer:
    from transformers import AutoTokenizer

    from specserve.executor.loader import resolve_hf_dir

    hf = AutoTokenizer.from_pretrained(str(resolve_hf_dir("embedded:smollm2-135m-instruct", None)))
    ids = {b: hf.convert_tokens_to_ids(c) for b, c in gpt2_byte_chars().items()}
    # (bytes that never occur in UTF-8 text, such as C0 or F5..FF, have no token here)
    byte_ids = {b: i for b, i in ids.items() if hf.convert_ids_to_tokens(i) == gpt2_byte_chars()[b]}
    assert all(b in byte_ids for c in MULTI_BYTE for b in c.encode())
    return PlainTokenizer(hf, (hf.eos_token_id,), byte_ids)


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: the vocabulary character of each byte in byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


@pytest.fixture(scope="module")
def byte_fallback() -> PlainTokenizer:
    """A Unigram tokenizer with byte fallback and Llama 2's decoder (no downloads)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "▁hello", "▁world", "hello", "中", "文", "中文", "é", "😀", "▁the", ",", ".", "'s", "日本", "語"]
    vocab = [(p, 0.0) for p in pieces] + [(w, -float(i + 1)) for i, w in enumerate(words)]
    raw = RawTokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    # Byte fallback's decoder is not prefix-stable on INVALID byte runs: a stray continuation
    # byte turns every byte of the run it joins (earlier ones too) into U+FFFD, so no streaming
    # detokenizer can match a one-shot decode there.  Arbitrary ids are drawn from the
    # special and word pieces; byte tokens come from encoding text (all split points of
    # valid multi-byte characters).
    spliceable = [i for i, p in enumerate(pieces + words) if not p.startswith("<0x")]
    return PlainTokenizer(hf, (2,), {b: 3 + b for b in range(256)}, spliceable)


def first_completed_stop(text: str, stop: list[str]) -> int:
    """Brute force: scan end positions; the first end at which some stop string is
    complete cuts before the longest one completed there.  -1 if none."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop if text[:end].endswith(s)]
        if done:
            return end - max(len(s) for s in done)
    return -1


def stream(tok, prompt: list[int], ids: list[int], stop: list[str], rng: random.Random) -> tuple[str, bool]:
    d = IncrementalDetokenizer(tok, prompt, stop)
    text, stopped = "", False
    for part in chunks(ids, rng):
        delta, stopped = d.append(part)
        text += delta
        if stopped:
            break
    if not stopped:  # the final flush may complete a stop string too (one ending in U+FFFD)
        delta, stopped = d.append([], final=True)
        text += delta
    assert text == d.text  # what was streamed is exactly the request's final text
    return text, stopped


def check_cases(tok: PlainTokenizer, salt: int) -> None:
    rng = random.Random(SEED + salt)
    for case in range(CASES_PER_TOKENIZER):
        ids = random_ids(tok, rng)
        prompt = tok.encode_plain(random_text(rng)) if rng.random() < 0.5 else []
        tail = prompt[-5:]
        context = tok.decode(tail)
        full = tok.decode(tail + ids)
        assert full.startswith(context)
        want = full[len(context) :]
        if not prompt:
            assert want == tok.decode(ids)  # one decode of all ids
        stop: list[str] = []
        if want and rng.random() < 0.35:
            a = rng.randrange(len(want))
            stop = [want[a : a + rng.randint(1, 4)]]
            if rng.random() < 0.5:
                stop.append(random_text(rng))
        where = f"seed={SEED + salt} case={case} prompt={prompt} ids={ids} stop={stop!r}"
        text, stopped = stream(tok, prompt, ids, stop, rng)
        cut = first_completed_stop(want, stop)
        if cut == -1:
            assert not stopped and text == want, where
        else:
            assert stopped and text == want[:cut], where
        # Not streamed: everything in one append, then the final flush.
        d = IncrementalDetokenizer(tok, prompt, stop)
        whole, stopped = d.append(ids)
        if not stopped:
            whole += d.append([], final=True)[0]
        assert whole == (want if cut == -1 else want[:cut]), where


def test_byte_level_bpe_any_split(smollm2):
    check_cases(smollm2, 0)


def test_byte_fallback_any_split(byte_fallback):
    check_cases(byte_fallback, 1)


def test_speculative_emoji_run_is_flushed(smollm2):
    """The probe's case: emoji tokens arriving several per step, each step ending inside a
    character; nothing may be lost at the end."""
    ids = smollm2.encode_plain("🎉🎉🎉🔥🔥✨✨✨🚀")
    d = IncrementalDetokenizer(smollm2, [], [])
    text = "".join(d.append(ids[i : i + 3])[0] for i in range(0, len(ids), 3))
    text += d.append([], final=True)[0]
    assert text == "🎉🎉🎉🔥🔥✨✨✨🚀"

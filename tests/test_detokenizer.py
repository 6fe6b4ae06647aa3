from __future__ import annotations

import pytest

from specserve.engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from specserve.engine.tokenizer import Tokenizer


class CharTok:
    """Each id is one character; id 0 is a partial multi-byte char until followed by 1."""

    def decode(self, ids, skip_special_tokens=True):
        out, i = [], 0
        while i < len(ids):
            if ids[i] == 0:
                if i + 1 < len(ids) and ids[i + 1] == 1:
                    out.append("é")
                    i += 2
                    continue
                out.append("\ufffd")
            else:
                out.append(chr(ord("a") + ids[i] - 2))
            i += 1
        return "".join(out)


def ids(s):
    return [ord(c) - ord("a") + 2 for c in s]


def test_incremental_text_equals_full_decode():
    d = IncrementalDetokenizer(CharTok(), ids("xy"), stop=[])
    pieces = [d.append([t])[0] for t in ids("hello")]
    assert "".join(pieces) == "hello" and d.text == "hello"


def test_incomplete_character_is_held_until_complete():
    d = IncrementalDetokenizer(CharTok(), [], stop=[])
    assert d.append([0]) == ("", False)
    assert d.append([1]) == ("é", False)


def test_stop_string_is_never_partially_emitted():
    d = IncrementalDetokenizer(CharTok(), [], stop=["cde"])
    emitted = ""
    for t in ids("abcd"):
        delta, stopped = d.append([t])
        emitted += delta
        assert not stopped
    assert "c" not in emitted  # "cd" could be the start of the stop string: held back
    delta, stopped = d.append(ids("e"))
    assert stopped and emitted + delta == "ab" and d.text == "ab"


def test_final_flush_releases_held_text():
    d = IncrementalDetokenizer(CharTok(), [], stop=["zzz"])
    text = "".join(d.append([t])[0] for t in ids("abcd"))
    text += d.append([], final=True)[0]
    assert text == "abcd"


# --------------------------------------------------------------------------- U+FFFD and bounded work

FFFD_ID = 24211  # SmolLM2: the token "ï¿½", the complete bytes EF BF BD of a real U+FFFD
EURO_BYTES = [173, 220, 122]  # SmolLM2's single-byte tokens for E2, 82 and AC ("€")


class CountingTokenizer(Tokenizer):
    """The engine's Tokenizer, counting decode calls and the ids they decode."""

    def __init__(self, hf):
        super().__init__(hf, (hf.eos_token_id,))
        self.calls = 0
        self.ids = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.ids += len(ids)
        return super().decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def smollm2_hf():
    from transformers import AutoTokenizer

    from specserve.executor.loader import resolve_hf_dir

    return AutoTokenizer.from_pretrained(str(resolve_hf_dir("embedded:smollm2-135m-instruct", None)))


def per_step_work(tok: CountingTokenizer, prompt: list[int], steps: list[list[int]]):
    """Stream ``steps``; returns (text, [(decode calls, decoded ids, delta) per step])."""
    d = IncrementalDetokenizer(tok, prompt, [])
    work = []
    for part in steps:
        calls, ids_before = tok.calls, tok.ids
        delta, _ = d.append(part)
        work.append((tok.calls - calls, tok.ids - ids_before, delta))
    text = "".join(w[2] for w in work) + d.append([], final=True)[0]
    return text, work


@pytest.mark.parametrize("per_step", [1, 3])
def test_fffd_run_costs_bounded_work_per_step(smollm2_hf, per_step):
    """A run of real U+FFFD tokens is emitted as it arrives, with a few decodes of a few
    ids per step however long the run is (it was re-decoded in full on every step)."""
    tok = CountingTokenizer(smollm2_hf)
    n = 600
    prompt = tok.encode("Say something:")
    text, work = per_step_work(tok, prompt, [[FFFD_ID] * per_step for _ in range(n // per_step)])
    assert max(w[0] for w in work) <= 3
    assert max(w[1] for w in work) <= 2 * per_step + 2 * CONTEXT_TOKENS
    assert text == tok.decode([FFFD_ID] * n) == "\ufffd" * n
    assert [w[2] for w in work] == ["\ufffd" * per_step] * len(work)  # nothing held back


def test_special_token_run_costs_bounded_work_per_step(smollm2_hf):
    """A long run of skipped special tokens does not grow the decoded window either."""
    tok = CountingTokenizer(smollm2_hf)
    hi, there = tok.encode(" hi", add_special_tokens=False), tok.encode(" there", add_special_tokens=False)
    steps = [hi] + [[1]] * 300 + [there]  # 1: <|im_start|>, skipped by the decode
    text, work = per_step_work(tok, [], steps)
    assert text == tok.decode(sum(steps, [])) == " hi there"
    assert max(w[1] for w in work) <= 2 * CONTEXT_TOKENS + 4


def test_unfinished_bytes_wait_but_a_real_fffd_does_not(smollm2_hf):
    tok = Tokenizer(smollm2_hf, (smollm2_hf.eos_token_id,))
    d = IncrementalDetokenizer(tok, [], [])
    assert [d.append([t])[0] for t in EURO_BYTES] == ["", "", "€"]
    assert d.append([FFFD_ID]) == ("\ufffd", False)
    assert d.append(EURO_BYTES[:2] + [FFFD_ID]) == ("\ufffd\ufffd", False)  # E2 82 then a real U+FFFD: both final
    assert d.append(EURO_BYTES[:1]) == ("", False)
    assert d.append([], final=True) == ("\ufffd", False)  # the flush shows the unfinished byte
    assert d.text == tok.decode(EURO_BYTES + [FFFD_ID] + EURO_BYTES[:2] + [FFFD_ID] + EURO_BYTES[:1])


class FffdCharTok(CharTok):
    """No token bytes to read: id 99 is a real U+FFFD; counts decoded ids."""

    def __init__(self):
        self.ids = 0

    def decode(self, ids, skip_special_tokens=True):
        self.ids += len(ids)
        parts, run = [], []
        for i in [*ids, 99]:
            if i == 99:
                parts.append(super().decode(run))
                run = []
            else:
                run.append(i)
        return "\ufffd".join(parts)


def test_without_token_bytes_a_fffd_run_is_held_a_few_tokens_at_most():
    tok = FffdCharTok()
    d = IncrementalDetokenizer(tok, [], [])  # no token bytes: the decoded text decides
    out = []
    for _ in range(400):
        before = tok.ids
        out.append(d.append([99])[0])
        assert tok.ids - before <= 20  # independent of the run's length
    assert out[:3] == ["", "", ""] and out[3:] == ["\ufffd"] * 397  # at most 3 tokens held
    assert d.append([0])[0] == "\ufffd"  # the oldest held U+FFFD goes: it cannot be unfinished
    assert d.append([1])[0] == "\ufffd\ufffdé"
    assert d.text == "\ufffd" * 400 + "é"


class PieceVocab:
    """A byte-level vocabulary of a few pieces (GPT-2 spelling: â Ĥ ¬ are E2 82 AC)."""

    def __init__(self, pieces: dict[int, str]):
        self.pieces = pieces

    def convert_ids_to_tokens(self, token_id):
        return self.pieces[token_id]


def test_unfinished_tail_is_read_from_token_bytes():
    from specserve.engine.detokenizer import TokenBytes, incomplete_tail

    tails = (b"", b"a", b"\xe2", b"a\xe2\x82", b"\xe2\x82\xac", b"\xef\xbf\xbd")
    assert [incomplete_tail(b) for b in tails] == [0, 0, 1, 2, 0, 0]
    assert incomplete_tail(b"\xf0\x9f\x98") == 3 and incomplete_tail(b"\x82") == 0  # a stray continuation is final
    tb = TokenBytes(PieceVocab({0: "âĤ", 1: "¬", 2: "ï¿½", 3: "<|x|>"}), True, False, frozenset({3}))
    assert (tb(0), tb(1), tb(2), tb(3)) == (b"\xe2\x82", b"\xac", b"\xef\xbf\xbd", b"")
    assert tb.complete_end([2, 2, 0], 0) == 2 and tb.complete_end([2, 0, 3, 1], 1) == 4
    assert tb.complete_end([2, 0, 3], 1) == 1  # the special token after the unfinished one waits with it


def test_tokens_straddling_characters_are_held_a_bounded_number_of_tokens():
    """A token that ends one character and starts the next (AC E2 82) never leaves a
    clean cut; the hold, and with it the work per step, is still bounded."""
    from specserve.engine.detokenizer import MAX_HELD_TOKENS, TokenBytes

    tb = TokenBytes(PieceVocab({0: "âĤ", 1: "¬âĤ", 2: "¬"}), True, False, frozenset())
    assert tb.complete_end([0, 1, 2], 0) == 3
    assert tb.complete_end([0, 1], 0) == 0
    assert tb.complete_end([0] + [1] * 40, 0) == 41 - MAX_HELD_TOKENS

"""The vocabulary spelling of CTC text (``method.ctc_spelling``): which tokens make the
lexicon, what each rewrite does (nearest word, ties by frequency, splits, joins), what it
leaves alone (lexicon words, case and punctuation), with the real SmolLM2 vocabulary, and
how the ctc proposer chooses it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.audio.spelling import VocabularySpeller, vocabulary_lexicon
from specserve.config import Config, ModelConfig, validate_config
from specserve.errors import ConfigError
from specserve.methods import method_options
from specserve.proposers.ctc import CtcProposer

WORDS = ["the", "a", "i", "coat", "come", "warm", "left", "open", "dinner", "after", "river", "clear", "tomatoes",
         "garden", "gate", "was", "all", "night", "lamp", "on", "table", "we", "planted",
         "less", "it", "yes", "im", "its"]


class _Tok:
    """A tokenizer stand-in: ``Ġ``-marked word tokens numbered in list order, and some
    tokens the lexicon must skip."""

    def __init__(self, words=WORDS, marker="Ġ"):
        self.vocab = {f"{marker}{w}": i + 10 for i, w in enumerate(words)}
        self.vocab.update({"coat": 900, "ĠHello": 901, "Ġx": 902, "Ġ42": 903, "<|im_end|>": 2, "Ġdon't": 904,
                           "Ġ''": 905})

    def get_vocab(self):
        return dict(self.vocab)


@pytest.fixture(scope="module")
def speller():
    return VocabularySpeller(vocabulary_lexicon(_Tok()))


def test_the_lexicon_is_the_word_initial_lowercase_tokens():
    lex = vocabulary_lexicon(_Tok())
    assert lex["coat"] == 13 and lex["the"] == 10  # the marked token's id, not the bare "coat" (900)
    assert "hello" not in lex and "Hello" not in lex and "x" not in lex and "42" not in lex
    assert lex["don't"] == 904 and lex["a"] == 11 and lex["i"] == 12
    assert "''" not in lex  # apostrophes alone are not a word
    assert vocabulary_lexicon(_Tok(marker="▁")) == lex  # sentencepiece's marker too
    with pytest.raises(ValueError, match="lexicon is empty"):
        VocabularySpeller({})


@pytest.mark.parametrize("text, want", [
    ("the garden gate was left open all night", "the garden gate was left open all night"),  # lexicon words stay
    ("the garden gate was leftopen all night", "the garden gate was left open all night"),  # a split
    ("after d inner", "after dinner"),  # a join (a single letter and its neighbour)
    ("the rivr was cleare", "the river was clear"),  # nearest words
    ("we planted tomatos", "we planted tomatoes"),
    ("a warm cote", "a warm come"),  # the nearest word
    ("yess it was", "yes it was"),  # a tie at distance 1 ("less" is more frequent): the same first letter wins
    ("zess it was", "less it was"),  # no candidate shares the first letter: the more frequent word
    ("i'm warm it's open", "i'm warm it's open"),  # contractions of lexicon words stay, not "im", "its"
    ("the gate wasn't open", "the gate wasn't open"),  # "wasn" is no lexicon word here, and nothing is near
    ("the zzzzqqqq gate", "the zzzzqqqq gate"),  # nothing near: kept
    ("Hello, the rivr gate!", "Hello, the river gate!"),  # words with case or punctuation are left as they are
    ("", ""),
])
def test_rewrites(speller, text, want):
    assert speller.correct(text) == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(WORDS), st.text("abcdefghilmnoprstuvw'", min_size=1, max_size=12)),
                min_size=1, max_size=12))
def test_every_word_out_is_a_lexicon_word_or_one_it_was_given(words):
    sp = VocabularySpeller(vocabulary_lexicon(_Tok()))
    out = sp.correct(" ".join(words)).split()
    assert out and all(w in sp.rank or w in words for w in out)
    known = [w for w in words if w in sp.rank]
    assert sp.correct(" ".join(known)) == " ".join(known)  # lexicon words only: unchanged


def test_with_smollm2s_vocabulary():
    from transformers import AutoTokenizer

    from specserve.executor.loader import resolve_hf_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_hf_dir("embedded:smollm2-135m-instruct", None)))
    sp = VocabularySpeller.from_tokenizer(tok)
    assert len(sp.rank) > 10_000
    assert sp.correct("the garden gate was leftopen all night") == "the garden gate was left open all night"
    assert sp.correct("the river was cold and very cleare") == "the river was cold and very clear"
    assert sp.correct("the bus was crouded on the way home") == "the bus was crowded on the way home"


def test_the_proposer_spells_where_the_option_says(speller):
    tok = _Tok()
    auto = method_options("ctc", num_speculative_tokens=4)
    assert auto.ctc_spelling == "auto"
    assert CtcProposer(auto, tok, normalized=True).speller is not None  # normalised transcripts: vocabulary
    assert CtcProposer(auto, tok, normalized=False).speller is None  # raw ones: none
    off = method_options("ctc", num_speculative_tokens=4, ctc_spelling="none")
    assert CtcProposer(off, tok, normalized=True).speller is None
    on = method_options("ctc", num_speculative_tokens=4, ctc_spelling="vocabulary")
    assert CtcProposer(on, tok, normalized=False).speller is not None
    # a tokenizer without word tokens: auto falls back to none, vocabulary is refused by name
    bare = _Tok(words=[], marker="#")
    bare.vocab = {"w1": 5, "w2": 6}
    assert CtcProposer(auto, bare, normalized=True).speller is None
    with pytest.raises(ConfigError, match="method.ctc_spelling"):
        CtcProposer(on, bare, normalized=True)
    with pytest.raises(ConfigError, match="method.ctc_spelling"):
        validate_config(Config(model=ModelConfig(path="x"),
                               method=method_options("ctc", num_speculative_tokens=4, ctc_spelling="lexicon")))


def test_one_transcript_searches_at_most_its_budget():
    sp = VocabularySpeller(vocabulary_lexicon(_Tok()), max_searches=2)
    calls = []
    real = sp._search.__func__

    def counting(self, word, limit):
        before = self._searches
        out = real(self, word, limit)
        calls.append(self._searches - before)
        return out

    sp._search = counting.__get__(sp)
    out = sp.correct("rivr cleare tomatos warmm")
    assert sum(calls) == 2  # "rivr", then "rivrcleare" (a join): the budget is spent
    assert out == "river cleare tomatos warmm"
    assert sp.correct("tomatos") == "tomatoes"  # a new call, a new budget
    assert list(sp._cache) == [("tomatos", 2)]  # and its own cache: nothing kept from the call before
    assert sp.correct("x" * 40) == "x" * 40  # too long to search

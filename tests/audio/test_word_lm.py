"""The word bigram model the ctc drafter spells with in context (``audio.word_lm``): its
probabilities, its file (round trip and every malformed shape refused by what is wrong),
the speller weighing words in context with it, and how the proposer and the loader pick
it up."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.audio.spelling import VocabularySpeller, vocabulary_lexicon
from specserve.audio.word_lm import BOS, EOS, WordBigramLM
from specserve.errors import ConfigError
from specserve.methods import method_options
from specserve.proposers.ctc import CtcProposer
from tests.audio.test_spelling import _Tok

CORPUS = ["you can buy food at the market", "they buy bread and food", "we buy food here",
          "the bus went by the market", "a cup of tea", "she sat by the river", "the farmer's market is open"]


def test_probabilities_follow_the_counts_and_sum_to_one():
    lm = WordBigramLM.from_sentences(CORPUS, vocab_size=50)
    assert lm.unigrams["buy"] == 3 and lm.bigrams[("buy", "food")] == 2 and lm.bigrams[(BOS, "you")] == 1
    assert lm.log_prob("can", "buy") > lm.log_prob("can", "by")  # seen beats unseen
    assert lm.log_prob("buy", "food") > lm.log_prob("by", "food")
    assert lm.log_prob("never-seen", "food") == lm.unigram_log_prob("food")  # an unknown history backs off
    # over every word, seen or not, a history's probabilities sum to one (the unseen words
    # share the unigram floor of the nominal vocabulary)
    seen = list(lm.unigrams)
    unseen = lm.vocab_size - len(seen)
    for prev in ["buy", "the", BOS, "market"]:
        floor = math.exp(lm.log_prob(prev, "zzz-unseen"))
        total = sum(math.exp(lm.log_prob(prev, w)) for w in seen) + unseen * floor
        assert total == pytest.approx(1.0, rel=1e-9)


def test_the_file_round_trips(tmp_path):
    lm = WordBigramLM.from_sentences(CORPUS, discount=0.5)
    lm.save(tmp_path / "lm.json.gz")
    back = WordBigramLM.load(tmp_path / "lm.json.gz")
    assert back.unigrams == lm.unigrams and back.bigrams == lm.bigrams and back.discount == 0.5
    assert back.log_prob("buy", "food") == lm.log_prob("buy", "food")


def _write(path, doc, raw=None):
    with gzip.open(path, "wb") as f:
        f.write(raw if raw is not None else json.dumps(doc).encode())
    return path


GOOD = {"format": "specserve-word-bigrams", "version": 1, "unigrams": {"a": 2, "b": 1}, "bigrams": [["a", "b", 1]]}


@pytest.mark.parametrize("change, match", [
    ({"format": "other"}, "format is not"),
    ({"version": 2}, "version 2 is not 1"),
    ({"unigrams": {"a": 0}}, "unigrams must map words to positive integer counts"),
    ({"unigrams": {"a": True}}, "unigrams must map"),
    ({"unigrams": ["a"]}, "unigrams must map"),
    ({"bigrams": [["a", "b"]]}, r"bigrams must be \[previous word, word, positive count\] rows"),
    ({"bigrams": [["a", 3, 1]]}, "bigrams must be"),
    ({"bigrams": {"a": 1}}, "bigrams must be"),
    ({"discount": 1.5}, "discount must be in"),
])
def test_a_malformed_file_is_refused_saying_what_is_wrong(tmp_path, change, match):
    WordBigramLM.load(_write(tmp_path / "ok.gz", GOOD))
    with pytest.raises(ValueError, match=match):
        WordBigramLM.load(_write(tmp_path / "bad.gz", {**GOOD, **change}))


def test_a_file_that_is_not_gzip_json_is_refused(tmp_path):
    (tmp_path / "plain.json").write_text(json.dumps(GOOD))
    with pytest.raises(ValueError, match="not a gzip-compressed JSON"):
        WordBigramLM.load(tmp_path / "plain.json")
    with pytest.raises(ValueError, match="not a gzip-compressed JSON"):
        WordBigramLM.load(_write(tmp_path / "trunc.gz", None, raw=b'{"format": '))


WORDS = ["the", "a", "you", "can", "buy", "by", "food", "at", "market", "bus", "went", "river", "she", "sat",
         "cup", "of", "tea", "farmer", "farmers", "is", "open", "they", "bread", "and", "we", "here", "main",
         "street", "stream", "to", "te"]


@pytest.fixture(scope="module")
def lm():
    return WordBigramLM.from_sentences(CORPUS + ["the shop on main street", "we live on main street"])


def test_the_speller_weighs_words_in_context(lm):
    lex = vocabulary_lexicon(_Tok(words=WORDS))
    plain = VocabularySpeller(lex)
    ctx = VocabularySpeller(lex, lm=lm, lm_weight=0.6)
    assert plain.correct("you can by food at the market") == "you can by food at the market"  # both lexicon words
    assert ctx.correct("you can by food at the market") == "you can buy food at the market"
    assert ctx.correct("the bus went by the market") == "the bus went by the market"  # "by" where it belongs
    assert ctx.correct("the farmers market is open") == "the farmer's market is open"  # a possessive
    assert ctx.correct("we live on main streat") == "we live on main street"
    assert ctx.correct("") == ""
    assert ctx.correct("Hello, the market!") == "Hello, the market!"  # case and punctuation kept


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(WORDS), st.text("abcdefhilmnoprstuy'", min_size=1, max_size=10)),
                min_size=1, max_size=10))
def test_in_context_every_word_out_is_a_lexicon_word_its_possessive_or_one_it_was_given(lm, words):
    sp = VocabularySpeller(vocabulary_lexicon(_Tok(words=WORDS)), lm=lm)
    out = sp.correct(" ".join(words)).split()
    assert out
    for w in out:
        assert w in sp.rank or w in words or (w.endswith("'s") and w[:-2] in sp.rank)
    assert sp._searches <= sp.max_searches


def test_the_proposer_spells_in_context_where_the_model_has_a_word_model(lm):
    tok = _Tok(words=WORDS)
    auto = method_options("ctc", num_speculative_tokens=4)
    assert CtcProposer(auto, tok, normalized=True, word_lm=lm).speller.lm is lm  # auto: context
    assert CtcProposer(auto, tok, normalized=True).speller.lm is None  # no word model: vocabulary
    assert CtcProposer(auto, tok, normalized=False, word_lm=lm).speller is None  # raw transcripts: none
    vocab = method_options("ctc", num_speculative_tokens=4, ctc_spelling="vocabulary")
    assert CtcProposer(vocab, tok, normalized=True, word_lm=lm).speller.lm is None
    ctx = method_options("ctc", num_speculative_tokens=4, ctc_spelling="context")
    assert CtcProposer(ctx, tok, normalized=False, word_lm=lm).speller.lm is lm
    with pytest.raises(ConfigError, match="method.ctc_spelling.*has none"):
        CtcProposer(ctx, tok, normalized=True)


@pytest.mark.parametrize("name, match", [
    ("missing.json.gz", "missing.json.gz is not in"),
    ("../elsewhere.json.gz", "must name a file in the model directory"),
    (7, "must name a file in the model directory"),
    ("bad.json.gz", "format is not"),
])
def test_the_loader_refuses_a_bad_word_model_naming_the_key(tmp_path, name, match):
    from specserve.errors import ModelLoadError
    from specserve.executor.loader import load_model
    from tests.tiny_models import make_tiny_speech_model

    d = make_tiny_speech_model(tmp_path / "m")
    _write(d / "bad.json.gz", {**GOOD, "format": "x"})
    cfg = json.loads((d / "config.json").read_text())
    cfg.setdefault("specserve", {})["spelling_lm"] = name
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"specserve\.spelling_lm.*" + match):
        load_model(str(d), "float32", torch.device("cpu"))


def test_the_loader_reads_a_model_s_word_model(tmp_path, lm):
    from specserve.executor.loader import load_model
    from tests.tiny_models import make_tiny_speech_model

    d = make_tiny_speech_model(tmp_path / "m")
    lm.save(d / "spelling_lm.json.gz")
    cfg = json.loads((d / "config.json").read_text())
    cfg.setdefault("specserve", {})["spelling_lm"] = "spelling_lm.json.gz"
    (d / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(d), "float32", torch.device("cpu"))
    assert loaded.speech.word_lm.bigrams == lm.bigrams


def test_the_script_counts_training_sentences_only(tmp_path):
    """scripts/speech_spelling_lm.py: the generated sentences' counts, less the held-out
    ones (and any sentence holding one) and the validation texts; config.json names the file."""
    import importlib.util

    import numpy as np

    script = importlib.util.spec_from_file_location(
        "speech_spelling_lm", __import__("pathlib").Path(__file__).resolve().parents[2] / "scripts" / "speech_spelling_lm.py")
    mod = importlib.util.module_from_spec(script)
    script.loader.exec_module(mod)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "granite_speech", "specserve": {"x": 1}}))
    held = tmp_path / "held.txt"
    held.write_text("the garden gate was left open\n")
    gen = tmp_path / "generated.jsonl"
    gen.write_text(json.dumps(["1. We buy fresh food here.\n2. The garden gate was left open all day.",
                               "1. They buy bread at the market.\n2. A quiet valid sentence here."]) + "\n")
    valid = tmp_path / "data.npz"
    np.savez(valid, samples=np.zeros(4, np.int16), offsets=np.arange(3), num_train=1,
             texts=np.asarray(["we buy fresh food here", "a quiet valid sentence here"]))
    mod.main(["--model", str(model), "--generated", str(gen), "--valid-data", str(valid), "--exclude-file", str(held)])
    cfg = json.loads((model / "config.json").read_text())["specserve"]
    assert cfg["x"] == 1 and cfg["spelling_lm"] == "spelling_lm.json.gz"
    assert cfg["spelling_lm_source"]["generated_sentences"] == 2  # of 4: one held out, one validation
    lm = WordBigramLM.load(model / "spelling_lm.json.gz")
    assert lm.bigrams[("they", "buy")] == 1 and lm.bigrams[("buy", "fresh")] == 1
    assert "garden" not in lm.unigrams and "quiet" not in lm.unigrams
    with pytest.raises(SystemExit):
        mod.main(["--model", str(tmp_path / "nowhere")])


def test_sound_distance_prices_spelling_by_sound():
    from specserve.audio.spelling import sound_distance

    assert sound_distance("window", "window") == 0.0
    assert sound_distance("windo", "window") == 0.5  # a quiet w
    assert sound_distance("newn", "noon") == pytest.approx(1.3)  # vowels, a quiet letter and a doubled one
    assert sound_distance("cat", "kat") == 0.6  # similar consonants
    assert sound_distance("cat", "bat") == 1.0
    assert sound_distance("tomatos", "tomatoes") == 0.5
    assert sound_distance("abcdef", "uvwxyz", cutoff=2.0) == float("inf")  # stops past the cutoff
    assert sound_distance("", "ab") == 2.0


@settings(max_examples=300, deadline=None)
@given(st.text("abcehkostuwz'", max_size=8), st.text("abcehkostuwz'", max_size=8))
def test_sound_distance_is_a_cheaper_symmetric_levenshtein(a, b):
    from rapidfuzz.distance import Levenshtein

    from specserve.audio.spelling import sound_distance

    d, lev = sound_distance(a, b), Levenshtein.distance(a, b)
    assert d == pytest.approx(sound_distance(b, a))
    assert 0.3 * lev - 1e-9 <= d <= lev + 1e-9  # every edit costs 0.3 to 1
    assert (d == 0) == (a == b)
    assert sound_distance(a, b, cutoff=d) == pytest.approx(d)  # a cutoff at the distance keeps it


def test_in_context_the_rescoring_has_a_per_call_budget(lm):
    lex = vocabulary_lexicon(_Tok(words=WORDS))
    sp = VocabularySpeller(lex, lm=lm, max_rescored=3)
    sp.correct("you can by fod at the markt on main streat")
    assert sp._rescored == 3  # the rest scored by Levenshtein's distance
    sp.correct("the")
    assert sp._rescored <= 3  # a new call, a new budget

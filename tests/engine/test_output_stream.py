"""Property test: what a stream sends is what the whole output is, however the engine's
steps split it (one token at a time, the whole output at once, or random runs of 1..K+1
tokens as speculation delivers them), with stop strings that span those runs.

For random outputs (``test_detokenizer_property``'s texts: emoji, CJK, combining marks,
U+FFFD, unfinished characters) and stop strings cut out of the output itself, the
``OutputProcessor``'s deltas must add up to its final output: text, token ids and
log-probabilities alike; the final output must not depend on the chunking; a token is
never sent before its text; and when a stop string cuts the text, the token ids are those
that spell the kept text.  Three tokenizer families: the embedded SmolLM2's byte-level BPE
(counted from token bytes), a SentencePiece-style one with byte fallback and a word-level
one whose decoder puts spaces between tokens (both counted by decoding).

The seed differs per run (printed on failure; set DETOK_SEED to replay one).
"""

from __future__ import annotations

import random

import pytest
from test_detokenizer_property import (  # noqa: F401  (fixtures)
    SEED,
    PlainTokenizer,
    byte_fallback,
    random_ids,
    random_text,
    smollm2,
)

from specserve.engine.output import OutputProcessor
from specserve.engine.tokenizer import Tokenizer
from specserve.request import FinishReason, RequestOutput, SamplingParams, SpecDecodeStats, TokenLogprob

CASES_PER_TOKENIZER = 300
K = 7  # the longest run a step delivers is K + 1


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> PlainTokenizer:
    """The tiny models' word-level tokenizer: its decoder joins tokens with spaces."""
    from tiny_models import _tokenizer
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("words")
    _tokenizer(out)
    hf = AutoTokenizer.from_pretrained(str(out))
    tok = PlainTokenizer(hf, (2,), {})
    tok.random_words = True
    return tok


def output_ids(tok: PlainTokenizer, rng: random.Random) -> list[int]:
    if getattr(tok, "random_words", False):
        return [rng.randrange(3, 60) for _ in range(rng.randint(1, 24))]  # includes <|im_start|>/<|im_end|>
    return random_ids(tok, rng)


def runs(ids: list[int], rng: random.Random, how: str) -> list[list[int]]:
    if how == "one":
        return [[t] for t in ids]
    if how == "all":
        return [list(ids)]
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, K + 1)
        out.append(ids[i : i + n])
        i += n
    return out


def stream(tok, prompt, ids, params, chunks) -> tuple[list[RequestOutput], RequestOutput]:
    """Feed ``chunks`` as engine steps until the processor finishes the request (a stop
    string) or the tokens run out (the last step then ends it for length)."""
    proc = OutputProcessor(tok, prompt, params)
    sent = []
    for n, part in enumerate(chunks):
        last = n == len(chunks) - 1
        out = RequestOutput(
            request_id="r", new_token_ids=list(part), new_text="", token_ids=[], text="", finished=last,
            finish_reason=FinishReason.LENGTH if last else None, num_prompt_tokens=len(prompt),
            spec=SpecDecodeStats(), new_logprobs=[TokenLogprob(t, -float(t)) for t in part],
        )
        out, _ = proc.process(out)
        sent.append((list(out.new_token_ids), [e.token_id for e in out.new_logprobs or []], out.new_text))
        if out.finished:
            return sent, out
    raise AssertionError("the request never finished")


def check(tok: PlainTokenizer, salt: int) -> None:
    rng = random.Random(SEED + salt)
    for case in range(CASES_PER_TOKENIZER):
        ids = output_ids(tok, rng)
        prompt = tok.encode_plain(random_text(rng))[-8:] if rng.random() < 0.6 else []
        ctx = prompt[-5:]
        base = tok.decode(ctx)
        want = tok.decode(ctx + ids)[len(base) :]
        stop: list[str] = []
        if want:
            for _ in range(rng.randint(1, 3)):  # stop strings out of the output: they match
                a = rng.randrange(len(want))
                stop.append(want[a : a + rng.randint(1, 10)])
            # (not U+FFFD: bytes that never complete a character show as U+FFFD only once
            # the stream ends, so where such a stop string matches depends on the chunking)
            stop = [s for s in stop if "\ufffd" not in s]
            if rng.random() < 0.3:
                stop.append(random_text(rng))
        params = SamplingParams(stop=stop, logprobs=0, include_stop_str_in_output=rng.random() < 0.3)
        where = f"seed={SEED + salt} case={case} prompt={prompt} ids={ids} stop={stop!r} params={params}"
        finals = []
        for how in ("one", "all", "random", "random"):
            sent, final = stream(tok, prompt, ids, params, runs(ids, rng, how))
            streamed_ids = [t for s in sent for t in s[0]]
            streamed_lps = [t for s in sent for t in s[1]]
            streamed_text = "".join(s[2] for s in sent)
            assert streamed_ids == final.token_ids == streamed_lps, where
            assert [e.token_id for e in final.logprobs] == final.token_ids, where
            assert streamed_text == final.text, where
            # A token is never sent before its text: until the end, the released tokens' decode
            # fits in what was emitted.  (The end may add a token whose text a stop string cut.)
            emitted, released = "", []
            for ids_part, _, text_part in sent[:-1] if stop else ():
                emitted += text_part
                released += ids_part
                shown = tok.decode(ctx + released)[len(base) :].rstrip("\ufffd")
                assert len(shown) <= len(emitted), where
            finals.append((final.text, list(final.token_ids), final.finish_reason))
        assert all(f == finals[0] for f in finals), (where, finals)
        text, kept, reason = finals[0]
        if reason is FinishReason.STOP:  # cut: the kept tokens spell the kept text, no more
            spelled = tok.decode(ctx + kept)[len(base) :]
            assert spelled.startswith(text) or spelled.rstrip("\ufffd") == text.rstrip("\ufffd"), where
            fewer = tok.decode(ctx + kept[:-1])[len(base) :] if kept else ""
            assert len(fewer.rstrip("\ufffd")) < len(text) or tok.decode(kept[-1:]) == "", where
        else:
            assert kept == ids and text == want, where


def test_byte_level_bpe_streams_what_it_returns(smollm2):
    check(smollm2, 11)


def test_byte_fallback_streams_what_it_returns(byte_fallback):
    check(byte_fallback, 12)


def test_spaced_decoder_streams_what_it_returns(words):
    check(words, 13)


def test_spaces_after_a_run_of_special_tokens_count_where_they_stand(byte_fallback):
    """Found by the property test (seed 963456623, case 88): after a run of special tokens
    (no text) the character window held no text, the decoder's strip ate the next space, the
    character count fell one behind the text, and a stop string completed by the last space
    kept a trailing special token only when it arrived in the same step."""
    prompt = [148, 144, 243, 162, 146, 192, 259, 63]
    ids = [264, 2, 264, 269, 262, 1, 1, 2, 2, 1, 259, 259, 1]
    params = SamplingParams(stop=["o  "], logprobs=0, include_stop_str_in_output=True)
    finals = set()
    for chunks in ([[t] for t in ids], [ids], [ids[:6], ids[6:8], ids[8:]]):
        _, final = stream(byte_fallback, prompt, ids, params, chunks)
        finals.add((final.text, tuple(final.token_ids), final.finish_reason))
    assert finals == {("文文,hello  ", tuple(ids[:-1]), FinishReason.STOP)}


def test_the_reported_stop_string_stream(smollm2):
    """The report: a repeated phrase, stop "epsilon, alpha beta gamma" completed inside a
    run of tokens; the stream sent 6 token ids while the output had 3."""
    text = "alpha beta gamma delta epsilon, " * 3
    ids = smollm2.encode_plain(text)
    prompt = smollm2.encode_plain("alpha beta gamma delta epsilon, " * 12 + "alpha beta")
    params = SamplingParams(stop=["epsilon, alpha beta gamma"], logprobs=0)
    results = set()
    for how in ("one", "all", "random"):
        sent, final = stream(smollm2, prompt, ids, params, runs(ids, random.Random(SEED), how))
        assert [t for s in sent for t in s[0]] == final.token_ids == [t for s in sent for t in s[1]]
        results.add((final.text, tuple(final.token_ids)))
    assert len(results) == 1
    text, kept = results.pop()
    assert text == "alpha beta gamma delta "  # cut before the stop string
    assert smollm2.decode(list(kept)) == "alpha beta gamma delta epsilon"  # its space comes with " epsilon"

"""The CTC drafter (``+method=ctc``; its declaration and modes: ``specserve.methods.ctc``).

What the engine asks of it, besides the proposer protocol:

* ``hypothesis(seq, ctc_log_probs)`` once a request's recording is encoded: the greedy
  CTC path (argmax per frame, repeats merged, blank 0 dropped), its labels read as
  Unicode code points, the text stripped (and normalised where the model writes
  normalised transcripts), spelt with the text model's vocabulary where
  ``method.ctc_spelling`` says so (``audio.spelling``; ``context``: with the speech
  model's word bigram model too), re-tokenized with the text
  model's tokenizer (no special tokens) -> a ``CtcHypothesis`` with the tokens and
  whether the entropy gate settles the request (relaxed mode, greedy requests, non-empty
  text, max entropy <= threshold).
  The engine keeps the tokens on the request (``Sequence.hypothesis``, kept across
  preemption) and seeds the first step's drafts with them.
* ``first_pass(seq, draft_probs)`` after the first verification of a relaxed greedy
  request: "accept" when every draft token's probability under the target is at least
  the floor (the paper's all-or-nothing rule, no end-of-text check), else the fallback
  ("resume" or "restart").

Drafting (``propose``) reuses Predicted Outputs' re-synchronising drafter
(``proposers.prediction.PredictionIndex``) over the request's hypothesis: drafts follow
the hypothesis while the output does, and re-synchronise after an insertion, deletion or
replacement.  Per-request indexes are rebuilt from ``Sequence.hypothesis`` on demand, so
the release hook (``remove``) may drop them at any teardown, preemption included.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from specserve.executor.models.granite_speech import ctc_greedy_labels, ctc_max_entropy, ctc_text
from specserve.methods.ctc import DEFAULT_ENTROPY_THRESHOLD, CtcOptions
from specserve.proposers.base import DraftRequest, Proposal, ProposerContext
from specserve.proposers.prediction import PredictedOutputs, PredictionIndex
from specserve.request import GREEDY_EPS


@dataclass
class CtcHypothesis:
    text: str
    token_ids: list[int]
    max_entropy: float
    settled: bool  # the entropy gate passed: the CTC text is the answer (relaxed mode)


def entropy_gate(max_entropy: float, text: str, threshold: float) -> bool:
    """The paper's first stage: the CTC text is final when it is non-empty and the largest
    per-frame entropy does not exceed the threshold (a threshold <= 0 turns the gate off)."""
    return threshold > 0 and bool(text.strip()) and max_entropy <= threshold


def confidence_accept(draft_probs: list[float], floor: float) -> bool:
    """The paper's second stage: every draft token's probability reaches the floor (an
    empty draft is never accepted)."""
    return bool(draft_probs) and all(p >= floor for p in draft_probs)


log = logging.getLogger(__name__)


class CtcProposer:
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, opts: CtcOptions, tokenizer: Any, normalized: bool = False,
                 model_entropy_threshold: float | None = None, word_lm: Any = None):
        self.opts = opts
        self.tokenizer = tokenizer
        self.normalized = normalized
        self.relaxed = opts.ctc_acceptance == "relaxed"
        # relaxed mode's gate: the configured one, else the model's calibrated one, else IBM's
        if opts.ctc_entropy_threshold is not None:
            self.entropy_threshold, self.entropy_threshold_source = float(opts.ctc_entropy_threshold), "config"
        elif model_entropy_threshold is not None:
            self.entropy_threshold, self.entropy_threshold_source = float(model_entropy_threshold), "model"
        else:
            self.entropy_threshold, self.entropy_threshold_source = DEFAULT_ENTROPY_THRESHOLD, "default"
        if self.relaxed:
            log.info("ctc relaxed (lossy): entropy gate %g nats (%s), confidence floor %g, fallback %s",
                     self.entropy_threshold, {"config": "method.ctc_entropy_threshold",
                                              "model": "calibrated for this model: its config.json",
                                              "default": "IBM's"}[self.entropy_threshold_source],
                     opts.ctc_confidence_threshold, opts.ctc_fallback)
        self.num_spec_tokens = int(opts.num_speculative_tokens or 0)
        self._drafter = _HypothesisDrafts(self.num_spec_tokens)
        spelling = opts.ctc_spelling
        if spelling == "auto":
            spelling = ("context" if word_lm is not None else "vocabulary") if normalized else "none"
        self.speller = None
        if spelling in ("vocabulary", "context"):
            from specserve.audio.spelling import VocabularySpeller, vocabulary_lexicon
            from specserve.errors import ConfigError

            if spelling == "context" and word_lm is None:
                raise ConfigError("method.ctc_spelling", "context spells with the speech model's word bigram model "
                                                         "(config.json's specserve.spelling_lm); this model has none: "
                                                         "use auto, vocabulary or none")
            lexicon = vocabulary_lexicon(tokenizer)
            if lexicon:
                self.speller = VocabularySpeller(lexicon, lm=word_lm if spelling == "context" else None)
            elif opts.ctc_spelling != "auto":
                raise ConfigError("method.ctc_spelling", f"{spelling}: the model's tokenizer has no word-initial "
                                                         "lowercase tokens to spell with; use auto or none")

    # ------------------------------------------------------------ the engine's hooks
    def hypothesis(self, seq: Any, ctc_log_probs: torch.Tensor) -> CtcHypothesis:
        text = ctc_text(ctc_greedy_labels(ctc_log_probs)).strip()
        if self.normalized:
            from specserve.audio.text import normalize_transcript

            text = normalize_transcript(text)
        if self.speller is not None and text:
            text = self.speller.correct(text)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids if text else []
        ent = ctc_max_entropy(ctc_log_probs)
        greedy = seq.params.temperature < GREEDY_EPS
        settled = self.relaxed and greedy and entropy_gate(ent, text, self.entropy_threshold)
        return CtcHypothesis(text, list(ids), ent, settled)

    def judges_first_pass(self, seq: Any) -> bool:
        """Whether the first verification of ``seq`` follows the relaxed rule."""
        p = seq.params
        return self.relaxed and p.temperature < GREEDY_EPS and p.logprobs is None and not p.has_logits_processors

    def first_pass(self, seq: Any, draft_probs: list[float]) -> str:
        """"accept", or the fallback ("resume" | "restart")."""
        if confidence_accept(draft_probs, float(self.opts.ctc_confidence_threshold)):
            return "accept"
        return self.opts.ctc_fallback

    # ------------------------------------------------------------ the proposer protocol
    def propose(self, requests: list[DraftRequest], step: Any = None) -> Proposal:
        return Proposal(token_ids=[self._drafter.drafts_for(r) if r.max_drafts > 0 else [] for r in requests])

    def on_verified(self, seq: Any, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        pass

    def remove(self, request_id: str) -> None:
        self._drafter.remove(request_id)


class _HypothesisDrafts(PredictedOutputs):
    """Predicted Outputs' drafter over each request's CTC hypothesis (``Sequence.hypothesis``)
    instead of its ``prediction``."""

    def _index(self, seq: Any) -> PredictionIndex | None:
        idx = self.indexes.get(seq.request_id)
        if idx is None:
            tokens = getattr(seq, "hypothesis", None)
            if not tokens:
                return None
            idx = self.indexes[seq.request_id] = PredictionIndex(
                tokens, seq.num_prompt_tokens, self.min_match, self.max_match, self.window
            )
        return idx


def build(opts: CtcOptions, ctx: ProposerContext) -> CtcProposer:
    speech = getattr(ctx.target, "speech", None)
    if speech is None:
        from specserve.errors import ConfigError

        raise ConfigError("method.method", "ctc drafts from a speech model's CTC head; model.path is a text model "
                                           "(use a Granite-Speech-shaped model, e.g. model=smollm2-135m-speech)")
    return CtcProposer(opts, ctx.target.tokenizer, normalized=speech.transcript == "normalized",
                       model_entropy_threshold=speech.ctc_entropy_threshold, word_lm=speech.word_lm)

"""``+method=ctc``: CTC-draft self-speculation for speech models (arXiv 2603.11243; the
proposer: ``specserve.proposers.ctc``).

A speech model's encoder has a CTC head; its greedy hypothesis of the recording, re-tokenized
with the text model's tokenizer, is the draft of the transcript.  Two acceptance modes
(``method.ctc_acceptance``):

* ``exact`` (default, lossless): the hypothesis is drafted like a Predicted Output (one
  re-synchronising drafter, ``proposers.prediction``); the prompt's last chunk carries as
  much of it as the step allows, so a short recording's transcript is verified in the
  prefill's forward; the output is what plain decoding gives.
* ``relaxed`` (the paper's rule, lossy: ``lossless="false"`` in metrics): a greedy request
  whose CTC posteriors' largest per-frame entropy (nats, blank included) is at most
  ``ctc_entropy_threshold`` (null, the default: the threshold the model's config declares,
  chosen for it on held-out recordings, else IBM's 0.7) takes the CTC text as its answer
  with no LLM forward; else
  the first forward verifies the whole hypothesis and accepts it when every draft token's
  probability is at least ``ctc_confidence_threshold``; else ``ctc_fallback``: ``resume``
  (the accepted prefix kept, decoding goes on with the hypothesis re-synchronised as
  drafts) or ``restart`` (the hypothesis dropped, plain decoding from the prompt, as
  IBM's evaluation scripts do, without their 2-beam search).  Sampled requests are
  verified as in ``exact``.

``ctc_spelling`` (``auto``: ``context`` for models writing normalised lowercase
transcripts that ship a word bigram model, else ``vocabulary`` for such models) rewrites
the CTC text's words that are not among the text model's word tokens into the nearest
ones (``specserve.audio.spelling``; ``context`` also weighs every word in context with the
model's word bigram model, ``audio.word_lm``) before it is tokenized: better drafts in
both modes, and in relaxed mode the text the gate settles with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specserve.errors import ConfigError
from specserve.methods import MethodSpec, SpeculativeConfig, register

ACCEPTANCE_MODES = ("exact", "relaxed")
FALLBACKS = ("resume", "restart")
SPELLINGS = ("auto", "none", "vocabulary", "context")
DEFAULT_ENTROPY_THRESHOLD = 0.7  # IBM's evaluation scripts' gate (nats)


@dataclass
class CtcOptions(SpeculativeConfig):
    ctc_acceptance: str = "exact"
    # nats; the gate is off at 0 or below.  None: the model's calibrated gate (its config's
    # specserve.ctc_entropy_threshold), else IBM's 0.7 (DEFAULT_ENTROPY_THRESHOLD)
    ctc_entropy_threshold: Optional[float] = None
    ctc_confidence_threshold: float = 0.2
    ctc_fallback: str = "resume"
    # How the CTC text is spelt before it is tokenized: "vocabulary" rewrites words outside
    # the text model's word tokens (specserve.audio.spelling), "context" also weighs every
    # word in context with the speech model's word bigram model (config.json's
    # specserve.spelling_lm), "none" keeps the greedy text; "auto" is context for models
    # that write normalised lowercase transcripts and have a word model, vocabulary for
    # those without one, else none.
    ctc_spelling: str = "auto"

    @property
    def lossless(self) -> bool:
        return super().lossless and self.ctc_acceptance == "exact"

    def validate(self) -> None:
        if self.ctc_acceptance not in ACCEPTANCE_MODES:
            raise ConfigError("method.ctc_acceptance", f"must be one of {', '.join(ACCEPTANCE_MODES)}; "
                                                       f"got {self.ctc_acceptance!r}")
        if self.ctc_fallback not in FALLBACKS:
            raise ConfigError("method.ctc_fallback", f"must be one of {', '.join(FALLBACKS)}; got {self.ctc_fallback!r}")
        if self.ctc_spelling not in SPELLINGS:
            raise ConfigError("method.ctc_spelling", f"must be one of {', '.join(SPELLINGS)}; got {self.ctc_spelling!r}")
        t = self.ctc_entropy_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t != t):
            raise ConfigError("method.ctc_entropy_threshold", f"must be a number (nats) or null, got {t!r}")
        c = self.ctc_confidence_threshold
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0:
            raise ConfigError("method.ctc_confidence_threshold", f"must be a probability in [0, 1], got {c!r}")
        if self.rejection_sample_method == "synthetic":
            raise ConfigError("method.rejection_sample_method", "synthetic is not available with +method=ctc")


register(MethodSpec(
    name="ctc",
    summary="the speech encoder's greedy CTC transcript, re-synchronised like a Predicted Output (speech models)",
    proposer="specserve.proposers.ctc:build",
    options=CtcOptions,
    needs_model=False,
))

"""Speech requests in the engine: what a request with a recording needs beyond a text one.

The engine (``engine.engine.LLMEngine``) calls these at five points:

* ``validate``: a recording needs a speech model, and a prompt whose audio positions are
  one contiguous run of exactly the recording's audio-token count (``InvalidRequestError``
  naming the field).
* ``admit``: the request's prefix-cache partition gains the recording's digest (two
  recordings never share cached audio rows; the same recording does), and it waits in the
  encoder queue (``engine.audio_stage``) instead of the scheduler.
* ``encoded``: at the start of each step, the recordings this step's encoder budget allows
  are encoded (``executor.audio_runner``): the request keeps its audio rows
  (``RequestState.audio``); with ``+method=ctc`` the proposer turns the CTC posteriors
  into the hypothesis (``Sequence.hypothesis``) that drafts the first step, or settles the
  request with the CTC text (relaxed mode's entropy gate).  Then it joins the scheduler.
* ``input_embeds``: a step's prompt chunk that covers audio positions carries their rows
  (``SeqInput.input_embeds``), a preempted request's recomputation included.
* ``review_first_pass``: relaxed mode's confidence rule on the first verification of the
  hypothesis, and the stage (``SpecDecodeStats.ctc_stage``) every CTC request reports.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from specserve.engine.audio_stage import AudioStage
from specserve.errors import InvalidRequestError
from specserve.request import GREEDY_EPS, SamplingParams

log = logging.getLogger(__name__)


class SpeechRequests:
    def __init__(self, target: Any, frames_per_step: int, proposer: Any, num_spec_tokens: int,
                 frames_beside_text: int = 0):
        from specserve.executor.audio_runner import AudioEncoderRunner

        self.spec = target.speech
        self.runner = AudioEncoderRunner(self.spec, target.dtype)
        self.stage = AudioStage(self.runner, frames_per_step, frames_beside_text)
        # the CTC drafter (+method=ctc), else None: recordings are transcribed by plain decoding
        self.ctc = proposer if hasattr(proposer, "hypothesis") else None
        self.num_spec_tokens = num_spec_tokens

    @property
    def audio_token_index(self) -> int:
        return self.spec.audio_token_index

    # ------------------------------------------------------------ admission
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        clip = params.audio
        n = self.runner.num_audio_tokens(len(clip.samples))
        pos = [i for i, t in enumerate(prompt_token_ids) if t == self.audio_token_index]
        if len(pos) != n or (pos and pos[-1] - pos[0] != n - 1):
            raise InvalidRequestError("prompt", f"must hold one run of {n} audio tokens (id {self.audio_token_index}) "
                                                f"for this recording ({clip.duration_s:.2f} s); it holds {len(pos)}")

    @staticmethod
    def partitioned(params: SamplingParams) -> SamplingParams:
        """``params`` with the recording's digest in its prefix-cache partition."""
        salt = f"{params.cache_salt or ''}\x1faudio:{params.audio.digest}"
        return dataclasses.replace(params, cache_salt=salt)

    def admit(self, st: Any) -> None:
        st.seq.background = True  # its encoder pass and prompt yield to text requests' decoding
        self.stage.submit(st)

    def remove(self, request_id: str) -> None:
        """The release hook of the encoder queue."""
        self.stage.remove(request_id)

    def __len__(self) -> int:
        return len(self.stage)

    # ------------------------------------------------------------ encoding
    def encoded(self, beside_foreground: bool = False) -> list[tuple[Any, Any, Exception | None]]:
        """This step's encoder work: (state, hypothesis or None, failure or None) per request
        whose recording was encoded; its audio rows are on the state.  ``beside_foreground``:
        a text request runs or waits (the encoder yields, ``AudioStage``)."""
        out = []
        for st, enc in self.stage.run(beside_foreground):
            if isinstance(enc, Exception):
                out.append((st, None, enc))
                continue
            seq = st.seq
            first = seq.prompt_token_ids.index(self.audio_token_index)
            st.audio = (first, enc.embeds)
            hyp = None
            if self.ctc is not None:
                try:
                    hyp = self.ctc.hypothesis(seq, enc.ctc_log_probs)
                except Exception as e:
                    out.append((st, None, e))
                    continue
                seq.hypothesis = hyp.token_ids or None
                if seq.hypothesis is None:  # nothing to draft: plain decoding settles it
                    seq.spec_stats.ctc_stage = "decoded"
            out.append((st, hyp, None))
        return out

    def first_drafts(self, seq: Any) -> list[int]:
        """The drafts of the request's first step: the hypothesis, up to K."""
        return list(seq.hypothesis[: self.num_spec_tokens]) if seq.hypothesis else []

    # ------------------------------------------------------------ steps
    @staticmethod
    def input_embeds(st: Any, start: int, num_new: int) -> list[tuple[int, Any]] | None:
        """The audio rows that fall in the chunk [start, start + num_new) of the request's
        tokens, as (offset in the chunk, rows) pairs."""
        if st.audio is None:
            return None
        first, rows = st.audio
        a, b = max(start, first), min(start + num_new, first + rows.shape[0])
        if a >= b:
            return None
        return [(a - start, rows[a - first : b - first])]

    def review_first_pass(self, s: Any, logits: torch.Tensor, row: int, eos: int | None) -> None:
        """A CTC request's first verification with drafts: relaxed mode's rule (greedy
        requests) may replace its ``Verified``; the stage is recorded either way."""
        seq, v = s.seq, s.verified
        if self.ctc is None or seq.spec_stats.ctc_stage is not None or not s.drafts.token_ids or v is None \
                or v.failure is not None or seq.hypothesis is None:
            return
        d = s.drafts.token_ids
        whole = len(d) == len(seq.hypothesis)
        if self.ctc.judges_first_pass(seq):
            # logits row i predicts draft i (row 0: after the prompt's last token)
            probs = logits[row : row + len(d)].float().softmax(dim=-1)
            p = probs[torch.arange(len(d), device=probs.device), torch.tensor(d, device=probs.device)].tolist()
            decision = self.ctc.first_pass(seq, p) if whole else self.ctc.opts.ctc_fallback
            if decision == "accept":
                s.verified = dataclasses.replace(v, tokens=list(d) + ([eos] if eos is not None else []),
                                                 num_accepted=len(d), logprobs=None)
                seq.spec_stats.ctc_stage = "verified"
                return
            if decision == "restart":  # plain decoding from the prompt: its first token, no more drafts
                first = int(logits[row].argmax())
                s.verified = dataclasses.replace(v, tokens=[first], num_accepted=0, logprobs=None)
                seq.hypothesis = None
                self.ctc.remove(seq.request_id)
            seq.spec_stats.ctc_stage = "decoded"
            return
        seq.spec_stats.ctc_stage = "verified" if whole and v.num_accepted == len(d) else "decoded"

    @staticmethod
    def greedy(params: SamplingParams) -> bool:
        return params.temperature < GREEDY_EPS

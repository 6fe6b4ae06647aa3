"""Speech requests between admission and the scheduler (the encoder's queue).

A request that carries a recording (``SamplingParams.audio``) is admitted here, not to the
scheduler: its prompt cannot be computed before its audio rows exist.  At the start of
every engine step ``run`` encodes queued recordings in arrival order while their encoder
frames fit in ``frames_per_step`` (at least one recording per step), so a burst of long
recordings adds a bounded amount of encoder work to each step and the decoding requests
keep stepping between them.  While a foreground (text) request runs or waits, the encoder yields
further: each step adds ``frames_beside_text`` frames to a credit and a recording is
encoded once the credit covers it (a 30 s recording every twenty steps at 75 frames), so the
text request's steps each carry a twentieth of an encoder pass, not a whole one.  The
engine then hands each encoded request to the scheduler (or settles it without an LLM
forward, +method=ctc's entropy gate).

``remove`` is a release hook (``engine.requests.RequestTable``): a request aborted while
queued leaves the queue with its teardown.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class AudioStage:
    def __init__(self, runner: Any, frames_per_step: int, frames_beside_text: int = 0):
        self.runner = runner  # executor.audio_runner.AudioEncoderRunner
        self.frames_per_step = frames_per_step
        self.frames_beside_text = frames_beside_text  # 0: no yielding
        self.credit = 0  # frames earned while yielding, not yet spent
        self.queue: deque[Any] = deque()  # RequestStates waiting for their encoder pass

    def __len__(self) -> int:
        return len(self.queue)

    def submit(self, st: Any) -> None:
        self.queue.append(st)

    def remove(self, request_id: str) -> None:
        for st in self.queue:
            if st.request_id == request_id:
                self.queue.remove(st)
                return

    def run(self, beside_foreground: bool = False) -> list[tuple[Any, Any]]:
        """Encode what this step's budget allows: (state, encoding or the exception) pairs.
        ``beside_foreground``: a foreground request runs (the encoder yields to it)."""
        yielding = beside_foreground and self.frames_beside_text > 0
        if not yielding or not self.queue:
            self.credit = 0
        else:
            self.credit = min(self.credit + self.frames_beside_text, self.frames_per_step)
        done: list[tuple[Any, Any]] = []
        used = 0
        while self.queue:
            st = self.queue[0]
            n = self.runner.cost(len(st.seq.params.audio.samples))
            if yielding:
                # a recording over the step budget runs once the credit is full
                if n > self.credit and self.credit < self.frames_per_step:
                    break
                self.credit = max(0, self.credit - n)
            elif done and used + n > self.frames_per_step:
                break
            self.queue.popleft()
            used += n
            try:
                done.append((st, self.runner.encode(st.seq.params.audio.samples)))
            except Exception as e:  # this request's recording alone
                done.append((st, e))
            if yielding:
                break  # one recording a step at most while yielding
        return done

"""Transcript text: the normalisation the embedded speech model is trained to write and
the benchmark's WER is computed under (stated once, here).

``normalize_transcript``: lower case; every character that is not a letter a-z, an
apostrophe or a space becomes a space (digits and punctuation included); runs of spaces
collapse to one; leading and trailing spaces go.  ``"Don't stop -- it's 5 PM!"`` ->
``"don't stop it's pm"``.  No torch.
"""

from __future__ import annotations

import re

_NOT_KEPT = re.compile(r"[^a-z' ]+")
_SPACES = re.compile(r" +")


def normalize_transcript(text: str) -> str:
    t = _NOT_KEPT.sub(" ", text.lower())
    t = t.replace(" '", " ").replace("' ", " ")  # quotes, not apostrophes inside words
    return _SPACES.sub(" ", t).strip(" '")

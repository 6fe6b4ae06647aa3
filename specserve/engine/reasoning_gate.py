"""A request's token constraints around its reasoning: the grammar starts where the reasoning
ends, and a thinking budget forces the end (pure Python + numpy; the grammar is a
``specserve.structured.GrammarState``).

:class:`ReasoningGate` has the grammar state's interface (``masks(drafts)`` before a step,
``advance(tokens)`` after it, so ``engine.step_controls.plan_step`` and the commit treat it
as a grammar) and ``forced(limit)``, the tokens that are certain to come next (what
grammar-forced drafts draft).  It follows the request's output token by token through
these phases (``ReasoningParams`` gives the markers as token ids and where the prompt
leaves the output):

* ``optional``: the output may open its reasoning.  Its first token is a start marker's
  first token (then ``start``/``open``) or anything else (then ``closed``; with a grammar,
  that token is the grammar's first: the row allows the grammar's tokens and the markers'
  first tokens).
* ``start``: the rest of a start marker spelled over several tokens (forced with a grammar,
  which could not take a marker left half written; followed freely without one).
* ``open``: inside the reasoning, unconstrained.  It ends when the output ends with an end
  marker's tokens (then ``closed``), or when ``thinking_token_budget`` tokens were spent in
  it (then ``forcing``).
* ``forcing``: the budget's tokens (an optional message, then the end marker) are forced,
  one per position; then ``closed``.
* ``closed``: the grammar, if any, constrains every later position.

Every verified position gets the row of the phase it is in after the drafts before it, so
drafts past a budget's end, drafts a grammar refuses and drafts that would break a forced
marker are cut at the first such draft; the output is plain decoding's under the same
constraints, however speculation splits it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from specserve.request import ReasoningParams

__all__ = ["ReasoningGate"]

OPTIONAL, START, OPEN, FORCING, CLOSED = "optional", "start", "open", "forcing", "closed"


@dataclass(frozen=True)
class _Phase:
    phase: str
    count: int = 0  # tokens spent in the reasoning (open)
    tail: tuple[int, ...] = ()  # the last reasoning tokens (to match an end marker)
    spelling: int = 0  # which start marker is being written (start)
    at: int = 0  # tokens of the start marker, or of the forced end, written so far


def _bit(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _set(row: np.ndarray, token: int) -> None:
    row[token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))


class ReasoningGate:
    def __init__(self, reasoning: ReasoningParams, budget: int | None, grammar: Any, words: int):
        self.r = reasoning
        self.budget = budget
        self.grammar = grammar  # GrammarState or None
        self.words = words
        self.starts = [list(s) for s in reasoning.start_token_ids if s]
        self.ends = [tuple(e) for e in reasoning.end_token_ids if e]
        self.tail_len = max((len(e) for e in self.ends), default=1)
        self.forced_ids = list(reasoning.forced_token_ids)
        state = reasoning.state if reasoning.state in (OPTIONAL, OPEN, CLOSED) else OPTIONAL
        self.state = self._enter(_Phase(state))

    # ---------------------------------------------------------------- phases

    @property
    def phase(self) -> str:
        return self.state.phase

    @property
    def reasoning_tokens(self) -> int:
        return self.state.count

    def _enter(self, s: _Phase) -> _Phase:
        """``s`` with a budget already spent turned into forcing (and an empty forced end into closed)."""
        if s.phase == OPEN and self.budget is not None and s.count >= self.budget:
            return _Phase(FORCING if self.forced_ids else CLOSED, s.count)
        return s

    def _step(self, s: _Phase, token: int) -> _Phase:
        """The phase after ``token`` (a token the gate itself does not refuse)."""
        if s.phase == OPTIONAL:
            for k, spelling in enumerate(self.starts):
                if spelling[0] == token:
                    if len(spelling) == 1:
                        return self._enter(_Phase(OPEN))
                    return _Phase(START, spelling=k, at=1)
            return _Phase(CLOSED)
        if s.phase == START:
            spelling = self.starts[s.spelling]
            if spelling[s.at] != token:
                return _Phase(CLOSED)  # (only without a grammar: with one, the marker is forced)
            if s.at + 1 == len(spelling):
                return self._enter(_Phase(OPEN))
            return dataclasses.replace(s, at=s.at + 1)
        if s.phase == OPEN:
            tail = (s.tail + (token,))[-self.tail_len :]
            if any(tail[-len(e) :] == e for e in self.ends):
                return _Phase(CLOSED, s.count + 1)
            return self._enter(_Phase(OPEN, s.count + 1, tail))
        if s.phase == FORCING:
            if s.at + 1 >= len(self.forced_ids):
                return _Phase(CLOSED, s.count)
            return dataclasses.replace(s, at=s.at + 1)
        return s

    def _only(self, s: _Phase) -> int | None:
        """The one token the gate allows in phase ``s`` (None: it does not restrict it)."""
        if s.phase == FORCING:
            return self.forced_ids[s.at]
        if s.phase == START and self.grammar is not None:
            return self.starts[s.spelling][s.at]
        return None

    def _grammar_turn(self, s: _Phase, token: int | None) -> bool:
        """Whether the token at a position in phase ``s`` is the grammar's (``token`` None: the
        next position, not drafted)."""
        if s.phase == CLOSED:
            return True
        if s.phase == OPTIONAL and self.grammar is not None:
            return token is None or all(sp[0] != token for sp in self.starts)
        return False

    # ---------------------------------------------------------------- the step's rows

    def masks(self, drafts: list[int]) -> tuple[np.ndarray, int]:
        """Bitmask rows (n+1, W) for the next position and after each of the first n drafts
        the constraints allow in a row (see ``GrammarState.masks``)."""
        rows: list[np.ndarray] = []
        s = self.state
        n = len(drafts)
        for j in range(len(drafts) + 1):
            token = drafts[j] if j < len(drafts) else None
            if self._grammar_turn(s, token):
                rest, m = self._grammar_rows(drafts[j:])
                if s.phase == OPTIONAL:  # the first row also allows the reasoning to open
                    for spelling in self.starts:
                        _set(rest[0], spelling[0])
                rows.extend(rest)
                n = j + m
                break
            row = np.full(self.words, -1, dtype=np.int32)
            only = self._only(s)
            if only is not None:
                row[:] = 0
                _set(row, only)
            elif s.phase == OPTIONAL:  # with a grammar, a start marker's first token
                if self.grammar is not None:
                    row = self._grammar_rows([])[0][0]
                    for spelling in self.starts:
                        _set(row, spelling[0])
            rows.append(row)
            if token is None:
                n = j
                break
            if not _bit(row, token):
                n = j
                break
            s = self._step(s, token)
        return np.stack(rows[: n + 1]), n

    def _grammar_rows(self, drafts: list[int]) -> tuple[list[np.ndarray], int]:
        if self.grammar is None:
            return [np.full(self.words, -1, dtype=np.int32) for _ in range(len(drafts) + 1)], len(drafts)
        g_rows, m = self.grammar.masks(list(drafts))
        return [r.copy() for r in g_rows], m

    def advance(self, tokens: list[int]) -> None:
        """Follow the tokens a step emitted; the grammar's share goes to it (which raises
        ``RequestFailedError`` when it cannot take them)."""
        s = self.state
        for i, t in enumerate(tokens):
            if self._grammar_turn(s, t):
                self.state = _Phase(CLOSED, s.count)
                if self.grammar is not None:
                    self.grammar.advance(list(tokens[i:]))
                return
            s = self._step(s, t)
        self.state = s

    def forced(self, limit: int) -> list[int]:
        """The tokens certain to come next (at most ``limit``): the rest of a forced marker
        or budget end, then what the grammar forces (its fast-forward tokens; after a
        complete grammar, the end of sequence)."""
        out: list[int] = []
        s = self.state
        while len(out) < limit:
            only = self._only(s)
            if only is not None:
                out.append(only)
                s = self._step(s, only)
                continue
            if s.phase == CLOSED and self.grammar is not None:
                out += self.grammar.forced(limit - len(out))
            break
        return out


def constraint_state(params: Any, grammar: Any, words: int) -> Any:
    """A request's constraint state: its grammar (or None) behind a ``ReasoningGate`` when the
    request has reasoning markers and something to gate (a grammar, a thinking budget)."""
    r = params.reasoning
    if r is not None and (grammar is not None or params.thinking_token_budget is not None):
        return ReasoningGate(r, params.thinking_token_budget, grammar, words)
    return grammar


def grammar_drafts(requests: Any, scheduled: list[Any], max_drafts: int, max_model_len: int) -> set[str]:
    """Grammar-forced drafts: each decoding request whose constraints (grammar, forced markers,
    a spent thinking budget) allow exactly one continuation gets those tokens as its next
    step's drafts (``Drafts.num_forced``), within its cap on drafts, its context and its
    max_tokens.  Returns the ids of the requests drafted for (the method drafts none for
    them this step)."""
    from specserve.engine.requests import Drafts

    out: set[str] = set()
    if max_drafts <= 0:
        return out
    for s in scheduled:
        seq = s.seq
        if seq.finished or not s.sample:
            continue
        st = requests.get(seq.request_id)
        state = st.grammar if st is not None else None
        cap = seq.params.num_speculative_tokens
        if state is None or cap == 0:
            continue
        limit = min(max_drafts, max_drafts if cap is None else cap, max_model_len - len(seq.token_ids) - 1,
                    seq.params.max_tokens - seq.num_output_tokens - 1)  # fmt: skip
        tokens = state.forced(limit) if limit > 0 else []
        if tokens:
            st.drafts = Drafts(list(tokens), num_forced=len(tokens))
            out.add(seq.request_id)
    return out

from __future__ import annotations

from specserve.engine.detokenizer import IncrementalDetokenizer


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

from __future__ import annotations

import json

from specserve.data import first_human_turns, iter_conversations


def test_truncated_json_array_is_decoded_object_by_object(tmp_path):
    items = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "first"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "second"}]},
    ]
    text = json.dumps(items)
    p = tmp_path / "trunc.json"
    p.write_text(text[: text.rindex("second") + 3])  # cut inside the last string
    assert [x["id"] for x in iter_conversations(p)] == ["a", "b"]
    assert first_human_turns(p) == ["hi"]

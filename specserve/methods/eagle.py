"""``+method=eagle`` and ``+method=eagle3``: a one-layer head over the target's hidden
states (the proposer: ``specserve.proposers.eagle``)."""

from __future__ import annotations

from specserve.methods import MethodSpec, register

for _name, _summary in (
    ("eagle", "an EAGLE-1/2 head over the target's last hidden state"),
    ("eagle3", "an EAGLE-3 head over the target's low, middle and high features"),
):
    register(MethodSpec(
        name=_name,
        summary=_summary,
        proposer="specserve.proposers.eagle:build_eagle",
        memory="specserve.proposers.eagle:eagle_memory",
        draft_probs=True,
        tree=True,
        kv_layers=1,
    ))

"""``+method=draft_model``: a separate draft LM (the proposer: ``specserve.proposers.draft_model``)."""

from __future__ import annotations

from specserve.methods import MethodSpec, register

register(MethodSpec(
    name="draft_model",
    summary="a smaller LM with the target's vocabulary; PARD drafts all K in one forward",
    proposer="specserve.proposers.draft_model:build",
    memory="specserve.proposers.draft_model:memory",
    parallel_drafting=True,  # PARD: a draft whose config.json has pard_token
    tensor_parallel=True,
    tree=True,  # EAGLE-2 trees expanded by the draft over its own cache
))

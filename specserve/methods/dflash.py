"""``+method=dflash``: a block-diffusion drafter (the proposer: ``specserve.proposers.dflash``)."""

from __future__ import annotations

from specserve.methods import MethodSpec, register

register(MethodSpec(
    name="dflash",
    summary="a block-diffusion draft model over the target's features: one forward drafts the block",
    proposer="specserve.proposers.dflash:build",
    memory="specserve.proposers.dflash:memory",
    draft_probs=True,
    parallel_drafting=True,  # always: one forward denoises the whole block
))

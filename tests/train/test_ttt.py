"""The training-time test computes exactly what serving computes: row t of unrolled
step j equals the paged head after real rows 0..t and j drafting steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "proposers"))

from eagle_heads import write_head  # noqa: E402
from specserve.executor.batch import SeqInput, StepBatch  # noqa: E402
from specserve.executor.eagle_loader import build_head, check_against_target, read_head  # noqa: E402
from specserve.executor.kv_cache import KVCache  # noqa: E402
from specserve.executor.loader import load_model  # noqa: E402
from specserve.proposers.eagle import head_metadata  # noqa: E402
from specserve.train.ttt import Batch, unroll  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402


@pytest.mark.parametrize("nkv", [4, 2])
def test_unrolled_steps_match_the_paged_head(tmp_path, nkv):
    torch.manual_seed(0)
    target = load_model(str(make_tiny_model(tmp_path / "t", "llama", seed=1, num_key_value_heads=nkv)),
                        "float32", torch.device("cpu"))
    ck = read_head(str(write_head(tmp_path / "h", "eagle3", seed=2, aux_ids=[0, 1, 1], draft_vocab=100,
                                  config_over={"num_key_value_heads": nkv})), "eagle3")
    check_against_target(ck, target.arch, 4)
    head = build_head(ck, target.model, torch.float32, torch.device("cpu"), 64)
    n, steps = 12, 4
    tokens = torch.randint(3, 500, (1, n + 1))
    feats = torch.randn(1, n, 3 * 64) * 3
    batch = Batch(tokens, feats, torch.zeros(1, n, 64), torch.tensor([n]), torch.tensor([0]))
    ttt = [head.logits(out) for _, out in unroll(head, batch, steps)]  # each (1, n, Vd): first_row 0
    bs = 4
    for t0 in (0, 3, 6):
        kv = KVCache(1, 16, bs, nkv, 16, torch.float32, torch.device("cpu"))
        table = list(range(8))
        seq = SeqInput(tokens[0, 1 : t0 + 2].tolist(), 0, table, [t0])
        b = StepBatch.from_inputs([seq], bs)
        meta, pos = head_metadata(b, bs, torch.device("cpu"))
        with torch.no_grad():
            out = head(torch.tensor(b.token_ids), head.project(feats[0, : t0 + 1]), pos, meta, kv.layer(0))
            hidden = out[t0 : t0 + 1]
            for j in range(steps):
                if j:
                    b = StepBatch.from_inputs([SeqInput([int(tokens[0, t0 + 1 + j])], t0 + j, table, [0])], bs)
                    meta, pos = head_metadata(b, bs, torch.device("cpu"))
                    hidden = head(torch.tensor(b.token_ids), hidden, pos, meta, kv.layer(0))
                served = head.logits(hidden)[0]
                torch.testing.assert_close(served, ttt[j][0, t0].detach(), atol=2e-4, rtol=1e-4)
    # starting later steps at a later row changes nothing for the rows computed
    late = [(s, head.logits(out)) for s, out in unroll(head, batch, steps, first_row=5)]
    for j, (s, lg) in enumerate(late):
        torch.testing.assert_close(lg[0], ttt[j][0, s:], atol=2e-4, rtol=1e-4)

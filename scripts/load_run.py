"""Helpers for scripts/load_run.sh (the loopback load run on the embedded default).

Subcommands::

    reference  --dtype D --max-tokens N --out FILE     offline greedy references for the loadgen prompts
    ports      N                                       print N free loopback TCP ports
    wait-health URL --timeout-s T [--pid P]            wait until URL/health answers 200
    metrics    URL --out FILE                          scrape /metrics; fail unless KV usage and running are 0
    ties       --report FILE --ids FILE --dtype D      logit gap where mismatching answers diverge
    fingerprint --save F | --compare F                specserve/**/*.py hashes: code changed mid-run?
    sigterm    --report FILE --server-rc RC --exit-s S --drain-timeout-s T --out FILE
                                                       judge the SIGTERM phase and write its summary

The references use the same Config the server builds (``+method=ngram`` and
``model.dtype``) and the same prompt token ids (``Tokenizer.encode``, which is
what both front ends call for a ``prompt`` string), one request at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request


def _engine(dtype: str):
    from specserve.cli import compose_config
    from specserve.engine.engine import LLMEngine

    serve_args = os.environ.get("SERVE_ARGS", "+method=ngram").split()  # load_run.sh's knob
    cfg = compose_config([*serve_args, f"model.dtype={dtype}"])
    return LLMEngine(cfg)


def cmd_reference(args) -> int:
    from specserve.loadgen import BUILTIN_PROMPTS
    from specserve.request import SamplingParams

    eng = _engine(args.dtype)
    ref, ids_out = {}, {}
    for prompt in BUILTIN_PROMPTS:
        ids = eng.tokenizer.encode(prompt)
        out = eng.generate([ids], [SamplingParams(temperature=0.0, max_tokens=args.max_tokens)])[0]
        ref[prompt] = out.text
        ids_out[prompt] = {"prompt_token_ids": ids, "token_ids": out.token_ids, "finish_reason": out.finish_reason.value}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(ref, f, indent=2, ensure_ascii=False)
    with open(args.out.replace(".json", "-ids.json"), "w", encoding="utf-8") as f:
        json.dump({"dtype": eng.info.dtype, "max_tokens": args.max_tokens, "prompts": ids_out}, f, indent=1)
    print(f"references: {len(ref)} prompts, dtype {eng.info.dtype}, max_tokens {args.max_tokens} -> {args.out}")
    return 0


def cmd_ports(args) -> int:
    socks = []
    for _ in range(args.n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    print(" ".join(str(s.getsockname()[1]) for s in socks))
    for s in socks:
        s.close()
    return 0


def _pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def cmd_wait_health(args) -> int:
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline:
        if args.pid and not _pid_alive(args.pid):
            print("the server process exited before it was healthy", file=sys.stderr)
            return 1
        try:
            with urllib.request.urlopen(f"{args.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return 0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    print(f"{args.url}/health not 200 after {args.timeout_s} s", file=sys.stderr)
    return 1


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("" if not s.labels.get("finished_reason") else f"{{{s.labels['finished_reason']}}}")
            if "reason" in s.labels and "finished_reason" not in s.labels:
                key = f"{s.name}{{{s.labels['reason']}}}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def cmd_metrics(args) -> int:
    wanted = (
        "specserve_kv_cache_usage_perc", "specserve_num_requests_running", "specserve_num_requests_waiting",
        "specserve_spec_decode_num_drafts_total", "specserve_spec_decode_num_draft_tokens_total",
        "specserve_spec_decode_num_accepted_tokens_total", "specserve_generation_tokens_total",
        "specserve_prompt_tokens_total",
    )  # fmt: skip
    m: dict[str, float] = {}
    for _ in range(50):  # the last cancelled requests may take a step to be aborted
        m = scrape(args.url)
        if m.get("specserve_kv_cache_usage_perc", 1) == 0 and m.get("specserve_num_requests_running", 1) == 0:
            break
        time.sleep(0.1)
    out = {k: v for k, v in m.items() if k in wanted or k.startswith(("specserve_request_success_total",
                                                                         "specserve_request_errors_total"))}  # fmt: skip
    drafts = out.get("specserve_spec_decode_num_drafts_total", 0)
    if drafts:
        out["mean_acceptance_length"] = 1 + out["specserve_spec_decode_num_accepted_tokens_total"] / drafts
        out["acceptance_rate"] = (
            out["specserve_spec_decode_num_accepted_tokens_total"] / out["specserve_spec_decode_num_draft_tokens_total"]
        )
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))
    ok = out.get("specserve_kv_cache_usage_perc") == 0 and out.get("specserve_num_requests_running") == 0
    print(f"KV usage at end: {out.get('specserve_kv_cache_usage_perc')} -> {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


def _logits(eng, seq: list[int], first: int):
    """Logit rows predicting seq[first:] from one full-prefill forward (no batching)."""
    from specserve.executor.runner import SeqInput

    table: list[int] = []
    assert eng.blocks.ensure(table, len(seq))
    try:
        fwd = eng.runner.forward([SeqInput(seq, 0, table, list(range(first - 1, len(seq) - 1)))])
    finally:
        eng.blocks.free(table)
    return fwd.logits.float()


def cmd_ties(args) -> int:
    """For each distinct mismatch: the first token where the served text leaves the
    reference, the served token there, and the logit gap between the two, in the
    serving dtype and in float32 (single-sequence forwards over the reference prefix).
    A gap near 0 is a near-tie that batched arithmetic may legitimately flip."""
    import torch

    with open(args.report, encoding="utf-8") as f:
        report = json.load(f)
    mism = report["mismatches"].get("distinct") or report["mismatches"]["examples"]
    if not mism:
        print("no mismatches")
        return 0
    with open(args.ids, encoding="utf-8") as f:
        ref_ids = json.load(f)["prompts"]
    eng = _engine(args.dtype)
    f32 = _engine("float32") if args.dtype != "float32" else eng
    tok = eng.tokenizer
    rows = []
    for ex in mism:
        ids = ref_ids[ex["prompt"]]["prompt_token_ids"]
        ref = ref_ids[ex["prompt"]]["token_ids"]
        got = ex["got"]
        row = {"protocol": ex["protocol"], "prompt": ex["prompt"], "occurrences": ex.get("occurrences", 1),
               "finish_reason": ex.get("finish_reason")}  # fmt: skip
        if tok.decode(ref) != ex["expected"]:
            row["note"] = "the reference ids do not decode to the reference text"
        dec = [tok.decode(ref[:i]) for i in range(len(ref) + 1)]
        pos = next((i for i in range(len(ref)) if not got.startswith(dec[i + 1])), None)
        if pos is None and ref and ref[-1] in tok.eos_token_ids and len(got) > len(dec[-1]):
            pos = len(ref) - 1  # the reference stopped (EOS) where the served answer went on
        row["first_diff_token_index"] = pos
        if pos is None:
            row["note"] = "the served text extends the whole reference"
            rows.append({**row, "got": got, "expected": ex["expected"]})
            print(json.dumps(row, ensure_ascii=False))
            continue
        seq = ids + ref[: pos + 1]
        lg = _logits(eng, seq, len(ids))[pos]
        lf = _logits(f32, seq, len(ids))[pos]
        # The served token: the best-ranked candidate whose text continues the served text
        # (EOS when the served answer simply ended here).
        prefix = tok.decode(ref[:pos])
        served = None
        for cand in torch.topk(lg, 20).indices.tolist():
            if cand == ref[pos]:
                continue
            if cand in tok.eos_token_ids and len(got) == len(prefix):
                served = cand
                break
            text = tok.decode(ref[:pos] + [cand])
            if len(text) > len(prefix) and got.startswith(text):
                served = cand
                break
        row.update(
            reference_token=repr(tok.decode([ref[pos]], skip_special_tokens=False)),
            served_token=None if served is None else repr(tok.decode([served], skip_special_tokens=False)),
            gap_serving_dtype=None if served is None else round(float(lg[ref[pos]] - lg[served]), 4),
            gap_float32=None if served is None else round(float(lf[ref[pos]] - lf[served]), 4),
            top2_gap_serving_dtype=round(float(torch.topk(lg, 2).values.diff().abs()), 4),
            got=got, expected=ex["expected"],
        )  # fmt: skip
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("got", "expected")}, ensure_ascii=False))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2, ensure_ascii=False)
    return 0


def _file_hashes() -> dict[str, str]:
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        for p in sorted(root.joinpath("specserve").rglob("*.py"))
    }


def cmd_fingerprint(args) -> int:
    """--save FILE: record every specserve/*.py hash; --compare FILE: list the files changed since."""
    now = _file_hashes()
    if args.save:
        with open(args.save, "w", encoding="utf-8") as f:
            json.dump(now, f, indent=1)
        return 0
    with open(args.compare, encoding="utf-8") as f:
        then = json.load(f)
    changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
    print(" ".join(changed))
    return 1 if changed else 0


def cmd_sigterm(args) -> int:
    with open(args.report, encoding="utf-8") as f:
        report = json.load(f)
    checks = {
        "server_exit_code_0": args.server_rc == 0,
        "server_exited_within_drain_timeout_plus_margin": args.exit_s <= args.drain_timeout_s + args.margin_s,
        "no_request_lost_or_truncated": report["lost"]["count"] == 0,
        "no_unexpected_errors": not report["errors"]["unexpected"],
        "no_mismatches": report["mismatches"]["count"] == 0,
        "some_requests_refused_or_unreachable_after_sigterm": any(
            k.endswith((":refused_draining", ":unreachable")) for k in report["errors"]["expected"]
        ),
    }
    summary = {
        "server_exit_code": args.server_rc,
        "sigterm_after_s": args.sigterm_after_s,
        "server_exit_s_after_sigterm": round(args.exit_s, 2),
        "drain_timeout_s": args.drain_timeout_s,
        "checks": checks,
        "loadgen": report,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, ensure_ascii=False)
    print(json.dumps({k: v for k, v in summary.items() if k != "loadgen"}, indent=2))
    return 0 if all(v for k, v in checks.items() if k != "some_requests_refused_or_unreachable_after_sigterm") else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="load_run.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--dtype", required=True)
    r.add_argument("--max-tokens", type=int, required=True)
    r.add_argument("--out", required=True)
    r = sub.add_parser("ports")
    r.add_argument("n", type=int)
    r = sub.add_parser("wait-health")
    r.add_argument("url")
    r.add_argument("--timeout-s", type=float, default=300)
    r.add_argument("--pid", type=int)
    r = sub.add_parser("metrics")
    r.add_argument("url")
    r.add_argument("--out", required=True)
    r = sub.add_parser("ties")
    r.add_argument("--report", required=True)
    r.add_argument("--ids", required=True, help="the reference's -ids.json")
    r.add_argument("--dtype", required=True)
    r.add_argument("--out", required=True)
    r = sub.add_parser("fingerprint")
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--save")
    g.add_argument("--compare")
    r = sub.add_parser("sigterm")
    r.add_argument("--report", required=True)
    r.add_argument("--server-rc", type=int, required=True)
    r.add_argument("--exit-s", type=float, required=True)
    r.add_argument("--sigterm-after-s", type=float, required=True)
    r.add_argument("--drain-timeout-s", type=float, required=True)
    r.add_argument("--margin-s", type=float, default=15.0)
    r.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return {"reference": cmd_reference, "ports": cmd_ports, "wait-health": cmd_wait_health, "metrics": cmd_metrics,
            "ties": cmd_ties, "fingerprint": cmd_fingerprint, "sigterm": cmd_sigterm}[args.cmd](args)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

"""Summarise scripts/gpu_bench.sh's JSON files into a table with issue #10's targets."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(d: Path, name: str) -> dict | None:
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def tps(r: dict | None, run: str) -> float | None:
    return None if r is None or run not in r["runs"] else r["runs"][run]["tokens_per_second"]


def main() -> None:
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "results/gpu")
    c1, c16, c64 = (load(d, f"smol-ngram-bf16-c{c}") for c in (1, 16, 64))
    fp32, draft, big = load(d, "smol-ngram-fp32-c1"), load(d, "smol-draft-bf16-c1"), load(d, "llama1b-vanilla-bf16-c1")
    rows: list[tuple[str, str, str, str]] = []

    def check(what: str, value: float | None, target: str, ok) -> None:
        shown = "n/a" if value is None else f"{value:.3g}"
        rows.append((what, shown, target, "-" if value is None else ("yes" if ok(value) else "NO")))

    v1 = tps(c1, "specserve_vanilla")
    check("SmolLM2 bf16 c1 vanilla / transformers generate", v1 and tps(c1, "hf_generate") and
          v1 / tps(c1, "hf_generate"), ">= 15", lambda x: x >= 15)
    check("SmolLM2 bf16 c1 vanilla ms/token over the bandwidth floor",
          c1 and c1["memory_bandwidth_floor"].get("vanilla_c1_over_floor"), "<= 20", lambda x: x <= 20)
    check("1.2B Llama bf16 c1 vanilla over its floor",
          big and big["memory_bandwidth_floor"].get("vanilla_c1_over_floor"), "<= 1.6", lambda x: x <= 1.6)
    for name, r, target in (("c1", c1, 1.8), ("c16", c16, 1.0), ("c64", c64, 1.0)):
        check(f"SmolLM2 bf16 {name} ngram / vanilla", r and r["ratios"].get("specserve_over_specserve_vanilla"),
              f">= {target}", lambda x, t=target: x >= t)
    check("SmolLM2 bf16 vanilla c64 / c1 tokens/s", v1 and tps(c64, "specserve_vanilla") and
          tps(c64, "specserve_vanilla") / v1, ">= 20", lambda x: x >= 20)
    if fp32:
        check("fp32 ngram greedy_match vs vanilla", fp32["greedy_match"].get("specserve_vs_specserve_vanilla"),
              "1.0", lambda x: x == 1.0)
        check("fp32 ngram greedy_match vs transformers", fp32["greedy_match"].get("specserve_vs_hf_generate"),
              ">= 0.95", lambda x: x >= 0.95)
    check("draft_model (self) bf16 c1 / vanilla", draft and draft["ratios"].get("specserve_over_specserve_vanilla"),
          "(report)", lambda x: True)
    e3 = load(d, "smol-eagle3-bf16-c1")
    check("eagle3 bf16 c1 / vanilla (issue #11)", e3 and e3["ratios"].get("specserve_over_specserve_vanilla"),
          ">= 2", lambda x: x >= 2)
    check("eagle3 mean acceptance length (K=4)", e3 and e3["runs"]["specserve"].get("mean_acceptance_length"),
          "(report)", lambda x: True)
    for name, what in (("smol-eagle3-chain-auto-bf16-c1", "chains, adaptive (the default)"),
                       ("smol-eagle3-tree-n8-bf16-c1", "trees, topk 4, 8 nodes, depth 5")):
        r = load(d, name)
        check(f"eagle3 bf16 c1 {what} / vanilla (issue #23)", r and r["ratios"].get("specserve_over_specserve_vanilla"),
              "(report)", lambda x: True)
        check(f"eagle3 bf16 c1 {what}: AL", r and r["runs"]["specserve"].get("mean_acceptance_length"),
              "(report)", lambda x: True)
    print("| figure | measured | target | met |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print("\nPer-step breakdown (one request):\n")
    print("| run | step | wall ms | device ms | host ms | kernels | graph launches |\n|---|---|---|---|---|---|---|")
    for name in ("smol-ngram-bf16-c1", "llama1b-vanilla-bf16-c1"):
        r = load(d, name)
        for kind, p in ((r or {}).get("step_profile") or {}).items():
            print(f"| {name} | {kind} | {p.get('wall_ms_per_step', 0):.3f} | {p.get('device_ms_per_step', 0):.3f} | "
                  f"{p.get('host_ms_per_step', 0):.3f} | {p.get('kernels_per_step', 0):.0f} | "
                  f"{p.get('graph_launches_per_step', 0):.1f} |")


if __name__ == "__main__":
    main()

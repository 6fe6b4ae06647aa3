"""Compile every Triton binary the engine launches for sm_80 and sm_90, without a GPU, and
write the table (binaries per kernel and arch, registers, spills, shared memory).

    .venv/bin/python scripts/triton_aot_report.py [--out docs/benchmarks/triton-aot] [--workers 2]

Writes report.json and README.md under --out, and exits 1 when a binary does not
compile, spills in bf16/fp16, exceeds its GPU's shared memory, or a (preset, dtype)
has more attention binaries than allowed (specserve.kernels.aot.violations).  Triton
must not run interpreted, and compiles into a fresh temporary cache (a cached
binary would skip ptxas and its report); nothing is kept between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks/triton-aot", help="directory for report.json and README.md")
    ap.add_argument("--workers", type=int, default=2, help="compiler processes")
    ap.add_argument("--preset", action="append", help="only these presets (default: all)")
    ap.add_argument("--dtype", action="append", help="only these dtypes (default: each preset's)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the interpreter compiles nothing; unset it", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="triton-aot-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # before triton is imported, here and in the workers
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        import triton

        from specserve.kernels import aot

        t0 = time.perf_counter()
        jobs = [job for p in aot.PRESETS if not args.preset or p.name in args.preset
                for dt in p.dtypes if not args.dtype or dt in args.dtype
                for job in aot.preset_jobs(p, dt)]
        rows = aot.compile_all(jobs, workers=args.workers)
        seconds = time.perf_counter() - t0
    bad = aot.violations(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"triton": triton.__version__, "archs": list(aot.ARCHS), "binaries": len(rows),
              "attention_binaries": {" ".join(k): n for k, n in aot.count_attention(rows).items()},
              "violations": bad, "rows": rows}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "README.md").write_text(aot.markdown(rows, triton.__version__))
    print(f"{len(rows)} rows ({len(jobs)} binaries of presets and dtypes x {len(aot.ARCHS)} archs) in {seconds:.0f} s; "
          f"{len(bad)} violations -> {out}")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

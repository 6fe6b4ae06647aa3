"""Predicted Outputs on a code-edit workload, through the real server and the official openai client.

The workload: ten HumanEval-like Python modules written for this benchmark (one to
three functions or a small class, 20-30 lines, in ``CODE_EDITS`` below), each with a
request for a small change (rename a method, variable or parameter, change a default,
a threshold or an error message).  A system prompt asks for the complete updated code
in one code block; the request stops at the block's closing fence (``stop: "\n```"``,
what a code-edit client does).  Every request is sent over ``/v1/chat/completions`` at
temperature 0 without a prediction and with ``prediction = {"type": "content",
"content": <the original code>}`` (OpenAI's Predicted Outputs), alternating which goes
first; one server process, one engine, concurrency 1.  The answers must be identical.
Each (request, with/without) pair is timed ``--repeats`` times and the fastest counts
(the box is shared: other processes' load inflates single timings); tokens/s is
completion tokens over the summed wall times (client side, HTTP included).

    .venv/bin/python scripts/bench_predicted_outputs.py --repeats 3 \
        --out docs/benchmarks/predicted-outputs-code-edit-fp32.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

CODE_EDITS: list[tuple[str, str]] = [
('''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        if not self.items:
            return None
        return self.items[-1]

    def is_empty(self):
        return len(self.items) == 0

    def size(self):
        return len(self.items)
''', "Rename the method `peek` to `top`."),
('''def word_frequencies(text):
    counts = {}
    for line in text.splitlines():
        for word in line.split():
            word = word.strip(".,!?").lower()
            if not word:
                continue
            if word in counts:
                counts[word] += 1
            else:
                counts[word] = 1
    return counts


def most_common(counts, n):
    items = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)
    return items[:n]


def print_report(text, n=10):
    counts = word_frequencies(text)
    for word, count in most_common(counts, n):
        print(f"{word}: {count}")
''', "Change the default value of `n` in `print_report` from 10 to 5."),
('''def binary_search(items, target):
    low = 0
    high = len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        elif items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1


def insertion_sort(items):
    result = list(items)
    for i in range(1, len(result)):
        key = result[i]
        j = i - 1
        while j >= 0 and result[j] > key:
            result[j + 1] = result[j]
            j -= 1
        result[j + 1] = key
    return result
''', "Rename the variable `key` to `current` in `insertion_sort`."),
('''import math


def circle_area(radius):
    if radius < 0:
        raise ValueError("radius must be non-negative")
    return math.pi * radius ** 2


def rectangle_area(width, height):
    if width < 0 or height < 0:
        raise ValueError("sides must be non-negative")
    return width * height


def triangle_area(base, height):
    if base < 0 or height < 0:
        raise ValueError("sides must be non-negative")
    return 0.5 * base * height
''', 'Change the error message in `circle_area` to "negative radius".'),
    ('''def parse_csv_line(line, sep=","):
    fields = []
    current = ""
    quoted = False
    for ch in line:
        if ch == '"':
            quoted = not quoted
        elif ch == sep and not quoted:
            fields.append(current)
            current = ""
        else:
            current += ch
    fields.append(current)
    return fields


def parse_csv(text, sep=","):
    rows = []
    for line in text.splitlines():
        if line.strip():
            rows.append(parse_csv_line(line, sep))
    return rows
''', "Rename the parameter `sep` to `delimiter` in both functions."),
    ('''def fibonacci(n):
    if n < 0:
        raise ValueError("n must be non-negative")
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def prime_fibonacci(count):
    result = []
    n = 0
    while len(result) < count:
        value = fibonacci(n)
        if is_prime(value):
            result.append(value)
        n += 1
    return result
''', "Rename the function `is_prime` to `check_prime` and update the call."),
    ('''class BankAccount:
    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance
        self.history = []

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))

    def withdraw(self, amount):
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
        self.history.append(("withdraw", amount))

    def statement(self):
        lines = [f"Account of {self.owner}"]
        for kind, amount in self.history:
            lines.append(f"{kind}: {amount}")
        lines.append(f"balance: {self.balance}")
        return "\\n".join(lines)
''', "Change the error message in `withdraw` to \"not enough money\"."),
    ('''def flatten(nested):
    result = []
    for item in nested:
        if isinstance(item, list):
            result.extend(flatten(item))
        else:
            result.append(item)
    return result


def chunk(items, size):
    if size <= 0:
        raise ValueError("size must be positive")
    return [items[i:i + size] for i in range(0, len(items), size)]


def unique(items):
    seen = set()
    result = []
    for item in items:
        if item not in seen:
            seen.add(item)
            result.append(item)
    return result
''', "Rename the variable `seen` to `visited` in `unique`."),
    ('''def celsius_to_fahrenheit(celsius):
    return celsius * 9 / 5 + 32


def fahrenheit_to_celsius(fahrenheit):
    return (fahrenheit - 32) * 5 / 9


def convert_all(values, to_fahrenheit=True):
    converted = []
    for value in values:
        if to_fahrenheit:
            converted.append(celsius_to_fahrenheit(value))
        else:
            converted.append(fahrenheit_to_celsius(value))
    return converted


def describe(temperature):
    if temperature < 0:
        return "freezing"
    elif temperature < 15:
        return "cold"
    elif temperature < 25:
        return "mild"
    return "hot"
''', "In `describe`, change the threshold 25 to 28."),
    ('''def matrix_multiply(a, b):
    rows = len(a)
    cols = len(b[0])
    inner = len(b)
    result = [[0] * cols for _ in range(rows)]
    for i in range(rows):
        for j in range(cols):
            total = 0
            for k in range(inner):
                total += a[i][k] * b[k][j]
            result[i][j] = total
    return result


def transpose(matrix):
    return [list(row) for row in zip(*matrix)]


def identity(n):
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]
''', "Rename the variable `total` to `acc` in `matrix_multiply`."),
]

SYSTEM = ("You are a coding assistant. When asked to change code, reply with the complete updated code in one "
          "Python code block and nothing else.")
PROMPT = "```python\n{code}```\n\n{edit}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core box two threads stall each other's work)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--limit", type=int, default=len(CODE_EDITS), help="use the first N snippets")
    ap.add_argument("--stop", default="\n```", help="stop string: the end of the code block ('' = none)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="times each (request, with/without) pair is timed; the fastest counts (a shared box)")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    ap.add_argument("--out", default="results/predicted-outputs-code-edit.json")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import openai
    import torch

    from specserve.cli import compose_config
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.engine import LLMEngine
    from specserve.server import start_servers

    overrides = [f"model.dtype={a.dtype}", f"engine.num_threads={a.threads}", "server.host=127.0.0.1",
                 "server.grpc_port=0", "server.http_port=0", "server.api_key_env=", *a.override]
    cfg = compose_config(overrides)
    engine = LLMEngine(cfg)
    handle = start_servers(cfg, AsyncEngine(engine, cfg.server.max_queue))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{handle.http_port}/v1", api_key="unused", timeout=600)
    model = cfg.model.name

    def ask(code: str, edit: str, predict: bool) -> dict:
        kw = dict(model=model, temperature=0, max_tokens=a.max_tokens, stop=[a.stop] if a.stop else None,
                  messages=[{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": PROMPT.format(code=code, edit=edit)}])
        if predict:
            kw["prediction"] = {"type": "content", "content": code}
        t0 = time.perf_counter()
        r = client.chat.completions.create(**kw)
        wall = time.perf_counter() - t0
        d = r.usage.completion_tokens_details
        return {"text": r.choices[0].message.content, "completion_tokens": r.usage.completion_tokens,
                "prompt_tokens": r.usage.prompt_tokens, "wall_s": wall,
                "accepted_prediction_tokens": d.accepted_prediction_tokens,
                "rejected_prediction_tokens": d.rejected_prediction_tokens,
                "mean_acceptance_length": r.model_extra["spec_decode"]["mean_acceptance_length"],
                "num_drafts": r.model_extra["spec_decode"]["num_drafts"]}

    ask("def f(x):\n    return x\n", "Rename `x` to `y`.", True)  # warm-up
    rows = []
    for i, (code, edit) in enumerate(CODE_EDITS[: a.limit]):
        res: dict = {}
        for rep in range(a.repeats):
            for p in ((False, True) if (i + rep) % 2 == 0 else (True, False)):  # alternate who goes first
                r = ask(code, edit, p)
                if p in res:
                    assert r["text"] == res[p]["text"], "greedy output changed between repeats"
                    r["wall_s"] = min(r["wall_s"], res[p]["wall_s"])
                res[p] = r
        plain, pred = res[False], res[True]
        row = {"edit": edit, "identical": plain["text"] == pred["text"], "plain": plain, "prediction": pred}
        rows.append(row)
        logging.warning("%2d: %3d tokens, plain %.1f tok/s, prediction %.1f tok/s (accepted %d, rejected %d), %s",
                        i, plain["completion_tokens"], plain["completion_tokens"] / plain["wall_s"],
                        pred["completion_tokens"] / pred["wall_s"], pred["accepted_prediction_tokens"],
                        pred["rejected_prediction_tokens"], "identical" if row["identical"] else "DIFFERENT")
    handle.stop()

    def agg(key: str) -> dict:
        toks = sum(r[key]["completion_tokens"] for r in rows)
        wall = sum(r[key]["wall_s"] for r in rows)
        return {"completion_tokens": toks, "wall_s": wall, "tokens_per_second": toks / wall,
                "accepted_prediction_tokens": sum(r[key]["accepted_prediction_tokens"] for r in rows),
                "rejected_prediction_tokens": sum(r[key]["rejected_prediction_tokens"] for r in rows)}

    summary = {"plain": agg("plain"), "prediction": agg("prediction")}
    summary["speedup"] = summary["prediction"]["tokens_per_second"] / summary["plain"]["tokens_per_second"]
    summary["identical_outputs"] = sum(r["identical"] for r in rows) / len(rows)
    per_request = [r["plain"]["wall_s"] / r["prediction"]["wall_s"] for r in rows]
    summary["per_request_speedup"] = {"min": min(per_request), "median": sorted(per_request)[len(per_request) // 2],
                                      "max": max(per_request)}
    report = {
        "workload": {"description": __doc__.split("\n\n")[1].strip(), "system": SYSTEM, "prompt_template": PROMPT,
                     "num_requests": len(rows), "max_tokens": a.max_tokens, "stop": a.stop, "concurrency": 1,
                     "temperature": 0, "repeats": a.repeats, "timing": "fastest of the repeats per request"},
        "config": {"model": model, "dtype": str(engine.target.dtype).removeprefix("torch."),
                   "device": str(engine.target.device), "threads": torch.get_num_threads(),
                   "method": engine.info.method, "num_prediction_tokens": cfg.engine.num_prediction_tokens,
                   "overrides": overrides},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__},
        "summary": summary,
        "requests": rows,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    s = summary
    print(f"plain      {s['plain']['tokens_per_second']:6.1f} tok/s  ({s['plain']['completion_tokens']} tokens)")
    print(f"prediction {s['prediction']['tokens_per_second']:6.1f} tok/s  accepted {s['prediction']['accepted_prediction_tokens']}"
          f" rejected {s['prediction']['rejected_prediction_tokens']}")
    print(f"speedup {s['speedup']:.2f}x, identical outputs {s['identical_outputs']:.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a speech model's word bigram model (``audio.word_lm``), the counts its ctc drafter
spells with in context (``method.ctc_spelling: context``, what ``auto`` picks when the
model has one), from the sentences the model was trained on.

The sentences: the ShareGPT training sentences ``specserve-train`` drew for each
``--sharegpt SEED:COUNT`` (``train.speech_data.training_sentences``, exactly as the trainer
draws them) and the text model's everyday sentences kept in each ``--generated`` file (a
trainer's ``generated.jsonl``).  Never in it: the held-out test sentences
(``--exclude-file``, the fixtures' ``sentences.txt``: any sentence holding one) and the
validation sentences of each ``--valid-data`` recordings file (``data.npz`` /
``data_gen.npz``: the texts past ``num_train``), so gate calibration on those stays
held out.  ``--model`` gets ``spelling_lm.json.gz`` and ``config.json``'s
``specserve.spelling_lm``.

  python scripts/speech_spelling_lm.py --model specserve/assets/smollm2-135m-speech \\
      --sharegpt 0:8000 1:12000 --generated outputs/speech/generated.jsonl \\
      --valid-data outputs/speech/data.npz outputs/speech/data_gen.npz
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specserve.audio.text import normalize_transcript
from specserve.audio.word_lm import WordBigramLM
from specserve.train.speech import load_recordings
from specserve.train.speech_data import training_sentences
from specserve.train.speech_text import sentences_of

FILE = "spelling_lm.json.gz"


def corpus(sharegpt: list[tuple[int, int]], generated: list[Path], held: list[str],
           valid: set[str]) -> tuple[list[str], list[str]]:
    """The ShareGPT and the generated training sentences, held-out and validation ones left out."""
    held_n = [normalize_transcript(h) for h in held]

    def kept(sentences: list[str]) -> list[str]:
        return [s for s in sentences if s not in valid and not any(h in s for h in held_n)]

    shared: list[str] = []
    for seed, count in sharegpt:  # the trainer draws count + its validation sentences; the first count train
        shared += training_sentences(count, held, seed=seed)
    gen: list[str] = []
    for path in generated:
        for line in path.read_text().splitlines():
            if line.strip():
                for text in json.loads(line):
                    gen += sentences_of(text)
    return kept(shared), kept(gen)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the speech model directory (config.json)")
    ap.add_argument("--sharegpt", nargs="*", default=[], help="SEED:COUNT of each training run's ShareGPT sentences")
    ap.add_argument("--generated", nargs="*", default=[], type=Path, help="trainers' generated.jsonl files")
    ap.add_argument("--valid-data", nargs="*", default=[], type=Path, help="recordings whose validation texts stay out")
    ap.add_argument("--exclude-file", default="tests/fixtures/speech/sentences.txt", type=Path)
    a = ap.parse_args(argv)
    cfg_path = Path(a.model) / "config.json"
    if not cfg_path.is_file():
        ap.error(f"--model must be a model directory holding config.json; got {a.model!r}")
    try:
        sharegpt = [(int(s.split(":")[0]), int(s.split(":")[1])) for s in a.sharegpt]
    except (IndexError, ValueError):
        ap.error(f"--sharegpt takes SEED:COUNT pairs; got {a.sharegpt!r}")
    held = [s for s in a.exclude_file.read_text().splitlines() if s.strip()]
    valid: set[str] = set()
    for p in a.valid_data:
        d = load_recordings(p)
        valid.update(d["texts"][d["num_train"]:])
    shared, gen = corpus(sharegpt, a.generated, held, valid)
    sentences = shared + gen
    if not sentences:
        ap.error("no sentences: give --sharegpt and/or --generated")
    lm = WordBigramLM.from_sentences(sentences)
    lm.save(Path(a.model) / FILE)
    cfg = json.loads(cfg_path.read_text())
    extra = cfg.setdefault("specserve", {})
    extra["spelling_lm"] = FILE
    extra["spelling_lm_source"] = {"sharegpt_sentences": len(shared), "sharegpt_seeds": a.sharegpt,
                                   "generated_sentences": len(gen), "script": "scripts/speech_spelling_lm.py"}
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    print(json.dumps({"sentences": len(sentences), "words": len(lm.unigrams), "bigrams": len(lm.bigrams),
                      "bytes": (Path(a.model) / FILE).stat().st_size}))


if __name__ == "__main__":
    main()

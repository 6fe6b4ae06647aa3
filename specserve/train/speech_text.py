"""Everyday English sentences written by the text model itself, for training the embedded
speech model (``specserve.train.speech``, ``data.generated_sentences``).

The ShareGPT training pool (``speech_data.training_sentences``) is conversational and
technical: it rarely says "bread", "coat" or "river".  These sentences fill that gap: the
frozen text model is asked, topic by topic from ``TOPICS`` (everyday life, written for
this purpose), for ten short plain sentences (specserve's own engine samples them:
temperature 0.9, top-p 0.95, a seed per prompt); the lines are normalised as transcripts are
(``audio.text``), kept when they hold 3 to 14 plain words, deduplicated, and never one of
the excluded (held-out test) sentences nor a sentence containing one.  Sampling is seeded
(the same sentences on a rerun with the same thread count); the batches written so far
are kept in a JSONL file, so an interrupted run goes on where it stopped.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from specserve.audio.text import normalize_transcript

log = logging.getLogger(__name__)

TOPICS = [
    # home and family
    "cooking dinner", "breakfast", "cleaning the house", "a messy bedroom", "doing the laundry", "washing the dishes",
    "a new sofa", "moving to a new house", "a family dinner", "grandparents", "a baby sister", "brothers and sisters",
    "a birthday party", "a wedding", "a quiet evening at home", "watching television", "a broken window",
    "fixing a leaking tap", "the neighbours", "a garden shed", "feeding the cat", "walking the dog", "a pet rabbit",
    "a goldfish", "a parrot", "bedtime", "getting up early", "a lazy sunday", "a holiday at home",
    # food and shops
    "baking a cake", "making soup", "fruit and vegetables", "a bakery", "a coffee shop", "a restaurant",
    "ordering food", "a picnic lunch", "a farmers market", "the supermarket", "buying new shoes", "a toy shop",
    "a bookshop", "paying at the checkout", "a cup of tea", "ice cream on a hot day", "a school lunch", "spicy food",
    "a recipe from grandmother", "a sandwich", "a barbecue", "a birthday cake", "eating out with friends",
    # school and work
    "a day at school", "a science lesson", "a maths test", "homework", "a school trip", "the school playground",
    "a new teacher", "a music lesson", "learning to read", "a university lecture", "an exam", "a job interview",
    "the first day at a new job", "a busy office", "a team meeting", "working from home", "a factory", "a hospital",
    "a visit to the doctor", "a dentist appointment", "a police officer", "a fire station", "a nurse", "a builder",
    "a bus driver", "a shopkeeper", "a postman", "a pilot", "a farmer", "a chef", "a painter", "a musician",
    # town and travel
    "a busy street", "the town square", "a train station", "an airport", "a long train journey", "a bus ride",
    "riding a bicycle", "driving a car", "a traffic jam", "a taxi", "a ferry", "a map of the city", "getting lost",
    "a hotel room", "packing a suitcase", "a summer holiday", "a trip to the mountains", "a camping trip",
    "a walk in the park", "a city at night", "a small village", "a church", "a castle", "a museum visit",
    "a cinema", "a theatre show", "a concert", "a library", "a swimming pool", "a playground", "a zoo",
    # nature and weather
    "the weather", "a rainy afternoon", "a snowy morning", "a windy day", "a thunderstorm", "a hot summer",
    "autumn leaves", "spring flowers", "the winter", "the seaside", "a sandy beach", "the ocean", "a lake",
    "a forest", "a mountain", "a river", "a waterfall", "the night sky", "stars and planets", "the sunrise",
    "birds in the trees", "farm animals", "wild animals", "insects", "a horse", "cows in a field", "fishing",
    "planting trees", "growing vegetables", "a flower garden", "a big storm", "a foggy morning", "the moon",
    # people and feelings
    "a best friend", "making new friends", "a kind stranger", "an old man", "a little girl", "a young boy",
    "feeling tired", "feeling happy", "a bad day", "a surprise", "a funny joke", "an argument", "saying sorry",
    "helping a neighbour", "a phone call", "writing a letter", "sending a message", "a lost wallet",
    "keeping a secret", "a good book", "a favourite song", "a dream", "a scary movie", "a game of chess",
    # sport and free time
    "playing football", "a tennis match", "running a race", "swimming lessons", "a basketball game",
    "going to the gym", "yoga", "a bike race", "skiing", "a board game", "drawing pictures", "painting a picture",
    "playing the piano", "learning a language", "taking photos", "a hobby", "knitting", "building a model",
    "a video game", "dancing", "singing in a choir", "a football club", "a weekend trip", "a long walk",
    # things and time
    "a calendar", "the days of the week", "the months of the year", "a watch",
    "a mobile phone", "a computer", "a camera", "a kitchen", "a bathroom", "a bedroom", "a garage", "a roof",
    "a door and a key", "a chair", "a table", "a bag", "an umbrella", "clothes for winter", "a hat and gloves",
    "money", "a bank", "a post office", "a newspaper", "a radio", "a bicycle shop", "a car repair",
    "a market stall", "a road", "a tall building", "a lift", "stairs",
]

_NUMBERING = re.compile(r"^\s*\d+[.)]\s*")
_PLAIN = re.compile(r"^[A-Za-z ,;:'!?.\-]+$")


def _prompt(tok: Any, topic: str) -> str:
    msg = f"Write ten short, simple, everyday sentences about {topic}. Use plain words. One sentence per line."
    return tok.apply_chat_template([{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True) + "1."


def sentences_of(text: str) -> list[str]:
    """The usable normalised sentences of one generated answer (one per line)."""
    out = []
    for line in text.split("\n"):
        line = _NUMBERING.sub("", line).strip()
        if not line or not _PLAIN.match(line):
            continue
        s = normalize_transcript(line)
        if 3 <= len(s.split()) <= 14:
            out.append(s)
    return out


def generated_sentences(hf_dir: Path, num: int, exclude: list[str], seed: int, cache: Path,
                        batch_size: int = 48, max_new_tokens: int = 160) -> list[str]:
    """``num`` distinct normalised sentences written by the text model in ``hf_dir``
    (batches cached in ``cache``, a JSONL file)."""
    import torch

    held = [normalize_transcript(s) for s in exclude]
    held_set = set(held)
    batches: list[list[str]] = []
    if cache.is_file():
        batches = [json.loads(line) for line in cache.read_text().splitlines() if line.strip()]
    seen: set[str] = set()
    out: list[str] = []

    def take(texts: list[str]) -> None:
        for t in texts:
            for s in sentences_of(t):
                if s in seen or s in held_set or any(h in s for h in held):
                    continue
                seen.add(s)
                out.append(s)

    for b in batches:
        take(b)
    if len(out) >= num:
        return out[:num]
    from specserve.llm import LLM
    from specserve.request import SamplingParams

    llm = LLM(str(hf_dir), num_threads=torch.get_num_threads())  # the fused CPU decoder in bf16 where it runs
    tok = llm.engine.target.tokenizer  # the model's transformers tokenizer (renders the prompts)
    t0 = time.time()
    while len(out) < num:
        b = len(batches)
        topics = [TOPICS[(b * batch_size + i) % len(TOPICS)] for i in range(batch_size)]
        # keyed seeds: each prompt's draws depend on its own seed only, not on its batch
        params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=max_new_tokens,
                                 seed=seed * 1000003 + b * batch_size + i) for i in range(batch_size)]
        gen = llm.generate([_prompt(tok, t) for t in topics], params, use_tqdm=False, add_special_tokens=False)
        texts = ["1." + g.outputs[0].text for g in gen]
        with cache.open("a") as f:
            f.write(json.dumps(texts) + "\n")
        batches.append(texts)
        take(texts)
        log.info("generated sentences: %d/%d (batch %d, %.0f s)", len(out), num, b + 1, time.time() - t0)
    return out[:num]

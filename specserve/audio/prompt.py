"""The prompt of a transcription request: the model's chat template around one user
turn holding the audio placeholder and an instruction, as Granite Speech is prompted
("<|audio|>can you transcribe the speech into a written format?").

``transcription_prompt`` returns token ids with ``num_audio_tokens`` copies of the
model's ``audio_token_index`` where the placeholder stood; the engine replaces those
rows' input embeddings with the projector's outputs.  Used alike by the serving doors,
the offline API, the benchmark and the trainer, so a model is served with the prompt it
was trained on.  No torch.
"""

from __future__ import annotations

from typing import Any

DEFAULT_INSTRUCTION = "can you transcribe the speech into a written format?"
_PLACEHOLDER = "\u2063AUDIO\u2063"  # never produced by a tokenizer's text


def transcription_prompt(tokenizer: Any, audio_token_index: int, num_audio_tokens: int,
                         instruction: str | None = DEFAULT_INSTRUCTION, context: str | None = None,
                         system: str | None = None) -> list[int]:
    """Token ids of the prompt.  ``context``: the client's ``prompt`` field (earlier text
    of the same recording or spellings to follow), placed after the instruction.
    ``instruction`` and ``system``: the model's own (``SpeechSpec``: a model may declare
    them in its config; None: the Granite instruction, and the template's default system
    turn)."""
    instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
    text = " ".join(t for t in (instruction, context) if t)
    content = _PLACEHOLDER + text
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        rendered = content
    before, sep, after = rendered.partition(_PLACEHOLDER)
    if not sep:
        raise ValueError("the chat template dropped the audio placeholder")
    ids_before = tokenizer(before, add_special_tokens=False).input_ids if before else []
    ids_after = tokenizer(after, add_special_tokens=False).input_ids if after else []
    # the client's text must not smuggle audio positions in
    ids_before = [t for t in ids_before if t != audio_token_index]
    ids_after = [t for t in ids_after if t != audio_token_index]
    return ids_before + [audio_token_index] * num_audio_tokens + ids_after

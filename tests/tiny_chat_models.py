"""Tiny random chat models with tool-calling and thinking chat templates written for the
tests: a Qwen3 (Qwen-style template: tools as JSON lines in <tools>, calls as
<tool_call>{json}</tool_call>, tool results as <tool_response> user turns, a think block
opened in the prompt, closed when enable_thinking is false) and a Llama (Llama 3.1-style:
tools in the first user message, calls as {"name", "parameters"} JSON, results under an
ipython header).  Byte-level tokenizers, so any text is expressible, with the markers as
added tokens as the real models have them."""

from __future__ import annotations

from pathlib import Path

from tiny_models import make_tiny_model

QWEN_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'user' or m.role == 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

LLAMA_TEMPLATE = """<|begin_of_text|>
{%- if messages[0].role == 'system' %}<|start_header_id|>system<|end_header_id|>

{{ messages[0].content }}<|eot_id|>
{%- endif %}
{%- set ns = namespace(first_user=true) %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'user' %}<|start_header_id|>user<|end_header_id|>

{% if tools and ns.first_user %}Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.

{% for t in tools %}{{ t | tojson }}

{% endfor %}{% endif %}{%- set ns.first_user = false %}{{ m.content }}<|eot_id|>
{%- elif m.role == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>

{% if m.tool_calls %}{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

QWEN_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
QWEN_MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
LLAMA_SPECIALS = ["<unk>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|python_tag|>"]  # fmt: skip


def _tokenizer(out: Path, specials: list[str], markers: list[str], eos: str, template: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(specials + sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in markers])  # text, as in Qwen3
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos, pad_token=eos)
    fast.chat_template = template
    fast.save_pretrained(out)


def _model(out: Path, arch: str, specials: list[str], markers: list[str], eos: str, template: str,
           seed: int) -> Path:  # fmt: skip
    eos_id = specials.index(eos)
    make_tiny_model(out, arch, seed=seed, eos_token_id=eos_id, bos_token_id=None, max_position_embeddings=2048)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (out / f).unlink(missing_ok=True)
    _tokenizer(out, specials, markers, eos, template)
    return out


def make_qwen_chat_model(out: Path, seed: int = 0) -> Path:
    """A tiny Qwen3 with the Qwen-style tools + thinking template (EOS <|im_end|>)."""
    return _model(out, "qwen3", QWEN_SPECIALS, QWEN_MARKERS, "<|im_end|>", QWEN_TEMPLATE, seed)


def make_llama_chat_model(out: Path, seed: int = 0) -> Path:
    """A tiny Llama with the Llama 3.1-style tools template (EOS <|eot_id|>)."""
    return _model(out, "llama", LLAMA_SPECIALS, [], "<|eot_id|>", LLAMA_TEMPLATE, seed)

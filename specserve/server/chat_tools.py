"""The chat endpoints' tools and reasoning: request fields in, OpenAI's answer shapes out.

Shared by ``/v1/chat/completions`` (``http_app``), ``/v1/responses`` (``responses``) and
gRPC (``grpc_service``), around ``specserve.formats.chat``:

* :func:`chat_formats`: the server's formats (``ModelInfo.tool_call_format`` /
  ``reasoning_format``, resolved by the engine from ``model.*`` or the chat template) and
  its options (``server.enable_auto_tool_choice``, ``reasoning_content_alias``,
  ``default_chat_template_kwargs``, ``thinking_budget_message``), once per front end;
* :func:`render_chat`: validate a request's tools and messages (control tokens outside
  message contents, tool schemas) and render the prompt with its tools and
  ``chat_template_kwargs``, in the front end's worker threads;
* :class:`ChatAnswers`: each choice's answer parsed as it streams (``Answer``): the whole
  message, or the deltas of one engine output as OpenAI's chunks.
"""

from __future__ import annotations

from typing import Any

from specserve.errors import InvalidRequestError
from specserve.formats.chat import (
    Answer,
    ChatFormats,
    ChatPlan,
    check_tool_schemas,
    control_token_problem,
)

__all__ = ["ChatAnswers", "chat_formats", "chat_plan", "render_chat"]

_FORMATS_ATTR = "_chat_formats"


def chat_formats(fe: Any) -> ChatFormats:
    """The front end's ``ChatFormats`` (built on first use)."""
    formats = getattr(fe, _FORMATS_ATTR, None)
    if formats is None:
        info, cfg = fe.engine.info, fe.cfg
        formats = ChatFormats(
            getattr(info, "tool_call_format", None), getattr(info, "reasoning_format", None),
            auto_tool_choice=getattr(cfg, "enable_auto_tool_choice", True),
            reasoning_content_alias=getattr(cfg, "reasoning_content_alias", True),
            default_template_kwargs=dict(getattr(cfg, "default_chat_template_kwargs", None) or {}),
            budget_message=getattr(cfg, "thinking_budget_message", "") or "",
        )  # fmt: skip
        setattr(fe, _FORMATS_ATTR, formats)
    return formats


def chat_plan(fe: Any, body: dict, flat: bool = False) -> ChatPlan:
    """A request body's tools, tool choice, reasoning and template fields (400 naming the bad one)."""
    return ChatPlan.from_fields(
        chat_formats(fe), tools=body.get("tools"), tool_choice=body.get("tool_choice"),
        parallel_tool_calls=body.get("parallel_tool_calls"), chat_template_kwargs=body.get("chat_template_kwargs"),
        separate_reasoning=body.get("separate_reasoning"), thinking_token_budget=body.get("thinking_token_budget"),
        flat=flat,
    )  # fmt: skip


async def render_chat(fe: Any, messages: list[dict[str, Any]], plan: ChatPlan, flat: bool = False,
                      add_special_tokens: bool = False, truncate: int | None = None) -> list[int]:  # fmt: skip
    """The prompt's token ids: the messages rendered with the plan's tools and template
    keywords, after their checks (all in the front end's worker threads); vLLM's
    ``add_special_tokens`` and ``truncate_prompt_tokens`` as ``Frontend.tokenize_messages_async``."""
    tok = fe.engine.tokenizer

    def checks() -> None:
        if plan.tools:
            check_tool_schemas(plan.tools, flat=flat)
        control_token_problem(plan, messages, list(getattr(tok, "special_texts", []) or []))

    if plan.tools or any(len(m) > 2 for m in messages) or plan.template_kwargs:
        await fe.run_off_loop(checks)
    return await fe.tokenize_messages_async(messages, add_special_tokens, truncate, tools=plan.template_tools,
                                            template_kwargs=plan.template_kwargs)  # fmt: skip


class ChatAnswers:
    """Every choice's parsed answer, by choice index (one prompt: its reasoning state is
    read once from its tokens)."""

    def __init__(self, plan: ChatPlan, tokenizer: Any, prompt_ids: list[int]):
        self.plan = plan
        self.state = plan.prompt_state(tokenizer, prompt_ids) if plan.reasoning_on else None
        self._answers: dict[int, Answer] = {}
        self._finished: set[int] = set()

    @property
    def active(self) -> bool:
        """Whether answers need parsing at all (tools to read, or reasoning to split)."""
        return self.plan.parses_tools or (self.plan.reasoning_on and self.plan.separate_reasoning)

    def answer(self, index: int) -> Answer:
        a = self._answers.get(index)
        if a is None:
            a = self._answers[index] = self.plan.answer(self.state)
        return a

    def events(self, index: int, new_text: str, finished: bool) -> list:
        a = self.answer(index)
        events = a.feed(new_text)
        if finished:
            events += a.finish()
        return events

    def message(self, index: int, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole answer's ``message`` and OpenAI's finish reason."""
        a = self.plan.answer(self.state)
        a.feed(text)
        a.finish()
        return a.message(), self.plan.finish_reason(finish, a)

    def chunk_choices(self, index: int, new_text: str, finish: str | None, logprobs: Any) -> list[dict[str, Any]]:
        """One engine output as OpenAI chunk choices: one per event (a call's first delta
        apart from its arguments), the log-probabilities on the first, the finish reason on
        the last (an empty delta when the output added no event)."""
        a = self.answer(index)
        events = self.events(index, new_text, finish is not None)
        out = [{"index": index, "delta": a.delta(e), "logprobs": None, "finish_reason": None} for e in events]
        if finish is not None:
            reason = self.plan.finish_reason(finish, a)
            if out:
                out[-1]["finish_reason"] = reason
            else:
                out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        if logprobs is not None:
            if not out:
                out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": None})
            out[0]["logprobs"] = logprobs
        return out

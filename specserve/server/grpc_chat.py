"""gRPC's tools and reasoning: ``GenerateRequest`` fields 60-64 in, ``GenerateResponse``
fields 60-62 out, through the same plan and answer parsing as the chat endpoint
(``chat_tools``, ``formats.chat``)."""

from __future__ import annotations

import json
from typing import Any

from specserve.errors import InvalidRequestError
from specserve.formats.chat import ChatPlan, template_messages
from specserve.formats.tools.base import ToolEvent
from specserve.server.chat_tools import chat_formats
from specserve.v1 import specserve_pb2 as pb

__all__ = ["GrpcAnswer", "grpc_messages", "grpc_plan"]


def grpc_messages(messages: Any) -> list[dict[str, Any]]:
    """Proto chat messages as template messages (tool calls, tool results, reasoning)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["content"] = m.content or None
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in m.tool_calls]  # fmt: skip
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
        if m.name:
            d["name"] = m.name
        out.append(d)
    return template_messages(out)


def grpc_plan(fe: Any, request: Any, chat: bool) -> ChatPlan:
    """The request's tools, choice, reasoning and template fields (INVALID_ARGUMENT naming one)."""
    tools = []
    for i, t in enumerate(request.tools):
        fn: dict[str, Any] = {"name": t.name, "strict": t.strict}
        if t.description:
            fn["description"] = t.description
        if t.parameters_json:
            try:
                fn["parameters"] = json.loads(t.parameters_json)
            except ValueError as e:
                raise InvalidRequestError(f"tools[{i}].parameters_json", f"is not valid JSON: {e}") from None
        tools.append({"type": "function", "function": fn})
    if tools and not chat:
        raise InvalidRequestError("tools", "needs messages input (the chat template renders them)")
    choice: Any = None
    if request.HasField("tool_choice"):
        tc = request.tool_choice
        if tc.function and tc.mode:
            raise InvalidRequestError("tool_choice", "set mode or function, not both")
        choice = {"type": "function", "function": {"name": tc.function}} if tc.function else (tc.mode or None)
    kwargs = None
    if request.chat_template_kwargs_json:
        try:
            kwargs = json.loads(request.chat_template_kwargs_json)
        except ValueError as e:
            raise InvalidRequestError("chat_template_kwargs_json", f"is not valid JSON: {e}") from None
    sp = request.sampling_params
    budget = sp.thinking_token_budget if sp.HasField("thinking_token_budget") else None
    return ChatPlan.from_fields(
        chat_formats(fe), tools=tools or None, tool_choice=choice,
        parallel_tool_calls=request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None,
        chat_template_kwargs=kwargs,
        separate_reasoning=request.separate_reasoning if request.HasField("separate_reasoning") else None,
        thinking_token_budget=budget,
    )  # fmt: skip


class GrpcAnswer:
    """One request's answer parsed into ``GenerateResponse``'s content, reasoning and tool
    calls: a call's first delta carries its index, id and name, later ones its index and an
    arguments fragment."""

    def __init__(self, plan: ChatPlan, state: str | None):
        self.plan, self.state = plan, state
        self.streamed = plan.answer(state)

    @staticmethod
    def _fill(msg: Any, events: list[ToolEvent]) -> None:
        for e in events:
            if e.kind == "reasoning":
                msg.reasoning += e.text
            elif e.kind == "content":
                msg.content += e.text
            elif e.kind == "call":
                msg.tool_calls.append(pb.ToolCall(index=e.index, id=e.id, name=e.text))
            else:
                msg.tool_calls.append(pb.ToolCall(index=e.index, arguments=e.text))

    def delta(self, msg: Any, new_text: str, finish: str | None) -> str | None:
        """Fill one streamed message; returns the finish reason to send (tool_calls for calls)."""
        a = self.streamed
        self._fill(msg, a.feed(new_text) + (a.finish() if finish is not None else []))
        return self.plan.finish_reason(finish, a)

    def whole(self, msg: Any, text: str, finish: str | None) -> str | None:
        """Fill the whole answer; returns the finish reason to send."""
        a = self.plan.answer(self.state)
        a.feed(text)
        a.finish()
        msg.reasoning, msg.content = a.reasoning, a.content
        msg.tool_calls.extend(pb.ToolCall(index=c.index, id=c.id, name=c.name, arguments=c.arguments) for c in a.calls)
        return self.plan.finish_reason(finish, a)

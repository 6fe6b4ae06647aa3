"""OpenAI's Responses API: ``POST /v1/responses`` (what the OpenAI Agents SDK calls by default).

Stateless: each request carries its whole conversation.  ``input`` is a string (one user
turn) or items: messages (``role`` + text or ``input_text``/``output_text`` parts),
``function_call`` (a call the model made: becomes an assistant turn's ``tool_calls``),
``function_call_output`` (its result: a ``tool`` turn) and ``reasoning`` (handed back to
the template as the next assistant turn's ``reasoning_content``).  ``instructions``
becomes the system turn.  ``tools`` are flat function tools (``{"type": "function",
"name", "parameters", "strict"}``), ``tool_choice`` and ``parallel_tool_calls`` as in
chat (``formats.chat``), ``max_output_tokens``, ``temperature``, ``top_p``,
``text.format`` (``json_object`` / ``json_schema``), and the chat endpoint's extensions
(``chat_template_kwargs``, ``thinking_token_budget``, ``seed``, ``cache_salt``).
``previous_response_id``, ``store: true``, ``conversation`` and ``background: true``
need stored responses: a 400 naming the field.

The answer's output items are ``reasoning`` (its text as ``reasoning_text`` content),
``message`` (``output_text``) and ``function_call`` (``call_id``, ``name``,
``arguments``), in the order the model wrote them.  Streamed (``stream: true``), the
typed events OpenAI sends: ``response.created``, ``response.in_progress``, per item
``response.output_item.added`` ... ``response.output_item.done`` with the content part,
``response.reasoning_text.delta``, ``response.output_text.delta`` and
``response.function_call_arguments.delta`` events between, then ``response.completed``
(``response.incomplete`` when ``max_output_tokens`` cut it).  An error after the first
event arrives as an ``error`` event.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from specserve.errors import InvalidRequestError
from specserve.formats.chat import ChatPlan, apply_plan, reasoning_tokens, template_messages
from specserve.formats.tools.base import ToolEvent
from specserve.request import StructuredOutputsParams
from specserve.server.chat_tools import chat_plan, render_chat
from specserve.server.errors import INTERNAL, classify, openai_error_body
from specserve.server.frontend import SamplingFields

log = logging.getLogger("specserve.server.http")

__all__ = ["create_response", "input_messages"]

_STATEFUL = {
    "previous_response_id": "needs stored responses, which this server does not keep: send the whole conversation in input",
    "conversation": "needs stored conversations, which this server does not keep: send the whole conversation in input",
}


def _hex(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- input


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}[{j}]", "only text parts (input_text, output_text) are supported")
            out.append(part["text"])
        return "".join(out)
    raise InvalidRequestError(where, "must be a string or a list of text parts")


def input_messages(body: dict) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages (OpenAI's chat shape, tool calls included)."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequestError("instructions", "must be a string")
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequestError("input", "is required: a string or a non-empty list of items")
    reasoning: str | None = None  # a reasoning item waits for the assistant turn it belongs to
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(f"{where}.role", "must be user, system, developer or assistant")
            msg: dict[str, Any] = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise InvalidRequestError(f"{where}.{key}", "must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # calls of one turn
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequestError(f"{where}.call_id", "must be the call_id of the call it answers")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise InvalidRequestError(f"{where}.content", "must be a list of reasoning_text parts")
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:
            raise InvalidRequestError(f"{where}.type", f"{str(kind)[:40]!r} is not supported (message, function_call, "
                                      "function_call_output, reasoning)")  # fmt: skip
    return out


def _format(body: dict) -> StructuredOutputsParams | None:
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError("text.format", 'type must be "text", "json_object" or "json_schema"')
    if fmt["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequestError("text.format.schema", "must be a JSON schema object")
        return StructuredOutputsParams(json=fmt["schema"])
    return None


def _check_stateless(body: dict) -> None:
    for key, why in _STATEFUL.items():
        if body.get(key) is not None:
            raise InvalidRequestError(key, why)
    if body.get("store") is True:
        raise InvalidRequestError("store", "true needs stored responses, which this server does not keep: send "
                                  "store: false (or leave it out)")  # fmt: skip
    if body.get("background") is True:
        raise InvalidRequestError("background", "background responses are not supported")
    for key in ("store", "stream", "background"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise InvalidRequestError(key, "must be a boolean")


# --------------------------------------------------------------------------- output


class ResponseState:
    """The response object and its output items, built from the answer's events; with
    ``emit``, the typed stream events as they happen."""

    def __init__(self, body: dict, model: str, plan: ChatPlan, emit=None):
        self.id = _hex("resp")
        self.created = int(time.time())
        self.body, self.model, self.plan = body, model, plan
        self.output: list[dict[str, Any]] = []
        self.emit = emit
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the item being written
        self.calls: dict[int, int] = {}  # call index -> output index

    def event(self, kind: str, **fields: Any) -> None:
        if self.emit is not None:
            self.emit({"type": kind, "sequence_number": self.seq, **fields})
            self.seq += 1

    def response(self, status: str, usage: dict | None = None, incomplete: str | None = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": self.output if status != "in_progress" else [], "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.get("instructions"), "metadata": b.get("metadata") or {},
            "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
            "temperature": b.get("temperature"), "top_p": b.get("top_p"), "max_output_tokens": b.get("max_output_tokens"),
            "tool_choice": b.get("tool_choice", "auto" if self.plan.tools else "none"),
            "tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.schema(),
                       "strict": t.strict} for t in self.plan.tools],
            "text": b.get("text") or {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "usage": usage,
        }  # fmt: skip

    # ---------------------------------------------------------------- items

    def _close(self) -> None:
        item = self.open
        if item is None:
            return
        self.open = None
        index = self.output.index(item)
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=part["text"], logprobs=[])  # fmt: skip
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        elif item["type"] == "reasoning":
            part = item["content"][0]
            self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=part["text"])  # fmt: skip
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        else:
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       arguments=item["arguments"])  # fmt: skip
        self.event("response.output_item.done", output_index=index, item=item)

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> int:
        self._close()
        index = len(self.output)
        self.output.append(item)
        self.open = item
        added = {**item, "status": "in_progress", "content": []} if part is not None else dict(item)
        self.event("response.output_item.added", output_index=index, item=added)
        if part is not None:
            item["content"] = [part]
            self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                       part=dict(part))  # fmt: skip
        return index

    def feed(self, events: list[ToolEvent]) -> None:
        for e in events:
            item = self.open
            if e.kind == "reasoning":
                if item is None or item["type"] != "reasoning":
                    self._start({"type": "reasoning", "id": _hex("rs"), "summary": [], "status": "in_progress"},
                                {"type": "reasoning_text", "text": ""})  # fmt: skip
                    item = self.open
                item["content"][0]["text"] += e.text
                self.event("response.reasoning_text.delta", item_id=item["id"], output_index=len(self.output) - 1,
                           content_index=0, delta=e.text)  # fmt: skip
            elif e.kind == "content":
                if item is None or item["type"] != "message":
                    self._start({"type": "message", "id": _hex("msg"), "role": "assistant", "status": "in_progress"},
                                {"type": "output_text", "text": "", "annotations": [], "logprobs": []})  # fmt: skip
                    item = self.open
                item["content"][0]["text"] += e.text
                self.event("response.output_text.delta", item_id=item["id"], output_index=len(self.output) - 1,
                           content_index=0, delta=e.text, logprobs=[])  # fmt: skip
            elif e.kind == "call":
                index = self._start({"type": "function_call", "id": _hex("fc"), "call_id": e.id, "name": e.text,
                                     "arguments": "", "status": "in_progress"}, None)  # fmt: skip
                self.calls[e.index] = index
            else:
                index = self.calls[e.index]
                self.output[index]["arguments"] += e.text
                self.event("response.function_call_arguments.delta", item_id=self.output[index]["id"],
                           output_index=index, delta=e.text)  # fmt: skip

    def finish(self) -> None:
        self._close()


# --------------------------------------------------------------------------- the handler


def _sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


async def create_response(request: web.Request, fe: Any, body: dict, tenant: str | None) -> web.StreamResponse:
    """``POST /v1/responses`` (see the module docstring)."""
    _check_stateless(body)
    stream = body.get("stream") is True
    plan = chat_plan(fe, body, flat=True)
    messages = input_messages(body)
    ids = await render_chat(fe, template_messages(messages), plan, flat=True)
    fields = SamplingFields(temperature=body.get("temperature"), top_p=body.get("top_p"),
                            max_tokens=body.get("max_output_tokens"), seed=body.get("seed"),
                            structured_outputs=_format(body), cache_salt=body.get("cache_salt"))  # fmt: skip
    try:
        params = fe.make_params(fields, tenant, len(ids))
    except InvalidRequestError as e:
        if e.field == "max_tokens":
            raise InvalidRequestError("max_output_tokens", str(e).split(": ", 1)[1]) from None
        raise
    tok = fe.engine.tokenizer
    params = apply_plan(plan, params, ids, tok, field="text.format")
    req = fe.prepare(None, ids, params, tenant)
    state_of = plan.prompt_state(tok, ids) if plan.reasoning_on else None
    answer = plan.answer(state_of)
    response: web.StreamResponse | None = None
    pending: list[dict] = []
    st = ResponseState(body, fe.model_name, plan, emit=pending.append if stream else None)

    async def flush() -> None:
        for ev in pending:
            await response.write(_sse(ev))
        pending.clear()

    last = None
    async with aclosing(fe.stream(req)) as outputs:
        try:
            async for out in outputs:
                if stream and response is None:  # headers after the first output: earlier errors keep their status
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                           "X-Accel-Buffering": "no"})  # fmt: skip
                    await response.prepare(request)
                    st.event("response.created", response=st.response("in_progress"))
                    st.event("response.in_progress", response=st.response("in_progress"))
                last = out
                st.feed(answer.feed(out.new_text))
                if out.finished:
                    st.feed(answer.finish())
                if stream:
                    await flush()
        except ConnectionError:
            raise
        except Exception as exc:
            if response is None:
                raise
            fe.record_error(exc)
            if classify(exc) is INTERNAL:
                log.error("Responses stream failed", exc_info=exc)
            err = openai_error_body(exc)[1]["error"]
            st.event("error", code=err.get("code") or err.get("type"), message=err["message"], param=err.get("param"))
            await flush()
            await response.write_eof()
            return response
    assert last is not None and last.finished, "the engine ended a stream without a final output"
    st.finish()
    n_out = len(last.token_ids)
    usage = {"input_tokens": last.num_prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": n_out,
             "output_tokens_details": {"reasoning_tokens": reasoning_tokens(plan, tok, state_of, last.token_ids)},
             "total_tokens": last.num_prompt_tokens + n_out}  # fmt: skip
    reason = last.finish_reason.value if last.finish_reason is not None else None
    status = {"length": "incomplete", "abort": "cancelled"}.get(reason, "completed")
    final = st.response(status, usage, "max_output_tokens" if reason == "length" else None)
    if not stream:
        return web.json_response(final)
    st.event({"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed"),
             response=final)
    await flush()
    await response.write_eof()
    return response


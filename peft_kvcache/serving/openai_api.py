"""The OpenAI chat completions wire format the server speaks: the request (checked field by field into a
`RequestError` that says what is wrong), the chat template, the text a reply streams (cut at stop strings),
and the response, chunk and error bodies.

Example:
    >>> request = parse_chat_request({"model": "shout", "messages": [{"role": "user", "content": "hi"}]})
    >>> request.model, request.stream, request.stop_strings()
    ('shout', False, [])
    >>> error_body(RequestError("The model `x` does not exist.", 404, "model", "model_not_found"))["error"]["code"]
    'model_not_found'
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from transformers.generation.streamers import BaseStreamer

from ..errors import RequestError

# Used when the tokenizer has no chat template of its own: role-tagged turns, each closed by the EOS token,
# and the assistant's turn opened for the reply.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MAX_STOP_STRINGS = 4  # as OpenAI's API


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # "name" and other fields the template may ignore

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The fields of ``POST /v1/chat/completions`` this server honours; any other field is refused if it asks
    for something the server does not do (``n`` > 1, ``logprobs``, ``tools``, penalties), ignored otherwise."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    # Asked for, these would change the answer's meaning: refused (`unsupported`) rather than ignored.
    n: int | None = None
    logprobs: bool | None = None
    tools: list[dict] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def unsupported(self) -> None:
        """Refuse what this server does not do, naming the field."""
        refused = {"n": self.n not in (None, 1), "logprobs": bool(self.logprobs), "tools": bool(self.tools),
                   "presence_penalty": self.presence_penalty not in (None, 0),
                   "frequency_penalty": self.frequency_penalty not in (None, 0)}
        for name, asked in refused.items():
            if asked:
                raise RequestError(f"{name}: not supported by this server ({name}={getattr(self, name)!r})", param=name)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise RequestError(f"stop: give at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
        return stops

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_chat_request(body) -> ChatRequest:
    """A `ChatRequest` from a decoded JSON body, or a `RequestError` (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        request = ChatRequest.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise RequestError(f"{where}: {first['msg']}", param=where.split(".")[0]) from None
    request.stop_strings()  # checks them
    request.unsupported()
    return request


def decode_json(raw: bytes):
    """The decoded JSON of a request body, or a `RequestError` (400)."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from None


def render_prompt(tokenizer, messages: Sequence[ChatMessage]) -> torch.Tensor:
    """The token ids ``[n]`` of ``messages`` rendered with the tokenizer's chat template (or
    `FALLBACK_CHAT_TEMPLATE`) with the assistant's turn opened; the template's text is tokenized without
    adding special tokens again. A template that refuses the messages gives a `RequestError`."""
    from jinja2 import TemplateError

    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False, add_generation_prompt=True)
    except TemplateError as err:
        raise RequestError(f"messages: the model's chat template refuses them: {err}", param="messages") from None
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)


class TextDeltas(BaseStreamer):
    """A generate() streamer that decodes the reply as it grows and hands ``emit`` each new piece of text,
    holding back an incomplete UTF-8 character and any tail that could start a stop string; once a stop string
    appears, the text is cut before it and `stop_hit` is set (poll it to stop generation). The first put is the
    prompt and is skipped; ``on_first`` is called at the first generated token.

    Example:
        >>> deltas = TextDeltas(tokenizer, ["\\n\\n"], emit=print)   # doctest: +SKIP
        >>> model.generate(ids, streamer=deltas); deltas.text        # doctest: +SKIP
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), emit: Callable[[str], None] | None = None,
                 on_first: Callable[[], None] | None = None):
        self.tokenizer, self.stop, self.emit, self.on_first = tokenizer, list(stop), emit, on_first
        self.ids: list[int] = []
        self.text, self.sent, self.stop_hit, self._puts = "", 0, False, 0
        self._window, self._read = 0, 0  # ids[_window:_read] give the decoder the context of the next ones

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 1 or self.stop_hit:
            return
        if self._puts == 2 and self.on_first is not None:
            self.on_first()
        self.ids.extend(torch.as_tensor(value).reshape(-1).tolist())
        piece = self._decode_new()
        if not piece:
            return
        searched = max(0, len(self.text) - max((len(s) for s in self.stop), default=1) + 1)
        text = self.text + piece
        cuts = [i for i in (text.find(s, searched) for s in self.stop) if i >= 0]
        if cuts:
            self.text, self.stop_hit = text[: min(cuts)], True
            self._flush(len(self.text))
            return
        self.text = text
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self._flush(len(text) - hold)

    def _decode_new(self) -> str:
        """The text the ids since the last call add, decoded with a few ids of context before them (a whole-reply
        decode at every token would be quadratic); empty while the ids end inside a UTF-8 character."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        window = decode(self.ids[self._window:])
        if window.endswith("\ufffd"):  # U+FFFD: the bytes of a character not all generated yet
            return ""
        piece = window[len(decode(self.ids[self._window:self._read])):]
        self._window, self._read = self._read, len(self.ids)
        return piece

    def end(self) -> None:
        self._flush(len(self.text))

    def _flush(self, upto: int) -> None:
        if upto > self.sent:
            piece, self.sent = self.text[self.sent: upto], upto
            if self.emit is not None:
                self.emit(piece)


# ----- bodies -----


def error_body(err: RequestError | str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    if isinstance(err, RequestError):
        message, param, code = str(err), err.param, err.code
        kind = "not_found_error" if err.status == 404 else kind
    else:
        message = err
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """The response's ``usage`` object, with the cached prompt tokens in ``prompt_tokens_details``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(request_id: str, created: int, model: str, text: str, finish_reason: str, usage_: dict,
                    extra: dict) -> dict:
    """A ``chat.completion`` object, with the server's ``peft_kvcache`` field."""
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage_, "peft_kvcache": extra}


def chunk_event(request_id: str, created: int, model: str, delta: dict | None, finish_reason: str | None = None,
                **fields) -> str:
    """One server-sent event holding a ``chat.completion.chunk`` (``delta`` None: the usage chunk, no choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, **fields}
    return f"data: {json.dumps(body)}\n\n"


DONE_EVENT = "data: [DONE]\n\n"

__all__ = ["ChatMessage", "ChatRequest", "DONE_EVENT", "FALLBACK_CHAT_TEMPLATE", "TextDeltas", "chunk_event",
           "completion_body", "decode_json", "error_body", "parse_chat_request", "render_prompt", "usage"]

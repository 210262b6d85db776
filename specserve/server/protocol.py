"""Pydantic models of the OpenAI API subset the server speaks (requests and responses).

Field ranges that OpenAI documents are declared here, so a bad value fails validation and the
app turns it into a 400 with an OpenAI error body. Checks that need the engine (context length,
vocabulary size, model name) live in the serving modules. Unknown request fields are ignored,
as OpenAI-compatible servers usually do, so newer clients keep working.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128  # fan-out cap: each choice is one engine request
MAX_TOP_LOGPROBS = 20
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1 - MAX_N  # seed + i must stay an int64


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingFields(_Request):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions commonly sent by benchmark clients
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # tokenized through the chat template
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- responses ---------------------------------------------------------------------------

class SpeculationUsage(BaseModel):
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    speculation: SpeculationUsage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "specserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: Any = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

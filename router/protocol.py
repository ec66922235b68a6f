"""Request bodies of the public HTTP APIs (pydantic): OpenAI completions, chat completions, tokenize / detokenize,
Anthropic messages and count_tokens, OpenAI Responses. Field types and ranges only — what a value means is decided in
router/serving.py, and the handlers (openai_api.py, anthropic_api.py, responses_api.py) read them.

Every body forbids unknown fields (a 400 naming the field, never silently ignored) and non-finite numbers (a 400
saying so, not a misleading range message). Fields accepted although they change nothing here say why.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from expertmesh.wire.sampling_params import MAX_LOGPROBS

METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds on `metadata`
# stop strings per request, on every surface (`stop`, Anthropic `stop_sequences`): OpenAI's documented bound, which
# vLLM applies to Anthropic's too; each is matched against the answer as it streams
MAX_STOP_SEQUENCES = 4


class AcceptedNoOps(BaseModel):
    """Parameters accepted although they change nothing here, each for a stated reason. Request bodies forbid any
    other unknown field (a 400 naming it, never silently ignored). Numbers must be finite: NaN / inf are a 400
    saying so (not a misleading range message)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    user: str | None = None  # an end-user id for a provider's abuse monitoring: no per-user state
    # tags stored with a request (a stored Response keeps and returns them), bounded as OpenAI bounds them
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None  # store: false is what this server does anyway
    parallel_tool_calls: Literal[True] | None = None  # several calls in one turn are parsed and returned
    service_tier: Literal["auto", "default", "standard_only"] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is None:
            return v
        if len(v) > METADATA_PAIRS:
            raise ValueError(f"at most {METADATA_PAIRS} key-value pairs, found {len(v)}")
        for key, value in v.items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(f"key {key[:16]!r}… longer than {METADATA_KEY_CHARS} characters")
            if len(value) > METADATA_VALUE_CHARS:
                raise ValueError(f"the value of {key!r} is longer than {METADATA_VALUE_CHARS} characters")
        return v


TokenId = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,12}$")]


MAX_SAMPLES = 16  # `n`: parallel samples of one request


class SamplingFields(AcceptedNoOps):
    """Sampling parameters beyond OpenAI's core ones (vLLM's names), shared by completions and chat; the vocabulary
    and everything else is checked with the rest (expertmesh.model.sampling.check_sampling), a 400 naming the field.
    What RL and eval tools send, as vLLM honours it: `n` parallel samples (sharing the prompt's cached KV, each its
    own seeded generator: seed + i), `ignore_eos` (generate to max_tokens), `return_token_ids`."""

    n: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    ignore_eos: bool = False
    return_token_ids: bool = False
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100, le=100)]] | None = None

    def sampling_kwargs(self) -> dict:
        bias = tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
        return {
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": bias,
        }


# ----------------------------------------------------------------------------------------------- OpenAI
def check_stop_count(v):
    if isinstance(v, list) and len(v) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, found {len(v)}")
    return v


class CompletionBody(SamplingFields):
    model: str
    prompt: str | list[int] | list[str]
    max_tokens: int | None = None  # unset: chat_prep.max_tokens_for decides (16, OpenAI's default)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    cache_salt: str | None = Field(default=None, min_length=1)  # router/prefix_scope.py

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return check_stop_count(v)


class ChatBody(SamplingFields):
    model: str
    messages: list[dict] = Field(min_length=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    stream: bool = False
    stream_options: dict | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    reasoning_effort: str | None = None
    thinking_budget: str | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # needs logprobs
    response_format: dict | None = None
    chat_template_kwargs: dict | None = None
    truncation: Literal["auto", "disabled"] = "disabled"  # the context-overflow policy (router/truncation.py)
    # whom the prompt's cached prefixes are shared with, further than the API key (router/prefix_scope.py)
    cache_salt: str | None = Field(default=None, min_length=1)
    prompt_cache_key: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return check_stop_count(v)


class TokenizeBody(BaseModel):
    """vLLM's `POST /tokenize`: a completions prompt, or a chat conversation rendered as the chat endpoint does."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[dict] | None = Field(default=None, min_length=1)
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # as on /v1/chat/completions: they decide the prompt (thinking off, and for a format that states them — K3 —
    # the tier, the tool choice and the response format), so the ids equal what the chat endpoint feeds
    reasoning_effort: str | None = None
    chat_template_kwargs: dict | None = None
    thinking_budget: str | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------------------------- Anthropic
class CountTokensBody(AcceptedNoOps):
    """What decides a messages request's prompt (Anthropic `POST /v1/messages/count_tokens`)."""

    model: str
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    thinking_budget: str | None = None


class MessagesBody(CountTokensBody):
    max_tokens: int
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stop_sequences: list[str] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, v):
        if v is not None and any(not s for s in v):
            raise ValueError("each stop sequence must be non-empty")
        return check_stop_count(v)


# ----------------------------------------------------------------------------------------------- Responses
class ResponsesBody(SamplingFields):
    """`POST /v1/responses`. Every field is honoured or refused (a 400 naming it); unknown fields are refused."""

    model: str
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    reasoning: dict | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    store: bool = True
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    include: list[str] | None = None
    text: dict | None = None
    background: Literal[False] | None = None
    prompt_cache_key: str | None = None  # a further scope of the prompt's cached prefixes (router/prefix_scope.py)
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: the same
    safety_identifier: str | None = None  # like `user`: no per-user state here
    stream_options: dict | None = None  # include_obfuscation: false (events are not padded)

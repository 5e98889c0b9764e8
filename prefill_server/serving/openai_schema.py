"""The parts of OpenAI request bodies the gateway reads, validated with clear messages.

Bodies are otherwise passed to the decode as sent (the fields read here as read: ``parse``), so these
models allow extra fields. The sampling fields are checked by the decode's own rules (vLLM's request classes and ``SamplingParams``,
the ranges OpenAI documents) before anything is computed: a body the decode would refuse is refused
here, not after its prompt was prefilled. Limits a decode sets itself (``--max-logprobs``, its number
of stop strings) stay the decode's to check.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, StrictStr, TypeAdapter,
                      ValidationError)

from prefill_server.engine.worker import check_client_salt
from prefill_server.errors import InvalidRequest
from prefill_server.serving.chat_messages import system_texts, template_message


def _number(value: Any) -> Any:
    """vLLM checks these counts before reading them: a string is refused, not read as a number."""
    if value is not None and not isinstance(value, (int, float)):
        raise ValueError("must be an integer")
    return value


def _null_is(default: Any) -> BeforeValidator:
    """A field vLLM reads null as its default (so code reading it sees that value, not None)."""
    return BeforeValidator(lambda v: default if v is None else v)


Count = Annotated[int, BeforeValidator(_number)]
# the keys of vLLM's StructuredOutputsParams of which exactly one is set
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class _JsonSchemaFormat(_Open):
    name: StrictStr
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class _StructuralTag(_Open):
    begin: StrictStr
    structural_tag_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    end: StrictStr


class _ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaFormat | None = None


class _TagFormat(_Open):
    type: Literal["structural_tag"]
    format: Any


class _LegacyTagFormat(_Open):
    type: Literal["structural_tag"]
    structures: list[_StructuralTag]
    triggers: list[StrictStr]


class _Function(_Open):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class _Tool(_Open):
    type: Literal["function"] = "function"
    function: _Function


class _NamedFunction(_Open):
    name: StrictStr


class _NamedToolChoice(_Open):
    function: _NamedFunction
    type: Literal["function"] = "function"


_INT64 = dict(ge=-2**63, le=2**63 - 1)


class _Body(BaseModel):
    # Typed as vLLM 0.32's request classes type them and read as leniently (pydantic's lax mode: "0.7"
    # is a temperature, 1 and "yes" are true, 1.0 is an integer; null only where vLLM's field allows
    # it), so a body its decode takes is taken here and one it refuses is refused before any work.
    # ``parse`` writes the values read back into the body, so what reads the body later sees them.
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    stream: Annotated[bool, _null_is(False)] = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # the ranges are SamplingParams'
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # (0 or -1: off)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    stop: StrictStr | list[StrictStr] | None = None
    prompt_logprobs: Count | None = Field(default=None, ge=-1)  # (-1: the whole vocabulary)
    seed: int | None = Field(default=None, **_INT64)  # a 64-bit seed, as vLLM takes
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=2**63 - 1)  # (-1: the context's length)
    # (the vocabulary's bounds are checked where the first token's sampling is built: ``first_draw``)
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    cache_salt: Any = None  # vLLM's rule, with its message: ``prefix_cache.check_client_salt``
    # read where the first token is the answer (``local_answer``, ``first_token``)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    user: StrictStr | None = None
    priority: int = Field(default=0, **_INT64)
    length_penalty: float = 1.0
    request_id: StrictStr = ""
    vllm_xargs: dict[str, StrictStr | int | float | list[StrictStr | int | float]] | None = None
    # an object of vLLM's StructuredOutputsParams fields (vLLM 0.32 answers 500 to any other value)
    structured_outputs: dict[str, Any] | None = None
    response_format: _ResponseFormat | _TagFormat | _LegacyTagFormat | None = None

    def _limit(self) -> int | None:
        return self.max_tokens

    @classmethod
    def precheck(cls, body: dict) -> None:
        """Fields refused before the body's own validation (their message is the useful one)."""

    def check(self) -> None:
        """The checks across fields (after each field's own)."""
        check_client_salt(self.cache_salt)
        if self.structured_outputs is not None and \
                sum(self.structured_outputs.get(k) is not None for k in _CONSTRAINTS) != 1:
            raise InvalidRequest(f"structured_outputs must set exactly one of {', '.join(_CONSTRAINTS)}",
                                 field="structured_outputs")
        fmt = self.response_format
        if isinstance(fmt, _ResponseFormat) and fmt.type == "json_schema" and fmt.json_schema is None:
            raise InvalidRequest("response_format of type json_schema needs its json_schema: {\"name\": ..., "
                                 "\"schema\": {...}}", field="response_format")
        if self.stream_options and not self.stream:  # (an empty object passes, as in vLLM)
            raise InvalidRequest("stream_options is only for streamed answers: set \"stream\": true or drop "
                                 "stream_options", field="stream_options")
        if self.stream and self.prompt_logprobs not in (None, 0):
            raise InvalidRequest("prompt_logprobs are not available in streamed answers: set \"stream\": false "
                                 "or drop prompt_logprobs", field="prompt_logprobs")
        if self.n is not None and self.n > 1:
            raise InvalidRequest(f"n is {self.n}: this server answers one choice per request (the KV it hands the "
                                 "decode is one sequence's); send n separate requests", field="n")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(s == "" for s in stops):
            raise InvalidRequest("stop cannot contain an empty string", field="stop")
        if self.min_tokens is not None and self._limit() is not None and self.min_tokens > self._limit():
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must not exceed the answer's token limit "
                                 f"({self._limit()})", field="min_tokens")


class CompletionBody(_Body):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    logprobs: Count | None = Field(default=None, ge=-1)  # (-1: the whole vocabulary)
    n: int = Field(default=1, ge=1)
    echo: bool | None = False
    add_special_tokens: bool = True

    @classmethod
    def precheck(cls, body: dict) -> None:
        # vLLM 0.32 renders a suffix only for models with a fill-in-the-middle format (none of those
        # served here), and reads prompt_embeds (empty: absent) in place of the prompt's tokens: a KV
        # computed from the prompt alone would be another prompt's
        if body.get("prompt_embeds") not in (None, []):
            raise InvalidRequest("prompt_embeds cannot be prefilled here (the KV is computed from the prompt's "
                                 "tokens): send the prompt as text or token ids", field="prompt_embeds")
        if body.get("suffix") is not None:
            raise InvalidRequest("suffix (fill in the middle) is only supported for models with a FIM completion "
                                 "format, which none served here has (vLLM refuses it too): put the text in the "
                                 "prompt, or drop suffix", field="suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr  # any name, as vLLM takes it (a custom role reaches the template as it came)
    content: Union[StrictStr, list[dict[str, Any]], None] = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=1, ge=1)
    echo: bool = False
    tools: list[_Tool] | None = None  # the chat template renders them (as sent)
    tool_choice: Literal["none", "auto", "required"] | _NamedToolChoice | None = "none"
    parallel_tool_calls: bool | None = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # how the chat is rendered (``chat_render``)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[Count, _null_is(0)] = Field(default=0, ge=-1)

    def _limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check(self) -> None:
        super().check()
        if self.tools == []:
            raise InvalidRequest("tools must not be an empty list: send at least one tool or leave tools out",
                                 field="tools")
        choice = self.tool_choice
        if choice not in (None, "none") and self.tools is None:
            raise InvalidRequest("tool_choice needs tools: send the tools to choose from, or drop tool_choice",
                                 field="tool_choice")
        if isinstance(choice, _NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise InvalidRequest(f"tool_choice names the function {choice.function.name!r}, which is not one of "
                                 "the tools sent", field="tool_choice")
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            raise InvalidRequest("top_logprobs needs \"logprobs\": true", field="top_logprobs")


# fields of several accepted forms: what to say when a value fits none (pydantic names each form tried)
_FORMS = {"prompt": "text, a list of token ids (integers), or a list holding one of those",
          "content": "a string, a list of content parts ({\"type\": \"text\", \"text\": ...}), or null"}


def parse(model_cls, body: Any):
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model_cls.precheck(body)
    try:
        parsed = model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"]]
        form = next((i for i, p in enumerate(loc) if p in _FORMS), None)
        if form is not None and form + 1 < len(loc) and not loc[form + 1].isdigit():  # a union's branch
            where = ".".join(loc[:form + 1])
            raise InvalidRequest(f"invalid field '{where}': it must be {_FORMS[loc[form]]}", field=where) from None
        where = ".".join(loc) or "body"
        raise InvalidRequest(f"invalid field '{where}': {err['msg']}", field=where) from None
    parsed.check()
    for name in parsed.model_fields_set & type(parsed).model_fields.keys():
        value = getattr(parsed, name)
        if not isinstance(value, BaseModel) and not (isinstance(value, list) and
                                                     any(isinstance(v, BaseModel) for v in value)):
            body[name] = value  # the value read ("0.7" -> 0.7, 1 -> True); objects stay as sent
    return parsed


_FLAG = TypeAdapter(Union[bool, None])  # a StreamOptions field of vLLM's (lax: true, 1, "yes", null...)


def usage_asked(stream_options: Any) -> tuple[bool, bool] | None:
    """(include_usage, continuous_usage_stats) as vLLM 0.32 reads a client's ``stream_options``
    (``should_include_usage``: the second only with the first); None where vLLM would refuse them
    (the decode is then sent them as they are, to say so itself). Reading them validates nothing:
    a body is accepted or refused as before."""
    if stream_options is None:
        return False, False
    if not isinstance(stream_options, dict):
        return None
    try:
        include, continuous = (bool(_FLAG.validate_python(stream_options.get(k)))
                               for k in ("include_usage", "continuous_usage_stats"))
    except ValidationError:
        return None
    return include, include and continuous


def single_prompt(prompt) -> str | list[int]:
    """One prompt as text or token ids; batches of several prompts are refused."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequest("send one prompt per request (a list of several prompts is not supported)",
                                 field="prompt")
        prompt = prompt[0]
    if isinstance(prompt, (str, list)) and len(prompt) == 0:
        raise InvalidRequest("the prompt is empty: send some text or token ids", field="prompt")
    return prompt


_TEXT_PARTS = ("text", "input_text", "output_text")  # content parts whose "text" vLLM renders as text


def chat_messages(body: ChatBody) -> list[dict]:
    msgs = []
    for i, m in enumerate(body.messages):
        content = m.content
        if content is None and "content" in m.model_fields_set and m.role != "assistant":
            raise InvalidRequest(f"messages[{i}].content is null: only an assistant message's may be (give the "
                                 "text, or leave content out)", field=f"messages.{i}.content")  # (as vLLM)
        texts = [content] if isinstance(content, str) else []
        if isinstance(content, list):  # OpenAI content parts: text only
            for part in content:
                if part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported",
                                         field=f"messages.{i}.content")
                texts.append(part["text"])
        if m.role == "system":
            texts = system_texts(texts)
        # text parts joined as vLLM joins them for string templates; the fields vLLM keeps
        msgs.append(template_message(i, m.model_dump(), "\n".join(texts)))
    return msgs

"""The parts of OpenAI request bodies the gateway reads, validated with clear messages.

Bodies are otherwise passed to the decode unchanged, so these models allow extra fields. The
sampling fields are checked by the decode's own rules (vLLM's request classes and ``SamplingParams``,
the ranges OpenAI documents) before anything is computed: a body the decode would refuse is refused
here, not after its prompt was prefilled. Limits a decode sets itself (``--max-logprobs``, its number
of stop strings) stay the decode's to check.
"""
from __future__ import annotations

from typing import Any, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      TypeAdapter, ValidationError)

from prefill_server.engine.worker import check_client_salt
from prefill_server.errors import InvalidRequest
from prefill_server.serving.chat_messages import system_texts, template_message


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    # a JSON number, not "0.7" or true; the ranges are SamplingParams'
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # (0 or -1: off)
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0)
    min_tokens: StrictInt | None = Field(default=None, ge=0)
    stop: StrictStr | list[StrictStr] | None = None
    prompt_logprobs: StrictInt | None = Field(default=None, ge=-1)  # (-1: the whole vocabulary)
    seed: StrictInt | None = Field(default=None, ge=-2**63, le=2**63 - 1)  # a 64-bit seed, as vLLM takes
    n: StrictInt | None = Field(default=None, ge=1)
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)  # (-1: the context's length)
    # typed as vLLM's request classes type them (lax: "1.5" is a bias, "7" a token id); the vocabulary's
    # bounds are checked where the first token's sampling is built (``first_draw``)
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    cache_salt: Any = None  # vLLM's rule, with its message: ``prefix_cache.check_client_salt``

    def _limit(self) -> int | None:
        return self.max_tokens

    @classmethod
    def precheck(cls, body: dict) -> None:
        """Fields refused before the body's own validation (their message is the useful one)."""

    def check(self) -> None:
        """The checks across fields (after each field's own)."""
        check_client_salt(self.cache_salt)
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
    logprobs: StrictInt | None = Field(default=None, ge=-1)  # (-1: the whole vocabulary)

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
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None  # the chat template renders them
    # how the chat is rendered (``chat_render``), typed as vLLM's chat endpoint types them
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=-1)  # (-1: the whole vocabulary)

    def _limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check(self) -> None:
        super().check()
        if self.tools == []:
            raise InvalidRequest("tools must not be an empty list: send at least one tool or leave tools out",
                                 field="tools")
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

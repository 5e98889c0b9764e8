"""A chat body's rendering here follows vLLM 0.32's chat endpoint (``ChatCompletionRequest.
build_chat_params``: the request's own fields override ``chat_template_kwargs``; a request template
is refused unless the decode trusts it), since the decode renders the same body itself."""

import pytest
from vllm_serving_reference import ask

from prefill_server.errors import InvalidRequest
from prefill_server.models.tokenizer import developer_as_system
from prefill_server.serving.chat_render import template_kwargs
from prefill_server.serving.token_parity import local_chat_ids

MSGS = [{"role": "user", "content": "Hi"}]

D, S, U, A = "developer", "system", "user", "assistant"
CONVERSATIONS = [[{"role": r, "content": c} for r, c in conv] for conv in (
    [(D, "Be brief."), (U, "Name a colour.")],
    [(S, "You are kind."), (D, "Be brief."), (U, "Hi")],
    [(U, "Hi"), (D, "Answer in French.")],
    [(D, ""), (U, "Hi")],
    [(D, ""), (D, "x"), (U, "Hi"), (A, "Hello"), (D, "y"), (U, "Again")],
    [(S, ""), (U, "Hi"), (D, "late")],
    [(U, "Hi"), (A, "Hello")],
    [(S, "only system"), (U, "Hi")],
)] + [[{"role": D, "content": "d", "tools": [{"type": "function"}], "name": "dev"}, {"role": U, "content": "u"}]]


def test_defaults_are_the_chat_endpoints():
    assert template_kwargs({"messages": MSGS}) == {"add_generation_prompt": True, "continue_final_message": False,
                                                   "add_special_tokens": False}


def test_request_fields_override_template_kwargs():
    kw = template_kwargs({"messages": MSGS, "add_generation_prompt": False, "tools": [{"type": "function"}],
                          "chat_template_kwargs": {"add_generation_prompt": True, "custom": 1},
                          "documents": [{"title": "t", "text": "x"}], "reasoning_effort": "low"})
    assert kw["add_generation_prompt"] is False and kw["custom"] == 1 and kw["tools"] == [{"type": "function"}]
    assert kw["documents"] == [{"title": "t", "text": "x"}] and kw["enable_thinking"] is True
    # an unset value (None, "auto") does not override the kwargs' own
    kw = template_kwargs({"messages": MSGS, "documents": None, "chat_template_kwargs": {"documents": [1]}})
    assert kw["documents"] == [1]


@pytest.mark.parametrize("body,needle", [
    ({"chat_template": "{{ messages }}"}, "chat template sent with the request"),
    ({"chat_template_kwargs": {"chat_template": "x"}}, "chat template sent with the request"),
    ({"chat_template_kwargs": {"tokenize": True}}, "tokenize"),
])
def test_refused(body, needle):
    with pytest.raises(InvalidRequest, match=needle):
        template_kwargs({"messages": MSGS, **body})


def test_local_ids_follow_the_fields(local_service):
    tok = local_service.tokenizer
    msgs = MSGS + [{"role": "assistant", "content": "Hello"}]
    gen = local_chat_ids(tok, msgs, template_kwargs({"messages": msgs}))
    plain = local_chat_ids(tok, msgs, template_kwargs({"messages": msgs, "add_generation_prompt": False}))
    cont = local_chat_ids(tok, msgs, template_kwargs({"messages": msgs, "add_generation_prompt": False,
                                                       "continue_final_message": True}))
    assert gen == tok.encode_chat(msgs) and plain == tok.encode_chat(msgs, add_generation_prompt=False)
    assert len(cont) < len(plain) < len(gen) and plain[:len(cont)] == cont
    assert tok.decode(cont).endswith("Hello")
    with pytest.raises(InvalidRequest, match="cannot both be true"):
        local_chat_ids(tok, msgs, template_kwargs({"messages": msgs, "continue_final_message": True}))


def test_developer_messages_become_system_as_vllm_renders_them():
    """For a template that does not name the role (SmolLM2's), each conversation as vLLM 0.32's HF
    renderer hands it to the template (``vllm_serving_reference.py roles``)."""
    ours = [developer_as_system(c) for c in CONVERSATIONS]
    assert ours[0] == [{"role": S, "content": "Be brief."}, {"role": U, "content": "Name a colour."}]
    assert ours[1][0] == {"role": S, "content": "You are kind.\n\nBe brief."} and len(ours[1]) == 2
    assert ours == ask("roles", CONVERSATIONS)


def test_a_developer_message_renders_as_system_with_smollm2(local_service):
    tok = local_service.tokenizer
    dev = [{"role": D, "content": "Be brief."}, {"role": U, "content": "Name a colour."}]
    assert tok.encode_chat(dev) == tok.encode_chat([{"role": S, "content": "Be brief."}, dev[1]])

"""K3's own grammars (expertmesh/chat/k3_grammar.py): they accept what the template writes for a forced tool call
and a `response_format` answer, and sampling under their mask yields a call that fits the tool's schema."""

import json

from support.k3_chat import WEATHER, ids_of, model_output

from expertmesh.chat.format import Message, ToolCall


def test_k3_grammars_accept_what_the_template_writes_and_constrain_sampling(k3_chat):
    import jsonschema
    import numpy as np

    from expertmesh.chat.grammar import Constraint, ll_tokenizer

    lltok = ll_tokenizer(k3_chat.tokenizer)
    params = WEATHER["function"]["parameters"] | {"required": ["city"]}
    forced = [{"name": "get_weather", "parameters": params}]
    reply = Message(
        "assistant",
        "",
        reasoning="go",
        tool_calls=[ToolCall("c", "get_weather", json.dumps({"city": "Paris", "days": 3}))],
    )
    for thinking in (True, False):
        out = model_output(k3_chat, [Message("user", "w?")], reply, tools=[WEATHER], thinking=thinking)
        after = out[out.index(k3_chat.close_id) + 1 :] if thinking else out
        c = Constraint(lltok, k3_chat.tool_call_grammar(forced, thinking=thinking), "tools")
        for t in after[:-1]:  # up to ⟨eom⟩, which the sampler forces once the grammar is done
            assert c.allowed()[t], k3_chat.tokenizer.decode([t], skip_special=False)
            c.advance(t)
        assert c.done
    # sampling under the mask yields a call of the forced tool whose arguments fit its schema. llguidance's fast
    # mask lets every special token through where a text lexeme may end before a special one (a string argument
    # before ⟨close⟩); the matcher refuses the wrong ones, so they are checked one by one here (grammar.Constraint
    # does not do that yet: a sampler that picks one gets a GrammarError)
    rng = np.random.default_rng(0)
    c = Constraint(lltok, k3_chat.tool_call_grammar(forced, thinking=False), "tools")
    out = []
    specials = set(k3_chat.tokenizer.id_to_special)
    for _ in range(400):
        if c.done:
            break
        allowed = [
            int(t)
            for t in np.flatnonzero(c.allowed())
            if t != k3_chat.eom_id and (t not in specials or c.matcher.validate_tokens([int(t)]) == 1)
        ]
        weights = np.array([200.0 if t in specials else 1.0 for t in allowed])  # free text ends soon
        t = int(rng.choice(allowed, p=weights / weights.sum()))
        c.advance(t)
        out.append(t)
    parsed = k3_chat.parse_output(out, phase="content", tools=[WEATHER])
    assert [c.name for c in parsed.tool_calls] and parsed.tool_calls[0].name == "get_weather"
    for call in parsed.tool_calls:
        jsonschema.validate(json.loads(call.arguments), params)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    c = Constraint(lltok, k3_chat.response_grammar(schema, thinking=True), "response_format")
    for t in ids_of(
        k3_chat, 'think<|sep|><|open|>response<|sep|>{"a": 5}<|close|>response<|sep|><|close|>message<|sep|>'
    ):
        assert c.allowed()[t]
        c.advance(t)
    assert c.done

"""The OpenAI request surface without Ray: every bad value is a 400 naming its field, before anything runs."""

from __future__ import annotations

import pytest

from orchestrator.serving.protocol import ChatCompletionRequest, RequestError, parse


def test_parse_names_the_field():
    with pytest.raises(RequestError) as err:
        parse(ChatCompletionRequest, {"model": "m"})
    assert err.value.param == "messages" and err.value.status == 400
    with pytest.raises(RequestError):
        parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [""] * 5})
    with pytest.raises(RequestError):
        parse(ChatCompletionRequest, [1, 2])


HOSTILE = {
    "seed 2**64": ({"seed": 2**64, "temperature": 1}, "seed"),
    "seed below -2**63": ({"seed": -(2**63) - 1, "temperature": 1}, "seed"),
    "seed 1.5": ({"seed": 1.5}, "seed"),
    "temperature 1e-40": ({"temperature": 1e-40}, "temperature"),
    "temperature NaN": ({"temperature": float("nan")}, "temperature"),
    "temperature inf": ({"temperature": float("inf")}, "temperature"),
    "temperature 3": ({"temperature": 3}, "temperature"),
    "top_p 0": ({"top_p": 0}, "top_p"),
    "top_p NaN": ({"top_p": float("nan")}, "top_p"),
    "top_k -5": ({"top_k": -5}, "top_k"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "text part without text": ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
    "text part with a number": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages.0.content",
    ),
    "image part": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages.0.content",
    ),
    "content null": ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    "stop too many": ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_values_are_a_400_naming_the_field(case):
    overrides, param = HOSTILE[case]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | overrides
    with pytest.raises(RequestError) as err:
        req = parse(ChatCompletionRequest, body)
        req.chat()
        req.sampling(16)
    assert err.value.status == 400 and err.value.param is not None
    assert err.value.param.startswith(param), err.value.param


def test_good_values_at_the_edges_pass():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    for extra in ({"seed": 2**63 - 1, "temperature": 0.01}, {"seed": -(2**63), "temperature": 2}, {"temperature": 0}):
        req = parse(ChatCompletionRequest, body | extra)
        assert req.chat() == [{"role": "user", "content": "hi"}]
        assert req.sampling(16).max_tokens == 16

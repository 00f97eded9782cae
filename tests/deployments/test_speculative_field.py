"""The OpenAI edge's `speculative` extension field reaches SamplingParams (a request can turn
speculative decoding off), and a non-bool is refused like every other strict field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize("value", [True, False])
def test_speculative_reaches_sampling_params(value: bool) -> None:
    completion = CompletionRequest(prompt="p", speculative=value)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "p"}], speculative=value)
    assert completion.sampling(8, None).speculative is value
    assert chat.sampling(8, None).speculative is value


def test_default_speculates_and_strings_are_refused() -> None:
    assert CompletionRequest(prompt="p").sampling(8, None).speculative is True
    with pytest.raises(ValidationError, match="speculative"):
        CompletionRequest(prompt="p", speculative="no")

"""Fixtures shared by the Serve test modules: each module defines its own `base` (the app's URL,
started once per module); `client` and `model` are read from it."""

from __future__ import annotations

import openai
import pytest
from serve_apps import openai_client


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai_client(base)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id

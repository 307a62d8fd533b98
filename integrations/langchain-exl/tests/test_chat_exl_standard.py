"""LangChain's standard test suites (langchain-tests) run against ChatExl, offline, on a tiny random chat model
(the suites judge the protocol: messages, streaming, async, usage, stop, structured output; tests on the real
default model are in test_langchain_exl.py). Every skipped group is a capability switch below, with its reason."""
from __future__ import annotations

import pytest
import pytest_socket
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_exl import ChatExl
from tiny_chat_model import tiny_chat_model


@pytest.fixture(autouse=True)
def offline():
    """As `pytest --disable-socket --allow-unix-socket` (asyncio's event loop uses a unix socket pair)."""
    pytest_socket.disable_socket(allow_unix_socket=True)
    yield
    pytest_socket.enable_socket()


class ExlCapabilities:
    @property
    def chat_model_class(self) -> type[ChatExl]:
        return ChatExl

    @property
    def chat_model_params(self) -> dict:
        # Seeded sampling, not greedy: greedy decoding of random weights cycles, and a cycle inside a JSON string
        # would never close it. max_tokens: the suites' standard 100.
        return {"model": tiny_chat_model(0), "temperature": 1.0, "seed": 0}

    @property
    def has_tool_calling(self) -> bool:
        return False        # ChatExl does not implement tool calling (bind_tools raises NotImplementedError)

    @property
    def supports_json_mode(self) -> bool:
        return True         # method="json_mode": grammar-constrained to any JSON object

    # Switches left at langchain-tests' defaults, each a skip in the report, and why:
    # - multimodal inputs (image, audio, video, PDF, Anthropic blocks) False: ChatExl takes text only;
    # - init_from_env_params unset: a local model directory reads no environment variables (no API key);
    # - is_lc_serializable() False: the model lives in process memory, not in a serializable client config;
    # - enable_vcr_tests False: there is no HTTP traffic to record (test_stream_time needs a cassette).


class TestChatExlUnit(ExlCapabilities, ChatModelUnitTests):
    pass


class TestChatExlIntegration(ExlCapabilities, ChatModelIntegrationTests):
    @property
    def model_override_value(self) -> str:
        return tiny_chat_model(1)       # a per-call `model=` names another model directory

    @pytest.mark.xfail(reason="json_mode constrains the output to some JSON object; which keys it has comes from "
                              "the prompt, which a random-weight model cannot follow (the grammar itself is tested "
                              "in test_langchain_exl.py)")
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

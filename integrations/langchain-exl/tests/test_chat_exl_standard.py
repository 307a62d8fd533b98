"""LangChain's standard test suites (langchain-tests) run against ChatExl, offline, on a tiny random chat model
(the suites judge the protocol: messages, streaming, async, usage, stop, structured output; tests on the real
default model are in test_langchain_exl.py). Every skipped group is a capability switch below, with its reason;
the tool-calling tests that need a model reading the prompt are xfail, each with what it checked before failing."""
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


ARGUMENT_3 = ("the call is forced and valid (one call of magic_function, an integer argument), but the suite "
              "wants the 3 of the prompt, which a random-weight model cannot read")


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
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True         # the suites force calls with tool_choice="any" (-> "required") or a tool's name

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

    # The tool-calling tests whose checks need a model that reads the prompt. Each of them passes the protocol
    # checks before the one that fails (one call, the tool's name, an id, type "tool_call", the content blocks);
    # test_tool_calling's question on the default model: test_langchain_exl.py::test_default_model_calls_the_tool_...
    @pytest.mark.xfail(strict=True, reason=ARGUMENT_3)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_tool_calling(self, model) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(strict=True, reason=ARGUMENT_3)
    async def test_tool_calling_async(self, model) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason="a forced call of the tool without arguments is right ({} every time), but the "
                              "random model may go on to a second, parallel call, and the suite wants exactly one "
                              "(parallel_tool_calls=False bounds it: test_langchain_exl.py)")
    def test_tool_calling_with_no_arguments(self, model) -> None:
        super().test_tool_calling_with_no_arguments(model)

    @pytest.mark.xfail(strict=True, reason="tool_choice is left to the model (auto) and a random-weight model "
                                           "answers with text, not the call the question needs")
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(strict=True, reason="the call is forced and valid, but copying the prompt's '你好' into the "
                                           "argument takes a model that reads it")
    def test_unicode_tool_call_integration(self, model, **kwargs) -> None:
        super().test_unicode_tool_call_integration(model, **kwargs)

    @pytest.mark.xfail(reason="json_mode constrains the output to some JSON object; which keys it has comes from "
                              "the prompt, which a random-weight model cannot follow (the grammar itself is tested "
                              "in test_langchain_exl.py)")
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

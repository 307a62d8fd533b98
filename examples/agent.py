"""An agent with two tools, a calculator and a lookup in a small dict: the model calls a tool, the tool's result goes
back to it, and it answers. First with LangChain's ChatExl in this process, then the same loop through `exl serve`
with the openai client.

Every call is built by the engine's grammar, so it parses and its arguments fit the tool's schema: the country is
one of the dict's keys (an enum), the expression is numbers joined by operators (a pattern). The 135M default model
does not pick tools by itself, so each turn names the tool to call (tool_choice) and the last one ("none") asks for
the answer in text; with a capable model, use tool_choice="auto" and loop until a reply makes no calls. The 135M
model's answer mostly echoes the last tool result.

Runs offline on the default model (SmolLM2-135M-Instruct), or on a model directory given as the first argument.
Needs langchain-exl, the server extra (pip install 'exl-backends[server]') and openai."""
import ast
import json
import operator
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Annotated, Literal

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from openai import OpenAI
from pydantic import Field

from exl_backends.commands.quickstart import default_model_dir
from langchain_exl import ChatExl

CAPITALS = {"France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Kenya": "Nairobi"}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


@tool
def capital(country: Literal["France", "Italy", "Japan", "Kenya"]) -> str:
    """The capital city of a country."""
    return CAPITALS[country]


@tool
def calculator(expression: Annotated[str, Field(pattern=r"^[0-9]+( [-+*/] [0-9]+)*$")]) -> str:
    """Evaluate an arithmetic expression: whole numbers joined by + - * /, e.g. 3 + 4 * 2."""
    try:
        return f"{arithmetic(ast.parse(expression, mode='eval').body):g}"
    except ZeroDivisionError:
        return "error: division by zero"


def arithmetic(node: ast.expr) -> float:
    """The value of a parsed expression of numbers and + - * / (the pattern allows nothing else)."""
    if isinstance(node, ast.BinOp):
        return OPERATORS[type(node.op)](arithmetic(node.left), arithmetic(node.right))
    return node.value


TOOLS = {t.name: t for t in (capital, calculator)}
QUESTION = "What is the capital of France, and what is 12 * 7?"
CHOICES = ["capital", "calculator", "none"]     # each turn's tool_choice: a tool's name forces that call


def langchain_agent(model_dir: str) -> None:
    llm = ChatExl(model=model_dir, temperature=0, max_tokens=64, max_seq_len=1024)
    messages = [HumanMessage(QUESTION)]
    for choice in CHOICES:
        reply = llm.bind_tools(list(TOOLS.values()), tool_choice=choice).invoke(messages)
        messages.append(reply)
        for call in reply.tool_calls:
            result = TOOLS[call["name"]].invoke(call)      # a ToolMessage answering the call's id
            print(f"langchain call: {call['name']}({json.dumps(call['args'])}) -> {result.content}")
            messages.append(result)
    print(f"langchain answer: {reply.content!r}")


def openai_agent(client: OpenAI) -> None:
    model = client.models.list().data[0].id
    specs = [convert_to_openai_tool(t) for t in TOOLS.values()]     # OpenAI function specs of the same tools
    messages = [{"role": "user", "content": QUESTION}]
    for choice in CHOICES:
        tool_choice = choice if choice in ("auto", "none", "required") else \
            {"type": "function", "function": {"name": choice}}
        reply = client.chat.completions.create(model=model, messages=messages, tools=specs, tool_choice=tool_choice,
                                               temperature=0, max_tokens=64).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls or []:
            result = TOOLS[call.function.name].invoke(json.loads(call.function.arguments))
            print(f"server call: {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(f"server answer: {reply.content!r}")


def start_server(model_dir: str, port: int, api_key: str) -> subprocess.Popen:
    """`exl serve` (which you would run in a terminal; its banner and request log are left out here), once /health
    answers."""
    server = subprocess.Popen([sys.executable, "-m", "exl_backends.cli", "serve", "-m", model_dir, "--port", str(port),
                               "--api-key", api_key, "--max-seq-len", "1024"], stdout=subprocess.DEVNULL)
    while server.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"exl serve exited with status {server.returncode}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    model_dir = str(sys.argv[1] if len(sys.argv) > 1 else default_model_dir())
    langchain_agent(model_dir)
    port = free_port()
    server = start_server(model_dir, port, api_key="agent-example")
    try:
        openai_agent(OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="agent-example"))
    finally:
        server.terminate()
        server.wait()

"""An LCEL chain, prompt | ChatExl | parser, streamed token by token.

Runs offline on the default model (SmolLM2-135M-Instruct), or on a model directory given as the first argument."""
import sys

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from exl_backends.commands.quickstart import default_model_dir
from langchain_exl import ChatExl

model_dir = str(sys.argv[1] if len(sys.argv) > 1 else default_model_dir())
llm = ChatExl(model=model_dir, max_tokens=48, temperature=0, max_seq_len=1024)      # was: ChatOpenAI(model=...)
prompt = ChatPromptTemplate.from_messages([("user", "What is the capital of {country}?")])
chain = prompt | llm | StrOutputParser()

for piece in chain.stream({"country": "France"}):
    print(piece, end="", flush=True)
print()
print(chain.invoke({"country": "Italy"}))

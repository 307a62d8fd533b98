"""Structured output with ChatExl: the engine's grammar constrains the reply to the pydantic schema, so it always
parses.

Runs offline on the default model (SmolLM2-135M-Instruct), or on a model directory given as the first argument."""
import sys

from pydantic import BaseModel, Field

from exl_backends.commands.quickstart import default_model_dir
from langchain_exl import ChatExl


class Person(BaseModel):
    name: str = Field(description="the person's first name")
    age: int = Field(description="the person's age in years")


model_dir = str(sys.argv[1] if len(sys.argv) > 1 else default_model_dir())
llm = ChatExl(model=model_dir, max_tokens=40, temperature=0, max_seq_len=1024)
extract = llm.with_structured_output(Person)
person = extract.invoke("Extract the name and age: Alice is 31 years old and lives in Lyon.")
print(repr(person))

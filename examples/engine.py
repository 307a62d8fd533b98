"""The generation engine directly: several jobs decoding together, each streaming its own text; output held to a
JSON schema; and n-gram speculative decoding on a task that repeats its prompt (same text, fewer model steps).

Runs offline on the default model (SmolLM2-135M-Instruct, imported once into ~/.cache), or on a model directory
given as the first argument; CPU or GPU."""
import json
import sys
import time

from exl_backends import ExlForCausalLM, Generator, SamplingParams
from exl_backends.commands.quickstart import default_model_dir

model_dir = sys.argv[1] if len(sys.argv) > 1 else default_model_dir()
model = ExlForCausalLM.from_pretrained(model_dir, max_seq_len=1024)
greedy = SamplingParams(temperature=0.0)
gen = Generator(model, max_batch_size=8)

# jobs submitted together decode together; iterating one job steps them all, and each keeps its own chunks
questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"]
jobs = [gen.submit([{"role": "user", "content": q}], max_new_tokens=24, sampling=greedy) for q in questions]
for question, job in zip(questions, jobs):
    print(f"{question} -> {' '.join(''.join(str(chunk) for chunk in job).split())}")

# output that always parses against a JSON schema (the grammar masks every step)
schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"], "additionalProperties": False}
answer = gen.generate([{"role": "user", "content": "The capital of Italy is Rome. Write that as JSON with the keys "
                                                   "city and country."}],
                      max_new_tokens=40, sampling=greedy, json_schema=schema)
print("json:", json.dumps(json.loads(str(answer))))

# n-gram drafting: tokens that followed the latest n-gram earlier in the text are checked in one step
code = "def area(width, height):\n    return width * height\n"
task = [{"role": "user", "content": f"Repeat this Python code exactly:\n{code}"}]
speeds = []
for generator in (gen, Generator(model, ngram_draft=True)):
    generator.generate(task, max_new_tokens=8, sampling=greedy)         # warm-up
    start = time.perf_counter()
    result = generator.generate(task, max_new_tokens=60, sampling=greedy)
    speeds.append((str(result), result.usage.completion_tokens / (time.perf_counter() - start)))
(plain, plain_speed), (drafted, drafted_speed) = speeds
print(f"ngram: same text {drafted == plain}, {drafted_speed:.1f} tokens/s against {plain_speed:.1f} without drafting")

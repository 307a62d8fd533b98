"""transformers-style generation on our engine: ExlForCausalLM in place of AutoModelForCausalLM, then generate,
streaming with TextIteratorStreamer, and transformers' text-generation pipeline.

Runs offline on the default model (SmolLM2-135M-Instruct, imported once into ~/.cache), or on a model directory
given as the first argument; CPU or GPU."""
import sys
from threading import Thread

from transformers import TextIteratorStreamer, pipeline

from exl_backends import ExlForCausalLM
from exl_backends.commands.quickstart import default_model_dir

model_dir = sys.argv[1] if len(sys.argv) > 1 else default_model_dir()
model = ExlForCausalLM.from_pretrained(model_dir, max_seq_len=1024)       # was: AutoModelForCausalLM
tokenizer = model.tokenizer
tokenizer.padding_side = "left"

# a batch of two chat prompts, left padded, greedy
chats = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Name a primary colour."}]]
texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
out = model.generate(**batch, max_new_tokens=24, do_sample=False)
for row in out:
    print("generate:", tokenizer.decode(row[batch.input_ids.shape[1]:], skip_special_tokens=True))

# streaming: generate in a thread, read text pieces as they come
streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
prompt = tokenizer(texts[0], return_tensors="pt", add_special_tokens=False).to(model.device)
thread = Thread(target=model.generate, kwargs=dict(**prompt, max_new_tokens=24, streamer=streamer))
thread.start()
print("stream:", end=" ", flush=True)
for piece in streamer:
    print(piece, end="", flush=True)
thread.join()
print()

# transformers' pipeline, with chat messages
chat = pipeline("text-generation", model=model, tokenizer=tokenizer)
reply = chat(chats[0], max_new_tokens=24, do_sample=False)[0]["generated_text"][-1]["content"]
print("pipeline:", reply)

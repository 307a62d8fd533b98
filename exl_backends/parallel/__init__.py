"""Tensor parallelism: every decoder layer sharded over N processes, one per GPU, through torch.distributed.

  shards.py  which rows and columns each rank holds; EXL2 / GPTQ weight shards; the layers that communicate
  load.py    loading one rank's shard of a checkpoint
  memory.py  the per-rank memory plan, agreed by all ranks before loading
  ranks.py   rank 0 and the other ranks: the control channel, announced forwards and graph replays, processes"""
from .load import Rank, load_shard
from .memory import fit_context, rank_footprint
from .ranks import TensorParallelModel, follow, free_port, from_pretrained, join_group, launched_rank
from .shards import exl2_columns, exl2_rows, gptq_columns, gptq_rows, head_runs, input_partition

__all__ = ["Rank", "TensorParallelModel", "exl2_columns", "exl2_rows", "fit_context", "follow", "free_port",
           "from_pretrained", "gptq_columns", "gptq_rows", "head_runs", "input_partition", "join_group",
           "launched_rank", "load_shard", "rank_footprint"]

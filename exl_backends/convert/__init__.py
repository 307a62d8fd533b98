"""The converter: fp16 Hugging Face checkpoint -> EXL2 (or GPTQ) checkpoint.

Stages (convert/pipeline.py, persisted in the job directory by convert/job.py): calibration tokens
(calibration.py) -> measurement of every candidate setting per sub-layer (measure.py) -> choice of one setting
per sub-layer for the target bpw (optimize.py) -> GPTQ quantization layer by layer (quantize.py, gptq.py) ->
shards written (formats/exl2_writer.py) -> quality receipt (receipt.py). Layout: shared/design/exl2-format.md §10."""

"""The converter's job directory: progress in job.json plus the files each stage leaves for the next, every one
written whole or not at all (temporary name, then os.replace). A job killed at any point resumes from its last
finished step when the same command runs again."""
from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import threading
import time
from enum import Enum
from pathlib import Path

from safetensors.torch import load_file
from torch import Tensor

from ..errors import ExlError
from ..formats.exl2_writer import save_tensors, write_json

JOB_FILE = "job.json"
JOB_VERSION = 1


class Stage(Enum):
    CALIBRATE = "calibrate"
    MEASURE = "measure"
    OPTIMIZE = "optimize"
    QUANTIZE = "quantize"
    COMPILE = "compile"
    RECEIPT = "receipt"
    DONE = "done"


class Job:
    """state: the options the job was started with, the current stage, per-stage progress and results."""

    def __init__(self, directory: Path, state: dict):
        self.dir, self.state = directory, state
        self._clock = time.monotonic()

    @classmethod
    def open(cls, directory: Path, options: dict) -> "Job":
        """Resumes the job in directory, or starts one. A job started with other options is an error."""
        file = directory / JOB_FILE
        if file.is_file():
            try:
                state = json.loads(file.read_text())
            except (OSError, ValueError) as e:
                raise ExlError(f"{file} is unreadable ({e}); delete the job directory {directory} to start over")
            if state.get("version") != JOB_VERSION or state.get("options") != options:
                raise ExlError(f"{directory} holds a conversion job started with other options "
                               f"({_differences(state.get('options') or {}, options)}); rerun with the same "
                               f"options to resume it, or pass another --job-dir (or delete {directory})")
            return cls(directory, state)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ExlError(f"cannot create the job directory {directory}: {e.strerror or e}") from None
        job = cls(directory, {"version": JOB_VERSION, "options": options, "stage": Stage.CALIBRATE.value,
                              "seconds": {}})
        job.save()
        return job

    @property
    def stage(self) -> Stage:
        return Stage(self.state["stage"])

    def advance(self, stage: Stage, **updates) -> None:
        """Books the time spent since the last save to the current stage and moves on to `stage`."""
        self._book_time()
        self.state["stage"] = stage.value
        self.state.update(updates)
        write_json(self.state, self.dir / JOB_FILE)

    def save(self) -> None:
        self._book_time()
        write_json(self.state, self.dir / JOB_FILE)

    def _book_time(self) -> None:
        now = time.monotonic()
        stage = self.state["stage"]
        self.state["seconds"][stage] = self.state["seconds"].get(stage, 0.0) + now - self._clock
        self._clock = now

    def path(self, name: str) -> Path:
        return self.dir / name

    def save_tensors(self, name: str, tensors: dict[str, Tensor]) -> None:
        save_tensors({k: v.cpu() for k, v in tensors.items()}, self.path(name))

    def load_tensors(self, name: str) -> dict[str, Tensor]:
        file = self.path(name)
        if not file.is_file():
            raise ExlError(f"{file} is missing although {self.dir / JOB_FILE} says its step finished; the job "
                           f"directory was modified: delete {self.dir} and start over")
        return load_file(str(file))

    def remove(self, name: str) -> None:
        target = self.path(name)
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)

    def total_seconds(self) -> float:
        return float(sum(self.state["seconds"].values()))


def job_stage(directory: Path) -> Stage | None:
    """The stage of the job in directory, if there is a readable one."""
    try:
        return Stage(json.loads((directory / JOB_FILE).read_text())["stage"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def states_file(kind: str, layer: int) -> str:
    """Hidden states entering `layer` in pass `kind` ('measure' or 'quant'); named by layer so that a crash
    between writing them and recording progress never pairs a layer with the wrong inputs."""
    return f"{kind}-states-{layer:04d}.safetensors"


def save_states(job: Job, kind: str, layer: int, states: Tensor) -> None:
    """states [R, L, D] f32 (on any device) as a safetensors file with the one tensor 'states', written whole or
    not at all. Written directly from the tensor's memory (safetensors' own writer copies it first and holds the
    GIL meanwhile), so a background thread writing it leaves the conversion running."""
    data = states.float().contiguous().cpu()
    header = json.dumps({"states": {"dtype": "F32", "shape": list(data.shape),
                                    "data_offsets": [0, data.numel() * 4]}}).encode()
    header += b" " * (-len(header) % 8)
    file = job.path(states_file(kind, layer))
    tmp = file.with_name(file.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            f.write(memoryview(data.numpy()).cast("B"))
        os.replace(tmp, file)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        what = "disk full" if e.errno == errno.ENOSPC else f"cannot write ({e.strerror or e})"
        raise ExlError(f"{what} while writing {file}: free some space or fix the job directory, then run the same "
                       f"command again (the job resumes where it stopped)") from None


def load_states(job: Job, kind: str, layer: int) -> Tensor:
    return job.load_tensors(states_file(kind, layer))["states"]


class StatesWriter:
    """A pass's per-layer states files (the resume points), each written in a background thread while the next
    layer computes (8B: 3.4 GB a layer in the quantization pass). A layer counts as done in job.json only once
    the states after it are on disk, so a killed job resumes as before from the last layer whose states were
    written: at most one layer further back. Use as a context manager: leaving it by an error waits for the write
    in flight without recording it."""

    def __init__(self, job: Job, kind: str, stage: Stage, progress_key: str):
        self.job, self.kind, self.stage, self.key = job, kind, stage, progress_key
        self._thread: threading.Thread | None = None
        self._layer = 0
        self._error: BaseException | None = None

    def put(self, layer: int, states: Tensor) -> None:
        """Records the previous write, then starts writing the states entering `layer` (states is not changed
        afterwards by the caller)."""
        self.flush()
        self._layer = layer
        self._thread = threading.Thread(target=self._write, args=(layer, states), daemon=True)
        self._thread.start()

    def flush(self) -> None:
        """Waits for the write in flight; records its layer done and removes the resume point before it."""
        if self._thread is None:
            return
        self._join()
        if self._error is not None:
            raise self._error
        self.job.advance(self.stage, **{self.key: self._layer})
        self.job.remove(states_file(self.kind, self._layer - 1))

    def _write(self, layer: int, states: Tensor) -> None:
        try:
            save_states(self.job, self.kind, layer, states)
        except BaseException as e:              # re-raised in the main thread by flush()
            self._error = e

    def _join(self) -> None:
        self._thread.join()
        self._thread = None

    def __enter__(self) -> "StatesWriter":
        return self

    def __exit__(self, exc_type, *rest) -> None:
        if exc_type is not None and self._thread is not None:
            self._join()


def _differences(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    diff = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    return "; ".join(diff) or "job format changed"

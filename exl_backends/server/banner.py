"""What `exl serve` prints once it listens: the model, its format and bits, the context and cache, the memory
plan, the URL and how to authenticate (the exact curl line)."""
from __future__ import annotations

import ipaddress
from pathlib import Path

from .. import formats
from ..commands import info
from ..engine.generator import Generator
from ..model import planner
from .auth import ApiKey


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:          # a host name: it may resolve to anything
        return False


def base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def format_line(model_dir: Path, config) -> str:
    ckpt = formats.open_checkpoint(model_dir)
    if ckpt.format in ("exl2", "gptq"):
        return f"{ckpt.format.upper()}, {info.bits_report(ckpt, config).average:.2f} bpw (decoder layers)"
    return f"{ckpt.format} (not quantized)"


def memory_line(model_dir: Path, model, cache_tokens: int) -> str:
    fp = planner.footprint(formats.open_checkpoint(model_dir), model.exl_config, model.cache_mode, model.dtype)
    p = fp.plan(cache_tokens)
    where = "GPU" if model.device.type == "cuda" else "RAM"
    return f"{planner.gib(p.total)} of {where}: {planner.breakdown(p)}"


def auth_lines(key: ApiKey | None, url: str, host: str) -> list[str]:
    if key is None:
        lines = ["auth       OFF (--no-auth): anyone who can reach the URL can use the model"]
        if not is_loopback(host):
            lines += ["", f"WARNING: auth is off and the server listens on {host}, beyond this machine: anyone on "
                          f"the network can use it. Drop --no-auth unless that is what you want."]
        return lines
    if key.is_new:
        header = f"Authorization: Bearer {key.value}"
        note = f"a new key, stored in {key.path} (mode 0600); this is the only time it is printed"
    elif key.path is not None:
        header = f"Authorization: Bearer $(cat {key.path})"
        note = f"the key is in {key.path}"
    else:
        header = "Authorization: Bearer <your key>"
        note = "the key is the one given with --api-key"
    return [f"auth       on: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'; {note}",
            f"try        curl {url}/v1/models -H \"{header}\""]


def draft_line(generator: Generator, draft_dir: Path | None) -> str:
    if draft_dir is not None:
        return f"{draft_dir}, up to {generator.scheduler.n_draft} tokens a step"
    if generator.ngram:
        return f"n-gram lookup in each request's tokens, up to {generator.scheduler.n_draft} tokens a step"
    return "none"


def text(model_dir: Path, model, generator: Generator, url: str, key: ApiKey | None, host: str,
         draft_dir: Path | None) -> str:
    config = model.exl_config
    device = str(model.device)
    if model.device.type == "cuda":
        import torch
        device += f" ({torch.cuda.get_device_name(model.device)})"
    cache_tokens = generator.capacity_pages * generator.page_size
    lines = [f"exl serve: {Path(model_dir).name}",
             f"model      {model_dir} ({config.architecture}, {config.n_layers} layers, vocab {config.vocab_size})",
             f"format     {format_line(Path(model_dir), config)}",
             f"device     {device}, {str(model.dtype).removeprefix('torch.')} compute",
             f"context    {generator.max_seq_len} tokens per request; KV cache {model.cache_mode}, {cache_tokens} "
             f"tokens shared by all requests, up to {generator.scheduler.max_batch_size} at once",
             f"memory     {memory_line(Path(model_dir), model, cache_tokens)}",
             f"draft      {draft_line(generator, draft_dir)}",
             f"url        {url}/v1  (docs {url}/docs, health {url}/health, metrics {url}/metrics)"]
    return "\n".join(lines + auth_lines(key, url, host))

"""Bad input never crashes or over-allocates: corrupted safetensors headers, truncated files, shapes that disagree
with the config, wrong dtypes, out-of-range q_groups / permutations / g_idx. Every case either loads (when the
mutation happens to be harmless) or raises the project's CheckpointError naming the file (and the tensor, when
one is at fault); nothing else escapes. Shapes are checked against the file size and config before any tensor
is read, and q_groups / g_idx before anything is unpacked, so no example allocates more than the file holds."""
from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from exl_backends import formats
from exl_backends.errors import CheckpointError, ExlError

from quant_helpers import make_exl2, make_gptq

KEY = "model.layers.0.mlp.down_proj"
K, N = 128, 64
FILE = "model.safetensors"
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def layer_tensors(kind: str) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    layer = (make_exl2(K, N, [(8, 32), (4, 64), (2, 32)], rng) if kind == "exl2"
             else make_gptq(K, N, 4, 32, rng, sym=False, act_order=True))
    bias = torch.randn(N).half()
    return {**{f"{KEY}.{n}": v for n, v in layer.tensors.items()}, f"{KEY}.bias": bias}


VALID = {kind: layer_tensors(kind) for kind in ("exl2", "gptq")}


def file_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        save_file(tensors, Path(d) / FILE)
        return (Path(d) / FILE).read_bytes()


RAW = {kind: file_bytes(t) for kind, t in VALID.items()}


def split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def load(raw: bytes, k: int = K, n: int = N) -> torch.Tensor | None:
    """Writes raw as the only shard of a directory and loads the layer through the reader; returns its
    dequantized weight, or the CheckpointError's message check is left to the caller."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / FILE).write_bytes(raw)
        ckpt = formats.open_checkpoint(d)
        formats.check_linear(ckpt, KEY, k, n, True)
        return formats.load_linear(ckpt, KEY, k, n, True, torch.device("cpu"), torch.float16).dense_weight()


def loads_or_names(raw: bytes, *, tensor: str | None = None, k: int = K, n: int = N) -> None:
    """The layer loads, or CheckpointError names the file (and `tensor`, or at least a tensor of the layer)."""
    try:
        w = load(raw, k, n)
    except CheckpointError as e:
        msg = str(e)
        assert FILE in msg, msg
        if tensor is not None:
            assert tensor in msg or f"'{KEY}." in msg, msg
        return
    assert w.shape == (n, k) and w.dtype == torch.float16


@pytest.mark.parametrize("kind", ["exl2", "gptq"])
def test_valid_files_load(kind):
    assert load(RAW[kind]) is not None


@pytest.mark.parametrize("kind", ["exl2", "gptq"])
@FUZZ
@given(data=st.data())
def test_corrupted_header_bytes(kind, data):
    raw = bytearray(RAW[kind])
    (n,) = struct.unpack("<Q", raw[:8])
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, 8 + n - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    loads_or_names(bytes(raw))


@pytest.mark.parametrize("header", [b"[" * 100_000, b'{"x": {"dtype": "F16", "shape": [' + b"9" * 5000 + b"]}}",
                                    b'{"x": 1}', b"[]", b"\xff\xfe", b'{"x": {"dtype": "F16"}}'],
                         ids=["deep-nesting", "huge-int", "entry-not-object", "not-object", "bad-utf8", "no-shape"])
def test_hostile_headers(header):
    loads_or_names(struct.pack("<Q", len(header)) + header + bytes(16))


DTYPE_NAMES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "U32", "BOOL", "F8_E4M3", "F8", "", "int4"]
JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.floats(allow_nan=True), st.dictionaries(
    st.text(max_size=3), st.integers(), max_size=2))


@pytest.mark.parametrize("kind", ["exl2", "gptq"])
@FUZZ
@given(data=st.data())
def test_mutated_header_entries(kind, data):
    header, body = split(RAW[kind])
    name = data.draw(st.sampled_from(sorted(header)))
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry"]))
    if field == "dtype":
        header[name]["dtype"] = data.draw(st.one_of(st.sampled_from(DTYPE_NAMES), JUNK))
    elif field == "shape":
        header[name]["shape"] = data.draw(st.one_of(
            st.lists(st.integers(-2, 2**40), max_size=3), st.lists(st.integers(0, 300), min_size=1, max_size=3), JUNK))
    elif field == "data_offsets":
        size = len(body)
        header[name]["data_offsets"] = data.draw(st.one_of(
            st.lists(st.integers(-1, 2 * size), min_size=2, max_size=2), st.lists(st.integers(), max_size=3), JUNK))
    else:
        header[name] = data.draw(JUNK)
    loads_or_names(join(header, body), tensor=name)


@pytest.mark.parametrize("kind", ["exl2", "gptq"])
@FUZZ
@given(cut=st.integers(0, 10**6))
def test_truncated_file(kind, cut):
    raw = RAW[kind]
    loads_or_names(raw[:cut % len(raw)])


@pytest.mark.parametrize("kind", ["exl2", "gptq"])
@FUZZ
@given(k=st.integers(1, 1024), n=st.integers(1, 1024))
def test_config_disagreeing_with_shapes(kind, k, n):
    """in/out features from a config.json that does not match the tensors."""
    if (k, n) == (K, N):
        return
    with pytest.raises(CheckpointError) as e:
        load(RAW[kind], k, n)
    assert FILE in str(e.value) and KEY in str(e.value)


@pytest.mark.parametrize("kind", ["exl2", "gptq"])
@FUZZ
@given(data=st.data())
def test_wrong_dtypes(kind, data):
    """A tensor stored in another dtype (a well-formed file): refused naming it, unless the format allows that
    dtype (float scales and biases may be fp32/bf16, g_idx int64)."""
    tensors = dict(VALID[kind])
    name = data.draw(st.sampled_from(sorted(tensors)))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                                       torch.int16, torch.uint8]))
    tensors[name] = tensors[name].to(dtype)
    loads_or_names(file_bytes(tensors), tensor=name)


@FUZZ
@given(q_groups=st.lists(st.integers(-2**15, 2**15 - 1), min_size=6, max_size=6)
       | st.lists(st.sampled_from([2, 3, 4, 5, 6, 8, 0, 4, 12, 16, 32]), min_size=6, max_size=6))
def test_exl2_q_groups_out_of_range(q_groups):
    tensors = dict(VALID["exl2"])
    tensors[f"{KEY}.q_groups"] = torch.tensor(q_groups, dtype=torch.int16)
    loads_or_names(file_bytes(tensors), tensor=f"{KEY}.q_groups")


@FUZZ
@given(data=st.data())
def test_exl2_q_invperm_not_a_permutation(data):
    tensors = dict(VALID["exl2"])
    perm = tensors[f"{KEY}.q_invperm"].clone()
    for _ in range(data.draw(st.integers(1, 3))):
        perm[data.draw(st.integers(0, K - 1))] = data.draw(st.integers(-2**31, 2**31 - 1) | st.integers(-1, K))
    tensors[f"{KEY}.q_invperm"] = perm
    is_perm = sorted(perm.tolist()) == list(range(K))
    try:
        load(file_bytes(tensors))
        assert is_perm
    except CheckpointError as e:
        assert not is_perm and f"'{KEY}.q_invperm'" in str(e) and FILE in str(e)


@FUZZ
@given(index=st.integers(0, K - 1), value=st.integers(-2**31, 2**31 - 1) | st.integers(-1, 5))
def test_gptq_g_idx_out_of_range(index, value):
    tensors = dict(VALID["gptq"])
    g_idx = tensors[f"{KEY}.g_idx"].clone()
    g_idx[index] = value
    tensors[f"{KEY}.g_idx"] = g_idx
    if 0 <= value < K // 32:
        assert load(file_bytes(tensors)) is not None
    else:
        with pytest.raises(CheckpointError, match=rf"{FILE}.*'{KEY}\.g_idx'"):
            load(file_bytes(tensors))


@pytest.mark.parametrize("kind,name,bad", [("exl2", "q_scale_max", float("inf")), ("exl2", "q_scale_max", float("nan")),
                                          ("gptq", "scales", float("nan")), ("gptq", "scales", 1e6)])
def test_non_finite_scales(kind, name, bad):
    """inf/NaN scales, or fp32 scales beyond fp16's range, would dequantize to inf/NaN weights."""
    tensors = dict(VALID[kind])
    scales = tensors[f"{KEY}.{name}"].float().clone()
    scales.view(-1)[1] = bad
    tensors[f"{KEY}.{name}"] = scales if bad == 1e6 else scales.half()
    with pytest.raises(CheckpointError, match=rf"{FILE}.*'{KEY}\.{name}'.*inf/NaN"):
        load(file_bytes(tensors))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)
QUANT_KEYS = ["quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format", "format", "dynamic",
              "pack_dtype", "is_marlin_format", "version", "zero_point", "w_bit", "q_group_size", "lm_head"]


@pytest.mark.parametrize("kind", ["exl2", "gptq"])
@FUZZ
@given(block=st.one_of(JSON, st.dictionaries(st.sampled_from(QUANT_KEYS), JSON | st.sampled_from(
    ["gptq", "exl2", "awq", "gptq_v2", "marlin", 4, 8, 128, -1, {".*": {"bits": 8}}, {"-:.*": {}}]), max_size=5)),
       where=st.sampled_from(["config.json", "quantize_config.json"]))
def test_random_quantization_configs(kind, block, where):
    """Whatever the quantization config holds, detection and loading end in success or the project's error."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / FILE).write_bytes(RAW[kind])
        (Path(d) / where).write_text(json.dumps({"quantization_config": block} if where == "config.json" else block))
        try:
            ckpt = formats.open_checkpoint(d)
            formats.load_linear(ckpt, KEY, K, N, True, torch.device("cpu"), torch.float16)
        except ExlError:
            pass

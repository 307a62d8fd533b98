"""`exl bench`'s accounting: the bytes a batch-1 decode step reads, for one model, a layer split, tensor-parallel
shards and a mixture of experts (router + top_k experts), and the report's notes saying which."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from exl_backends import parallel
from exl_backends.commands import bench
from exl_backends.model.model import Model, Stage

from conftest import save_tiny, tiny_config


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    out = {"llama": root / "llama", "mixtral": root / "mixtral"}
    save_tiny(out["llama"], tiny_config("llama", num_hidden_layers=3))
    save_tiny(out["mixtral"], tiny_config("mixtral"), seed=1)
    return out


def stored(directory) -> dict[str, int]:
    """Bytes of every tensor in the checkpoint (f32, as the CPU model keeps them)."""
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name).nbytes for name in f.keys()}


def test_dense_model_reads_everything_but_the_embedding(dirs):
    sizes = stored(dirs["llama"])
    expected = sum(n for name, n in sizes.items() if "embed_tokens" not in name)
    assert bench.weight_bytes(Model.load(dirs["llama"])) == expected


def test_moe_reads_the_router_and_top_k_experts(dirs):
    sizes = stored(dirs["mixtral"])
    m = Model.load(dirs["mixtral"])
    experts, top_k = len(m.blocks[0].mlp.experts), m.blocks[0].mlp.top_k         # 4, 2
    expert = sum(n for name, n in sizes.items() if ".layers.0." in name and ".experts.0." in name)
    everything = sum(n for name, n in sizes.items() if "embed_tokens" not in name)
    assert bench.weight_bytes(m) == everything - len(m.blocks) * (experts - top_k) * expert
    assert any("top_k=2 of its 4 experts" in note for note in bench.notes(m))


def test_layer_split_reads_what_the_whole_model_reads(dirs):
    cpu = torch.device("cpu")
    whole = Model.load(dirs["llama"])
    split = Model.load(dirs["llama"], stages=[Stage(cpu, range(0, 1)), Stage(cpu, range(1, 3))])
    assert bench.weight_bytes(split) == bench.weight_bytes(whole)
    assert any("layer split over 2 devices" in note for note in bench.notes(split))
    assert bench.notes(whole) == []


def test_tensor_parallel_shards_split_the_bytes(dirs):
    """Both ranks' shards read the whole model's bytes between them, plus the norms every rank keeps."""
    whole = Model.load(dirs["llama"])
    shards = [parallel.load_shard(dirs["llama"], parallel.Rank(r, 2, torch.device("cpu")), torch.float32)
              for r in range(2)]
    norms = sum(t.numel() * 4 for b in whole.blocks for t in (b.input_norm, b.post_attn_norm)) + whole.norm.numel() * 4
    assert sum(bench.weight_bytes(s) for s in shards) == bench.weight_bytes(whole) + norms
    assert bench.weight_bytes(shards[0]) < 0.6 * bench.weight_bytes(whole)


def test_report_runs_on_a_split_moe_model(dirs, monkeypatch):
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e9)     # not a 2 GiB copy on the CPU
    cpu = torch.device("cpu")
    m = Model.load(dirs["mixtral"], stages=[Stage(cpu, range(0, 1)), Stage(cpu, range(1, 2))])
    text = bench.report(m, *bench.measure(m, [16], "fp16", [24]))
    assert "layer split over 2 devices" in text and "mixture of experts" in text
    assert "prefill 24" in text and "decode ctx 16 (fp16)" in text


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_speed_steps_a_batch(dirs, batch):
    """The decode measurement runs `batch` sequences a step (CPU: eager) and reports finite logits."""
    result = bench.decode_speed(Model.load(dirs["llama"]), context=40, steps=3, page_size=32, batch=batch)
    assert result["finite"] and result["tok_s"] > 0 and "replay_tok_s" not in result


def test_decode_speed_never_runs_more_than_one_step_ahead(dirs, monkeypatch):
    """Warm and timed steps alike: step i is launched only after step i - 2's tokens were read, as the generator
    paces itself; unpaced warm steps queue ahead of the GPU, and the timed steps would carry their backlog."""
    events = []
    forward = bench.Runner.forward

    def launch(self, batch):
        events.append("launch")
        return forward(self, batch)

    class Arrival:                                # the copy's event, whose wait is the host's read
        def synchronize(self):
            events.append("read")

    class Copies:
        def start(self, t):
            return t, Arrival()

    monkeypatch.setattr(bench.Runner, "forward", launch)
    monkeypatch.setattr(bench, "TokenCopies", Copies)
    bench.decode_speed(Model.load(dirs["llama"]), context=40, steps=5, page_size=32)
    launched = read = 0
    for e in events:
        launched, read = launched + (e == "launch"), read + (e == "read")
        assert launched - read <= 2, events
    assert launched == read == bench.WARM_STEPS + 5


def test_decode_speed_feeds_each_step_the_one_befores_argmax(dirs, monkeypatch):
    """As the generator's look-ahead does: step i's input ids are step i - 1's greedy tokens, copied on the device
    (the host never sees them before the step is launched), at consecutive positions."""
    seen = []
    forward = bench.Runner.forward

    def spy(self, batch):
        logits = forward(self, batch)
        seen.append((batch.input_ids.tolist(), batch.positions.tolist(), logits.argmax(-1).tolist()))
        return logits
    monkeypatch.setattr(bench.Runner, "forward", spy)
    bench.decode_speed(Model.load(dirs["llama"]), context=40, steps=5, page_size=32, batch=2)
    n = bench.WARM_STEPS + 5
    assert len(seen) == n and seen[0][1] == [40, 40] and seen[-1][1] == [40 + n - 1] * 2
    assert all(ids == before[2] for (ids, _, _), before in zip(seen[1:], seen))
    assert len({tuple(ids) for ids, _, _ in seen}) > 1          # the tokens change: not a constant fed back


def test_quantized_model_on_the_cpu_reads_its_dequantized_weights(dirs, tmp_path):
    """The CPU path computes from f32 dequantized weights: 4 bytes a weight, as the f32 original, not the packed
    size (the GPU's)."""
    from quant_helpers import quantize_dir
    quantize_dir(dirs["llama"], tmp_path / "q", "exl2", quant_config={"quant_method": "exl2", "bits": 4.0},
                 head=True)
    sizes = stored(dirs["llama"])
    assert bench.weight_bytes(Model.load(tmp_path / "q")) == \
        sum(n for name, n in sizes.items() if "embed_tokens" not in name)


def test_bench_json_is_the_results_form(dirs, tmp_path, monkeypatch, capsys):
    """`exl bench --json DIR` prints its table and writes one result file in benchmarks/results' form, named by
    what, device, date and commit, whose decode rows carry the bound the table printed."""
    from exl_backends import cli
    monkeypatch.setenv("EXL_COMMIT", "abc1234")
    monkeypatch.setattr(bench, "load_report", lambda model_dir, device: ["load, warm: (not timed here)"])
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e9)     # not a 2 GiB copy on the CPU
    cli.main(["bench", "-m", str(dirs["llama"]), "--device", "cpu", "--contexts", "8,24", "--prefill", "16",
              "--json", str(tmp_path)])
    out = capsys.readouterr().out
    (path,) = tmp_path.glob("bench-cpu-*-abc1234.json")
    info = json.loads(path.read_text())
    assert info["commit"] == "abc1234" and info["device"]["name"] == "cpu" and info["date"] in path.name
    assert set(info) >= {"date", "commit", "device", "command", "results", "model", "bpw"}
    prefill, *decode = info["results"]
    assert prefill["what"] == "prefill" and prefill["tokens"] == 16 and prefill["tok_s"] > 0
    assert [r["context"] for r in decode] == [8, 24] and all(r["path"] == "launch-per-op" for r in decode)
    for r in decode:
        assert r["bound_tok_s"] == pytest.approx(info["device"]["copy_bandwidth"] / r["bytes"])
        assert f"decode ctx {r['context']} (fp16)" in out and f"{r['bound_tok_s']:10.1f}" in out
    assert f"wrote {path}" in out


def test_bench_schedule_prints_the_planned_step_table(dirs, capsys):
    """`exl bench --schedule` on the CPU: decode is launch-per-op there, and the pipelined megakernel's planned
    table is printed in each layout (an H100's SMs); a Mixtral model has no table."""
    from exl_backends import cli
    cli.main(["bench", "-m", str(dirs["llama"]), "--device", "cpu", "--schedule"])
    out = capsys.readouterr().out
    assert "launch-per-op" in out and "for 132 SMs (an H100's)" in out
    assert "layout columns: 5 waits a layer on a whole op" in out and "layout tiles-fine: 2 waits a layer" in out
    assert "attention: 2 slices on 2 SMs" in out          # one per KV group of the tiny config
    cli.main(["bench", "-m", str(dirs["mixtral"]), "--device", "cpu", "--schedule"])
    assert "step table" not in capsys.readouterr().out


def test_load_time_imports_no_transformers_by_either_route():
    """The load probe's two routes to the first token: transformers' API (generate, whose settings come from the
    fixture's generation_config.json without transformers' GenerationConfig) and the engine's Generator."""
    from conftest import FIXTURES
    model_dir = str(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6")
    engine, generate = (bench.load_time(model_dir, "cpu", route=r) for r in ("engine", "generate"))
    assert not engine["transformers_imported"] and not generate["transformers_imported"]
    for t in (engine, generate):
        assert all(t[k] > 0 for k in ("imports", "from_pretrained", "first_token"))

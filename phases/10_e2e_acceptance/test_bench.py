"""python -m engine bench latency | throughput | serve, end to end on tiny models (CPU, short
settings): every mode writes a complete JSON report whose figures are consistent with each other
and with what was asked; --compare hf ratios are the ratios of the reported figures; the eager
trace check passes on a real --profile trace and flags compiled / Inductor / CUDA-graph events.
The cuda test runs all three modes on the GPU (the lead's smoke run on the H200)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.__main__ import main
from engine.core.engine_args import EngineArgs


def bench(capsys, *argv) -> dict:
    """Run ``python -m engine bench ...`` in this process; the report on stdout's last line."""
    assert main(["bench", *map(str, argv)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel)


def check_common(report: dict, mode: str, device: str | None = "cpu") -> None:
    """``device``: where the measured engine ran (None: a server the bench only sent requests to).
    A run on the CPU samples no GPU of the host, whatever the host has."""
    assert report["bench"] == mode
    assert report["machine"]["torch"] == torch.__version__ and report["machine"]["device"]
    monitor = report["gpu_monitor"]
    assert ("unavailable" in monitor) != ("devices" in monitor), monitor
    if device == "cpu":
        assert monitor["unavailable"] == "the run is on the CPU", monitor
    if mode != "serve":
        assert report["model"]["num_layers"] == 2 and report["model"]["device"].startswith(device)
        assert report["engine"]["kv_cache_blocks"] > 0


def test_gpu_monitor_window_keeps_the_samples_inside_it():
    """``report(window)`` states utilisation over the timed part only: samples before and after
    (model load, warm-up) are left out; a window with no sample says so."""
    from engine.entrypoints.bench.monitor import GpuMonitor

    monitor = GpuMonitor()
    monitor.names, monitor.total = ["gpu"], [80 * 2**30]
    monitor.samples = [[(0.0, 0, 2**30), (1.0, 90, 2**31), (2.0, 100, 2**31), (3.0, 10, 2**30)]]
    whole, timed = monitor.report()["devices"][0], monitor.report((0.5, 2.5))["devices"][0]
    assert (whole["samples"], whole["util_pct_mean"]) == (4, 50.0)
    assert (timed["samples"], timed["util_pct_mean"], timed["mem_used_gib_max"]) == (2, 95.0, 2.0)
    assert "unavailable" in monitor.report((3.5, 4.0))


def test_latency_random_weights(capsys, tmp_path):
    trace, output = tmp_path / "trace.json", tmp_path / "new" / "report.json"
    report = bench(capsys, "latency", "--preset", "tiny-qwen3", "--random-weights", "--max-model-len", 96,
                   "--prompt-lens", "16,64,4096", "--repeats", 2, "--decode-tokens", 24, "--decode-prompt-len", 16,
                   "--split-steps", 4, "--compare", "hf", "--profile", trace, "--profile-steps", 3,
                   "--output", output)
    check_common(report, "latency")
    assert json.loads(output.read_text()) == report
    assert report["model"]["weights"].startswith("random") and report["engine"]["max_model_len"] == 96

    assert [t["prompt_len"] for t in report["ttft"]] == [16, 64, 95]  # 4096 clamped to max_model_len - 1
    for t in report["ttft"]:
        assert len(t["ms_all"]) == 2 and t["ms"] > 0 and min(t["ms_all"]) <= t["ms"] <= max(t["ms_all"])

    decode = report["decode"]
    # overlapped steps launch the first decode before the prefill is read back: one step less to time
    assert decode["tokens"] == decode["steps"] + decode["overlap"] == 24 and decode["prompt_len"] == 16
    assert close(decode["tok_s"], 24 / decode["seconds"]) and close(decode["ms_per_token"] * decode["tok_s"], 1e3)

    split = report["step_split"]
    assert split["steps"] == 4 and split["gpu_us_per_step"] is None  # CPU: host time only
    assert 0 < split["host_dispatch_us_forward"] <= split["host_dispatch_us_per_step"]
    assert close(split["cpu_dispatch_us_per_layer"] * 2, split["host_dispatch_us_forward"])

    profile = report["profile"]
    assert Path(profile["trace"]) == trace and trace.is_file() and profile["decode_steps"] == 3
    assert profile["check"]["eager"] and profile["check"]["events"] > 0
    assert 0 < profile["wall_us_per_step"] < 1e6 * 60

    compare = report["compare_hf"]
    assert compare["eager"]["tokens"] == 24 and compare["eager"]["prompt_len"] == 16
    assert close(compare["eager"]["tok_s"], 24 / compare["eager"]["seconds"])
    assert "CUDA" in compare["static_compile"]["skipped"]
    assert compare["ratios"] == {"ours_vs_eager": pytest.approx(decode["tok_s"] / compare["eager"]["tok_s"])}


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek-v2-lite"])
def test_random_weights_are_hf_weights(preset):
    """--compare hf times HF on the same weights: the engine built from a preset's random weights
    and HF's model filled by the bench generate the same greedy tokens (every checkpoint tensor
    loaded, DeepSeek's per-expert tensors included: the loader refuses a missing one)."""
    import argparse

    from engine.entrypoints.bench.models import hf_model, open_engine
    from engine.scheduling.sequence import SamplingParams

    args = argparse.Namespace(**vars(EngineArgs(max_num_seqs=2, max_num_batched_tokens=512, max_model_len=128,
                                                device="cpu")), preset=preset, seed=5)
    prompt = list(range(7, 40))
    with open_engine(args) as (engine, weights):
        assert weights == "random (seed 5)"
        ours = engine.generate_tokens([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        hf = hf_model(engine, args)
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert ours == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("source", ["checkpoint", "preset"])
def test_throughput(capsys, tiny_checkpoint, source):
    from engine.entrypoints.bench.offline import throughput_workload

    model = (["--model", tiny_checkpoint()] if source == "checkpoint"
             else ["--preset", "tiny-qwen3", "--random-weights"])
    compare = ["--compare", "hf", "--hf-num-seqs", 3] if source == "checkpoint" else []
    report = bench(capsys, "throughput", *model, "--num-seqs", 6, "--min-len", 4, "--max-len", 24, "--seed", 3,
                   *compare)
    check_common(report, "throughput")
    assert report["engine"]["max_model_len"] == 48  # prompt and output up to --max-len each
    prompts, output_lens = throughput_workload(6, 4, 24, 512, 48, 3)
    result = report["throughput"]
    assert result["num_seqs"] == 6 and result["temperature"] == 0.6
    assert result["input_tokens"] == sum(map(len, prompts)) and result["output_tokens"] == sum(output_lens)
    assert close(result["output_tok_s"], result["output_tokens"] / result["seconds"])
    assert close(result["total_tok_s"], (result["input_tokens"] + result["output_tokens"]) / result["seconds"])
    assert result["steps"] >= max(output_lens)  # at least one decode step per token of the longest output
    assert result["overlap"] is True and 0 < result["host_ms_per_step"] < 1e3 * result["seconds"]
    start, end = result["monotonic_window"]  # the timed part, which the GPU-busy figure is stated over
    assert 0 < end - start == result["seconds"]
    if source == "checkpoint":
        compare = report["compare_hf"]
        ours, hf = compare["ours"], compare["hf_eager"]
        assert ours["num_seqs"] == hf["num_seqs"] == 3 and ours["output_tokens"] == hf["output_tokens"]
        assert hf["output_tokens"] == 3 * hf["output_len"] and str(hf["output_len"]) in compare["subset"]
        assert compare["ratios"] == {"ours_vs_eager": pytest.approx(ours["output_tok_s"] / hf["output_tok_s"])}


def test_overlap_bench_reports_both_modes_on_a_simulated_device(capsys):
    """``bench overlap``: each batch size in both modes, with its host, device and step time per
    step and the floor its mode should reach (max(host, device) overlapped, the sum without);
    the device time is the simulated one, linear in the batch size. No timing is asserted."""
    report = bench(capsys, "overlap", "--num-seqs", "1,6", "--gpu-ms", "2,4", "--prompt-len", 8, "--output-len", 6)
    assert report["bench"] == "overlap" and report["simulated_device"]["full_batch"] == 6
    rows = report["results"]
    assert [(r["num_seqs"], r["overlap"]) for r in rows] == [(1, False), (1, True), (6, False), (6, True)]
    for row in rows:
        assert row["steps"] >= 5 and all(math.isfinite(v) and v > 0 for k, v in row.items() if k.endswith("_ms"))
        assert row["gpu_ms_per_step"] == pytest.approx(2.0 if row["num_seqs"] == 1 else 4.0)
        parts = (row["host_ms_per_step"], row["gpu_ms_per_step"])
        assert row["floor_ms"] == pytest.approx(max(parts) if row["overlap"] else sum(parts))
    for sync, overlapped in zip(rows[::2], rows[1::2]):
        assert overlapped["speedup_vs_sync"] == pytest.approx(sync["step_ms"] / overlapped["step_ms"])


def test_trace_check_flags_compiled_and_graph_events(tmp_path):
    """The eager check counts each kind of non-eager event in a chrome trace (ours are named
    ``_..._kernel``; Inductor's ``triton_poi_fused_...``)."""
    from engine.entrypoints.bench.trace import eager_trace_check

    eager_events = [{"name": "aten::mm", "cat": "cpu_op", "ph": "X", "ts": 0, "dur": 5},
                    {"name": "_rms_norm_kernel", "cat": "kernel", "ph": "X", "ts": 1, "dur": 2},
                    {"name": "cudaLaunchKernel", "cat": "cuda_runtime", "ph": "X", "ts": 1, "dur": 1}]
    planted = {"compiled_function_events": {"name": "Torch-Compiled Region: 0/0", "cat": "user_annotation"},
               "inductor_kernel_events": {"name": "triton_poi_fused_add_mul_0", "cat": "kernel"},
               "cuda_graph_launches": {"name": "cudaGraphLaunch", "cat": "cuda_runtime"}}

    def check(events):
        path = tmp_path / "trace.json"
        path.write_text(json.dumps({"traceEvents": events}))
        return eager_trace_check(path)

    clean = check(eager_events)
    assert clean["eager"] and clean["events"] == 3 and clean["gpu_kernel_events"] == 1
    for key, event in planted.items():
        result = check(eager_events + [event, event])
        assert result[key] == 2 and not result["eager"], (key, result)
        assert all(result[k] == 0 for k in planted if k != key)
    assert not check([])["eager"]  # an empty trace proves nothing


def profiled_trace(fn, path: Path, device: str) -> Path:
    """A chrome trace of three calls of ``fn`` (after three untraced ones)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return path


def test_trace_check_flags_a_real_compiled_trace(tmp_path):
    """A real profiler trace of a torch.compile'd function (TorchDynamo, eager backend: no C++
    build on CPU) fails the check."""
    from engine.entrypoints.bench.trace import eager_trace_check

    compiled = torch.compile(lambda x: (x * 2).sin() + 1, backend="eager")
    x = torch.randn(64)
    result = eager_trace_check(profiled_trace(lambda: compiled(x), tmp_path / "trace.json", "cpu"))
    assert result["compiled_function_events"] > 0 and not result["eager"], result


@pytest.mark.cuda
def test_trace_check_flags_inductor_kernels_and_cuda_graphs(tmp_path):
    """On the GPU: Inductor's kernels (default mode) and CUDA graph launches (reduce-overhead)
    in real traces are counted."""
    from engine.entrypoints.bench.trace import eager_trace_check

    x = torch.randn(4096, device="cuda")
    inductor = torch.compile(lambda x: (x * 2).sin() + 1)
    result = eager_trace_check(profiled_trace(lambda: inductor(x), tmp_path / "inductor.json", "cuda"))
    assert result["inductor_kernel_events"] > 0 and result["compiled_function_events"] > 0, result
    graphs = torch.compile(lambda x: (x * 3).cos() - 1, mode="reduce-overhead")
    result = eager_trace_check(profiled_trace(lambda: graphs(x), tmp_path / "graphs.json", "cuda"))
    assert result["cuda_graph_launches"] > 0 and not result["eager"], result


def test_compile_failure_is_reported_not_raised(tiny_checkpoint, monkeypatch):
    """--compare hf: when the static-cache + compile run fails, the report carries its error and
    the eager figures; the model's generation config is left as it was."""
    import transformers

    from engine.entrypoints.bench.hf_compare import compare_decode

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint())).eval()
    real_generate = hf.generate

    def generate(*args, **kwargs):
        if hf.generation_config.cache_implementation == "static":
            raise RuntimeError("planted compile failure")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(hf, "generate", generate)
    result = compare_decode(hf, list(range(3, 11)), 4, compile=True)
    assert result["eager"]["tokens"] == 4 and result["eager"]["tok_s"] > 0
    assert result["static_compile"] == {"error": "RuntimeError: planted compile failure"}
    assert hf.generation_config.cache_implementation is None and hf.generation_config.compile_config is None


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny-qwen3"], "--random-weights"),
    (["--random-weights"], "--preset"),
    (["--random-weights", "--preset", "tiny-qwen3", "--model", "x"], "not both"),
    (["--random-weights", "--preset", "tiny-qwen3", "--backend", "hf"], "--backend hf"),
])
def test_model_source_errors(capsys, argv, message):
    assert main(["bench", "latency", *argv]) == 2
    assert message in capsys.readouterr().err


HANG_GUARD_S = 60.0  # how long a wait for a condition lasts before the test fails on it (never the assertion)


class StubServer:
    """An SSE /v1/completions stub in a thread: each request streams ``max_tokens`` one-token
    chunks ``gap_s`` apart (the first after ``gap_s`` too), then a usage chunk and [DONE]; it
    records the most requests in flight at once. The first requests wait (up to the hang guard)
    until ``concurrency`` are in flight together, so a client keeping that many in flight is
    seen doing so however its tasks are scheduled."""

    def __init__(self, gap_s: float, concurrency: int):
        self.gap_s, self.concurrency, self.in_flight, self.max_in_flight = gap_s, concurrency, 0, 0
        self.ready = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _completions(self, request):
        from aiohttp import web

        body = await request.json()
        assert body["stream"] and body["ignore_eos"] and body["stream_options"]["include_usage"]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.in_flight >= self.concurrency:
            self.all_in.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.all_in.wait(), HANG_GUARD_S)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(self.gap_s)
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        self.in_flight -= 1
        return response

    async def _serve(self):
        from aiohttp import web

        app = web.Application()
        async def health(request):
            return web.json_response({"status": "ok"})

        app.add_routes([web.get("/health", health), web.post("/v1/completions", self._completions)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self.stop, self.all_in = asyncio.Event(), asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.ready.set()
        await self.stop.wait()
        await runner.cleanup()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(HANG_GUARD_S), "the stub server never started"
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


class ScriptedSession:
    """Stands in for aiohttp's session in ``bench serve``'s ``send_request``: a POST streams
    ``max_tokens`` one-token SSE chunks, the fake ``clock`` moving ``gap`` before each (the first
    too), then ``tail`` before the usage chunk and [DONE]."""

    def __init__(self, clock: list[float], gap: float, tail: float):
        self.clock, self.gap, self.tail = clock, gap, tail

    @contextlib.asynccontextmanager
    async def post(self, url: str, **kwargs):
        yield SimpleNamespace(status=200, content=self._lines(kwargs["json"]))

    async def _lines(self, body: dict):
        for i in range(body["max_tokens"]):
            self.clock[0] += self.gap
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}', 'finish_reason': None}]})}\n".encode()
            yield b"\n"
        self.clock[0] += self.tail
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n".encode()
        yield b"\n"
        yield b"data: [DONE]\n"


def test_serve_metrics_follow_vllm_conventions(monkeypatch):
    """On a fake clock that moves only as chunks arrive: TTFT is the time to the first chunk, ITL
    the gaps between the later ones, TPOT (E2E - TTFT) / (n - 1), E2E the time to the end of the
    stream (usage and [DONE] included), exactly; throughputs are counts over the duration."""
    from engine.entrypoints.bench import serve as bench_serve

    clock, gap, tail = [1000.0], 0.03, 0.005
    monkeypatch.setattr(bench_serve, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    session = ScriptedSession(clock, gap, tail)
    results = [asyncio.run(bench_serve.send_request(session, "http://stub", [7] * 10, n)) for n in (4, 4, 2)]
    assert all(r.ok and r.error is None for r in results) and [r.output_tokens for r in results] == [4, 4, 2]
    s = bench_serve.serve_metrics(results, seconds=2.0)
    assert (s["completed"], s["failed"], s["input_tokens"], s["output_tokens"]) == (3, 0, 30, 10)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (1.5, 5.0, 20.0)
    for key, expected in (("ttft_ms", [gap] * 3), ("itl_ms", [gap] * 7),
                          ("tpot_ms", [(3 * gap + tail) / 3] * 2 + [gap + tail]),
                          ("e2el_ms", [4 * gap + tail] * 2 + [2 * gap + tail])):
        assert s[key] == pytest.approx(bench_serve.summary_ms(expected), rel=1e-9), key


def test_serve_load_against_a_stub(capsys):
    """``bench serve --url`` against a stub streaming a chunk every ``gap``: every request
    completes, at most --max-concurrency in flight and that many reached, token counts add up,
    throughputs are counts over the duration; the timings are bounded below by the stub's gaps
    (only lower bounds hold whatever the machine's load; the conventions are checked exactly on
    a fake clock above)."""
    pytest.importorskip("aiohttp")
    gap = 0.03
    with StubServer(gap, concurrency=2) as stub:
        report = bench(capsys, "serve", "--url", stub.url, "--preset", "tiny-qwen3", "--random-weights",
                       "--num-prompts", 6, "--input-len", 10, "--output-len", 4, "--max-concurrency", 2)
    check_common(report, "serve", device=None)
    assert stub.max_in_flight == 2
    s = report["serve"]
    assert s["completed"] == 6 and s["failed"] == 0 and s["first_error"] is None
    assert s["input_tokens"] == 60 and s["output_tokens"] == 24
    assert close(s["request_throughput"], 6 / s["duration_s"])
    assert close(s["output_throughput"], 24 / s["duration_s"])
    assert close(s["total_token_throughput"], 84 / s["duration_s"])
    assert s["duration_s"] >= 3 * 4 * gap  # three rounds of two requests, four gaps each
    assert s["ttft_ms"]["median"] >= 1e3 * gap  # the first chunk comes one gap after the request
    assert s["e2el_ms"]["median"] >= 4e3 * gap  # the last one four gaps after it
    for key in ("ttft_ms", "itl_ms", "tpot_ms"):
        stats = s[key]
        assert stats["median"] <= stats["p99"] + 1e-9 and stats["mean"] > 0
    e2e = s["e2el_ms"]
    assert close(e2e["mean"], s["ttft_ms"]["mean"] + 3 * s["tpot_ms"]["mean"], 1e-6)


def serve_launched(capsys, model: list, device: str = "cpu") -> dict:
    """bench serve --launch: the bench starts the server, loads it, and stops it."""
    return bench(capsys, "serve", "--launch", *model, "--device", device, "--num-prompts", 5, "--input-len", 12,
                 "--output-len", 6, "--range-ratio", 0.5, "--request-rate", 50, "--max-concurrency", 3)


@pytest.mark.parametrize("source", ["checkpoint", "preset"])
def test_serve_launching_the_engine_server(capsys, tiny_checkpoint, source):
    """bench serve --launch against ``python -m engine serve`` (a tiny checkpoint, or the tiny
    preset with random weights): every request completes with exactly the tokens asked
    (ignore_eos), counted from the usage chunks."""
    from engine.entrypoints.bench.serve import serve_workload

    model = ["--model", tiny_checkpoint()] if source == "checkpoint" else ["--preset", "tiny-qwen3",
                                                                          "--random-weights"]
    report = serve_launched(capsys, model)
    check_common(report, "serve")
    prompts, output_lens = serve_workload(5, 12, 6, 0.5, 512, 0)
    s = report["serve"]
    assert s["completed"] == 5 and s["failed"] == 0, s["first_error"]
    assert s["url"].startswith("http://127.0.0.1:")
    assert s["input_tokens"] == sum(map(len, prompts)) and s["output_tokens"] == sum(output_lens)
    assert all(s[k]["median"] > 0 for k in ("ttft_ms", "tpot_ms", "e2el_ms")), json.dumps(s)


@pytest.mark.cuda
def test_bench_modes_on_cuda(capsys, tmp_path):
    """The H200 smoke run: all three modes on CUDA with a tiny model; GPU step time measured,
    our profiled decode eager with GPU kernels in the trace, HF's compiled run reported (its
    figures or its error), NVML samples when nvidia-ml-py is installed."""
    tiny = ["--preset", "tiny-qwen3", "--random-weights"]
    cuda = [*tiny, "--device", "cuda"]
    latency = bench(capsys, "latency", *cuda, "--max-model-len", 256, "--prompt-lens", "16,128,4096",
                    "--decode-tokens", 32, "--decode-prompt-len", 16, "--compare", "hf", "--enforce-eager",
                    "--profile", tmp_path / "trace.json")
    check_common(latency, "latency", "cuda")
    split = latency["step_split"]
    assert split["gpu_us_per_step"] > 0 and split["cpu_dispatch_us_per_layer"] > 0
    profile = latency["profile"]
    assert profile["check"]["eager"] and profile["check"]["gpu_kernel_events"] > 0
    assert profile["gpu_kernel_us_per_step"] > 0
    compiled = latency["compare_hf"]["static_compile"]
    assert "tok_s" in compiled or "error" in compiled, compiled
    print(json.dumps({"static_compile": compiled}), file=sys.stderr)

    throughput = bench(capsys, "throughput", *cuda, "--num-seqs", 16, "--min-len", 8, "--max-len", 64,
                       "--compare", "hf", "--hf-num-seqs", 4)
    check_common(throughput, "throughput", "cuda")
    assert throughput["throughput"]["output_tok_s"] > 0

    serve = serve_launched(capsys, tiny, "cuda")
    assert serve["serve"]["completed"] == 5, serve["serve"]["first_error"]

"""GPU utilisation and memory of every NVML device, sampled in a background thread while a
benchmark runs (``pynvml`` from the optional nvidia-ml-py package)."""
from __future__ import annotations

import threading
import time


class GpuMonitor:
    """``with GpuMonitor(interval_s) as mon: ...`` then ``mon.report()``: per device, the
    utilisation (% of time a kernel ran) mean / max and used memory mean / max in GiB; or
    ``{"unavailable": reason}`` when NVML cannot be used here. ``mon.report(window)`` keeps only
    the samples taken inside ``window`` (``time.monotonic()`` seconds, start and end): the timed
    part of a benchmark, without the model's load and warm-up. ``unavailable``: a reason not to
    sample at all (a run on the CPU: the host's GPUs are not what it measures)."""

    def __init__(self, interval_s: float = 0.2, unavailable: str | None = None):
        self.interval_s = interval_s
        self.unavailable = unavailable
        self.samples: list[list[tuple[float, int, int]]] = []  # per device: (monotonic s, util %, used bytes)
        self._stop = threading.Event()

    def __enter__(self) -> "GpuMonitor":
        if self.unavailable is not None:
            return self
        try:
            import pynvml
        except ImportError:
            self.unavailable = "pynvml not installed (pip install nvidia-ml-py)"
            return self
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self.names = [pynvml.nvmlDeviceGetName(h) for h in self._handles]
            self.total = [pynvml.nvmlDeviceGetMemoryInfo(h).total for h in self._handles]
        except pynvml.NVMLError as e:
            self.unavailable = f"NVML: {e}"
            return self
        self._nvml = pynvml
        self.samples = [[] for _ in self._handles]
        self._sample()
        self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        nvml, now = self._nvml, time.monotonic()
        for handle, samples in zip(self._handles, self.samples):
            samples.append((now, nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                            nvml.nvmlDeviceGetMemoryInfo(handle).used))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __exit__(self, *exc) -> None:
        if self.unavailable is None:
            self._stop.set()
            self._thread.join()
            self._nvml.nvmlShutdown()

    def report(self, window: tuple[float, float] | None = None) -> dict:
        if self.unavailable is not None:
            return {"unavailable": self.unavailable}
        devices = []
        for index, (name, total, samples) in enumerate(zip(self.names, self.total, self.samples)):
            if window is not None:
                samples = [s for s in samples if window[0] <= s[0] <= window[1]]
                if not samples:
                    return {"unavailable": f"no sample inside the {window[1] - window[0]:.3f} s window"}
            util, used = [s[1] for s in samples], [s[2] / 2**30 for s in samples]
            devices.append({"index": index, "name": name, "samples": len(samples),
                            "util_pct_mean": sum(util) / len(util), "util_pct_max": max(util),
                            "mem_used_gib_mean": sum(used) / len(used), "mem_used_gib_max": max(used),
                            "mem_total_gib": total / 2**30})
        return {"interval_s": self.interval_s, "devices": devices}

"""The SM clock and board power a benchmark ran at, sampled by NVML in a background thread and
summarised per bench phase. A GPU at its power cap (the H200's 700 W) lowers its clocks under long
loads, so a ratio against a floor means little without the clocks both were timed at.

NVML is the driver's library, reached through the ``nvidia-ml-py`` package (module ``pynvml``; the
device's image has it); without it, or off CUDA, the sampler records why and nothing else.
"""
from __future__ import annotations

import statistics
import threading
import time


class ClockSampler:
    """Samples (unix time, SM MHz, power W) of one GPU every ``period_s`` until ``stop``."""

    def __init__(self, device_index: int, period_s: float = 0.1):
        self.period_s = period_s
        self.samples: list[tuple[float, float, float]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception as e:  # no NVML here: the bench still runs, its JSON says so
            self.error = f"{type(e).__name__}: {e}"

    def start(self) -> "ClockSampler":
        if self.error is None:
            self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        nv, h = self._nvml, self._handle
        while not self._stop.is_set():
            try:
                mhz = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
                watts = nv.nvmlDeviceGetPowerUsage(h) / 1e3
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
                return
            self.samples.append((time.time(), float(mhz), float(watts)))
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def by_phase(self, phases: list[list]) -> dict:
        """{phase: {sm_mhz mean/min/max, power_w mean/max, samples}} for each [name, unix start]
        (a phase ends where the next begins); phases without samples are left out."""
        if self.error is not None and not self.samples:
            return {"unavailable": self.error}
        out: dict = {}
        for i, (name, start) in enumerate(phases):
            end = phases[i + 1][1] if i + 1 < len(phases) else float("inf")
            got = [(m, w) for t, m, w in self.samples if start <= t < end]
            if not got:
                continue
            mhz, watts = [m for m, _ in got], [w for _, w in got]
            out[name] = {"sm_mhz_mean": round(statistics.fmean(mhz)), "sm_mhz_min": min(mhz),
                         "sm_mhz_max": max(mhz), "power_w_mean": round(statistics.fmean(watts), 1),
                         "power_w_max": round(max(watts), 1), "samples": len(got)}
        return out

"""A description of the machine and software a benchmark ran on."""

from __future__ import annotations

import datetime
import os
import platform


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load_average() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def describe() -> dict:
    """CPU model, core count, load, OS, library versions and UTC date."""
    import keras
    import onnxruntime
    import tensorflow as tf

    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "load_average_1_5_15min": _load_average(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "onnxruntime": onnxruntime.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
    }

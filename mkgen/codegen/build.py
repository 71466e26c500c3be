"""Rendering a kernel module from a layout, and loading rendered source as a module."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from mkgen.codegen.render import render
from mkgen.plan.layout import KernelLayout

MiB = 1024 * 1024
VMEM_LIMIT_BYTES = 64 * MiB  # TPU7x's whole VMEM: the plan's budget stays below it


def render_kernel(layout: KernelLayout, header: str) -> str:
    """megakernel.py for a layout."""
    name = f"{layout.model}_{layout.topology}".replace("-", "_").replace(".", "_").replace(":", "_")
    return render(
        "megakernel.py.j2",
        L=layout,
        header=header,
        kernel_name=name,
        vmem_limit_bytes=VMEM_LIMIT_BYTES,
    )


def load_module(source: str, name: str) -> ModuleType:
    """Import rendered source as a module (written to a temp file so tracebacks show lines)."""
    directory = Path(tempfile.mkdtemp(prefix="mkgen-"))
    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

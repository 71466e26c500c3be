"""The weight stream's layout: what it holds, what it pads, and how the plan reports it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from cli_run import mkgen

from mkgen.codegen import pack
from mkgen.plan import plan_build
from mkgen.plan.options import BuildOptions
from mkgen.spec.hf_import import import_hf_config
from mkgen.spec.topology import parse_topology
from mkgen.spec.weights import model_weights

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def test_the_packed_stream_holds_the_plans_weight_bytes_and_pads_the_rest() -> None:
    """Every weight packed as a nonzero value: the stream's nonzero bf16 elements are the
    plan's weight bytes, and every other byte is its padding."""
    spec = import_hf_config(FIXTURES / "qwen3_moe" / "config.json", "qwen3_moe")
    options = BuildOptions.create(context=64)
    plan = plan_build(options.apply(spec), parse_topology("1x1x1"), options)
    ones = {w.name: np.ones(w.shape, np.float32) for w in model_weights(spec)}
    stream = pack.pack_stream(plan.kernel, ones, 0).view(np.uint16)
    assert stream.nbytes == plan.stream.bytes_per_step
    assert 2 * np.count_nonzero(stream) == plan.stream.weight_bytes
    assert plan.stream.padding_bytes == stream.nbytes - plan.stream.weight_bytes > 0


def test_plan_reports_the_streams_padding_in_text_and_json() -> None:
    text = mkgen("plan", "mixtral-8x7b", "--topology", "2x2x1")
    assert text.returncode == 0, text.stderr
    data = json.loads(mkgen("plan", "mixtral-8x7b", "--topology", "2x2x1", "--json").stdout)
    stream = data["stream"]
    assert stream["padding_bytes"] == stream["bytes_per_step"] - stream["weight_bytes"]
    percent = 100 * stream["padding_bytes"] / stream["bytes_per_step"]
    assert stream["padding_percent"] == round(percent, 3)
    assert f"padding {stream['padding_bytes'] / 2**20:.1f} MiB ({percent:.2f} %" in text.stdout

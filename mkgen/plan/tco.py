"""Cost per token for `mkgen estimate`: request scenarios, the prefill assumption, and the
published reference points the chart is drawn against.

Total tokens per dollar counts what a request is billed for, its input and its output:

    dollars per request = price per chip-hour / 3600 x chips x (prefill s + decode s)
    decode s  = output tokens / aggregate decode tokens/s (the cost model's prediction)
    prefill s = input tokens x 2 x active parameters / (chips x peak bf16 FLOP/s x MFU)

mkgen has no prefill estimate yet, so prefill is priced by the stated assumption
PREFILL_MFU (compute-bound matmuls at that share of the slice's peak). The chart says so.

The reference points are the public Inferact tpu-megakernels README and the seeds' TCO
chart, as published: total tokens per dollar at the chip-hour prices below (analyst
estimates, not list prices). A different price scales a point's tokens per dollar by
published price / new price; the input/output mix behind them is the chart's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from mkgen.errors import MkgenError
from mkgen.hardware import CATALOG
from mkgen.plan.options import check_chip_hour_price

# An assumption, not a measurement: prefill matmuls at 40 % of the slice's bf16 peak.
PREFILL_MFU = 0.40


@dataclass(frozen=True)
class Scenario:
    """A request shape: input tokens (prefilled) and output tokens (decoded)."""

    name: str
    input_tokens: int
    output_tokens: int
    why: str

    def describe(self) -> str:
        return f"{self.name}: {self.input_tokens:,} input + {self.output_tokens:,} output tokens"


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("agentic", 3072, 1024, "tool results and files read, a shorter answer"),
        Scenario("chat", 512, 512, "a short prompt and an answer of the same length"),
        Scenario("decode", 0, 1, "output tokens only, prefill not counted"),
    )
}


def scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise MkgenError(f"--scenario {name!r}: use one of {', '.join(SCENARIOS)}") from None


def total_tokens_per_dollar(
    scenario: Scenario,
    *,
    decode_tokens_per_s: float,
    active_params: float,
    chips: int,
    peak_bf16_flops_per_chip: float,
    price_per_chip_hour_usd: float,
) -> float:
    """Input plus output tokens per dollar of slice time for requests of `scenario`."""
    prefill_s = (
        scenario.input_tokens * 2 * active_params / (chips * peak_bf16_flops_per_chip * PREFILL_MFU)
    )
    decode_s = scenario.output_tokens / decode_tokens_per_s
    dollars = price_per_chip_hour_usd / 3600 * chips * (prefill_s + decode_s)
    return (scenario.input_tokens + scenario.output_tokens) / dollars


# ---------------------------------------------------------------- published references

REFERENCE_SOURCE = (
    "Kimi K3 (2.8T) serving points: the seeds' TCO chart (agentic total tokens per $ against "
    "P90 tokens/s per user) and the Inferact tpu-megakernels README (public)"
)

# Analyst chip-hour estimates the published points are priced at (USD).
PUBLISHED_PRICES: dict[str, float] = {
    "TPU7x": float(CATALOG["tpu7x"].price_per_chip_hour_usd or 0),
    "MI355X": 1.50,
    "B200": 1.73,
    "GB200": 1.86,
    "B300": 2.26,
    "GB300": 2.31,
}


@dataclass(frozen=True)
class ReferenceCurve:
    """Published points (tokens/s per user, total tokens per $) of one system, or only
    where its curve ends (tokens/s per user) when no price point was published."""

    label: str
    chip: str
    points: tuple[tuple[float, float], ...] = ()
    ends_at: tuple[tuple[float, str], ...] = ()  # (tokens/s per user, what)
    note: str = ""
    price_per_chip_hour_usd: float | None = None  # set by priced()

    def describe(self) -> str:
        """`GB300 NVL72 ($2.31/chip-hour)` once priced."""
        price = self.price_per_chip_hour_usd
        return self.label + (f" (${price:.2f}/chip-hour)" if price is not None else "")


# Every reference is Kimi K3 (2.8T): the seeds' TCO chart plots it on each system
# ("agentic total tokens per $1" against P90 tokens/s per user), and the GB200 points are
# its vLLM serving results. They are not the model an mkgen chart plots, unless that is
# Kimi K3 (estimate_chart_text says so).
REFERENCES = (
    ReferenceCurve(
        "Kimi K3 on TPUv7 (InferenceX agentic benchmark, TorchTPU vLLM with megakernels)",
        "TPU7x",
        points=((390.0, 2.2e6),),
        note="sustains up to ~400 tokens/s per user",
    ),
    ReferenceCurve("Kimi K3 on GB300 NVL72", "GB300", points=((25.0, 31e6), (400.0, 2.5e6))),
    ReferenceCurve("Kimi K3 on MI355X", "MI355X", ends_at=((130.0, "curve ends"),)),
    ReferenceCurve("Kimi K3 on B300", "B300", ends_at=((270.0, "curve ends"),)),
    ReferenceCurve(
        "Kimi K3 on 16 GB200, vLLM",
        "GB200",
        ends_at=((229.0, "acceptance 3"), (452.0, "acceptance 6")),
    ),
)


def parse_prices(items: tuple[str, ...] | list[str]) -> dict[str, float]:
    """PUBLISHED_PRICES with `--reference-price CHIP=USD` overrides."""
    prices = dict(PUBLISHED_PRICES)
    for item in items:
        chip, _, text = item.partition("=")
        if chip not in prices:
            raise MkgenError(
                f"--reference-price {item!r}: unknown chip {chip!r}; use one of "
                f"{', '.join(prices)} (write CHIP=USD)"
            )
        try:
            usd = float(text)
        except ValueError:
            raise MkgenError(
                f"--reference-price {item!r}: write CHIP=USD with a positive price"
            ) from None
        check_chip_hour_price(f"--reference-price {item!r}", usd)
        prices[chip] = usd
    return prices


def priced(curve: ReferenceCurve, prices: Mapping[str, float]) -> ReferenceCurve:
    """`curve` with its tokens per dollar at `prices` instead of the published ones."""
    scale = PUBLISHED_PRICES[curve.chip] / prices[curve.chip]
    return replace(
        curve,
        points=tuple((x, y * scale) for x, y in curve.points),
        price_per_chip_hour_usd=prices[curve.chip],
    )

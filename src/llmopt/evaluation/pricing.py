"""Hardware profiles with hourly prices, and the price metrics derived from throughput.

The reference prices are dated list prices (on-demand, us-east-1) and are only a starting point:
override them with --price-per-hour/--discount, or with a YAML file of profiles
($LLMOPT_HOME/hardware.yaml or --hardware-file). Every result records the price it used.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from llmopt import paths
from llmopt.errors import LlmoptError

INPUT_WEIGHT, OUTPUT_WEIGHT = 3, 1  # blended price: input and output tokens weighted 3:1


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    price_per_hour: float
    as_of: str
    discount: float = 0.0

    @property
    def effective_price_per_hour(self) -> float:
        return (1 - self.discount) * self.price_per_hour

    def to_dict(self) -> dict:
        return {**asdict(self), "effective_price_per_hour": self.effective_price_per_hour}


REFERENCE = {
    p.name: p
    for p in (
        HardwareProfile("r7i.large", "AWS EC2, 2 vCPU Sapphire Rapids (AMX), 16 GiB: closest to a 2-core AMX machine", 0.1323, "2024-06"),
        HardwareProfile("c7i.xlarge", "AWS EC2, 4 vCPU Sapphire Rapids (AMX), 8 GiB", 0.1785, "2024-06"),
        HardwareProfile("m7i.2xlarge", "AWS EC2, 8 vCPU Sapphire Rapids (AMX), 32 GiB", 0.4032, "2024-06"),
        HardwareProfile("g5.xlarge", "AWS EC2, 1x NVIDIA A10G 24 GB, 4 vCPU", 1.006, "2024-06"),
        HardwareProfile("g6.xlarge", "AWS EC2, 1x NVIDIA L4 24 GB, 4 vCPU", 0.8048, "2024-06"),
        HardwareProfile("ml.g5.2xlarge", "SageMaker hosting, 1x NVIDIA A10G 24 GB, 8 vCPU", 1.515, "2024-06"),
        HardwareProfile("p4d.24xlarge", "AWS EC2, 8x NVIDIA A100 40 GB", 32.7726, "2024-06"),
    )
}
DEFAULT_CPU_PROFILE = "r7i.large"


def profiles(extra_file: Path | None = None) -> dict[str, HardwareProfile]:
    """Reference profiles, overridden by the user's YAML file (a mapping of name -> fields)."""
    found = dict(REFERENCE)
    for path in (paths.home() / "hardware.yaml", extra_file):
        if path is None or not path.is_file():
            if extra_file is not None and path == extra_file:
                raise LlmoptError(f"hardware file '{extra_file}' does not exist", "pass a YAML file of profiles")
            continue
        try:
            data = yaml.safe_load(path.read_text()) or {}
            for name, fields in data.items():
                found[name] = HardwareProfile(name=name, **fields)
        except (yaml.YAMLError, TypeError, AttributeError) as exc:
            raise LlmoptError(
                f"{path}: bad hardware profiles ({exc})",
                "write `NAME: {description: ..., price_per_hour: 1.0, as_of: 2026-01}` per profile",
            ) from None
    return found


def choose(profile: str | None, price_per_hour: float | None, discount: float | None, extra_file: Path | None = None) -> HardwareProfile:
    if price_per_hour is not None:
        if price_per_hour <= 0:
            raise LlmoptError("--price-per-hour must be positive", "give the instance's hourly price, e.g. 1.006")
        base = HardwareProfile("custom", "price given on the command line", price_per_hour, "user")
    else:
        table = profiles(extra_file)
        name = profile or DEFAULT_CPU_PROFILE
        if name not in table:
            raise LlmoptError(f"unknown hardware profile '{name}'", f"use one of {', '.join(sorted(table))} or --price-per-hour")
        base = table[name]
    if discount is not None:
        if not 0 <= discount < 1:
            raise LlmoptError(f"discount {discount} is outside [0, 1)", "give a fraction, e.g. 0.3 for 30%")
        base = HardwareProfile(base.name, base.description, base.price_per_hour, base.as_of, discount)
    return base


def per_million(price_per_hour: float, tokens_per_second: float) -> float | None:
    """Dollars per 1M tokens when the instance does nothing but produce these tokens."""
    if tokens_per_second <= 0:
        return None
    return price_per_hour / (tokens_per_second * 3600 / 1e6)


def blended_per_million(price_per_hour: float, total_tokens_per_second: float) -> float | None:
    """DESIGN.md's blended price: price/h ÷ (total tokens/s × 3600 ÷ 10^6) ÷ 4, for 3:1 input:output."""
    value = per_million(price_per_hour, total_tokens_per_second)
    return None if value is None else value / (INPUT_WEIGHT + OUTPUT_WEIGHT)

"""Hardware profiles with hourly prices, and the price metrics derived from throughput.

The reference prices are dated list prices (on-demand, us-east-1) and are only a starting point:
override them with --price-per-hour/--discount, or with a YAML file of profiles
($LLMOPT_HOME/hardware.yaml or --hardware-file). Every result records the price it used.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, computed_field

from llmopt import paths
from llmopt.engine import platform
from llmopt.engine.platform import Hardware
from llmopt.errors import LlmoptError

INPUT_WEIGHT, OUTPUT_WEIGHT = 3, 1  # blended price: input and output tokens weighted 3:1


class HardwareProfile(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    description: str
    price_per_hour: float = Field(gt=0, le=1e6)
    as_of: str
    discount: float = Field(0.0, ge=0, lt=1)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def effective_price_per_hour(self) -> float:
        return (1 - self.discount) * self.price_per_hour


def _profile(name: str, description: str, price: float, as_of: str = "2024-06") -> HardwareProfile:
    return HardwareProfile(name=name, description=description, price_per_hour=price, as_of=as_of)


REFERENCE = {
    p.name: p
    for p in (
        _profile("r7i.large", "AWS EC2, 2 vCPU Sapphire Rapids (AMX), 16 GiB: closest to a 2-core AMX machine", 0.1323),
        _profile("c7i.xlarge", "AWS EC2, 4 vCPU Sapphire Rapids (AMX), 8 GiB", 0.1785),
        _profile("m7i.2xlarge", "AWS EC2, 8 vCPU Sapphire Rapids (AMX), 32 GiB", 0.4032),
        _profile("r7a.large", "AWS EC2, 2 vCPU AMD EPYC Genoa (AVX-512, no AMX), 16 GiB: closest to a 2-core AMD machine", 0.1522),
        _profile("c7a.xlarge", "AWS EC2, 4 vCPU AMD EPYC Genoa (AVX-512, no AMX), 8 GiB", 0.2053),
        _profile("g5.xlarge", "AWS EC2, 1x NVIDIA A10G 24 GB, 4 vCPU", 1.006),
        _profile("g6.xlarge", "AWS EC2, 1x NVIDIA L4 24 GB, 4 vCPU", 0.8048),
        _profile("ml.g5.2xlarge", "SageMaker hosting, 1x NVIDIA A10G 24 GB, 8 vCPU", 1.515),
        _profile("p4d.24xlarge", "AWS EC2, 8x NVIDIA A100 40 GB", 32.7726),
    )
}
# The profile suggested for a machine llmopt detects: the closest instance of the same processor kind.
SUGGESTED = {"intel": "r7i.large", "amd": "r7a.large", "A10G": "g5.xlarge", "L4": "g6.xlarge", "A100": "p4d.24xlarge"}


def for_hardware(hardware: Hardware) -> HardwareProfile:
    """The reference profile that fits the machine: its GPU kind, else its CPU maker."""
    if hardware.gpu:
        kind = next((k for k in ("A10G", "L4", "A100") if k in hardware.gpu), "L4")
        return REFERENCE[SUGGESTED[kind]]
    return REFERENCE[SUGGESTED["amd" if "AMD" in hardware.cpu_model.upper() else "intel"]]


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
        except (yaml.YAMLError, TypeError, AttributeError, ValueError, UnicodeDecodeError) as exc:
            raise LlmoptError(
                f"{path}: bad hardware profiles ({exc})",
                "write `NAME: {description: ..., price_per_hour: 1.0, as_of: 2026-01}` per profile",
            ) from None
    return found


def choose(profile: str | None, price_per_hour: float | None, discount: float | None, extra_file: Path | None = None) -> HardwareProfile:
    if price_per_hour is not None:
        if not 0 < price_per_hour <= 1e6:
            raise LlmoptError(f"--price-per-hour {price_per_hour:g} is not an hourly price", "give the instance's hourly price, e.g. 1.006")
        base = _profile("custom", "price given on the command line", price_per_hour, "user")
    else:
        table = profiles(extra_file)
        name = profile or for_hardware(platform.detect()).name
        if name not in table:
            raise LlmoptError(f"unknown hardware profile '{name}'", f"use one of {', '.join(sorted(table))} or --price-per-hour")
        base = table[name]
    if discount is not None:
        if not 0 <= discount < 1:
            raise LlmoptError(f"discount {discount} is outside [0, 1)", "give a fraction, e.g. 0.3 for 30%")
        base = base.model_copy(update={"discount": discount})
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

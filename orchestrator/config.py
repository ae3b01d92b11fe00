"""Job configuration: YAML under configs/ + `key=value` overrides (OmegaConf), validated by pydantic.

cfg = load_config(BenchmarkConfig, "configs/smollm2-135m/benchmark_generate.yaml", ["max_tokens=64"])
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, ValidationError

from orchestrator.errors import AerieError

T = TypeVar("T", bound=BaseModel)


class StrictModel(BaseModel):
    """Base of every job/app config: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def describe_validation_error(err: ValidationError) -> str:
    """Pydantic's errors as one line: `field.sub: message; other: message`."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "config"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def load_config(model: type[T], path: str | Path | None, overrides: list[str] | None = None) -> T:
    """Read YAML (optional), apply dotted `key=value` overrides, validate with `model`."""
    try:
        if path is not None:
            if not Path(path).is_file():
                raise AerieError(f"config file {str(path)!r} does not exist")
            base = OmegaConf.load(path)
        else:
            base = OmegaConf.create({})
        bad = [o for o in overrides or [] if not o.partition("=")[0].strip() or "=" not in o]
        if bad:
            raise AerieError(f"overrides must look like key=value, got {bad}")
        for override in overrides or []:  # one by one: `sources.0.weight=2` reaches into a list
            key, value = override.split("=", 1)
            try:
                OmegaConf.update(base, key, OmegaConf.from_dotlist([f"v={value}"])["v"], merge=True)
            except (OmegaConfBaseException, TypeError, ValueError) as err:
                raise AerieError(f"bad override {override!r}: {str(err).splitlines()[0]}") from err
        data = OmegaConf.to_container(base, resolve=True)
    except OmegaConfBaseException as err:
        raise AerieError(f"{path}: {err}") from err
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise AerieError(f"{path or 'config'}: {describe_validation_error(err)}") from err

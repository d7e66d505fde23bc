"""The --detector-* flags: the quarantine detector layers the controller judges tool results with
(fleet/core/quarantine/detector_config.py, docs/quarantine.md), for every tenant and per tenant."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from fleet.core.errors import InvalidArgument
from fleet.core.quarantine.detector_config import (
    DEFAULT_LAYERS,
    LAYERS,
    DetectorConfig,
    default_layers,
    fragmentation_problem,
    gate_problem,
    parse_detector,
    parse_layers,
)


def add_detector_flags(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--detector-layers (env KVFLEET_DETECTOR_LAYERS), --detector-encoder-gate (env KVFLEET_DETECTOR_ENCODER_GATE),
    --detector-encoder-max-fragmentation (env KVFLEET_DETECTOR_ENCODER_MAX_FRAGMENTATION) and --detector-tenant
    (repeatable; env KVFLEET_DETECTOR_TENANTS, ';'-separated)."""
    e = env.get
    p.add_argument(
        "--detector-layers",
        default=e("KVFLEET_DETECTOR_LAYERS"),
        help="quarantine detector layers the controller judges tool results with, comma-separated, of "
        f"{', '.join(LAYERS)} (default {','.join(DEFAULT_LAYERS)}, less any not installed, which the start line "
        "names; a layer named here and not installed is an error; encoder needs kvfleet[encoder]; docs/quarantine.md)",
    )
    p.add_argument(
        "--detector-encoder-gate",
        type=float,
        metavar="TAU",
        default=e("KVFLEET_DETECTOR_ENCODER_GATE"),  # NOTE: argparse parses a string default with type=float
        help="with the encoder layer in --detector-layers: the encoder judges only tool results whose learned score "
        "is >= TAU (a cascade: far fewer benign results withheld and a fraction of the CPU, fewer attacks caught; "
        "0.918 was chosen on validation, docs/quarantine_default.md); per tenant: gate:TAU in --detector-tenant",
    )
    p.add_argument(
        "--detector-encoder-max-fragmentation",
        type=float,
        metavar="PHI",
        default=e("KVFLEET_DETECTOR_ENCODER_MAX_FRAGMENTATION"),
        help="with the encoder layer in --detector-layers: an encoder window counts only if at most PHI of its tokens "
        "are word pieces, so the English encoder judges English text, not other languages, base64 or hex (0.2 was "
        "chosen on validation, docs/quarantine_default.md); per tenant: frag:PHI in --detector-tenant",
    )
    p.add_argument(
        "--detector-tenant",
        action="append",
        metavar="TENANT=LAYERS",
        default=[x for x in e("KVFLEET_DETECTOR_TENANTS", "").split(";") if x.strip()],
        help="a tenant's own detector (repeatable; env KVFLEET_DETECTOR_TENANTS, ';'-separated): its layers, "
        "each with an optional threshold, e.g. acme=rules,learned:0.99 or beta=rules,encoder:0.995 (every encoder member) or "
        "encoder:0.97/0.98 (one per member) (other tenants: --detector-layers)",
    )


def detector_layers_from(text: str | None) -> tuple[str, ...]:
    """--detector-layers parsed (None, not given: the default layers that are installed here); InvalidArgument
    names the flag and the fix, also for a layer named here whose packages are not installed."""
    if text is None:
        return default_layers()
    try:
        return parse_layers(text)
    except ValueError as e:
        raise InvalidArgument(f"--detector-layers: {e}") from None


def encoder_gate_from(gate: float | None, layers: tuple[str, ...]) -> float | None:
    """--detector-encoder-gate checked against the layers; InvalidArgument names the flag and the fix."""
    return _checked("--detector-encoder-gate", gate, gate_problem(gate, layers) if gate is not None else None)


def max_fragmentation_from(frag: float | None, layers: tuple[str, ...]) -> float | None:
    """--detector-encoder-max-fragmentation checked against the layers; InvalidArgument names the flag and the fix."""
    problem = fragmentation_problem(frag, layers) if frag is not None else None
    return _checked("--detector-encoder-max-fragmentation", frag, problem)


def _checked(flag: str, value: float | None, problem: str | None) -> float | None:
    if problem:
        raise InvalidArgument(f"{flag} {value:g}: {problem} (--detector-layers)")
    return value


def detector_tenants_from(items: list[str]) -> tuple[tuple[str, DetectorConfig], ...]:
    """--detector-tenant TENANT=LAYERS, each parsed; InvalidArgument names the flag, the item and the fix."""
    out: dict[str, DetectorConfig] = {}
    for item in items:
        tenant, sep, spec = (x.strip() for x in item.partition("="))
        if not sep or not tenant or not spec:
            raise InvalidArgument(f"--detector-tenant {item!r}: expected TENANT=LAYERS, e.g. acme=rules,learned:0.99")
        if tenant in out:
            raise InvalidArgument(f"--detector-tenant: tenant {tenant!r} is given twice")
        try:
            out[tenant] = parse_detector(spec)
        except ValueError as e:
            raise InvalidArgument(f"--detector-tenant {tenant}: {e}") from None
    return tuple(out.items())

"""Per-tenant overrides written as text, as the environment gives them.

`<tenant-uuid>=<n>,...` maps tenants to a whole number (a ceiling); `<uuid>,...`
lists tenants. Policies parse these in their field validators, so a value read
from a variable and one written in code mean the same.
"""

from __future__ import annotations

from assay.kernel.ids import TenantId, tenant_id


def tenant_map(value: object, unit: str) -> object:
    """Parse `<tenant-uuid>=<n>,...` (a per-tenant override map); other values pass through.

    Raises:
        ValueError: an entry is malformed, a tenant is not a UUID or is given twice, or
            a number is not a whole number >= 1.
    """
    if not isinstance(value, str):
        return value
    out: dict[TenantId, int] = {}
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        tenant, sep, number = entry.partition("=")
        if not sep:
            raise ValueError(f"{entry!r} is not <tenant-uuid>=<{unit}>")
        try:
            who = tenant_id(tenant.strip())
        except ValueError:
            raise ValueError(f"{tenant.strip()!r} is not a tenant UUID") from None
        if not number.strip().isdigit() or int(number) < 1:
            raise ValueError(f"{number.strip()!r} for {who} is not a whole number >= 1")
        if who in out:
            raise ValueError(f"tenant {who} is given twice")
        out[who] = int(number)
    return out


def tenant_keyed(value: object, unit: str) -> object:
    """`tenant_map`, with the tenants as strings (for maps keyed by `str(tenant)`)."""
    parsed = tenant_map(value, unit)
    if isinstance(parsed, dict):
        return {str(k): v for k, v in parsed.items()}
    return parsed


def tenant_set(value: object) -> object:
    """Parse `<tenant-uuid>,...` into a frozenset of tenant strings; other values pass.

    Raises:
        ValueError: an entry is not a tenant UUID.
    """
    if not isinstance(value, str):
        return value
    out: set[str] = set()
    for part in filter(None, (p.strip() for p in value.split(","))):
        try:
            out.add(str(tenant_id(part)))
        except ValueError as exc:
            raise ValueError(f"{part!r} is not a tenant UUID") from exc
    return frozenset(out)

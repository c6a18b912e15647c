"""Daily ceilings in tokens and dollars beside a purpose's call ceiling (§14.1).

A policy that meters a purpose (grading, the proposer) mixes these in: tokens and US
dollars per tenant per UTC day, with per-tenant overrides written as text the way
call ceilings are (`<tenant-uuid>=<amount>,...`). `limit` turns them, with the
purpose's own call ceiling, into the `SpendLimit` the stage's spend ledger checks
each reservation against.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from assay.kernel.ids import tenant_id
from assay.kernel.spend import SpendLimit, micro_usd
from assay.kernel.tenant_maps import tenant_keyed


def tenant_dollars(value: object) -> object:
    """Parse `<tenant-uuid>=<usd>,...` (dollars may have a fraction); other values pass.

    Raises:
        ValueError: an entry is malformed, a tenant is not a UUID or is given twice, or
            an amount is not a number >= 0.
    """
    if not isinstance(value, str):
        return value
    out: dict[str, float] = {}
    for entry in filter(None, (e.strip() for e in value.split(","))):
        tenant, sep, amount = entry.partition("=")
        if not sep:
            raise ValueError(f"{entry!r} is not <tenant-uuid>=<usd>")
        try:
            who = str(tenant_id(tenant.strip()))
        except ValueError:
            raise ValueError(f"{tenant.strip()!r} is not a tenant UUID") from None
        try:
            usd = float(amount)
        except ValueError:
            raise ValueError(f"{amount.strip()!r} for {who} is not a dollar amount") from None
        if not usd >= 0 or usd == float("inf"):
            raise ValueError(f"{amount.strip()!r} for {who} is not a dollar amount >= 0")
        if who in out:
            raise ValueError(f"tenant {who} is given twice")
        out[who] = usd
    return out


class DailySpendCeilings(BaseModel):
    """Tokens and dollars a tenant may spend on the purpose per UTC day (unset: no limit)."""

    tokens_per_day: int | None = Field(
        None, ge=0, description="Tokens (prompt + completion) per tenant per UTC day."
    )
    usd_per_day: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="US dollars per tenant per UTC day, at the model's configured prices.",
    )
    token_ceilings: dict[str, int] = Field(
        default_factory=dict, description="Per-tenant token ceilings: `<tenant-uuid>=<tokens>,...`."
    )
    usd_ceilings: dict[str, float] = Field(
        default_factory=dict, description="Per-tenant dollar ceilings: `<tenant-uuid>=<usd>,...`."
    )

    @field_validator("token_ceilings", mode="before")
    @classmethod
    def _tokens(cls, value: object) -> object:
        return tenant_keyed(value, "tokens")

    @field_validator("usd_ceilings", mode="before")
    @classmethod
    def _dollars(cls, value: object) -> object:
        return tenant_dollars(value)

    def spend_limit(self, tenant: str, calls: int | None) -> SpendLimit:
        """The tenant's ceiling per UTC day: `calls` (the purpose's own), tokens, dollars."""
        tokens = self.token_ceilings.get(str(tenant), self.tokens_per_day)
        usd = self.usd_ceilings.get(str(tenant), self.usd_per_day)
        return SpendLimit(calls, tokens, None if usd is None else micro_usd(usd))

"""The ``[health]`` section: operators' rules over the classification table, the remediation
policy per tenant or SKU, and the rate limits. Pydantic models that forbid unknown keys, like
every section of ``metald.config`` (which holds one ``HealthConfig``)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from metald.health.classify import DEFAULT_RULES, Rule, Severity, Table, build_table
from metald.health.signals import Kind


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)


class RuleConfig(_Model):
    """One rule: signals of ``kind`` whose code matches ``match`` (a regular expression over
    the whole code, case-insensitive) and whose value is at least ``min_value`` get
    ``severity``. An id of a built-in rule replaces it in place; a new id goes before every
    built-in rule (the first rule that matches decides)."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    kind: Kind
    match: str
    severity: Severity
    why: str = Field(default="", max_length=300)
    min_value: float | None = None
    #: The part a technician looks at: gpu, dimm, cpu, psu, fan, disk, nic, node.
    part: str = ""

    @field_validator("match")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"match is not a regular expression ({e}): {v!r}") from None
        return v


class PolicyConfig(_Model):
    """What remediation does with a machine of a claim. ``degraded``: drain it in the tenant's
    scheduler, or do nothing. ``fatal``: drain, wait for jobs, take it out of the claim and
    claim a replacement (``replace``); the same without a replacement (``remove``); or only
    drain (``drain``, for tenants that act themselves)."""

    degraded: Literal["drain", "none"] = "drain"
    fatal: Literal["replace", "remove", "drain"] = "replace"
    #: How long running jobs may finish on a drained machine with a fatal fault (0: now).
    job_wait_s: int = Field(default=3600, ge=0, le=7 * 86400)


class LimitsConfig(_Model):
    """At most this many machines of one claim, and of one rack, in remediation at once."""

    per_claim: int = Field(default=1, ge=1, le=10_000)
    per_rack: int = Field(default=2, ge=1, le=10_000)


class IntakeConfig(_Model):
    """How fast BMCs and nodes may push to metald, per instance (``metald.healthwatch.intake``):
    token buckets (``burst`` at once, refilled at ``per_s`` a second) checked before the store
    is touched; past any, 429 with Retry-After. A burst of 0 turns that bucket off."""

    #: Per BMC id: a BMC pushing its event log. A healthy one sends a few events a minute.
    bmc_event_burst: int = Field(default=20, ge=0, le=100_000)
    bmc_event_per_s: float = Field(default=0.5, ge=0, le=10_000)
    #: Per presented node token: the store's own limit (``report_min_interval_s``) still holds
    #: for a valid one; this bounds what guessed or replayed tokens cost.
    report_burst: int = Field(default=20, ge=0, le=100_000)
    report_per_s: float = Field(default=2.0, ge=0, le=10_000)
    #: Per source address, for each of the two routes.
    source_burst: int = Field(default=200, ge=0, le=1_000_000)
    source_per_s: float = Field(default=50.0, ge=0, le=100_000)
    #: In all, for each of the two routes (1,000 nodes every 15 s is about 67 a second).
    total_burst: int = Field(default=2000, ge=0, le=1_000_000)
    total_per_s: float = Field(default=500.0, ge=0, le=1_000_000)


class HealthConfig(_Model):
    #: Rules ahead of (or replacing, by id) the built-in table (``docs/health.md``).
    rules: list[RuleConfig] = Field(default_factory=list)
    #: Built-in rules turned off, by id.
    disable: list[str] = Field(default_factory=list)
    #: A node silent this long is fatal (metald's observation); shorter is transient.
    node_silence_s: int = Field(default=60, ge=5, le=86400)
    #: Correctable GPU ECC errors per hour, over ``ecc_window_s``, that make a storm.
    correctable_ecc_per_hour: float = Field(default=1000.0, gt=0)
    ecc_window_s: int = Field(default=3600, ge=60, le=7 * 86400)
    #: A transient fault is forgotten this long after its last signal.
    transient_ttl_s: int = Field(default=600, ge=1, le=86400)
    policy: PolicyConfig = PolicyConfig()
    #: By tenant name; wins over ``sku_policies`` and ``policy``.
    tenant_policies: dict[str, PolicyConfig] = Field(default_factory=dict)
    #: By SKU name; wins over ``policy``.
    sku_policies: dict[str, PolicyConfig] = Field(default_factory=dict)
    limits: LimitsConfig = LimitsConfig()
    intake: IntakeConfig = IntakeConfig()
    #: The interval metald tells each node agent to report at.
    report_interval_s: int = Field(default=15, ge=1, le=3600)
    #: A node reporting again sooner than this gets 429 with Retry-After (nothing recorded).
    report_min_interval_s: float = Field(default=3.0, ge=0, le=3600)
    #: How often the BMC's owner reads each in-use machine's BMC event log and sensors.
    bmc_interval_s: float = Field(default=20.0, ge=1, le=86400)
    #: metald's API as the BMCs reach it (``https://metald.mgmt:8080``): the BMC's owner
    #: subscribes each in-use Redfish BMC that offers an EventService to push its log entries
    #: to ``<this>/api/v1/bmc-events/<bmc id>`` (docs/health.md). Empty: polling only.
    bmc_events_url: str = Field(default="", max_length=512, pattern=r"^(https?://[^\s?#]+)?$")
    #: How often the watch looks for silent nodes and advances remediations.
    watch_interval_s: float = Field(default=5.0, ge=0.2, le=3600)
    #: Off: nothing is read, recorded or remediated (the report route still answers).
    enabled: bool = True

    @model_validator(mode="after")
    def _ids(self) -> HealthConfig:
        ids = [r.id for r in self.rules]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"health.rules: rule id(s) {', '.join(dup)} given twice")
        known = {r.id for r in DEFAULT_RULES}
        unknown = sorted(set(self.disable) - known)
        if unknown:
            raise ValueError(
                f"health.disable names no built-in rule: {', '.join(unknown)} "
                f"(see docs/health.md for the ids)"
            )
        return self

    def policy_for(self, *, tenant: str | None, sku: str | None) -> PolicyConfig:
        if tenant is not None and tenant in self.tenant_policies:
            return self.tenant_policies[tenant]
        if sku is not None and sku in self.sku_policies:
            return self.sku_policies[sku]
        return self.policy

    def table(self) -> Table:
        """The classification table in force: the built-in one with these rules and limits."""
        return build_table(
            [
                Rule(r.id, r.kind, r.match, r.severity, r.why, r.min_value, r.part)
                for r in self.rules
            ],
            disable=self.disable,
            node_silence_s=self.node_silence_s,
            correctable_ecc_per_hour=self.correctable_ecc_per_hour,
        )

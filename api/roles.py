"""Who may call what: the role sets route declarations name, each defined once (``ALL_ROLES``
and ``STAFF``, staff = admin and technician, live in ``api.routing``)."""

from __future__ import annotations

from api.routing import STAFF
from metald.auth import Role

ADMIN = frozenset({Role.ADMIN})
#: A machine's own agent (its token is scoped to that machine and its phase).
AGENT = frozenset({Role.AGENT})
#: Staff, and orchestrators for their tenants only: read claims, images, tenants.
READERS = STAFF | {Role.ORCHESTRATOR}
#: Claim and release machines: orchestrators for their tenants, admins for any.
CLAIMERS = frozenset({Role.ADMIN, Role.ORCHESTRATOR})
#: A join token hands out the tenant's scheduler secrets (munge key) and a place on its hub:
#: only admin and the tenant's own orchestrator mint one, never a technician.
JOIN_MINTERS = frozenset({Role.ADMIN, Role.ORCHESTRATOR})

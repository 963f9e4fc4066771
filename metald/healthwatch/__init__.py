"""The Day-2 loop around the pure health cores (``metald.health``): faults, BMC log cursors
and node heartbeats in the store (``faults``), the node report (``reports``), the remediation
workflow with the tenant's scheduler in the loop (``workflow``), the repair hand-off
(``repair``) and the service that watches machines in use (``watch``)."""

"""Commissioning's pure core: SKU profiles and their comparison with an inventory, the check
parsers, and metald's verdict on each check the agent reports. No store and no I/O: the runs
in the store are ``metald.provision.commissioning``'s."""

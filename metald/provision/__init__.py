"""Provisioning: the image catalog, boot intents, agent progress, the network-boot step and the watchdog.

``images``, ``intents`` and ``netboot_core`` (the network-boot step's table) are pure;
``progress`` and ``watchdog`` work on a Session; ``netboot`` runs the step's commands against
the store and the BMC (one-time PXE boot and a power cycle).
"""

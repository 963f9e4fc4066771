"""Provisioning: the image catalog, boot intents, agent progress, the driver and the watchdog.

``images`` and ``intents`` are pure; ``progress`` and ``watchdog`` work on a Session;
``driver`` adds the BMC (one-time PXE boot and a power cycle).
"""

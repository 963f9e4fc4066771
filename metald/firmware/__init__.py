"""Firmware lifecycle: baselines per SKU profile, compliance, and updates through the BMC.

``baselines`` is the pure comparison of a machine's recorded firmware versions with its
profile's baseline; ``updates`` the pure step core of one update; ``images`` the store of
verified images the BMCs fetch; ``service`` the background updates, owned and resumable.
"""

"""Claims for tenants, one module per flow (Ironic's conductor modules):

- ``allocation``: claim N machines matching a selector, all or none, idempotently;
- ``release``: a claim (or one machine of it) ends, its machines leave the tenant and wipe;
- ``provisioning``: what the agent on a claimed machine does next (install, wipe, join);
- ``images``: the image catalog's writes;
- ``workflow``: claim, release, retry and wipe with their after-commit effects (wake the event
  streams, sync the tenant hubs, network-boot through the BMC), over typed dependencies;
- ``records``: what these share.

The API validates and authorises, then hands off to ``workflow`` (or, for reads, ``records``).
"""

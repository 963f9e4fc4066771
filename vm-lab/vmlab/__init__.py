"""vm-lab: virtual racks of QEMU machines with virtual BMCs, for metald's tests and demos.

A lab is one network namespace holding a bridge, one tap per machine, one QEMU process per
machine and one virtual-BMC process per machine (IPMI and Redfish, driving QEMU over QMP).
Everything a lab owns is written to its state file first, so ``down`` can remove it even
after the process that built it was killed.
"""

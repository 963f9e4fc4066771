"""BMC control: IPMI and Redfish drivers behind one interface, the scheduler, the service."""

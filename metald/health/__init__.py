"""Health of machines in use (Day 2): typed signals from their witnesses, a versioned
classification table, the trust rule that folds signals into a machine's health, and the
remediation core that decides the next step. Pure: no store, no event loop, no I/O."""

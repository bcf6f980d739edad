"""Storage I/O primitives: io_uring, block readers, memory, capability probes."""

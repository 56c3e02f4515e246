"""The platform under every process: the CPU adapters, the compat guard of every private upstream name, which
rank this is, and the upstream log lines filtered out."""

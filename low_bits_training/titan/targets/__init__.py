"""The precision plan's targets, one module per kind (linear layers, MoE experts, attention products, FSDP2
collectives), their registry and the run resolved once, the schedule and delayed scaling."""

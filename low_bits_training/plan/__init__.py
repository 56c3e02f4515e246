"""The precision plan resolved, pure (no torchtitan, no torch.cuda): the recipe check, rules -> per-target
plans, operand options, attention checks, schedules, what-if, the backend policy, the plan table and the
autopilot's ladder. Between ``config`` (the schema) and ``titan`` / ``speed`` (what runs it)."""

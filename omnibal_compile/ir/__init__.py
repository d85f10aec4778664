"""The intermediate results every pass reads or writes: schedules, plans, cost tables (torch-free)."""

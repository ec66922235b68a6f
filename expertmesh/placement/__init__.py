"""Expert placement: the plan schema, the planner (pure functions) and the replica table."""
